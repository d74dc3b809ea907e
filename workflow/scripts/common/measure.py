"""The measurement harness of every stage (probe, tune, scan, train, infer, ops).

`measure(fn, reps)` (SPEC 5; `fn` takes no argument, its inputs are prepared by
the caller outside every timed window):
1. warm-up calls (compilation, autotuning); the last is the counted call, run
   under the launchers' byte accounting and torch.profiler (`logical`, labelled);
2. eager clock: `reps` calls as a user makes them, each between two CUDA events
   (perf_counter on the CPU), host work included, the allocator's peak reset first;
3. device clock, on a GPU for work whose eager median is under DEVICE_CLOCK_MAX_MS
   (host-heavy calls can take far longer eagerly than on the device): `calls` calls
   captured in one CUDA graph, each sample one replay (method "cuda_graph"), or
   where capture fails `calls` back-to-back launches between two events
   ("back_to_back"); a sample is the window divided by `calls`;
4. the headline (`samples_ms`, `stats`, `clock`) is the device clock where its
   median is under SHORT_MS, else the eager clock; both keep raw samples and
   P10 / median / P95;
5. the SM clock (NVML) before and after the configuration, `throttled` when a
   power or thermal slowdown was reported or the clock fell by over 5 %.
`Runner` runs a stage's configurations: resume, failures as records, time budget,
a new process after a failure that poisoned the CUDA context, and an attempt to
lock the GPU clocks (nvmlDeviceSetGpuLockedClocks, often refused without root)
whose outcome every record carries; the clocks are reset when the stage ends.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import gc
import io
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kernels.ops import accounting

STATUS_OK, STATUS_OOM, STATUS_FAILED = "ok", "oom", "failed"
# Exit status of a stage worker whose failure left the CUDA context unusable.
POISONED_EXIT = 75
SHORT_MS = 2.0              # device time under this per call is the headline
DEVICE_CLOCK_MAX_MS = 50.0  # the device clock is taken for work whose eager median is under this
DEVICE_WINDOW_MS = 1.0  # a device-clock sample covers about this much work
LOGICAL_BASIS = (
    "logical: bytes from the launchers' own accounting of the tensors each kernel reads "
    "and writes (kernels.ops.accounting; matmuls and other PyTorch ops not included); "
    "kernel launches counted by torch.profiler from what ran in one call"
)
_STICKY = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
           "device-side assert", "an illegal address", "cudaerrorlaunchfailure", "cuda_error_illegal_address",
           "uncorrectable ecc")


def device_of(device=None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _open_window(dev) -> int | None:
    """Synchronise and reset the allocator's peak before a timed window; the bytes
    allocated at its start (None on the CPU)."""
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


# ------------------------------------------------------------------ statistics


def percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not samples:
        raise ValueError("expected at least one sample, got none")
    s = sorted(samples)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict:
    return {"n": len(samples), "p10_ms": percentile(samples, 10), "median_ms": statistics.median(samples),
            "p95_ms": percentile(samples, 95), "mean_ms": statistics.fmean(samples), "min_ms": min(samples)}



# --------------------------------------------------------------------- clocks


def time_fn(fn: Callable[[], object], reps: int = 20, warmup: int = 3, device=None, budget_s: float | None = None,
            min_reps: int = 3) -> dict:
    """The eager clock: `warmup` untimed calls, then `reps` calls each between two
    CUDA events (perf_counter on the CPU) with the allocator's peak reset first.
    With `budget_s` it stops after at least `min_reps` samples once the window has
    lasted that long (`stopped_early`)."""
    for name, v, lo in (("reps", reps, 1), ("warmup", warmup, 0), ("min_reps", min_reps, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"expected {name} to be an integer >= {lo}, got {v!r}")
    dev = device_of(device)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    base, peak = _open_window(dev), None
    marks, stopped, t_start = [], False, time.perf_counter()
    for i in range(reps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            marks.append((s, e))
            # Waiting for the sample two behind keeps the queue non-empty while wall time tracks it.
            if budget_s is not None and i >= 2:
                marks[i - 2][1].synchronize()
        else:
            t0 = time.perf_counter()
            fn()
            marks.append((time.perf_counter() - t0) * 1e3)
        if budget_s is not None and min_reps <= i + 1 < reps and time.perf_counter() - t_start > budget_s:
            stopped = True
            break
    if cuda:
        torch.cuda.synchronize(dev)
        samples = [s.elapsed_time(e) for s, e in marks]
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        samples = marks
    return {"samples_ms": samples, **summarize(samples), "peak_bytes": peak, "base_bytes": base,
            "clock": "cuda_event" if cuda else "perf_counter", "reps_requested": reps, "warmup": warmup,
            "stopped_early": stopped}


def device_time(fn: Callable[[], object], reps: int, calls: int, device=None, graph: bool = True) -> dict:
    """The device clock of `fn` on a GPU: `calls` calls captured in one CUDA graph
    and replayed `reps` times (after two untimed replays), or, when capture fails
    or `graph` is False, `calls` back-to-back launches between two events; every
    sample is the window over `calls`. Host work stays out of a graph replay."""
    dev = device_of(device)
    g, why = None, None
    if graph:
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            g.replay()
            g.replay()
            torch.cuda.synchronize(dev)
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured falls back
            g, why = None, f"{type(exc).__name__}: {exc}"[:500]
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(dev)

    def window():
        if g is not None:
            g.replay()
        else:
            for _ in range(calls):
                fn()

    t = time_fn(window, reps, 0 if g is not None else 1, dev)
    samples = [s / calls for s in t["samples_ms"]]
    del g
    return {"samples_ms": samples, **summarize(samples), "method": "back_to_back" if why or not graph
            else "cuda_graph", "calls_per_sample": calls, "graph_error": why}


def time_trajectory(step: Callable[[int], object], checkpoints: Sequence[int], device=None,
                    before: Callable[[], object] | None = None, warmup: int = 0) -> dict:
    """One run of dependent steps step(0) .. step(max(checkpoints) - 1) (a decode
    trajectory): the cumulative milliseconds at every checkpoint from one event
    before the first step. `before` (prompt, cache set-up) is excluded: the peak is
    reset after it. `warmup` > 0 first runs `before` and that many untimed steps,
    then `before` again, so no one-time work (compilation, capture) is timed."""
    cps = sorted({int(c) for c in checkpoints})
    if not cps or cps[0] < 1:
        raise ValueError(f"expected checkpoints to be positive step counts, got {list(checkpoints)}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"expected warmup to be a non-negative integer, got {warmup!r}")
    dev = device_of(device)
    cuda = dev.type == "cuda"
    if warmup:
        if before is not None:
            before()
        for i in range(warmup):
            step(i)
        _sync(dev)
    if before is not None:
        before()
    base, peak = _open_window(dev), None
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    marks, t0 = [], time.perf_counter()
    for i in range(cps[-1]):
        step(i)
        if i + 1 in cps:
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
            else:
                marks.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(dev)
        marks = [start.elapsed_time(e) for e in marks]
        peak = torch.cuda.max_memory_allocated(dev)
    intervals = [c - p for c, p in zip(marks, [0.0, *marks[:-1]])]
    return {"checkpoints": cps, "cumulative_ms": marks, "interval_ms": intervals, "peak_bytes": peak,
            "base_bytes": base, "clock": "cuda_event" if cuda else "perf_counter", "warmup_steps": warmup}


class Clocks:
    """NVML view of one GPU's SM clock. `sample()` reads the clock and the reasons
    it is held down; `lock()` tries nvmlDeviceSetGpuLockedClocks at the default
    applications clock (most rented nodes refuse it without root) and says whether
    it worked; `reset()` releases a lock this process took."""

    SLOWDOWN = 0x4 | 0x8 | 0x20 | 0x40 | 0x80   # SW power cap, HW slowdown, SW/HW thermal, power brake

    def __init__(self, device=None):
        self.nvml, self.handle, self.locked = None, None, False
        dev = device_of(device)
        self.reason = "no GPU" if dev.type != "cuda" else None
        if dev.type != "cuda":
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

    def sample(self) -> dict | None:
        if self.handle is None:
            return None
        n = self.nvml
        try:
            reasons = n.nvmlDeviceGetCurrentClocksEventReasons(self.handle)
        except (n.NVMLError, AttributeError):
            reasons = None
        try:
            return {"sm_mhz": n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM), "reasons": reasons}
        except n.NVMLError:
            return None

    def lock(self) -> dict:
        if self.handle is None:
            return {"locked": False, "mhz": None, "reason": self.reason}
        n = self.nvml
        try:
            mhz = n.nvmlDeviceGetDefaultApplicationsClock(self.handle, n.NVML_CLOCK_SM)
        except n.NVMLError:
            mhz = n.nvmlDeviceGetMaxClockInfo(self.handle, n.NVML_CLOCK_SM)
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
        slow = any(s["reasons"] is not None and s["reasons"] & self.SLOWDOWN for s in (before, after))
        return {"before_mhz": before["sm_mhz"], "after_mhz": after["sm_mhz"], "reasons_after": after["reasons"],
                "throttled": bool(slow or after["sm_mhz"] < 0.95 * before["sm_mhz"])}


_CLOCKS: dict[str, Clocks] = {}


def clocks(device=None) -> Clocks:
    dev = device_of(device)
    return _CLOCKS.setdefault(str(dev), Clocks(dev))


# ------------------------------------------------------------------- measure


def measure(fn: Callable[[], object], reps: int, warmup: int = 2, device=None, budget_s: float | None = None,
            min_reps: int = 3, count: bool = True, device_clock: bool | None = None, graph: bool = True) -> dict:
    """Warm up, count one call, time `reps` eager calls and, on a GPU for work under
    DEVICE_CLOCK_MAX_MS (or as `device_clock` says), `reps` device-clock samples. Returns
    {"timing": headline samples and stats with "eager", "device", "sm_clock"},
    "logical": logical_counts or None}."""
    dev = device_of(device)
    for _ in range(max(warmup - 1, 0)):
        fn()
    if count:
        logical = logical_counts(fn, dev)
    else:
        fn()
        logical = None
    clk = clocks(dev)
    before = clk.sample()
    eager = time_fn(fn, reps, 0, dev, budget_s=budget_s, min_reps=min(min_reps, reps))
    eager["warmup"] = max(warmup, 1)
    dtime = None
    if dev.type == "cuda" and (eager["median_ms"] < DEVICE_CLOCK_MAX_MS if device_clock is None else device_clock):
        calls = max(1, min(200, math.ceil(DEVICE_WINDOW_MS / max(eager["min_ms"], 1e-3))))
        dtime = device_time(fn, eager["n"], calls, dev, graph)
    head = dtime if headline_is_device(dtime) else eager
    t = {**{k: eager[k] for k in ("peak_bytes", "base_bytes", "reps_requested", "warmup", "stopped_early")},
         **{k: head[k] for k in ("samples_ms", "n", "p10_ms", "median_ms", "p95_ms", "mean_ms", "min_ms")},
         "clock": f"device:{dtime['method']}" if head is dtime else f"eager:{eager['clock']}",
         "eager": {"samples_ms": eager["samples_ms"], **summarize(eager["samples_ms"]), "clock": eager["clock"]},
         "device": dtime, "sm_clock": clk.span(before, clk.sample())}
    return {"timing": t, "logical": logical}


def headline_is_device(dtime: dict | None) -> bool:
    """Whether the device clock is the headline: short work (device median under
    SHORT_MS), decided by the device time, not by the eager time that host work
    inflates."""
    return dtime is not None and dtime["median_ms"] < SHORT_MS


def timing_fields(m: dict) -> dict:
    """Record fields from `measure`'s result: the headline `samples_ms` / `stats` /
    `clock`, `eager` and `device` (each raw samples + stats), `sm_clock`, memory
    and `logical`."""
    t = m["timing"]
    stats = {k: t[k] for k in ("n", "p10_ms", "median_ms", "p95_ms", "mean_ms", "min_ms", "reps_requested",
                               "warmup", "stopped_early", "clock")}
    return {"samples_ms": list(t["samples_ms"]), "stats": stats, "clock": t["clock"], "eager": t["eager"],
            "device": t["device"], "sm_clock": t["sm_clock"], "peak_bytes": t["peak_bytes"],
            "base_bytes": t["base_bytes"], "logical": m.get("logical")}


def orders(names: Sequence) -> list[tuple[str, list]]:
    """Both run orders of a comparison: ("AB", names) then ("BA", reversed)."""
    names = list(names)
    return [("AB", names)] if len(names) < 2 else [("AB", names), ("BA", names[::-1])]


# ------------------------------------------------------------ logical counts


def count_kernels(events) -> dict:
    """Kernels, copies and fills among profiler events that ran on the GPU."""
    out = {"kernels": 0, "memcpy": 0, "memset": 0, "by_name": {}}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = "memcpy" if e.name.startswith("Memcpy") else "memset" if e.name.startswith("Memset") else "kernels"
        out[kind] += 1
        if kind == "kernels":
            out["by_name"][e.name] = out["by_name"].get(e.name, 0) + 1
    return out


@contextlib.contextmanager
def launch_counter(device=None):
    """Counts GPU kernels inside the block with torch.profiler; the dict is filled on
    exit (left empty without CUDA, with "error" when the profiler fails)."""
    out: dict = {}
    dev = device_of(device)
    if dev.type != "cuda":
        yield out
        return
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    try:
        prof.__enter__()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        yield out
        return
    try:
        yield out
        torch.cuda.synchronize(dev)
    finally:
        try:
            prof.__exit__(None, None, None)
            out.update(count_kernels(prof.events()))
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"


def logical_counts(fn: Callable[[], object], device=None) -> dict:
    """Run fn once under the launchers' accounting and the profiler. `launches` is
    the profiler's kernel count; without a GPU, the launchers' own count."""
    with accounting.counting() as c, launch_counter(device) as lc:
        fn()
    profiled = "kernels" in lc
    return {"basis": LOGICAL_BASIS, "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
            "param_bytes": None, "state_bytes": None, "launches": lc["kernels"] if profiled else c.launches,
            "launches_method": "torch.profiler" if profiled else "launcher accounting",
            "accounted_launches": c.launches, "by_kernel": dict(c.by_kernel), "memcpy": lc.get("memcpy"),
            "memset": lc.get("memset"),
            "top_kernels": dict(sorted(lc.get("by_name", {}).items(), key=lambda kv: -kv[1])[:40]),
            "profiler_error": lc.get("error")}


def reuse_logical(rec: dict | None) -> dict | None:
    """The logical counts of the same configuration's record in the other run order
    (the same kernels run), marked with where they were counted; else None."""
    if rec is None or rec.get("status") != STATUS_OK or not isinstance(rec.get("logical"), dict):
        return None
    return {**rec["logical"], "counted_in": rec["config_id"]}


def tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable through lists, tuples, dicts and plain objects."""
    seen: set[int] = set()

    def walk(o, depth=0):
        if depth > 6 or id(o) in seen:
            return 0
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, dict):
            return sum(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(walk(v, depth + 1) for v in o)
        if hasattr(o, "__dict__") and not isinstance(o, (type, torch.nn.Module)):
            return sum(walk(v, depth + 1) for v in vars(o).values())
        return 0

    return walk(obj)


# ------------------------------------------------------- hardware counters

NCU_METRICS = {"dram_bytes_read": "dram__bytes_read.sum", "dram_bytes_written": "dram__bytes_write.sum",
               "l2_bytes": "lts__t_bytes.sum",
               "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active"}
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep, launched between configurations


def mark_boundary() -> None:
    """A tiny named kernel that separates configurations in an Nsight Compute log."""
    torch.cuda._sleep(1)


def parse_ncu_csv(text: str) -> list[dict]:
    """Per-kernel rows of `ncu --csv --page raw`: name and our metric columns."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    out = []
    for r in csv.DictReader(io.StringIO("\n".join(lines))) if lines else []:
        name = r.get("Kernel Name") or r.get("Function Name") or ""
        if not name or name.startswith("nvtx") or r.get("ID", "").strip() == "":
            continue
        vals = {}
        for key, metric in NCU_METRICS.items():
            try:
                vals[key] = float((r.get(metric) or "").replace(",", "").strip())
            except ValueError:
                vals[key] = None
        out.append({"name": name, **vals})
    return out


def split_by_marker(rows: list[dict]) -> list[list[dict]]:
    """Groups of kernel rows between marker kernels (one group per configuration)."""
    groups, cur, seen = [], [], False
    for r in rows:
        if MARKER_KERNEL in r["name"]:
            if seen:
                groups.append(cur)
            cur, seen = [], True
        elif seen:
            cur.append(r)
    return groups + [cur] if seen else groups


def summarize_counters(rows: list[dict]) -> dict:
    def total(k):
        vals = [r[k] for r in rows if r.get(k) is not None]
        return sum(vals) if vals else None

    occ = [r["achieved_occupancy_pct"] for r in rows if r.get("achieved_occupancy_pct") is not None]
    return {"source": "ncu", "kernels": len(rows), "dram_bytes_read": total("dram_bytes_read"),
            "dram_bytes_written": total("dram_bytes_written"), "l2_bytes": total("l2_bytes"),
            "achieved_occupancy_pct_mean": (sum(occ) / len(occ)) if occ else None}


def ncu_counters(argv: Sequence[str], n_configs: int, timeout_s: float = 600, ncu: str = "ncu",
                 env: dict | None = None) -> list[dict] | None:
    """Run `argv` (a worker running n_configs configurations once each, each call
    between two mark_boundary() calls, set-up outside them; `env` added to its
    environment) under Nsight Compute; one counter summary per configuration, or
    None when it fails."""
    ncu = shutil.which(ncu) or ("/usr/local/cuda/bin/ncu" if os.path.isfile("/usr/local/cuda/bin/ncu") else ncu)
    cmd = [ncu, "--csv", "--page", "raw", "--metrics", ",".join(NCU_METRICS.values()), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    except (OSError, subprocess.SubprocessError):
        return None
    # Groups after each marker alternate: a call, then the next configuration's set-up.
    calls = split_by_marker(parse_ncu_csv(proc.stdout))[0::2] if proc.returncode == 0 else []
    return [summarize_counters(g) for g in calls[:n_configs]] if len(calls) >= n_configs else None


# ----------------------------------------------------------- probe figures


def find_key(doc, key: str):
    """First value stored under `key` anywhere in a nested JSON document."""
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for v in doc:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


def _positive(env: dict, key: str) -> float | None:
    v = find_key(env, key)
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def copy_bandwidth(env: dict) -> float | None:
    """Device copy bandwidth (bytes read + written per second) measured by the probe."""
    return _positive(env, "copy_bandwidth_bytes_per_s")


def matmul_rate(env: dict) -> float | None:
    return _positive(env, "matmul_bf16_flop_per_s")


def counters_available(env: dict) -> tuple[bool, str]:
    ok = find_key(env, "counters_available")
    check = find_key(env, "counters")
    reason = check.get("reason") if isinstance(check, dict) else None
    reason = reason or find_key(env, "reason")
    return bool(ok), str(reason or ("counters available" if ok else "the probe found no readable counters"))


# ------------------------------------------------------------------ failures


@dataclass
class Outcome:
    status: str
    value: object = None
    error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


class Skip(Exception):
    """A configuration that does not apply here (a peer that is not installed, a
    backend that does not exist); nothing is recorded for it."""


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def is_sticky(exc: BaseException) -> bool:
    """Whether the error leaves the CUDA context unusable for this process."""
    msg = f"{type(exc).__name__}: {exc}".lower()
    return any(s in msg for s in _STICKY)


def describe(exc: BaseException, limit: int = 4000) -> dict:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "message": str(exc)[:limit], "traceback_tail": tb[-limit:],
            "sticky": is_sticky(exc)}


def error_text(err: dict) -> str:
    return f"{err['type']}: {err['message']}"[:2000] or err["type"]


def release(device=None) -> None:
    """Free what a finished or failed configuration left on the GPU."""
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
        status, err = STATUS_OOM if is_oom(exc) else STATUS_FAILED, describe(exc)
        del exc
        release(device)
        return Outcome(status, None, err)


def context_usable(device=None) -> bool:
    dev = device_of(device)
    if dev.type != "cuda":
        return True
    try:
        x = torch.ones(8, device=dev)
        torch.cuda.synchronize(dev)
        return float((x + 1).sum().item()) == 16.0
    except Exception:  # noqa: BLE001
        return False


RESTARTS_ENV = "KERNELS_STAGE_RESTARTS"


def reexec(job, max_restarts: int = 8) -> None:
    """Replace this process by a fresh run of the same stage job, which resumes from
    the records already written (the failing configuration among them)."""
    from common import atomic
    from common.facts import REPO_ROOT

    n = int(os.environ.get(RESTARTS_ENV, "0")) + 1
    if n > max_restarts:
        raise RuntimeError(f"stage {job.rule}: CUDA context poisoned {n} times; giving up")
    path = REPO_ROOT / "results" / ".tmp" / "jobs" / f"{job.rule}-restart.json"
    atomic.write_json(path, job.to_json())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, job.script, "--job", str(path)], {**os.environ, RESTARTS_ENV: str(n)})


# -------------------------------------------------------------------- runner


@dataclass
class Budget:
    """Wall-clock budget of a stage: configurations not started before it runs out
    are left unrecorded (a later run with a larger budget resumes them)."""

    seconds: float | None
    start: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (time.perf_counter() - self.start)

    def exhausted(self) -> bool:
        return self.left() <= 0


def log_line(log, msg: str) -> None:
    stream = log or sys.stdout
    stream.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    stream.flush()


class Runner:
    """Runs a stage's configurations one by one: skips those already recorded
    (resume), records failures, stops starting new ones when the time budget is
    spent, restarts the process when a failure poisoned the CUDA context, and
    stamps every record with the outcome of the clock lock it tried."""

    def __init__(self, stage: str, profile: str, records_dir, budget_s: float | None = None, device=None,
                 log=None, restart: Callable[[], None] | None = None, lock_clocks: bool = False):
        from pathlib import Path

        from common import records

        self.records, self.stage, self.profile = records, stage, profile
        self.dir, self.device = Path(records_dir), device_of(device)
        self.budget, self.log, self.restart = Budget(budget_s), log, restart
        self.done = records.done_ids(self.dir, profile)
        self.planned: list[str] = []
        self.skipped: list[str] = []
        self.clocks = clocks(self.device)
        self.clock_lock = self.clocks.lock() if lock_clocks else {"locked": False, "reason": "not requested (profile key probe.lock_clocks)"}

    def say(self, msg: str) -> None:
        log_line(self.log, f"{self.stage}: {msg}")

    def get(self, config_id: str) -> dict | None:
        if config_id not in self.done:
            return None
        return self.records.read_record(self.records.record_path(self.dir, config_id))

    def ok(self, config_id: str) -> dict | None:
        rec = self.get(config_id)
        return rec if rec is not None and rec["status"] == STATUS_OK else None

    def run(self, config_id: str, body: Callable[[], dict], **fields) -> dict | None:
        """Record `body()`'s fields (or its failure) under config_id; returns the
        record, or None when the configuration was skipped or left for lack of time."""
        got = self.run_group([config_id], lambda: {config_id: body() or {}}, {config_id: fields})
        return got.get(config_id)

    def run_group(self, config_ids: list[str], body: Callable[[], dict], fields: dict) -> dict:
        """One measurement that yields several records (a decode trajectory gives one
        per checkpoint): `body()` returns {config_id: fields}; `fields[cid]` holds each
        record's own fields. All or none are recorded; returns {config_id: record}."""
        for c in config_ids:
            if c in self.planned:
                raise ValueError(f"configuration {c!r} planned twice in stage {self.stage}")
        self.planned += config_ids
        pending = [c for c in config_ids if c not in self.done]
        if pending and self.budget.exhausted():
            self.skipped += pending
        elif pending:
            t0 = time.perf_counter()
            try:
                outcome = capture(body, self.device)
            except Skip as why:
                self.planned = self.planned[:-len(config_ids)]
                self.say(f"{config_ids[0]}: not applicable ({why})")
                return {}
            for c in config_ids:
                if outcome.ok:
                    extra = outcome.value.get(c)
                    if extra is None:
                        raise RuntimeError(f"measurement of {config_ids} returned nothing for {c}")
                else:
                    extra = {"status": outcome.status, "error": error_text(outcome.error),
                             "error_detail": outcome.error, "samples_ms": [], "stats": None}
                rec = self.records.new_record(self.stage, self.profile, c, **{
                    **fields[c], **extra, "clock_lock": self.clock_lock})
                rec["wall_s"] = time.perf_counter() - t0
                self.records.write_record(self.dir, rec)
                self.done.add(c)
            med = (rec.get("stats") or {}).get("median_ms") if len(config_ids) == 1 else None
            self.say(f"{config_ids[0]}{f' .. ({len(config_ids)} records)' if len(config_ids) > 1 else ''}: "
                     f"{outcome.status}" + (f" median {med:.4g} ms" if med is not None else "")
                     + ("" if outcome.ok else f" ({error_text(outcome.error)[:200]})"))
            if not outcome.ok and (outcome.error["sticky"] or not context_usable(self.device)):
                self.say("the CUDA context is unusable after this failure; restarting the stage process")
                if self.restart is None:
                    raise RuntimeError(f"CUDA context poisoned by {config_ids[0]} and no restart available")
                self.restart()
        return {c: self.get(c) for c in config_ids if c in self.done}

    def finish(self, out_jsonl) -> list[dict]:
        """Concatenate this run's planned, recorded configurations into out_jsonl and
        release a clock lock."""
        self.clocks.reset()
        ids = [c for c in dict.fromkeys(self.planned) if c in self.done]
        if self.skipped:
            self.say(f"time budget spent: {len(self.skipped)} configurations not run: {self.skipped}")
        return self.records.collect(self.dir, out_jsonl, profile=self.profile, ids=ids)
