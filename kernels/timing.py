"""The one timing function of the project: CUDA events, warm-up excluded, raw samples kept.

`time_fn` runs `fn` for `warmup` calls (compilation happens there), synchronises,
resets the allocator's peak, then times `reps` calls, each between two CUDA events
(or perf_counter on the CPU). It returns every sample in milliseconds plus
P10/median/P95 and the peak memory of the timed window.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not samples:
        raise ValueError("expected at least one sample, got none")
    s = sorted(samples)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict:
    return {
        "n": len(samples),
        "p10_ms": percentile(samples, 10),
        "median_ms": statistics.median(samples),
        "p95_ms": percentile(samples, 95),
        "mean_ms": statistics.fmean(samples),
        "min_ms": min(samples),
    }


def time_fn(fn: Callable[[], object], reps: int = 20, warmup: int = 3, device: str | torch.device | None = None) -> dict:
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    )
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(dev)
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        peak = torch.cuda.max_memory_allocated(dev)
        out = {"samples_ms": samples, **summarize(samples), "peak_bytes": peak, "base_bytes": base, "clock": "cuda_event"}
    else:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        out = {"samples_ms": samples, **summarize(samples), "peak_bytes": None, "base_bytes": None, "clock": "perf_counter"}
    return out
