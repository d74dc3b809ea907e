"""The measurement harness of every stage: `measure` (eager clock, device clock for short
work, logical counts of one call) and `Runner` (resume, failures as records, a time budget,
restart after a poisoned CUDA context, the clock lock)."""

from __future__ import annotations

import atexit
import contextlib
import cProfile
import csv
import functools
import gc
import math
import os
import pstats
import re
import shutil
import statistics
import subprocess
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import profiler

from kernels.ops import accounting

from . import atomic, records, stage
from .facts import REPO_ROOT

STATUS_OK, STATUS_OOM, STATUS_FAILED = "ok", "oom", "failed"
POISONED_EXIT = 75  # exit status of a stage worker whose failure left the CUDA context unusable
RESTARTS_ENV = "KERNELS_STAGE_RESTARTS"
SHORT_MS = 2.0  # device time under this per call is the headline
DEVICE_CLOCK_MAX_MS = 50.0  # the device clock is taken for work whose eager median is under this
DEVICE_WINDOW_MS = 1.0  # a device-clock sample covers about this much work
MAX_GRAPH_CALLS = 256  # calls in one replayed graph at most
# Calls in the pilot graph that sizes the device clock's graph: enough for calls under
# 0.1 ms that the host queues replays faster than the device runs them (a pilot sample
# then holds no idle gap), few for longer calls, whose pilot would otherwise cost seconds.
PILOT_CALLS, PILOT_SHORT_CALLS, PILOT_SHORT_MS = 2, 16, 0.1
# Calls run back to back for at least this long before the eager clock: the host path of a
# short call reaches its steady speed (CPU clocks, caches) only after tens of milliseconds,
# most of all after the profiler's counting pass; a user's loop calls it in that state.
EAGER_WARM_MS = 30.0
# Calls of a short configuration each started on an idle device (host_waits)
HOST_WAIT_CALLS = 30
# the allocator's counters host_waits reads per call: cudaMalloc calls, and frees of all cached
# blocks (each waits for every stream) after a failed cudaMalloc
_ALLOC_STATS = ("num_device_alloc", "num_sync_all_streams", "num_alloc_retries")
# what torch's sync debug mode warns per synchronising call (not its one-off "prototype feature" notice)
SYNC_WARNING = "called a synchronizing CUDA operation"
LOGICAL_BASIS = ("logical: bytes from the launchers' own accounting of the tensors each kernel reads and writes "
                 "(kernels.ops.accounting; matmuls and other PyTorch ops not included); kernel launches counted by "
                 "torch.profiler from what ran in one call")
_STICKY = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
           "device-side assert", "an illegal address", "cudaerrorlaunchfailure", "cuda_error_illegal_address",
           "uncorrectable ecc")


