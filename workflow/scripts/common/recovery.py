"""Clears what a killed run (SIGKILL, a lost node) leaves behind, so the same command
resumes: its directory locks and the outputs it left marked incomplete are removed
while the Snakefile is parsed, unless another Snakemake process works in the same
directory. Finished configurations live in records.d, never a declared output."""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path


def is_snakemake(cmdline: list[str]) -> bool:
    head = cmdline[:3]
    if any(os.path.basename(a) == "snakemake" for a in head):
        return True
    return any(a == "-m" and b == "snakemake" for a, b in zip(head, head[1:]))


def other_runs(workdir: Path) -> list[int]:
    """PIDs of Snakemake processes, other than this one and its ancestors, whose
    working directory is `workdir`."""
    import psutil

    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            info = p.info
            if info["pid"] in mine or not info["cmdline"] or not is_snakemake(info["cmdline"]):
                continue
            if info["cwd"] and Path(info["cwd"]).resolve() == workdir.resolve():
                found.append(info["pid"])
        except (psutil.Error, OSError):
            continue
    return found


NON_EXECUTING = (
    "--dry-run", "--dryrun", "--lint", "--dag", "--rulegraph", "--filegraph", "--d3dag", "--report",
    "--summary", "--detailed-summary", "--unlock", "--cleanup-metadata", "--list-rules", "--list",
    "--list-target-rules", "--list-changes", "--list-input-changes", "--list-code-changes",
    "--list-params-changes", "--list-untracked", "--containerize", "--print-compilation", "--archive",
)


def executes(argv: list[str]) -> bool:
    """Whether a snakemake command line runs jobs (not a dry run, lint, graph,
    report or listing), so that clearing a killed run's leftovers is its business."""
    for a in argv[1:]:
        if a in ("-n", "-l") or a.split("=", 1)[0] in NON_EXECUTING or a.startswith("--list"):
            return False
        if a.startswith("-") and not a.startswith("--") and a[1:].isalpha() and "n" in a[1:]:
            return False
    return True


def incomplete_outputs(workdir: Path) -> dict[Path, Path]:
    """Marker file -> output path, for Snakemake's incomplete-output markers (the
    marker's name is the output path, base64-encoded)."""
    out = {}
    for marker in sorted((workdir / ".snakemake" / "incomplete").glob("*")):
        if not marker.is_file():
            continue
        try:
            path = base64.urlsafe_b64decode(marker.name.encode()).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            continue
        out[marker] = workdir / path
    return out


def recover(workdir: str | os.PathLike) -> dict[str, list[str]]:
    """Release stale locks and delete outputs a killed run left marked incomplete,
    unless another Snakemake run works in `workdir`. Returns what was done."""
    workdir = Path(workdir)
    locks = sorted((workdir / ".snakemake" / "locks").glob("*.lock"))
    incomplete = incomplete_outputs(workdir)
    if not (locks or incomplete) or other_runs(workdir):
        return {"locks": [], "outputs": []}
    for p in locks:
        p.unlink(missing_ok=True)
    removed = []
    for marker, output in incomplete.items():
        if output.is_file() or output.is_symlink():
            output.unlink()
            removed.append(os.path.relpath(output, workdir))
        marker.unlink(missing_ok=True)
    return {"locks": [p.name for p in locks], "outputs": removed}
