"""The one timing function of the project: CUDA events, warm-up excluded, raw samples kept.

`time_fn` runs `fn` for `warmup` calls (compilation happens there), synchronises,
resets the allocator's peak, then times `reps` calls, each between two CUDA events
(or perf_counter on the CPU). It returns every sample in milliseconds plus
P10/median/P95 and the peak memory of the timed window. With `budget_s` it stops
early (after at least `min_reps` samples) once the timed window has lasted that
long, and says so in `stopped_early`, so a slow backend cannot eat a stage's time.

`time_trajectory` times one long run of dependent steps (a decode trajectory):
one event before the first step and one after each checkpoint, so the cumulative
time to reach every checkpoint comes from the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

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


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _check_counts(reps: int, warmup: int, min_reps: int) -> None:
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"expected reps to be an integer >= 1, got {reps!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"expected warmup to be an integer >= 0, got {warmup!r}")
    if not isinstance(min_reps, int) or min_reps < 1:
        raise ValueError(f"expected min_reps to be an integer >= 1, got {min_reps!r}")


def time_fn(
    fn: Callable[[], object],
    reps: int = 20,
    warmup: int = 3,
    device: str | torch.device | None = None,
    budget_s: float | None = None,
    min_reps: int = 3,
) -> dict:
    _check_counts(reps, warmup, min_reps)
    dev = _device(device)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    stopped = False
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        starts, ends = [], []
        t0 = time.perf_counter()
        for i in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            starts.append(s)
            ends.append(e)
            # Waiting for the sample two behind keeps two samples queued (the
            # device never idles between samples) while wall time tracks it.
            if budget_s is not None and i >= 2:
                ends[i - 2].synchronize()
                if i + 1 >= min_reps and i + 1 < reps and time.perf_counter() - t0 > budget_s:
                    stopped = True
                    break
        torch.cuda.synchronize(dev)
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        peak = torch.cuda.max_memory_allocated(dev)
        out = {"samples_ms": samples, **summarize(samples), "peak_bytes": peak, "base_bytes": base,
               "clock": "cuda_event"}
    else:
        samples = []
        t_start = time.perf_counter()
        for i in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            if budget_s is not None and i + 1 >= min_reps and i + 1 < reps \
                    and time.perf_counter() - t_start > budget_s:
                stopped = True
                break
        out = {"samples_ms": samples, **summarize(samples), "peak_bytes": None, "base_bytes": None,
               "clock": "perf_counter"}
    out["reps_requested"] = reps
    out["warmup"] = warmup
    out["stopped_early"] = stopped
    return out


def time_trajectory(
    step: Callable[[int], object],
    checkpoints: Sequence[int],
    device: str | torch.device | None = None,
    before: Callable[[], object] | None = None,
    warmup: int = 0,
) -> dict:
    """Run `step(i)` for i = 0 .. max(checkpoints) - 1 as one trajectory.

    `before` (prompt processing, cache set-up) runs first and is excluded: the
    allocator's peak is reset after it. `warmup` > 0 first runs `before` and that
    many untimed steps (compilation, CUDA-graph capture, autotuning happen there),
    then `before` again, so the timed trajectory starts from the same state without
    any one-time work in it. Returns the cumulative milliseconds at
    each checkpoint (`cumulative_ms[k]` = time of the first `checkpoints[k]`
    steps), the per-interval times and the peak memory of the trajectory.
    """
    cps = sorted({int(c) for c in checkpoints})
    if not cps or cps[0] < 1:
        raise ValueError(f"expected checkpoints to be positive step counts, got {list(checkpoints)}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"expected warmup to be a non-negative integer, got {warmup!r}")
    dev = _device(device)
    cuda = dev.type == "cuda"
    if warmup:
        if before is not None:
            before()
        for i in range(warmup):
            step(i)
        if cuda:
            torch.cuda.synchronize(dev)
    if before is not None:
        before()
    n = cps[-1]
    marks = set(cps)
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        start = torch.cuda.Event(enable_timing=True)
        events = []
        start.record()
        for i in range(n):
            step(i)
            if i + 1 in marks:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                events.append(e)
        torch.cuda.synchronize(dev)
        cumulative = [start.elapsed_time(e) for e in events]
        peak = torch.cuda.max_memory_allocated(dev)
        clock = "cuda_event"
    else:
        base = peak = None
        cumulative = []
        t0 = time.perf_counter()
        for i in range(n):
            step(i)
            if i + 1 in marks:
                cumulative.append((time.perf_counter() - t0) * 1e3)
        clock = "perf_counter"
    intervals = [c - p for c, p in zip(cumulative, [0.0, *cumulative[:-1]])]
    return {"checkpoints": cps, "cumulative_ms": cumulative, "interval_ms": intervals,
            "peak_bytes": peak, "base_bytes": base, "clock": clock, "warmup_steps": warmup}
