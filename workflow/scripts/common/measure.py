"""How every measuring stage measures: timing, logical statistics, run orders,
fresh re-measurement of selections, and failure capture.

Method (SPEC 5):
- `measure(fn, ...)`: warm-up calls first (compilation and autotuning happen
  there); the last warm-up call is also the *counted* call, run under the
  launchers' own byte accounting and torch.profiler, so the logical statistics
  describe exactly one call of what ran; then `kernels.timing.time_fn` times
  `reps` further calls between CUDA events with the allocator's peak reset at
  the start of the timed window.
- Statistics from accounting and the profiler are labelled logical: bytes are
  the launchers' accounting of the tensors each kernel reads and writes, launch
  counts are the kernels the profiler saw run. Hardware counters are a separate
  field filled only from Nsight Compute (`ncu_counters`), else null.
- `orders(names)`: every comparison runs in both orders, A then B and B then A.
- `select_fastest` picks from probe results; the caller re-measures the winner
  with a new `measure` call, so reported figures never reuse the samples that
  chose them.
- `capture(fn)`: an out-of-memory error or any other exception in one
  configuration becomes an outcome (status "oom" / "failed", error text) and the
  stage goes on; `context_usable` tells whether the CUDA context survived (an
  illegal address poisons it, and only a new process recovers: see `supervise`).
"""

from __future__ import annotations

import contextlib
import csv
import gc
import io
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from kernels import timing
from kernels.ops import accounting

STATUS_OK = "ok"
STATUS_OOM = "oom"
STATUS_FAILED = "failed"
# Exit status of a stage worker that recorded a failure which left the CUDA
# context unusable; the supervisor starts a new worker, which resumes.
POISONED_EXIT = 75

LOGICAL_BASIS = (
    "logical: bytes from the launchers' own accounting of the tensors each kernel reads "
    "and writes (kernels.ops.accounting; matmuls and other PyTorch ops not included); "
    "kernel launches counted by torch.profiler from what ran in one call"
)

_STICKY = (
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "device-side assert",
    "an illegal address",
    "cudaErrorLaunchFailure",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "uncorrectable ECC",
)


def device_of(device=None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------- failures


@dataclass
class Outcome:
    status: str
    value: object = None
    error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    msg = str(exc)
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in msg.lower() or isinstance(exc, MemoryError)
    )


def is_sticky(exc: BaseException) -> bool:
    """Whether the error leaves the CUDA context unusable for this process."""
    msg = f"{type(exc).__name__}: {exc}"
    return any(s.lower() in msg.lower() for s in _STICKY)


def describe(exc: BaseException, limit: int = 4000) -> dict:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:limit],
        "traceback_tail": tb[-limit:],
        "sticky": is_sticky(exc),
    }


def release(device=None) -> None:
    """Free what a finished or failed configuration left behind."""
    gc.collect()
    dev = device_of(device)
    if dev.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(dev)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            torch.cuda.reset_peak_memory_stats(dev)


def capture(fn: Callable[[], object], device=None) -> Outcome:
    """Run fn; an exception becomes an Outcome instead of ending the stage."""
    try:
        return Outcome(STATUS_OK, fn())
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of one configuration is data
        if isinstance(exc, SystemExit):
            raise
        status = STATUS_OOM if is_oom(exc) else STATUS_FAILED
        err = describe(exc)
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


# ---------------------------------------------------------- logical counts


def count_kernels(events) -> dict:
    """Kernels, copies and fills among profiler events that ran on the GPU."""
    kernels = copies = fills = 0
    names: dict[str, int] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if name.startswith("Memcpy"):
            copies += 1
        elif name.startswith("Memset"):
            fills += 1
        else:
            kernels += 1
            names[name] = names.get(name, 0) + 1
    return {"kernels": kernels, "memcpy": copies, "memset": fills, "by_name": names}


@contextlib.contextmanager
def launch_counter(device=None):
    """Counts GPU kernel launches inside the block with torch.profiler; the result
    dict is filled on exit (empty without CUDA or when the profiler fails)."""
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
    """Run fn once under the launchers' accounting and the profiler."""
    with accounting.counting() as c, launch_counter(device) as lc:
        fn()
    top = sorted(lc.get("by_name", {}).items(), key=lambda kv: -kv[1])[:40]
    return {
        "basis": LOGICAL_BASIS,
        "logical_bytes_read": c.bytes_read,
        "logical_bytes_written": c.bytes_written,
        "logical_accounted_launches": c.launches,
        "logical_by_kernel": dict(c.by_kernel),
        "logical_kernel_launches": lc.get("kernels"),
        "logical_memcpy": lc.get("memcpy"),
        "logical_memset": lc.get("memset"),
        "logical_top_kernels": dict(top),
        "launch_count_method": "torch.profiler" if "kernels" in lc else None,
        "launch_count_error": lc.get("error"),
    }


