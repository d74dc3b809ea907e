"""One GPU per stage job: which device a job measures on.

A stage that declares `gpu=1` gets one whole GPU. Under SLURM the job's GPU is
the one SLURM allocated: CUDA_VISIBLE_DEVICES is already set and is kept. On a
node Snakemake drives itself, `--resources gpu=N` lets up to N GPU stages run
at once (the default workflow profile sets N = 1), and each takes the first GPU
no other stage of this results directory holds: an exclusive `flock` on
`results/.tmp/gpus/<index>.lock`, held until the stage's process exits (the
kernel drops it even after a kill). Indices are NVML's (PCI bus order);
CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA count the same way.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

_held: list = []  # open lock files: the claim lasts as long as the process


def claim_gpu(lock_dir: str | os.PathLike, n_gpus: int) -> int | None:
    """Take the first free GPU of `n_gpus` and return its index, or None when
    CUDA_VISIBLE_DEVICES is already set (SLURM, or the user) or there is no GPU.
    Raises RuntimeError when every GPU is held by another stage."""
    if "CUDA_VISIBLE_DEVICES" in os.environ or n_gpus <= 0:
        return None
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index in range(n_gpus):
        f = open(lock_dir / f"{index}.lock", "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        _held.append(f)
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
        return index
    raise RuntimeError(
        f"all {n_gpus} GPUs are held by other stages of this results directory "
        f"({lock_dir}); run with --resources gpu=N where N is at most the number of GPUs"
    )
