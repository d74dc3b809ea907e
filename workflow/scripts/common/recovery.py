"""What a killed run leaves behind, cleared so that the same command resumes.

Snakemake releases its directory locks and removes a failed job's outputs on a
normal exit, on Ctrl-C and on SIGTERM. A run killed outright (SIGKILL, a lost
node) leaves both behind: the locks make the next `snakemake` refuse to start
until `--unlock`, and an output that a killed job had already written is only
marked incomplete, so the next run stops and asks for `--rerun-incomplete`.
The Snakefile calls `recover` while it is parsed (before Snakemake takes its
locks): when no other Snakemake process works in the same directory, neither can
belong to a live run, so the locks are released and the outputs marked
incomplete are deleted, which makes Snakemake run their jobs again.
Configurations finished inside a stage live in records.d, which is never a
declared output, so they survive.
"""

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