def device_of(device=None) -> torch.device:
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _open_window(dev) -> int | None:
    """Synchronise and reset the allocator's peak; the bytes allocated (None on the CPU)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _stamp(cuda: bool):
    if not cuda:
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _ms(start, end) -> float:
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


def percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not samples:
        raise ValueError("expected at least one sample, got none")
    return torch.tensor(samples, dtype=torch.float64).quantile(q / 100.0).item()


def summarize(samples: list[float]) -> dict:
    return {"n": len(samples), "p10_ms": percentile(samples, 10), "median_ms": statistics.median(samples),
            "p95_ms": percentile(samples, 95), "mean_ms": statistics.fmean(samples), "min_ms": min(samples)}


def time_fn(fn: Callable[[], object], reps: int = 20, warmup: int = 3, device=None, budget_s: float | None = None,
            min_reps: int = 3) -> dict:
    """The eager clock: `reps` calls each between two CUDA events (perf_counter on the CPU), stopped
    early once `budget_s` has passed and `min_reps` exist; `host_ms`: the host's time inside each call
    (launch work, checks and any wait)."""
    for name, v, lo in (("reps", reps, 1), ("warmup", warmup, 0), ("min_reps", min_reps, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"expected {name} to be an integer >= {lo}, got {v!r}")
    dev = device_of(device)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    base, marks, host, t_start = _open_window(dev), [], [], time.perf_counter()
    for i in range(reps):
        start, h = _stamp(cuda), time.perf_counter()
        fn()
        host.append((time.perf_counter() - h) * 1e3)
        marks.append((start, _stamp(cuda)))
        # Waiting for the sample two behind keeps the queue non-empty while wall time tracks it.
        if cuda and budget_s is not None and i >= 2:
            marks[i - 2][1].synchronize()
        if stopped := budget_s is not None and min_reps <= i + 1 < reps and time.perf_counter() - t_start > budget_s:
            break
    _sync(dev)
    samples = [_ms(s, e) for s, e in marks]
    return {"samples_ms": samples, **summarize(samples), "host_ms": host, "base_bytes": base,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
            "clock": "cuda_event" if cuda else "perf_counter", "reps_requested": reps, "warmup": warmup,
            "stopped_early": stopped}


def cuda_graph(warm: Callable[[], object], body: Callable[[], object], dev) -> torch.cuda.CUDAGraph:
    """`body` captured in a CUDA graph, after `warm` ran on a side stream as capture requires."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def device_time(fn: Callable[[], object], reps: int, calls: int, device=None) -> dict:
    """The device clock per call: `reps` replays of a graph of `calls` calls (back to back if capture fails)."""
    dev, why = device_of(device), None

    def calls_of_fn():
        for _ in range(calls):
            fn()

    try:
        g = cuda_graph(fn, calls_of_fn, dev)
        g.replay()
        g.replay()
        torch.cuda.synchronize(dev)
    except Exception as exc:  # noqa: BLE001 - a call that cannot be captured falls back
        g, why = None, f"{type(exc).__name__}: {exc}"[:500]
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(dev)
        # A failed capture leaves the CUDA generator capturing (every later random draw
        # raises "Offset increment outside graph capture"): one completed capture heals it.
        x = torch.zeros(1, device=dev)
        cuda_graph(lambda: None, lambda: x.add_(1), dev)
        torch.cuda.synchronize(dev)
    window = calls_of_fn if g is None else g.replay
    samples = [s / calls for s in time_fn(window, reps, int(g is None), dev)["samples_ms"]]
    del g, window
    return {"samples_ms": samples, **summarize(samples), "method": "back_to_back" if why else "cuda_graph",
            "calls_per_sample": calls, "graph_error": why}


def graph_calls(ms_per_call: float) -> int:
    """Calls per replayed graph: the power of two giving about DEVICE_WINDOW_MS a sample, at most MAX_GRAPH_CALLS."""
    n = math.ceil(math.log2(DEVICE_WINDOW_MS / max(ms_per_call, 1e-9)))
    return min(MAX_GRAPH_CALLS, 2 ** max(n, 0))


