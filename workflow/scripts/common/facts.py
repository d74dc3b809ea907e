"""Facts every record carries: git commit and dirty flag, library versions, the GPU."""

from __future__ import annotations

import platform
import subprocess
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@lru_cache(maxsize=1)
def commit() -> dict:
    """{"sha": full hash or "unknown", "dirty": bool or None}. Files under results/
    are outputs, not source, so they do not make the tree dirty."""
    sha = _git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": "unknown", "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    return {"sha": sha, "dirty": bool(status)}


def commit_time() -> int:
    """Committer time of HEAD (seconds since the epoch); 0 outside a git checkout."""
    t = _git("log", "-1", "--format=%ct")
    return int(t) if t else 0


def versions() -> dict:
    import torch
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__}


def gpu() -> dict | None:
    """The GPU this process computes on, None on a CPU run."""
    import torch

    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_bytes": p.total_memory,
            "sm_count": p.multi_processor_count, "count": torch.cuda.device_count()}
