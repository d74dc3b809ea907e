"""Verify a study artifact (.tar.gz or extracted folder) against its MANIFEST.json:
every listed file present with its size and sha256, nothing else present.

    python workflow/scripts/verify_archive.py results/artifact-<commit>-<profile>.tar.gz

Exit status 0 when it verifies, 1 with one line per problem otherwise."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path, PurePosixPath

MANIFEST = "MANIFEST.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _compare(manifest: dict, present: dict[str, bytes], unusual: list[str]) -> list[str]:
    problems = list(unusual)
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        return problems + ["the manifest lists no files"]
    for name in sorted(listed):
        if name not in present:
            problems.append(f"missing: {name}")
            continue
        data = present[name]
        if len(data) != listed[name]["bytes"] or sha256(data) != listed[name]["sha256"]:
            problems.append(f"content differs from the manifest: {name}")
    problems += [f"not in the manifest: {name}" for name in sorted(set(present) - set(listed))]
    return problems


def verify_tar(path: Path) -> list[str]:
    present, unusual, manifest = {}, [], None
    with tarfile.open(path, "r:gz") as tar:
        for m in tar.getmembers():
            parts = PurePosixPath(m.name).parts
            if m.isdir():
                continue
            if not m.isfile() or len(parts) < 2 or ".." in parts or m.name.startswith("/"):
                unusual.append(f"unexpected member: {m.name} (type {m.type!r})")
                continue
            rel = str(PurePosixPath(*parts[1:]))
            data = tar.extractfile(m).read()
            if rel == MANIFEST:
                manifest = data
            else:
                present[rel] = data
    if manifest is None:
        return [f"no {MANIFEST} in {path}"]
    return _compare(json.loads(manifest), present, unusual)


def verify_dir(path: Path) -> list[str]:
    mf = path / MANIFEST
    if not mf.is_file():
        return [f"no {MANIFEST} in {path}"]
    present = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p != mf}
    return _compare(json.loads(mf.read_text()), present, [])


def verify(path: str | Path) -> list[str]:
    """Problems found (an empty list means the artifact verifies)."""
    path = Path(path)
    if path.is_dir():
        return verify_dir(path)
    if not path.is_file():
        return [f"no such artifact: {path}"]
    try:
        return verify_tar(path)
    except (tarfile.TarError, OSError, EOFError, json.JSONDecodeError) as e:
        return [f"cannot read {path}: {e}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="artifact .tar.gz or an extracted artifact folder")
    args = ap.parse_args(argv)
    problems = verify(args.artifact)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"{args.artifact}: {len(problems)} problem(s)")
        return 1
    print(f"{args.artifact}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
