"""Clears what a killed run leaves behind, so the same command resumes: unless another
controlling Snakemake works in the same directory, its SLURM jobs are cancelled, its
locks released and its incomplete outputs removed. Jobs of a cluster run clear nothing."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

NON_EXECUTING = ("--dry-run", "--dryrun", "--lint", "--dag", "--rulegraph", "--filegraph", "--d3dag", "--report",
                 "--summary", "--detailed-summary", "--unlock", "--cleanup-metadata", "--containerize",
                 "--print-compilation", "--archive")  # and every --list* option


def is_snakemake(cmdline: list[str]) -> bool:
    head = cmdline[:3]
    return any(os.path.basename(a) == "snakemake" or (a, b) == ("-m", "snakemake")
               for a, b in zip(head, [*head[1:], ""]))


def job_mode(argv: list[str]) -> bool:
    """Whether a snakemake command line is one job of a controller (`--mode remote` / `subprocess`)."""
    modes = [b if a == "--mode" else a.removeprefix("--mode=") for a, b in zip(argv, [*argv[1:], ""])
             if a == "--mode" or a.startswith("--mode=")]
    return any(m != "default" for m in modes)


def other_runs(workdir: Path) -> list[int]:
    """PIDs of other controlling Snakemake processes (not this one's ancestors) working in `workdir`."""
    import psutil

    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    # process_iter fills `info` up front: a process that has gone or hides a field reads None there.
    infos = [p.info for p in psutil.process_iter(["pid", "cmdline", "cwd"])]
    return [i["pid"] for i in infos if i["pid"] not in mine and i["cmdline"] and is_snakemake(i["cmdline"])
            and not job_mode(i["cmdline"]) and i["cwd"] and Path(i["cwd"]).resolve() == workdir.resolve()]


def executes(argv: list[str]) -> bool:
    """Whether a snakemake command line runs jobs as the controller, whose business leftovers are."""
    return not job_mode(argv) and not any(
        a in ("-n", "-l") or a.split("=", 1)[0] in NON_EXECUTING or a.startswith("--list")
        or (a.startswith("-") and not a.startswith("--") and a[1:].isalpha() and "n" in a[1:])  # -n bundled: -np
        for a in argv[1:])


def incomplete_outputs(workdir: Path) -> dict[Path, Path]:
    """Marker file -> output path of Snakemake's incomplete markers (base64 of the path)."""
    out = {}
    for marker in sorted(p for p in (workdir / ".snakemake" / "incomplete").glob("*") if p.is_file()):
        with contextlib.suppress(ValueError):  # binascii.Error and UnicodeDecodeError among them: not a marker
            out[marker] = workdir / base64.urlsafe_b64decode(marker.name.encode()).decode()
    return out


def slurm_jobs(workdir: Path) -> list[str]:
    """This user's SLURM jobs that Snakemake submitted (comment `rule_...`) from `workdir`."""
    if shutil.which("squeue") is None:
        return []
    out = subprocess.run(["squeue", "--me", "--noheader", "--format=%i|%Z|%k"],
                         capture_output=True, text=True, timeout=60)
    rows = [line.strip().split("|", 2) for line in out.stdout.splitlines()] if out.returncode == 0 else []
    return [job for job, folder, comment in (r for r in rows if len(r) == 3)
            if comment.startswith("rule_") and folder and Path(folder).resolve() == workdir.resolve()]


def cancel_slurm_jobs(workdir: Path, timeout_s: float = 120) -> list[str]:
    """Cancel the jobs `slurm_jobs` finds and wait until they have left the queue."""
    if not (jobs := slurm_jobs(workdir)):
        return []
    subprocess.run(["scancel", *jobs], check=True, timeout=60)
    deadline = time.monotonic() + timeout_s
    while set(jobs) & set(slurm_jobs(workdir)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"SLURM jobs {jobs} of a killed run are still in the queue {timeout_s:.0f} s "
                               "after scancel")
        time.sleep(1)
    return jobs


def recover(workdir: str | os.PathLike) -> dict[str, list[str]]:
    """Clear a killed run's leftovers in `workdir`; what was done, also said on stderr."""
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
    done = {"locks": [p.name for p in locks], "outputs": removed, "jobs": jobs}
    if any(done.values()):
        print(f"Resuming a killed run: released locks {done['locks']}, cancelled SLURM jobs {jobs}, "
              f"removed incomplete outputs {removed}.", file=sys.stderr)
    return done
