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
  illegal address poisons it, and only a new process recovers: see `reexec`).
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
    """Free what a finished or failed configuration left behind (on a GPU, where
    a full collection is worth its time)."""
    dev = device_of(device)
    if dev.type == "cuda":
        gc.collect()
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
    except (KeyboardInterrupt, Skip):
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
    """Run fn once under the launchers' accounting and the profiler. `launches`
    is the profiler's count of GPU kernels that ran; without a GPU (Triton's
    interpreter) it is the launchers' own count."""
    with accounting.counting() as c, launch_counter(device) as lc:
        fn()
    profiled = "kernels" in lc
    top = sorted(lc.get("by_name", {}).items(), key=lambda kv: -kv[1])[:40]
    return {
        "basis": LOGICAL_BASIS,
        "bytes_read": c.bytes_read,
        "bytes_written": c.bytes_written,
        "param_bytes": None,
        "state_bytes": None,
        "launches": lc["kernels"] if profiled else c.launches,
        "launches_method": "torch.profiler" if profiled else "launcher accounting",
        "accounted_launches": c.launches,
        "by_kernel": dict(c.by_kernel),
        "memcpy": lc.get("memcpy"),
        "memset": lc.get("memset"),
        "top_kernels": dict(top),
        "profiler_error": lc.get("error"),
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
    """Run `argv` (a worker that runs n_configs configurations once each, each call
    between two mark_boundary() calls, set-up outside them) under Nsight Compute
    and return one counter summary per configuration, or None when it fails."""
    import shutil

    ncu = shutil.which(ncu) or ("/usr/local/cuda/bin/ncu" if os.path.isfile("/usr/local/cuda/bin/ncu") else ncu)
    cmd = [ncu, "--csv", "--page", "raw", "--metrics", ",".join(NCU_METRICS.values()), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    # Groups after each marker alternate: a call, then the next configuration's set-up.
    calls = split_by_marker(parse_ncu_csv(proc.stdout))[0::2]
    if len(calls) < n_configs:
        return None
    return [summarize_counters(g) for g in calls[:n_configs]]


# ------------------------------------------------------- probe and audit


def find_key(doc, key: str):
    """First value stored under `key` anywhere in a nested JSON document."""
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        for v in doc.values():
            found = find_key(v, key)
            if found is not None:
                return found
    elif isinstance(doc, list):
        for v in doc:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


def copy_bandwidth(env: dict) -> float | None:
    """Device copy bandwidth (bytes read + written per second) measured by the probe."""
    v = find_key(env, "copy_bandwidth_bytes_per_s")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def matmul_rate(env: dict) -> float | None:
    v = find_key(env, "matmul_bf16_flop_per_s")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def counters_available(env: dict) -> tuple[bool, str]:
    ok = find_key(env, "counters_available")
    reason = None
    check = find_key(env, "counters")
    if isinstance(check, dict):
        reason = check.get("reason")
    if reason is None:
        reason = find_key(env, "reason")
    return bool(ok), str(reason or ("counters available" if ok else "the probe found no readable counters"))


def gated_backends(gates: dict) -> dict[str, set[str]] | None:
    """{op: backends with at least one check and no failed check} from the audit's
    gates.json, or None when its checks do not name backends."""
    checks = gates.get("checks") if isinstance(gates, dict) else None
    if not isinstance(checks, list):
        return None
    passed: dict[str, set[str]] = {}
    failed: dict[str, set[str]] = {}
    named = False
    for c in checks:
        if not isinstance(c, dict) or "backend" not in c or c.get("backend") is None:
            continue
        named = True
        op = str(c.get("op") or c.get("mixer") or "")
        # A backend inexact by design is recorded by the audit but never exact.
        bucket = passed if c.get("passed") and c.get("role") != "inexact-by-design" else failed
        bucket.setdefault(op, set()).add(str(c["backend"]))
    if not named:
        return None
    return {op: names - failed.get(op, set()) for op, names in passed.items()}


def exact_backend_names(op: str, names: Iterable[str], gates: dict | None, inexact: Sequence[str] = ()) -> list[str]:
    """The backends of `op` that count as exact: not matching an `inexact` pattern
    (fnmatch) and, when the audit names backends, passing every one of its checks."""
    import fnmatch

    gated = gated_backends(gates) if gates else None
    out = []
    for n in names:
        if any(fnmatch.fnmatch(n, pat) for pat in inexact):
            continue
        if gated is not None:
            ok = gated.get(op)
            if ok is None:
                ok = set().union(*gated.values()) if gated else set()
            if n not in ok:
                continue
        out.append(n)
    return out


def diagnostic_backend_names(op: str, names: Iterable[str], gates: dict | None) -> tuple[list[str], set[str]]:
    """(backends a track times, the exact ones among them): the exact backends plus
    those inexact by design (kernels.ops.inexact_backends), which are timed as
    labelled diagnostics but never selected; listing order kept."""
    from kernels import ops

    names = list(names)
    exact = set(exact_backend_names(op, names, gates))
    return [n for n in names if n in exact or n in ops.inexact_backends()], exact


# ------------------------------------------------------- record fields


def timing_fields(m: dict) -> dict:
    """Record fields (samples_ms, stats, peak_bytes, logical) from `measure`'s result."""
    t = m["timing"]
    stats = {k: t[k] for k in ("n", "p10_ms", "median_ms", "p95_ms", "mean_ms", "min_ms")}
    stats.update({k: t[k] for k in ("reps_requested", "warmup", "stopped_early", "clock")})
    return {
        "samples_ms": list(t["samples_ms"]),
        "stats": stats,
        "peak_bytes": t["peak_bytes"],
        "base_bytes": t["base_bytes"],
        "logical": m.get("logical"),
    }


def reuse_logical(rec: dict | None) -> dict | None:
    """The logical counts of an earlier record of the same configuration (the other
    run order runs the same kernels), marked with where they were counted; None
    when there is none to reuse, and the caller counts."""
    if rec is None or rec.get("status") != STATUS_OK or not isinstance(rec.get("logical"), dict):
        return None
    return {**rec["logical"], "counted_in": rec["config_id"]}


def stats_of(samples: list[float]) -> dict:
    return timing.summarize(samples)


def error_text(err: dict) -> str:
    return f"{err['type']}: {err['message']}"[:2000] or err["type"]


class Skip(Exception):
    """A configuration that does not apply here (a peer that is not installed, a
    backend that does not exist); nothing is recorded for it."""


RESTARTS_ENV = "KERNELS_STAGE_RESTARTS"


def reexec(job, max_restarts: int = 8) -> None:
    """Replace this process by a fresh run of the same stage job; it resumes from
    the records already written. Used after a failure that poisoned the CUDA
    context (the failing configuration is already recorded, so it is skipped)."""
    from common import atomic
    from common.facts import REPO_ROOT

    n = int(os.environ.get(RESTARTS_ENV, "0")) + 1
    if n > max_restarts:
        raise RuntimeError(f"stage {job.rule}: CUDA context poisoned {n} times; giving up")
    os.environ[RESTARTS_ENV] = str(n)
    path = REPO_ROOT / "results" / ".tmp" / "jobs" / f"{job.rule}-restart.json"
    atomic.write_json(path, job.to_json())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, job.script, "--job", str(path)])


