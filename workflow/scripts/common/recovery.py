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

On a SLURM cluster the killed controller's jobs outlive it. The next controller
cancels them (`scancel`) before it submits anything, so that a stage never runs
twice at once (two writers, and two timing jobs competing for a node). The
Snakemake processes inside jobs (`--mode remote` or `subprocess`) never take
locks and never clear anything.
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import subprocess
import time
from pathlib import Path


def is_snakemake(cmdline: list[str]) -> bool:
    head = cmdline[:3]
    if any(os.path.basename(a) == "snakemake" for a in head):
        return True
    return any(a == "-m" and b == "snakemake" for a, b in zip(head, head[1:]))


def job_mode(argv: list[str]) -> bool:
    """Whether a snakemake command line is one job run for a controller (the
    `--mode remote` / `--mode subprocess` that executors start)."""
    for a, b in zip(argv, [*argv[1:], ""]):
        mode = a.split("=", 1)[1] if a.startswith("--mode=") else b if a == "--mode" else None
        if mode is not None and mode != "default":
            return True
    return False


def other_runs(workdir: Path) -> list[int]:
    """PIDs of controlling Snakemake processes (not jobs of one), other than this
    one and its ancestors, whose working directory is `workdir`."""
    import psutil

    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            info = p.info
            cmdline = info["cmdline"]
            if info["pid"] in mine or not cmdline or not is_snakemake(cmdline) or job_mode(cmdline):
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
    report or listing) as the controller (not as one job of a cluster run), so that
    clearing a killed run's leftovers is its business."""
    if job_mode(argv):
        return False
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


def slurm_jobs(workdir: Path) -> list[str]:
    """IDs of this user's queued or running SLURM jobs that Snakemake's SLURM
    executor submitted (comment `rule_<name>...`) from `workdir`; [] without SLURM."""
    if shutil.which("squeue") is None:
        return []
    out = subprocess.run(["squeue", "--me", "--noheader", "--format=%i|%Z|%k"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return []
    jobs = []
    for line in out.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        job_dir, _, comment = rest.partition("|")
        if comment.startswith("rule_") and job_dir and Path(job_dir).resolve() == workdir.resolve():
            jobs.append(job_id)
    return jobs


def cancel_slurm_jobs(workdir: Path, timeout_s: float = 120) -> list[str]:
    """Cancel the jobs `slurm_jobs` finds and wait until they have left the queue."""
    jobs = slurm_jobs(workdir)
    if not jobs:
        return []
    subprocess.run(["scancel", *jobs], check=True, timeout=60)
    deadline = time.monotonic() + timeout_s
    while set(jobs) & set(slurm_jobs(workdir)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"SLURM jobs {jobs} of a killed run are still in the queue {timeout_s:.0f} s after scancel")
        time.sleep(1)
    return jobs


def recover(workdir: str | os.PathLike) -> dict[str, list[str]]:
    """Release stale locks, cancel the killed run's SLURM jobs and delete outputs
    it left marked incomplete, unless another Snakemake run works in `workdir`.
    Returns what was done."""
    workdir = Path(workdir)
    locks = sorted((workdir / ".snakemake" / "locks").glob("*.lock"))
    incomplete = incomplete_outputs(workdir)
    if not (locks or incomplete) or other_runs(workdir):
        return {"locks": [], "outputs": [], "jobs": []}
    # Cancelled first: a job still running could write an output after it is deleted.
    jobs = cancel_slurm_jobs(workdir)
    for p in locks:
        p.unlink(missing_ok=True)
    removed = []
    for marker, output in incomplete.items():
        if output.is_file() or output.is_symlink():
            output.unlink()
            removed.append(os.path.relpath(output, workdir))
        marker.unlink(missing_ok=True)
    return {"locks": [p.name for p in locks], "outputs": removed, "jobs": jobs}
