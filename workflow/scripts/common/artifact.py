"""A study artifact's manifest check: `verify(path)` lists every file missing, altered or
not listed in MANIFEST.json of a .tar.gz artifact or an extracted folder;
`python workflow/scripts/common/artifact.py ARTIFACT` prints one line per problem and exits 1 if any."""

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


def read_files(path: Path) -> tuple[dict[str, bytes], list[str]]:
    """Files of a folder, or of a .tar.gz artifact's one top folder, by relative name; unexpected members."""
    if not path.is_file():
        return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}, []
    files, unusual = {}, []
    with tarfile.open(path, "r:gz") as tar:
        for m in tar.getmembers():
            parts = PurePosixPath(m.name).parts
            if not m.isdir() and (not m.isfile() or len(parts) < 2 or ".." in parts or m.name.startswith("/")):
                unusual.append(f"unexpected member: {m.name} (type {m.type!r})")
            elif m.isfile():
                files[str(PurePosixPath(*parts[1:]))] = tar.extractfile(m).read()
    return files, unusual


def verify(path: str | Path) -> list[str]:
    """Problems found (an empty list means the artifact verifies)."""
    path = Path(path)
    if not path.exists():
        return [f"no such artifact: {path}"]
    try:
        present, problems = read_files(path)
        if MANIFEST not in present:
            return [f"no {MANIFEST} in {path}"]
        listed = json.loads(present.pop(MANIFEST)).get("files")
    except (tarfile.TarError, OSError, EOFError, json.JSONDecodeError) as e:
        return [f"cannot read {path}: {e}"]
    if not isinstance(listed, dict) or not listed:
        return problems + ["the manifest lists no files"]
    for name in sorted(listed):
        if (data := present.get(name)) is None:
            problems.append(f"missing: {name}")
        elif len(data) != listed[name]["bytes"] or sha256(data) != listed[name]["sha256"]:
            problems.append(f"content differs from the manifest: {name}")
    return problems + [f"not in the manifest: {name}" for name in sorted(set(present) - set(listed))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Verify a study artifact against its MANIFEST.json.")
    ap.add_argument("artifact", help="artifact .tar.gz or an extracted artifact folder")
    path = ap.parse_args(argv).artifact
    problems = verify(path)
    print(*(f"FAIL {p}" for p in problems), f"{path}: {len(problems)} problem(s)" if problems else f"{path}: OK",
          sep="\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
