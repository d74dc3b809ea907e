"""Helpers for the pipeline tests: a throw-away copy of the repository and
Snakemake runs inside it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "workflow" / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def copy_repo(dest: Path) -> Path:
    """The repository's files (tracked and untracked, not ignored, no results)
    copied to `dest` and committed there, so that commit facts are real."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for rel in files:
        if not rel or rel.startswith("results/") or not (REPO / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    git = ["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "test copy"], cwd=dest, check=True)
    return dest


def env() -> dict:
    e = dict(os.environ)
    e["CUDA_VISIBLE_DEVICES"] = ""
    e["TRITON_INTERPRET"] = "1"
    return e


def snakemake(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env())


def run_and_kill(cwd: Path, args: list[str], when, timeout: float):
    """Start `snakemake args` in `cwd` and SIGKILL its whole process group (a lost
    node: no clean-up at all) as soon as `when(cwd)` returns something other than
    None. Returns (that value or None if the run ended first, the run's output)."""
    proc = subprocess.Popen([*SNAKEMAKE, *args], cwd=cwd, env=env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    found = None
    while time.time() < deadline and proc.poll() is None:
        found = when(cwd)
        if found is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    return found, proc.communicate(timeout=60)[0]
