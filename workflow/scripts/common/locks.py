"""Stale Snakemake locks after a hard kill.

Snakemake releases its directory locks on a normal exit, on Ctrl-C and on
SIGTERM, but a run killed outright (SIGKILL, a lost node) leaves them behind,
and the next `snakemake` refuses to start until `--unlock`. So that the same
command resumes, the Snakefile calls `release_stale_locks` while it is parsed
(before Snakemake takes its locks): when no other Snakemake process works in the
same directory, leftover locks cannot belong to a live run and are removed.
"""

from __future__ import annotations

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


def release_stale_locks(workdir: str | os.PathLike) -> list[str]:
    """Remove `.snakemake/locks/*` when no other Snakemake run uses `workdir`;
    returns the names removed."""
    workdir = Path(workdir)
    locks = sorted((workdir / ".snakemake" / "locks").glob("*.lock"))
    if not locks or other_runs(workdir):
        return []
    for p in locks:
        p.unlink(missing_ok=True)
    return [p.name for p in locks]