def time_trajectory(step: Callable[[int], object], checkpoints: Sequence[int], device=None,
                    before: Callable[[], object] | None = None, warmup: int = 0) -> dict:
    """Cumulative ms at every checkpoint of one run of dependent steps, after untimed `before` and `warmup` steps."""
    cps = sorted({int(c) for c in checkpoints})
    if not cps or cps[0] < 1:
        raise ValueError(f"expected checkpoints to be positive step counts, got {list(checkpoints)}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"expected warmup to be a non-negative integer, got {warmup!r}")
    dev, before = device_of(device), before or (lambda: None)
    cuda = dev.type == "cuda"
    if warmup:
        before()
        for i in range(warmup):
            step(i)
        _sync(dev)
    before()
    base, start, marks = _open_window(dev), _stamp(cuda), []
    for i in range(cps[-1]):
        step(i)
        if i + 1 in cps:
            marks.append(_stamp(cuda))
    _sync(dev)
    marks = [_ms(start, m) for m in marks]
    return {"checkpoints": cps, "cumulative_ms": marks, "interval_ms": [c - p for c, p in zip(marks, [0.0, *marks])],
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None, "base_bytes": base,
            "clock": "cuda_event" if cuda else "perf_counter", "warmup_steps": warmup}


class Clocks:
    """One GPU's SM clock through NVML: sampled, locked at the default applications clock, reset."""

    SLOWDOWN = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # SW power cap, HW slowdown, SW/HW thermal, power brake

    def __init__(self, device=None):
        dev = device_of(device)
        self.nvml, self.handle, self.locked, self.reason = None, None, False, None if dev.type == "cuda" else "no GPU"
        if self.reason:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(dev).uuid)
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except pynvml.NVMLError:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            self.nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - no NVML: clocks are left empty, with the reason
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"[:300]

    def _query(self, fn, *args):
        """fn(handle, *args), None where the device or NVML lacks it."""
        try:
            return fn(self.handle, *args)
        except (self.nvml.NVMLError, AttributeError):
            return None

    def sample(self) -> dict | None:
        n = self.nvml
        if n is None or (mhz := self._query(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM)) is None:
            return None
        procs = self._query(n.nvmlDeviceGetComputeRunningProcesses)
        return {"sm_mhz": mhz, "reasons": self._query(n.nvmlDeviceGetCurrentClocksEventReasons),
                "gpu_processes": None if procs is None else len(procs), "load1": os.getloadavg()[0]}

    def lock(self) -> dict:
        if self.handle is None:
            return {"locked": False, "mhz": None, "reason": self.reason}
        n = self.nvml
        mhz = (self._query(n.nvmlDeviceGetDefaultApplicationsClock, n.NVML_CLOCK_SM)
               or n.nvmlDeviceGetMaxClockInfo(self.handle, n.NVML_CLOCK_SM))
        try:
            n.nvmlDeviceSetGpuLockedClocks(self.handle, mhz, mhz)
        except n.NVMLError as exc:
            return {"locked": False, "mhz": mhz, "reason": f"nvmlDeviceSetGpuLockedClocks: {exc}"}
        self.locked = True
        atexit.register(self.reset)
        return {"locked": True, "mhz": mhz, "reason": None}

    def reset(self) -> None:
        if self.locked:
            with contextlib.suppress(Exception):
                self.nvml.nvmlDeviceResetGpuLockedClocks(self.handle)
            self.locked = False

    def span(self, before: dict | None, after: dict | None) -> dict | None:
        """The record's `sm_clock`: before / after, and whether it throttled."""
        if before is None or after is None:
            return None if self.reason is None else {"reason": self.reason}
        slow = any((s["reasons"] or 0) & self.SLOWDOWN for s in (before, after))
        procs = [s.get("gpu_processes") for s in (before, after) if s.get("gpu_processes") is not None]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return {"before_mhz": before["sm_mhz"], "after_mhz": after["sm_mhz"], "reasons_after": after["reasons"],
                "throttled": bool(slow or after["sm_mhz"] < 0.95 * before["sm_mhz"]),
                # compute processes on this GPU (this one included) and the host's 1-minute load
                # average over its CPUs: a neighbour on either moves the clocks
                "gpu_processes_max": max(procs) if procs else None, "shared_gpu": bool(procs) and max(procs) > 1,
                "host_load1_max": max(before.get("load1") or 0.0, after.get("load1") or 0.0), "host_cpus": cpus}


clocks = functools.cache(Clocks)  # one Clocks per device in this process, which holds any clock lock it took


def run_for(fn: Callable[[], object], dev, ms: float) -> float:
    """Call fn, each call waited for, until `ms` milliseconds have passed (once at least); the ms spent."""
    _sync(dev)
    t0 = time.perf_counter()
    while True:
        fn()
        _sync(dev)
        if (spent := (time.perf_counter() - t0) * 1e3) >= ms:
            return spent


def host_profile(fn: Callable[[], object], calls: int, device=None, top: int = 12) -> list[dict]:
    """The `top` functions by own host time per call (cProfile, whose own cost inflates each Python frame) over `calls`
    calls of fn. The device is waited for between calls, outside the profile: no launch waits on a full queue in it."""
    dev, prof = device_of(device), cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        fn()
        prof.disable()
        _sync(dev)
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({name})" if line else name, "calls": nc / calls,
             "own_us": tt / calls * 1e6, "cum_us": ct / calls * 1e6} for (f, line, name), (_, nc, tt, ct, _) in rows]


def host_waits(fn: Callable[[], object], calls: int, device=None) -> dict:
    """What separates an eager call's host time from its own host work, without a profiler: `host_drained_ms`, the
    median host time of `calls` calls each started on an idle device (host_median_ms, taken with earlier calls still
    queued, minus this is time spent waiting on the device); per call the CUDA caching allocator's counters
    (_ALLOC_STATS); the synchronisations torch's sync debug mode reports in one call (CUDA only)."""
    dev = device_of(device)
    cuda = dev.type == "cuda"
    # the allocator counts on the host, as calls enqueue: no wait before reading it
    before = torch.cuda.memory_stats(dev) if cuda else {}
    host = []
    for _ in range(calls):
        _sync(dev)
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
    out = {"host_drained_ms": statistics.median(host), "host_drained_calls": calls}
    if not cuda:
        return out
    after = torch.cuda.memory_stats(dev)
    out["allocator_per_call"] = {k: (after.get(k, 0) - before.get(k, 0)) / calls for k in _ALLOC_STATS}
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    _sync(dev)
    syncs = [str(w.message).splitlines()[0][:200] for w in caught if SYNC_WARNING in str(w.message)]
    out["syncs"] = {"count": len(syncs), "first": syncs[:3]}
    return out


