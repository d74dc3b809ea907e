"""Whole GPUs per stage job: which devices a job measures on.

A stage that declares `gpu=k` gets k whole GPUs of its own (k = 1 but for the
FSDP track's world size). Under SLURM they are the ones SLURM allocated:
CUDA_VISIBLE_DEVICES is already set and is kept. On a node Snakemake drives
itself, `--resources gpu=N` lets stages holding up to N GPUs run at once (N is 1
unless given), and each takes the first k GPUs no other stage of this results
directory holds: an exclusive `flock` on
`results/.tmp/gpus/<index>.lock`, held until the stage's process exits (the
kernel drops it even after a kill). Indices are NVML's (PCI bus order);
CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA count the same way.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

_held: list = []  # open lock files: the claim lasts as long as the process


def claim_gpus(lock_dir: str | os.PathLike, n_gpus: int, count: int = 1) -> list[int] | None:
    """Take the first `count` free GPUs of `n_gpus` and return their indices, or
    None when CUDA_VISIBLE_DEVICES is already set (SLURM, or the user) or there is
    no GPU. Raises RuntimeError when fewer than `count` are free."""
    if "CUDA_VISIBLE_DEVICES" in os.environ or n_gpus <= 0:
        return None
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    taken = []
    for index in range(n_gpus):
        if len(taken) == count:
            break
        f = open(lock_dir / f"{index}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        taken.append((index, f))
    if len(taken) < count:
        for _, f in taken:
            f.close()
        raise RuntimeError(
            f"{count} GPU(s) wanted, {len(taken)} of {n_gpus} free: the others are held by other stages of "
            f"this results directory ({lock_dir}); run with --resources gpu=N where N is at most the number of GPUs"
        )
    _held.extend(f for _, f in taken)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i, _ in taken)
    return [i for i, _ in taken]
