"""Whole GPUs per stage job: those given (SLURM, CUDA_VISIBLE_DEVICES) are kept; else the first free
ones by an exclusive flock on results/.tmp/gpus/<index>.lock, which dies with the process and
survives exec (a restarted stage keeps its claim). Indices are NVML's PCI bus order."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

_held: list = []  # open lock files: the claim lasts as long as the process


def claim_gpus(lock_dir: str | os.PathLike, n_gpus: int, count: int = 1) -> list[int] | None:
    """Indices of the first `count` free GPUs of `n_gpus`, now held; None under CUDA_VISIBLE_DEVICES
    or without a GPU; RuntimeError when too few are free."""
    if "CUDA_VISIBLE_DEVICES" in os.environ or n_gpus <= 0:
        return None
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    taken = {}
    for index in range(n_gpus):
        if len(taken) == count:
            break
        f = open(lock_dir / f"{index}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.set_inheritable(f.fileno(), True)
            taken[index] = f
        except BlockingIOError:
            f.close()
    if len(taken) < count:
        for f in taken.values():
            f.close()
        raise RuntimeError(f"{count} GPU(s) wanted, {len(taken)} of {n_gpus} free: the others are held by other "
                           f"stages of this results directory ({lock_dir}); run with --resources gpu=N where N is "
                           "at most the number of GPUs")
    _held.extend(taken.values())
    return list(taken)


def visible_env(indices: list[int]) -> dict[str, str]:
    """The environment under which CUDA numbers exactly the GPUs `indices` (NVML's order)."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in indices)}