class Runner:
    """Runs a stage's configurations one by one: skips those already recorded
    (resume), captures failures as records, stops starting new ones when the
    stage's time budget is spent, and restarts the process when a failure
    poisoned the CUDA context."""

    def __init__(self, stage: str, profile: str, records_dir, budget_s: float | None = None,
                 device=None, log=None, restart: Callable[[], None] | None = None):
        from pathlib import Path

        from common import records

        self.records = records
        self.stage, self.profile = stage, profile
        self.dir = Path(records_dir)
        self.device = device_of(device)
        self.budget = Budget(budget_s)
        self.log = log
        self.restart = restart
        self.done = records.done_ids(self.dir, profile)
        self.planned: list[str] = []
        self.skipped: list[str] = []

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
        """Record `body()`'s fields (or its failure) under config_id; returns the record,
        or None when the configuration was skipped or left for lack of time."""
        if config_id in self.planned:
            raise ValueError(f"configuration {config_id!r} planned twice in stage {self.stage}")
        self.planned.append(config_id)
        if config_id in self.done:
            return self.get(config_id)
        if self.budget.exhausted():
            self.skipped.append(config_id)
            return None
        t0 = time.perf_counter()
        try:
            outcome = capture(body, self.device)
        except Skip as why:
            self.planned.remove(config_id)
            self.say(f"{config_id}: not applicable ({why})")
            return None
        if outcome.ok:
            rec = self.records.new_record(self.stage, self.profile, config_id, **{**fields, **(outcome.value or {})})
        else:
            rec = self.records.new_record(self.stage, self.profile, config_id, **{
                **fields, "status": outcome.status, "error": error_text(outcome.error),
                "error_detail": outcome.error, "samples_ms": [], "stats": None})
        rec["wall_s"] = time.perf_counter() - t0
        self.records.write_record(self.dir, rec)
        self.done.add(config_id)
        med = (rec.get("stats") or {}).get("median_ms")
        self.say(f"{config_id}: {rec['status']}" + (f" median {med:.4g} ms" if med is not None else "")
                 + ("" if outcome.ok else f" ({rec['error'][:200]})"))
        if not outcome.ok and (outcome.error["sticky"] or not context_usable(self.device)):
            self.say("the CUDA context is unusable after this failure; restarting the stage process")
            if self.restart is None:
                raise RuntimeError(f"CUDA context poisoned by {config_id} and no restart available")
            self.restart()
        return rec

    def run_group(self, config_ids: list[str], body: Callable[[], dict], fields: dict) -> dict:
        """One measurement that yields several records (a decode trajectory gives one
        per checkpoint): `body()` returns {config_id: extra fields}; `fields[cid]`
        holds each record's own fields. All or none are recorded; returns
        {config_id: record} (empty when skipped or out of time)."""
        pending = [c for c in config_ids if c not in self.done]
        for c in config_ids:
            if c in self.planned:
                raise ValueError(f"configuration {c!r} planned twice in stage {self.stage}")
            self.planned.append(c)
        if pending and self.budget.exhausted():
            self.skipped += pending
            return {c: self.get(c) for c in config_ids if c in self.done}
        if pending:
            t0 = time.perf_counter()
            try:
                outcome = capture(body, self.device)
            except Skip as why:
                for c in config_ids:
                    self.planned.remove(c)
                self.say(f"{config_ids[0]}..: not applicable ({why})")
                return {}
            for c in config_ids:
                if outcome.ok:
                    extra = (outcome.value or {}).get(c)
                    if extra is None:
                        raise RuntimeError(f"measurement of the group {config_ids} returned nothing for {c}")
                    rec = self.records.new_record(self.stage, self.profile, c, **{**fields[c], **extra})
                else:
                    rec = self.records.new_record(self.stage, self.profile, c, **{
                        **fields[c], "status": outcome.status, "error": error_text(outcome.error),
                        "error_detail": outcome.error, "samples_ms": [], "stats": None})
                rec["wall_s"] = time.perf_counter() - t0
                self.records.write_record(self.dir, rec)
                self.done.add(c)
            self.say(f"{config_ids[0]} .. ({len(config_ids)} records): {outcome.status}"
                     + ("" if outcome.ok else f" ({error_text(outcome.error)[:200]})"))
            if not outcome.ok and (outcome.error["sticky"] or not context_usable(self.device)):
                self.say("the CUDA context is unusable after this failure; restarting the stage process")
                if self.restart is None:
                    raise RuntimeError(f"CUDA context poisoned by {config_ids[0]} and no restart available")
                self.restart()
        return {c: self.get(c) for c in config_ids}

    def finish(self, out_jsonl) -> list[dict]:
        """Concatenate this run's planned, recorded configurations into out_jsonl."""
        ids = [c for c in dict.fromkeys(self.planned) if c in self.done]
        if self.skipped:
            self.say(f"time budget spent: {len(self.skipped)} configurations not run: {self.skipped}")
        return self.records.collect(self.dir, out_jsonl, profile=self.profile, ids=ids)


@dataclass
class Budget:
    """Wall-clock budget of a stage: configurations not started before it runs
    out are left unrecorded (a later run with a larger budget resumes them)."""

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