# ----------------------------------------------------------------- measure


def measure(
    fn: Callable[[], object],
    reps: int,
    warmup: int = 2,
    device=None,
    budget_s: float | None = None,
    min_reps: int = 3,
    count: bool = True,
) -> dict:
    """Warm up, count one call, then time `reps` calls. Returns
    {"timing": time_fn's dict, "logical": logical_counts or None}."""
    dev = device_of(device)
    for _ in range(max(warmup - 1, 0)):
        fn()
    if count:
        logical = logical_counts(fn, dev)
    else:
        fn()
        logical = None
    t = timing.time_fn(fn, reps, 0, dev, budget_s=budget_s, min_reps=min(min_reps, reps))
    t["warmup"] = max(warmup, 1)
    return {"timing": t, "logical": logical}


def orders(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Both run orders of a comparison: ("AB", names) then ("BA", reversed)."""
    names = list(names)
    if len(names) < 2:
        return [("AB", names)]
    return [("AB", names), ("BA", names[::-1])]


def select_fastest(results: dict, key: str = "median_ms") -> str | None:
    """Name of the fastest entry of {name: timing dict or None}; ties keep the
    first name. Entries that are None (failed) are skipped."""
    best, best_v = None, math.inf
    for name, t in results.items():
        if t is None:
            continue
        v = t[key]
        if v < best_v:
            best, best_v = name, v
    return best


def rank(results: dict, key: str = "median_ms") -> list[str]:
    ok = [(n, t[key]) for n, t in results.items() if t is not None]
    return [n for n, _ in sorted(ok, key=lambda kv: kv[1])]


# ------------------------------------------------------------ supervision


def supervise(argv: Sequence[str], max_restarts: int = 8, log=None, env=None) -> int:
    """Run a stage worker (`argv`) until it exits with something other than
    POISONED_EXIT. Each worker resumes from the records already written, and the
    configuration that poisoned the previous one is among them."""
    env = dict(os.environ if env is None else env)
    for attempt in range(max_restarts + 1):
        proc = subprocess.run(list(argv), env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
        if proc.returncode != POISONED_EXIT:
            return proc.returncode
        if log is not None:
            log.write(f"[supervise] worker poisoned its CUDA context; restart {attempt + 1}\n")
            log.flush()
    return POISONED_EXIT


# ----------------------------------------------------- hardware counters

NCU_METRICS = {
    "dram_bytes_read": "dram__bytes_read.sum",
    "dram_bytes_written": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep, launched between configurations


def mark_boundary() -> None:
    """A tiny named kernel that separates configurations in an Nsight Compute log."""
    torch.cuda._sleep(1)


def parse_ncu_csv(text: str) -> list[dict]:
    """Per-kernel rows of `ncu --csv --page raw`: name and our metric columns."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out = []
    for r in rows:
        name = r.get("Kernel Name") or r.get("Function Name") or ""
        if not name or name.startswith("nvtx") or r.get("ID", "").strip() == "":
            continue
        vals = {}
        for key, metric in NCU_METRICS.items():
            raw = (r.get(metric) or "").replace(",", "").strip()
            try:
                vals[key] = float(raw)
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
    if seen:
        groups.append(cur)
    return groups


def summarize_counters(rows: list[dict]) -> dict:
    def total(k):
        vals = [r[k] for r in rows if r.get(k) is not None]
        return sum(vals) if vals else None

    occ = [r["achieved_occupancy_pct"] for r in rows if r.get("achieved_occupancy_pct") is not None]
    return {
        "source": "ncu",
        "kernels": len(rows),
        "dram_bytes_read": total("dram_bytes_read"),
        "dram_bytes_written": total("dram_bytes_written"),
        "l2_bytes": total("l2_bytes"),
        "achieved_occupancy_pct_mean": (sum(occ) / len(occ)) if occ else None,
    }


def ncu_counters(argv: Sequence[str], n_configs: int, timeout_s: float = 600, ncu: str = "ncu") -> list[dict] | None:
    """Run `argv` (a worker that runs n_configs configurations once each, calling
    mark_boundary() before each and once at the end) under Nsight Compute and
    return one counter summary per configuration, or None when it fails."""
    cmd = [ncu, "--csv", "--page", "raw", "--metrics", ",".join(NCU_METRICS.values()), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    groups = split_by_marker(parse_ncu_csv(proc.stdout))
    # The final marker closes the last configuration: groups = n_configs + 1 with an empty tail.
    if len(groups) < n_configs:
        return None
    return [summarize_counters(g) for g in groups[:n_configs]]


