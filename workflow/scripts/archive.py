"""Archive -> results/artifact-<commit>[-dirty]-<profile>.tar.gz: MANIFEST.json, this run's results,
config.yaml and any uncommitted diff. Sorted entries, normalised metadata and a nameless gzip
header make the same results give the same bytes; the stage verifies it."""

import gzip
import io
import os
import subprocess
import tarfile
from pathlib import Path

from common import atomic, facts, stage
from common.artifact import MANIFEST, sha256, verify

SKIP_PARTS = {".tmp", "records.d"}
# The folders of results/ that this run's rules write (stage outputs, logs, benchmarks).
RUN_DIRS = ("probe", "audit", "tune", "tracks", "report", "logs", "benchmarks")


def result_files(root: Path, exclude: set[Path]) -> list[Path]:
    """Files under RUN_DIRS except temporary ones, records.d copies and `exclude`."""
    return sorted(p for d in RUN_DIRS for p in (root / d).rglob("*") if p.is_file()
                  and not SKIP_PARTS & set(p.relative_to(root).parts) and p.resolve() not in exclude)


def build(entries: dict[str, bytes], prefix: str, mtime: int) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in sorted(entries.items()):
            info = tarfile.TarInfo(f"{prefix}/{name}")
            info.size, info.mtime, info.mode = len(data), mtime, 0o644
            info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def main(job):
    root = (artifact := Path(job.output.artifact)).parent
    exclude = {Path(p).resolve() for p in [job.log] if p} | {Path("results/benchmarks/archive.tsv").resolve()}
    entries = {f"results/{p.relative_to(root).as_posix()}": p.read_bytes() for p in result_files(root, exclude)}
    entries["config/config.yaml"] = (facts.REPO_ROOT / "config.yaml").read_bytes()
    entries["config/config.resolved.json"] = (atomic.dumps(job.config) + "\n").encode()
    commit = facts.commit()
    if commit["dirty"]:
        entries["source/uncommitted.diff"] = subprocess.run(["git", "diff", "HEAD", "--", ".", ":(exclude)results"],
                                                            cwd=facts.REPO_ROOT, capture_output=True).stdout
    probe = job.load("environment")
    manifest = {"schema": 1, "artifact": artifact.name, "profile": job.profile, "commit": commit, "config": job.config,
                "gpu": (probe.get("torch_device") or {}).get("name"), "probe": probe,
                "container": {"runtime": job.params["runtime"], "image": job.params["image"]},
                "command_line": os.environ.get(stage.COMMAND_LINE),
                "files": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in sorted(entries.items())}}
    entries[MANIFEST] = (atomic.dumps(manifest) + "\n").encode()
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH") or facts.commit_time())
    atomic.write_bytes(artifact, build(entries, artifact.name.removesuffix(".tar.gz"), mtime))
    if problems := verify(artifact):
        artifact.unlink()
        raise RuntimeError(f"the artifact just written does not verify: {problems}")
    print(f"archive: {artifact} ({len(entries)} files, {artifact.stat().st_size} bytes) verifies")


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
