"""Facts every record carries: git commit and dirty flag, library versions, the GPU."""

from __future__ import annotations

import hashlib
import platform
import sys
import subprocess
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
SOURCE = ("Snakefile", "config.yaml", "pyproject.toml", "envs", "kernels", "workflow")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the paths and bytes of SOURCE: names the code where git metadata is stale or
    missing (a copied tree); `python workflow/scripts/common/facts.py DIR` prints it."""
    h = hashlib.sha256()
    for name in SOURCE:
        for p in [root / name] if (root / name).is_file() else sorted((root / name).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def commit() -> dict:
    """{"sha", "dirty", "source_sha256"}; files under results/ do not make the tree dirty."""
    sha = _git("rev-parse", "HEAD")
    dirty = None if sha is None else bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                               ":(exclude)results"))
    return {"sha": sha or "unknown", "dirty": dirty, "source_sha256": source_digest()}


def commit_time() -> int:
    """Committer time of HEAD in seconds; 0 outside a git checkout."""
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


if __name__ == "__main__":
    print(source_digest(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO_ROOT))