def measure(fn: Callable[[], object], reps: int, warmup: int = 2, device=None, budget_s: float | None = None,
            logical: dict | None = None, count: bool = True, warm_ms: float = EAGER_WARM_MS,
            profile_calls: int = 0) -> dict:
    """A record's timing fields: the device clock where its median is under SHORT_MS, else the eager clock. `logical`:
    counts lent by the other run order's record, else (with `count`) one call's. A call under `warm_ms` runs back to
    back that long first (0 where processes must make the same calls: FSDP's ranks). `profile_calls`: for a call under
    SHORT_MS eager, host_waits (at most HOST_WAIT_CALLS calls) and the host profile."""
    dev = device_of(device)
    for _ in range(max(warmup - 1, 0)):
        fn()
    if counted := count and logical is None:
        logical = logical_counts(fn, dev)
    # One plain call (the profiled one is slower) decides whether the call is short.
    warmed = run_for(fn, dev, warm_ms) if warm_ms > 0 and run_for(fn, dev, 0) < warm_ms else 0.0
    if warm_ms <= 0 and not counted:
        fn()
    clk = clocks(dev)
    before = clk.sample()
    eager = time_fn(fn, reps, 0, dev, budget_s=budget_s, min_reps=min(3, reps))
    dtime = None
    if dev.type == "cuda" and eager["median_ms"] < DEVICE_CLOCK_MAX_MS:
        # The graph is sized by a pilot on the device clock, not by the eager clock: the calls
        # per sample, and with them a short call's figure, must not depend on the host's speed.
        n = PILOT_SHORT_CALLS if eager["min_ms"] < PILOT_SHORT_MS else PILOT_CALLS
        pilot = device_time(fn, 3, n, dev)["min_ms"]
        dtime = {**device_time(fn, eager["n"], graph_calls(pilot), dev), "pilot_ms": pilot}
    head = dtime if dtime is not None and dtime["median_ms"] < SHORT_MS else eager
    clock = f"device:{dtime['method']}" if head is dtime else f"eager:{eager['clock']}"
    stats = {**summarize(head["samples_ms"]), "reps_requested": reps, "warmup": max(warmup, 1),
             "stopped_early": eager["stopped_early"], "clock": clock}
    host = {"host_samples_ms": eager["host_ms"], "host_median_ms": statistics.median(eager["host_ms"]),
            "warm_ms": warmed}
    if profile_calls and eager["median_ms"] < SHORT_MS:
        host.update(host_waits(fn, min(profile_calls, HOST_WAIT_CALLS), dev))
        host["host_profile"] = host_profile(fn, profile_calls, dev)
    return {"samples_ms": list(head["samples_ms"]), "stats": stats, "logical": logical, "clock": clock,
            "eager": {"samples_ms": eager["samples_ms"], **summarize(eager["samples_ms"]), "clock": eager["clock"],
                      **host},
            "device": dtime, "sm_clock": clk.span(before, clk.sample()), "peak_bytes": eager["peak_bytes"],
            "base_bytes": eager["base_bytes"]}


def floor_fields(f: dict, floor_bytes: int, bandwidth: float | None) -> dict:
    floor_ms = floor_bytes / bandwidth * 1e3 if bandwidth else None
    f["logical"] = {**f["logical"], "floor_bytes": floor_bytes}
    f.update(floor_bytes=floor_bytes, copy_bandwidth_bytes_per_s=bandwidth, floor_ms=floor_ms,
             fraction_of_floor=floor_ms / f["stats"]["median_ms"] if floor_ms else None)
    return f


def orders(names: Sequence, keep: Sequence = ("AB", "BA")) -> list[tuple[str, list, object]]:
    """(order, its sequence, each name in it) for the run orders in `keep`: "AB" as given, "BA" reversed."""
    names = list(names)
    both = [("AB", names)] if len(names) < 2 else [("AB", names), ("BA", names[::-1])]
    return [(o, seq, name) for o, seq in both if o in keep for name in seq]


def count_kernels(events) -> dict:
    """Kernels, copies and fills among the GPU's profiler events; calls and us per kernel."""
    out = {"kernels": 0, "memcpy": 0, "memset": 0, "by_name": {}, "us_by_name": {}, "device_us": 0.0}
    for e in (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA):
        kind = "memcpy" if e.name.startswith("Memcpy") else "memset" if e.name.startswith("Memset") else "kernels"
        us = float(e.time_range.elapsed_us())
        out[kind] += 1
        out["device_us"] += us
        if kind == "kernels":
            out["by_name"][e.name] = out["by_name"].get(e.name, 0) + 1
            out["us_by_name"][e.name] = out["us_by_name"].get(e.name, 0.0) + us
    return out


def logical_counts(fn: Callable[[], object], device=None) -> dict:
    """One call of fn under the launchers' accounting and, on a GPU, torch.profiler."""
    dev, lc, prof = device_of(device), {}, None
    if dev.type == "cuda":
        try:
            prof = profiler.profile(activities=[profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as exc:  # noqa: BLE001 - the profiler's failure is recorded
            prof, lc["error"] = None, f"{type(exc).__name__}: {exc}"
    with accounting.counting() as c:
        try:
            fn()
            _sync(dev)
        finally:
            try:
                if prof is not None:
                    prof.__exit__(None, None, None)
                    lc.update(count_kernels(prof.events()))
            except Exception as exc:  # noqa: BLE001
                lc["error"] = f"{type(exc).__name__}: {exc}"
    profiled = "kernels" in lc
    by_time = sorted(lc.get("us_by_name", {}).items(), key=lambda kv: -kv[1])[:25]
    return {"basis": LOGICAL_BASIS, "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
            "param_bytes": None, "state_bytes": None, "launches": lc["kernels"] if profiled else c.launches,
            "launches_method": "torch.profiler" if profiled else "launcher accounting",
            "accounted_launches": c.launches, "by_kernel": dict(c.by_kernel), "memcpy": lc.get("memcpy"),
            "memset": lc.get("memset"), "device_us": lc.get("device_us"),
            "top_kernels": dict(sorted(lc.get("by_name", {}).items(), key=lambda kv: -kv[1])[:40]),
            "top_kernels_by_time": [{"name": n, "us": round(us, 2), "calls": lc["by_name"][n],
                                     "share": round(us / lc["device_us"], 4) if lc["device_us"] else None}
                                    for n, us in by_time], "profiler_error": lc.get("error")}


def tensor_bytes(obj, depth: int = 0, seen: set | None = None) -> int:
    """Bytes of every tensor reachable through lists, tuples, dicts and plain objects."""
    seen = set() if seen is None else seen
    if depth > 6 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        obj = list(vars(obj).values())
    return sum(tensor_bytes(v, depth + 1, seen) for v in obj) if isinstance(obj, (list, tuple)) else 0


NCU_METRICS = {"dram_bytes_read": "dram__bytes_read.sum", "dram_bytes_written": "dram__bytes_write.sum",
               "l2_bytes": "lts__t_bytes.sum",
               "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active"}
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep, launched between configurations
mark_boundary = functools.partial(torch.cuda._sleep, 1)


def number(text: str | None) -> float | None:
    """A number as Nsight Compute prints it (thousands separated by commas), or None."""
    try:
        return float((text or "").replace(",", "").strip())
    except ValueError:
        return None


def ncu_groups(text: str) -> list[dict]:
    """Per marker kernel in `ncu --csv --page raw` output, a summary of the kernels up to the next."""
    groups = []
    for r in csv.DictReader(ln for ln in text.splitlines() if ln.startswith('"')):
        name = r.get("Kernel Name") or r.get("Function Name")
        if not name or name.startswith("nvtx") or not r.get("ID", "").strip():
            continue
        if MARKER_KERNEL in name:
            groups.append([])
        elif groups:
            groups[-1].append({key: number(r.get(metric)) for key, metric in NCU_METRICS.items()})
    out = []
    for g in groups:
        vals = {k: [r[k] for r in g if r[k] is not None] for k in NCU_METRICS}
        occ = vals.pop("achieved_occupancy_pct")
        out.append({"source": "ncu", "kernels": len(g), **{k: sum(v) if v else None for k, v in vals.items()},
                    "achieved_occupancy_pct_mean": sum(occ) / len(occ) if occ else None})
    return out


def ncu_path(ncu: str = "ncu") -> str | None:
    return shutil.which(ncu) or ("/usr/local/cuda/bin/ncu" if os.path.isfile("/usr/local/cuda/bin/ncu") else None)


def ncu_counters(argv: Sequence[str], n_configs: int, timeout_s: float = 600, ncu: str = "ncu",
                 env: dict | None = None) -> list[dict] | None:
    """One counter summary per configuration of `argv` run under Nsight Compute, or None."""
    cmd = [ncu_path(ncu) or ncu, "--csv", "--page", "raw", "--metrics", ",".join(NCU_METRICS.values()), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    except (OSError, subprocess.SubprocessError):
        return None
    # Groups after each marker alternate: a call, then the next configuration's set-up.
    calls = ncu_groups(proc.stdout)[0::2] if proc.returncode == 0 else []
    return calls[:n_configs] if len(calls) >= n_configs else None


def find_key(doc, key: str):
    """First value under `key` anywhere in a nested JSON document."""
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    for v in doc if isinstance(doc, list) else []:
        if (found := find_key(v, key)) is not None:
            return found
    return None


def probe_figure(env: dict, key: str) -> float | None:
    """A positive figure the probe measured, wherever in `env` it put it, else None."""
    v = find_key(env, key)
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


copy_bandwidth = functools.partial(probe_figure, key="copy_bandwidth_bytes_per_s")  # bytes read + written per s
matmul_rate = functools.partial(probe_figure, key="matmul_bf16_flop_per_s")


def counters_available(env: dict) -> tuple[bool, str]:
    ok, check = find_key(env, "counters_available"), find_key(env, "counters")
    reason = (check.get("reason") if isinstance(check, dict) else None) or find_key(env, "reason")
    return bool(ok), str(reason or ("counters available" if ok else "the probe found no readable counters"))


@dataclass
class Outcome:
    status: str
    value: object = None
    error: dict | None = None

    ok = property(lambda self: self.status == STATUS_OK)


class Skip(Exception):
    """A configuration that does not apply here (a peer not installed); nothing is recorded."""


def describe(exc: BaseException, limit: int = 4000) -> dict:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    msg = f"{type(exc).__name__}: {exc}".lower()
    return {"type": type(exc).__name__, "message": str(exc)[:limit], "traceback_tail": tb[-limit:],
            "sticky": any(s in msg for s in _STICKY)}


def error_text(err: dict) -> str:
    return f"{err['type']}: {err['message']}"[:2000] or err["type"]


def release(device=None) -> None:
    dev = device_of(device)
    if dev.type == "cuda":
        gc.collect()
        for f in (torch.cuda.synchronize, lambda d: torch.cuda.empty_cache(), torch.cuda.reset_peak_memory_stats):
            with contextlib.suppress(Exception):
                f(dev)


def capture(fn: Callable[[], object], device=None) -> Outcome:
    """Run fn; an exception becomes an Outcome instead of ending the stage."""
    try:
        return Outcome(STATUS_OK, fn())
    except (KeyboardInterrupt, SystemExit, Skip):
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of one configuration is data
        status, err = records.classify_error(exc)[0], describe(exc)
        del exc
        release(device)
        return Outcome(status, None, err)


def context_usable(device=None) -> bool:
    """Whether the GPU still runs work after a failure (a sticky CUDA error poisons the context)."""
    dev = device_of(device)
    try:
        return dev.type != "cuda" or float((torch.ones(8, device=dev) + 1).sum().item()) == 16.0
    except Exception:  # noqa: BLE001 - any error here means the context is unusable
        return False


def reexec(job, max_restarts: int = 8) -> None:
    """Replace this process by a fresh run of the same stage job, which resumes."""
    n = int(os.environ.get(RESTARTS_ENV, "0")) + 1
    if n > max_restarts:
        raise RuntimeError(f"stage {job.rule}: CUDA context poisoned {n} times; giving up")
    path = REPO_ROOT / "results" / ".tmp" / "jobs" / f"{job.rule}-restart.json"
    atomic.write_json(path, job.to_json())
    stage.exec_python([job.script, "--job", str(path)], {RESTARTS_ENV: str(n)})


def deadline(seconds: float | None) -> Callable[[], bool]:
    """Whether a wall-clock budget of `seconds` from now is spent (never without one)."""
    end = math.inf if seconds is None else time.perf_counter() + seconds
    return lambda: time.perf_counter() >= end


class Runner:
    """Runs a stage's configurations, one record each."""

    def __init__(self, stage: str, profile: str, records_dir, budget_s: float | None = None, device=None,
                 restart: Callable[[], None] | None = None, lock_clocks: bool = False):
        self.stage, self.profile, self.dir, self.device = stage, profile, Path(records_dir), device_of(device)
        self.exhausted, self.restart, self.clocks = deadline(budget_s), restart, clocks(self.device)
        self.done, self.planned, self.skipped = records.done_ids(self.dir, profile), [], []
        self.clock_lock = self.clocks.lock() if lock_clocks else {
            "locked": False, "reason": "not requested (profile key probe.lock_clocks)"}

    @classmethod
    def for_job(cls, job, stage: str, settings: dict, device) -> "Runner":
        return cls(stage, job.profile, job.params["records_dir"], settings.get("budget_s"), device,
                   restart=lambda: reexec(job), lock_clocks=job.lock_clocks)

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {self.stage}: {msg}", flush=True)

    def get(self, config_id: str) -> dict | None:
        return records.read_record(records.record_path(self.dir, config_id)) if config_id in self.done else None

    def ok(self, config_id: str) -> dict | None:
        return rec if (rec := self.get(config_id)) is not None and rec["status"] == STATUS_OK else None

    def twin(self, config_id: str) -> dict | None:
        """The logical counts of a BA configuration's successful AB record (the same kernels)."""
        ab = re.sub(r"-BA(?=-|$)", "-AB", config_id)
        rec = self.ok(ab) if ab != config_id else None
        return {**rec["logical"], "counted_in": ab} if rec and isinstance(rec.get("logical"), dict) else None

    def run(self, config_id: str, body: Callable[[], dict], **fields) -> dict | None:
        """Record `body()`'s fields (or its failure); the record, or None when skipped."""
        return self.run_group([config_id], lambda: {config_id: body() or {}}, {config_id: fields}).get(config_id)

    def run_group(self, config_ids: list[str], body: Callable[[], dict], fields: dict) -> dict:
        """One measurement, several records (all or none): `body()` gives {config_id: fields}."""
        if twice := [c for c in config_ids if c in self.planned]:
            raise ValueError(f"configuration {twice[0]!r} planned twice in stage {self.stage}")
        self.planned += config_ids
        pending = [c for c in config_ids if c not in self.done]
        if pending and self.exhausted():
            self.skipped += pending
        elif pending:
            t0 = time.perf_counter()
            try:
                outcome = capture(body, self.device)
            except Skip as why:
                self.planned = self.planned[:-len(config_ids)]
                self.say(f"{config_ids[0]}: not applicable ({why})")
                return {}
            failure = None if outcome.ok else {"status": outcome.status, "error": error_text(outcome.error),
                                               "error_detail": outcome.error, "samples_ms": [], "stats": None}
            for c in config_ids:
                if (extra := failure or outcome.value.get(c)) is None:
                    raise RuntimeError(f"measurement of {config_ids} returned nothing for {c}")
                extra = {**fields[c], **extra, "clock_lock": self.clock_lock, "wall_s": time.perf_counter() - t0}
                records.write_record(self.dir, rec := records.new_record(self.stage, self.profile, c, **extra))
                self.done.add(c)
            med = (rec.get("stats") or {}).get("median_ms") if len(config_ids) == 1 else None
            self.say(f"{config_ids[0]}{f' .. ({len(config_ids)} records)' if len(config_ids) > 1 else ''}: "
                     f"{outcome.status}" + (f" median {med:.4g} ms" if med is not None else "")
                     + ("" if failure is None else f" ({failure['error'][:200]})"))
            if failure and (outcome.error["sticky"] or not context_usable(self.device)):
                self.say("the CUDA context is unusable after this failure; restarting the stage process")
                if self.restart is None:
                    raise RuntimeError(f"CUDA context poisoned by {config_ids[0]} and no restart available")
                self.restart()
        return {c: self.get(c) for c in config_ids if c in self.done}

    def finish(self, out_jsonl) -> list[dict]:
        """Write this run's planned, recorded configurations to out_jsonl; release a clock lock."""
        self.clocks.reset()
        if self.skipped:
            self.say(f"time budget spent: {len(self.skipped)} configurations not run: {self.skipped}")
        ids = [c for c in dict.fromkeys(self.planned) if c in self.done]
        recs = records.collect(self.dir, out_jsonl, profile=self.profile, ids=ids)
        self.say(f"{len(recs)} records")
        return recs
