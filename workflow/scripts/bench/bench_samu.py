"""Benchmark of the fused Triton SAMU op (issue 4), with the fused RG-LRU op at the same
shapes when kernels.backends("rglru") has Triton backends. One script, one GPU call:

  1. compile every kernel variant in parallel worker processes (the Triton cache is
     shared, so the runs below only load binaries);
  2. the GPU tests (tests/test_samu_gpu.py) -> gpu_tests.log: a backend whose gate
     test fails is not timed;
  3. device copy bandwidth (bytes read + written);
  4. forward+backward at B = 4, T = 2048, D = 2560, BF16 for every backend and chunk
     size, both orders, eagerly and replayed from a CUDA graph, with a per-kernel
     profile of one configuration each;
  5. forward (prefill: no gradients, final state out) at B = 8, D = 1024,
     T = 2048 .. 16384 against the memory floor (x read once, y written once);
  6. the decode step at B = 16, D = 2560 for both layouts and the batch sweep
     1 .. 512 (graph replay of 32 steps per sample), then a fresh run of the chosen
     layout at B = 16.

Every timing comes from kernels.timing.time_fn (CUDA events, raw samples kept) and
is stored as a schema-1 record (workflow/scripts/common/records.py) with GPU,
versions, commit, shapes and samples, in one JSON file under --out.

    python workflow/scripts/bench/bench_samu.py --out DIR --commit SHA [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "workflow" / "scripts")]

import torch  # noqa: E402

import kernels  # noqa: E402
from common import records  # noqa: E402
from kernels.ops import accounting  # noqa: E402
from kernels.timing import time_fn  # noqa: E402

# (backend, chunk_size, launcher options): run 3 adds the variants of the run-3 kernel work
# (several modes per thread: block_m / num_warps; the controller fused into the chunk summary)
SAMU_CONFIGS = [("serial", 32, {}), ("chunk", 8, {}), ("chunk", 16, {}), ("chunk", 32, {}), ("chunk", 64, {}),
                ("chunk", 16, {"block_m": 64, "num_warps": 1}), ("chunk", 16, {"block_m": 128, "num_warps": 1}),
                ("chunk", 16, {"block_m": 128, "num_warps": 2}), ("chunk", 32, {"block_m": 128, "num_warps": 1}),
                ("chunk", 16, {"fuse_controls": True}),
                ("chunk", 16, {"fuse_controls": True, "block_m": 128, "num_warps": 1}),
                ("chunk", 32, {"fuse_controls": True, "block_m": 128, "num_warps": 1}),
                ("chunk", 16, {"prefix": "group"}), ("chunk", 32, {"prefix": "group"})]


def label(name, chunk, opts=None):
    """Variant name: backend-K[-fused][-group][-bm<block_m>w<num_warps>] (the GPU tests' ids)."""
    opts = opts or {}
    out = f"{name}-{chunk}" if chunk else name
    if opts.get("fuse_controls"):
        out += "-fused"
    if opts.get("prefix", "fill") != "fill":
        out += f"-{opts['prefix']}"
    if "block_m" in opts:
        out += f"-bm{opts['block_m']}w{opts.get('num_warps')}"
    return out
TRAIN = dict(B=4, T=2048, D=2560)
FLOOR_B, FLOOR_D, FLOOR_TS = 8, 1024, (2048, 4096, 8192, 16384)
DECODE_D, DECODE_B = 2560, 16
DECODE_BATCHES = (1, 4, 16, 32, 64, 96, 128, 192, 256, 384, 512)
GRAPH_STEPS = 32
BF16 = torch.bfloat16
DEVICE = "cuda"


def cuda(**kw):
    return dict(device=DEVICE, **kw)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def dry_run_shapes():
    """--dry: tiny shapes on the CPU (Triton interpreter) to check this script's logic."""
    global DEVICE, TRAIN, FLOOR_B, FLOOR_D, FLOOR_TS, DECODE_D, DECODE_B, DECODE_BATCHES, GRAPH_STEPS
    global LB_TS, LB_PROBE_T
    DEVICE, TRAIN = "cpu", dict(B=1, T=40, D=16)
    LB_TS, LB_PROBE_T = (40,), 40
    FLOOR_B, FLOOR_D, FLOOR_TS = 1, 16, (40,)
    DECODE_D, DECODE_B, DECODE_BATCHES, GRAPH_STEPS = 16, 2, (1, 2), 2


def samu_inputs(B, T, D, seed=0, grad=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    M = D // 2
    u = torch.rand(M, generator=g, **cuda(dtype=torch.float64))
    p = {
        "x": torch.randn(B, T, D, generator=g, **cuda()).to(BF16),
        "phase_dir": torch.randn(D + 1, generator=g, **cuda()) / math.sqrt(D),
        "radial_dir": torch.randn(D + 1, generator=g, **cuda()) / math.sqrt(D),
        "phase_amp": torch.tensor(0.5, **cuda()),
        "radial_amp": torch.tensor(0.5, **cuda()),
        "nu_log": torch.log(-0.5 * torch.log(u * (0.999**2 - 0.9**2) + 0.9**2)).float(),
        "theta_log": torch.log(torch.rand(M, generator=g, **cuda()) * math.pi / 10),
    }
    if grad:
        for v in p.values():
            v.requires_grad_()
    return p


def rglru_inputs(B, T, D, seed=0, grad=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    p = {
        "x": torch.randn(B, T, D, generator=g, **cuda()).to(BF16),
        "gate_x": torch.randn(B, T, D, generator=g, **cuda()).to(BF16),
        "gate_a": torch.randn(B, T, D, generator=g, **cuda()).to(BF16),
        "a_param": torch.rand(D, generator=g, **cuda()) * 4 + 1,
    }
    if grad:
        for v in p.values():
            v.requires_grad_()
    return p


def documents(B, T):
    """segment_pos of one document per row (the training case: a reset at t = 0)."""
    return torch.arange(T, **cuda()).repeat(B, 1)


def op_call(mixer, name, chunk, p, seg, final=False, opts=None):
    if mixer == "samu":
        # the provider itself (run 3): launcher options reach it, every variant the same path
        from kernels.ops.samu_triton import BACKENDS
        return BACKENDS["samu"][name](p["x"], p["phase_dir"], p["radial_dir"], p["phase_amp"], p["radial_amp"],
                                      p["nu_log"], p["theta_log"], seg, None, final, chunk_size=chunk, **(opts or {}))
    return kernels.rglru(p["x"], p["gate_x"], p["gate_a"], p["a_param"], segment_pos=seg, output_final_state=final,
                         backend=name, chunk_size=chunk)


def train_step_fn(mixer, name, chunk, p, seg, dy, opts=None):
    params = list(p.values())

    def step():
        y, _ = op_call(mixer, name, chunk, p, seg, opts=opts)
        return torch.autograd.grad(y, params, dy)
    return step


def forward_fn(mixer, name, chunk, p, seg, opts=None):
    def fwd():
        with torch.no_grad():
            return op_call(mixer, name, chunk, p, seg, final=True, opts=opts)
    return fwd


def rglru_configs():
    names = [n for n in kernels.backends("rglru") if n != "reference"]
    out = []
    for n in names:
        out += [(n, k, {}) for k in (8, 16, 32, 64)] if n == "chunk" else [(n, None, {})]
    return out


def step_inputs(mixer, B, D, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(B, D, generator=g, **cuda()).to(BF16)
    if mixer == "samu":
        p = samu_inputs(1, 1, D, seed)
        state = torch.complex(torch.randn(B, D // 2, generator=g, **cuda()),
                              torch.randn(B, D // 2, generator=g, **cuda()))
        args = [p[k] for k in ("phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log")]
        return x, args, state
    H = 16
    W = D // H
    w = [torch.randn(H, W, W, generator=g, **cuda()).to(BF16) / math.sqrt(W), torch.zeros(H, W, **cuda()).to(BF16)]
    args = w + [t.clone() for t in w] + [torch.rand(D, generator=g, **cuda()) * 4 + 1]
    return x, args, torch.randn(B, D, generator=g, **cuda())


def step_fn(mixer, layout, x, args, state):
    fn = kernels.step_backends(mixer)[layout]
    return lambda: fn(x, *args, state)


# ---------------------------------------------------------------- warm-up (worker processes)

def warm(task):
    """Run one configuration once at its real shapes so that its kernels compile."""
    t0 = time.time()
    kind, mixer, name, chunk, opts = task
    try:
        if kind == "train" and mixer == "samu":
            # the variants the GPU tests use (initial state, resets, final state with a gradient)
            q = samu_inputs(1, TRAIN["T"], 64, grad=True)
            h0 = torch.zeros(1, 32, **cuda(dtype=torch.complex64), requires_grad=True)
            from kernels.ops.samu_triton import BACKENDS
            y, h = BACKENDS["samu"][name](*q.values(), documents(1, TRAIN["T"]), h0, True, chunk_size=chunk, **opts)
            torch.autograd.grad(y.float().sum() + h.real.sum(), [*q.values(), h0])
        if kind == "train":
            p = samu_inputs(**TRAIN, grad=True) if mixer == "samu" else rglru_inputs(**TRAIN, grad=True)
            seg = documents(TRAIN["B"], TRAIN["T"])
            dy = torch.randn(TRAIN["B"], TRAIN["T"], TRAIN["D"], **cuda()).to(BF16)
            train_step_fn(mixer, name, chunk, p, seg, dy, opts)()
            for T in FLOOR_TS:
                q = samu_inputs(FLOOR_B, T, FLOOR_D) if mixer == "samu" else rglru_inputs(FLOOR_B, T, FLOOR_D)
                forward_fn(mixer, name, chunk, q, documents(FLOOR_B, T), opts)()
        else:
            for layout in name:
                x, args, state = step_inputs(mixer, DECODE_B, DECODE_D)
                step_fn(mixer, layout, x, args, state)()
        sync()
        return task, None, time.time() - t0
    except Exception as e:  # noqa: BLE001 - reported, the main run records the failure again
        return task, f"{type(e).__name__}: {e}"[:500], time.time() - t0


def warm_all(tasks, workers):
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(warm, tasks))


# ---------------------------------------------------------------- measurements

class Bench:
    def __init__(self, commit, profile="h200"):
        self.commit = {"sha": commit, "dirty": False}
        self.profile = profile
        self.records = []

    def record(self, config_id, **fields):
        rec = records.new_record("kernels_samu", self.profile, config_id, commit=self.commit, **fields)
        records.validate(json.loads(json.dumps(rec)))
        self.records.append(rec)
        return rec

    def timed(self, config_id, fn, shapes, mixer, backend, order=None, reps=30, warmup=5, extra=None):
        try:
            with accounting.counting() as c:
                fn()
            sync()
            r = time_fn(fn, reps=reps, warmup=warmup)
            stats = {k: r[k] for k in ("p10_ms", "median_ms", "p95_ms", "mean_ms", "min_ms")}
            logical = {"bytes_read": c.bytes_read, "bytes_written": c.bytes_written, "param_bytes": None,
                       "state_bytes": None, "launches": c.launches}
            return self.record(config_id, shapes=shapes, mixer=mixer, backend=backend, order=order,
                               samples_ms=r["samples_ms"], stats=stats, logical=logical,
                               peak_bytes=r["peak_bytes"], **(extra or {}))
        except Exception as e:  # noqa: BLE001
            status, msg = records.classify_error(e)
            sync()
            return self.record(config_id, shapes=shapes, mixer=mixer, backend=backend, order=order,
                               status=status, error=msg, **(extra or {}))


def graph_of(fn, repeat=1):
    """A CUDA graph replaying `fn` `repeat` times (warmed on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeat):
            fn()
    return g


def kernel_profile(fn, iters=5):
    """Device time per kernel name over `iters` calls (torch.profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE != "cuda":
        raise RuntimeError("kernel profile needs CUDA")
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count:
            out[e.key] = {"calls_per_iter": e.count / iters, "us_per_iter": t / iters}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us_per_iter"]))


def copy_bandwidth(bench):
    n = 1 << 28 if DEVICE == "cuda" else 1 << 16
    a = torch.rand(n, **cuda())
    b = torch.empty_like(a)
    rec = bench.timed("copy-1GiB", lambda: b.copy_(a), {"bytes": 2 * n * 4}, None, "torch.copy_", reps=20)
    bw = 2 * n * 4 / (rec["stats"]["median_ms"] * 1e-3)
    rec["bytes_per_s"] = bw
    del a, b
    return bw


def run_tests(out_dir):
    """pytest tests/test_samu_gpu.py -> {test id: passed?}, log in out_dir."""
    xml = out_dir / "gpu_tests.xml"
    log = out_dir / "gpu_tests.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-s", "-p", "no:cacheprovider",
                        "tests/test_samu_gpu.py", f"--junitxml={xml}"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    passed = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = any(ch.tag in ("failure", "error", "skipped") for ch in case)
            passed[case.get("name")] = not bad
    return passed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="skip the remaining sections (still writing the results) once this much time has passed")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode step section")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU interpreter, no tests")
    ap.add_argument("--lookback", action="store_true",
                    help="only the look-back forward section (fwd='lookback': probes in child processes, then "
                         "CUDA-graph device times of the forward and fwd+bwd against chunk K = 16)")
    ap.add_argument("--lb-timeout", type=float, default=110.0, help="seconds the look-back probes may take")
    ap.add_argument("--lb-probe", help=argparse.SUPPRESS)
    ap.add_argument("--lb-probe-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"
        dry_run_shapes()
        args.skip_tests, args.workers, args.quick = True, 0, True
    if args.lb_probe is not None:
        return lb_probe(args.lb_probe, args.lb_probe_file)
    if args.lookback:
        return lookback_main(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    reps = 3 if args.dry else 10 if args.quick else 30
    bench = Bench(args.commit)
    rg = rglru_configs()
    def over_budget(section):
        if time.time() - t_start > args.budget_s:
            meta["notes"][f"skipped-{section}"] = f"time budget of {args.budget_s} s spent"
            return True
        return False

    meta = {"started": records.now(), "gpu": records.facts.gpu(), "versions": records.facts.versions(),
            "commit": bench.commit, "rglru_backends": [list(c) for c in rg], "notes": {}}

    tasks = [("train", "samu", n, k, o) for n, k, o in SAMU_CONFIGS] + [("train", "rglru", n, k, o) for n, k, o in rg]
    if not args.no_decode:
        tasks += [("step", "samu", ("row", "blocked"), None, {})]
        if "fused" in kernels.step_backends("rglru"):
            tasks += [("step", "rglru", ("fused",), None, {})]
    warmed = warm_all(tasks, args.workers) if args.workers else [warm(t) for t in tasks]
    meta["warmup"] = [{"task": list(map(str, t)), "error": e, "seconds": s} for t, e, s in warmed]
    print(f"[{time.time() - t_start:5.0f}s] warm-up done: {sum(e is None for _, e, _ in warmed)}/{len(warmed)} ok",
          flush=True)

    passed = {} if args.skip_tests else run_tests(out_dir)
    meta["gpu_tests"] = passed
    print(f"[{time.time() - t_start:5.0f}s] GPU tests: {sum(passed.values())}/{len(passed)} passed", flush=True)

    def gate(name, chunk, opts):
        key = f"test_bf16_gate[{label(name, chunk, opts)}]"
        return args.skip_tests or passed.get(key, False)

    bw = copy_bandwidth(bench)
    meta["copy_bytes_per_s"] = bw
    print(f"[{time.time() - t_start:5.0f}s] copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    # forward + backward
    shapes = {**TRAIN, "dtype": "bfloat16"}
    confs = [("samu", n, k, o) for n, k, o in SAMU_CONFIGS if gate(n, k, o)] + [("rglru", n, k, o) for n, k, o in rg]
    meta["not_timed_gate_failed"] = [label(n, k, o) for n, k, o in SAMU_CONFIGS if not gate(n, k, o)]
    p_s = samu_inputs(**TRAIN, grad=True)
    p_r = rglru_inputs(**TRAIN, grad=True)
    seg = documents(TRAIN["B"], TRAIN["T"])
    dy = torch.randn(TRAIN["B"], TRAIN["T"], TRAIN["D"], **cuda()).to(BF16)
    for order, seq in (("AB", confs), ("BA", confs[::-1])):
        for mixer, n, k, o in seq:
            fn = train_step_fn(mixer, n, k, p_s if mixer == "samu" else p_r, seg, dy, o)
            bench.timed(f"train-{mixer}-{label(n, k, o)}-{order}", fn, shapes, mixer, n, order, reps=reps,
                        extra={"kind": "fwd+bwd", "chunk_size": k, "timing": "eager", "variant": label(n, k, o),
                               "options": o})
    for mixer, n, k, o in confs:
        if over_budget(f"graph-profile-{mixer}-{label(n, k, o)}"):
            continue
        fn = train_step_fn(mixer, n, k, p_s if mixer == "samu" else p_r, seg, dy, o)
        try:
            g = graph_of(fn)
            bench.timed(f"train-{mixer}-{label(n, k, o)}-graph", g.replay, shapes, mixer, n, None, reps=reps,
                        extra={"kind": "fwd+bwd", "chunk_size": k, "timing": "cuda_graph", "variant": label(n, k, o),
                               "options": o})
            del g
        except Exception as e:  # noqa: BLE001
            meta["notes"][f"graph-{mixer}-{label(n, k, o)}"] = f"{type(e).__name__}: {e}"[:300]
        try:
            meta.setdefault("kernel_profile_train", {})[f"{mixer}-{label(n, k, o)}"] = kernel_profile(fn)
        except Exception as e:  # noqa: BLE001
            meta["notes"][f"profile-{mixer}-{label(n, k, o)}"] = f"{type(e).__name__}: {e}"[:300]
    del p_s, p_r, dy
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    print(f"[{time.time() - t_start:5.0f}s] fwd+bwd done", flush=True)

    # forward against the memory floor
    for T in FLOOR_TS:
        if over_budget(f"forward-T{T}"):
            continue
        q_s, q_r = samu_inputs(FLOOR_B, T, FLOOR_D), rglru_inputs(FLOOR_B, T, FLOOR_D)
        seg = documents(FLOOR_B, T)
        fconfs = [("samu", n, k, o) for n, k, o in SAMU_CONFIGS if gate(n, k, o)]
        fconfs += [("rglru", n, k, o) for n, k, o in rg]
        for order, seq in (("AB", fconfs), ("BA", fconfs[::-1])):
            for mixer, n, k, o in seq:
                q = q_s if mixer == "samu" else q_r
                n_in = 1 if mixer == "samu" else 3
                floor_bytes = (n_in + 1) * FLOOR_B * T * FLOOR_D * 2
                rec = bench.timed(f"fwd-{mixer}-{label(n, k, o)}-T{T}-{order}", forward_fn(mixer, n, k, q, seg, o),
                                  {"B": FLOOR_B, "T": T, "D": FLOOR_D, "dtype": "bfloat16"}, mixer, n, order,
                                  reps=reps, extra={"kind": "forward", "chunk_size": k, "floor_bytes": floor_bytes,
                                                    "variant": label(n, k, o), "options": o})
                if rec["status"] == "ok":
                    rec["floor_ms"] = floor_bytes / bw * 1e3
                    rec["fraction_of_floor"] = rec["floor_ms"] / rec["stats"]["median_ms"]
        if T == 8192:
            for mixer, n, k, o in fconfs:
                try:
                    meta.setdefault("kernel_profile_forward_T8192", {})[f"{mixer}-{label(n, k, o)}"] = kernel_profile(
                        forward_fn(mixer, n, k, q_s if mixer == "samu" else q_r, seg, o))
                except Exception as e:  # noqa: BLE001
                    meta["notes"][f"fprofile-{mixer}-{label(n, k, o)}"] = f"{type(e).__name__}: {e}"[:300]
        del q_s, q_r
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print(f"[{time.time() - t_start:5.0f}s] forward floor done", flush=True)

    # decode
    layouts = [] if args.no_decode else [("samu", "row"), ("samu", "blocked")]
    if layouts and "fused" in kernels.step_backends("rglru"):
        layouts.append(("rglru", "fused"))
    meta["decode_layouts"] = layouts
    sweep = {}
    for Bd in DECODE_BATCHES:
        if over_budget(f"decode-B{Bd}"):
            continue
        for mixer, layout in layouts:
            x, a, state = step_inputs(mixer, Bd, DECODE_D)
            fn = step_fn(mixer, layout, x, a, state)
            shapes = {"B": Bd, "D": DECODE_D, "dtype": "bfloat16"}
            try:
                g = graph_of(fn, GRAPH_STEPS)
                rec = bench.timed(f"step-{mixer}-{layout}-B{Bd}-graph", g.replay, shapes, mixer, layout, reps=reps,
                                  extra={"kind": "decode_step", "timing": f"cuda_graph_of_{GRAPH_STEPS}_steps"})
                if rec["status"] == "ok":
                    rec["us_per_step"] = rec["stats"]["median_ms"] * 1e3 / GRAPH_STEPS
                    sweep.setdefault(mixer, {}).setdefault(Bd, {})[layout] = rec["us_per_step"]
                del g
            except Exception as e:  # noqa: BLE001
                meta["notes"][f"step-graph-{mixer}-{layout}-{Bd}"] = f"{type(e).__name__}: {e}"[:300]
            if Bd == DECODE_B:
                bench.timed(f"step-{mixer}-{layout}-B{Bd}-eager", fn, shapes, mixer, layout, reps=reps * 3,
                            extra={"kind": "decode_step", "timing": "eager"})
    choice = {Bd: min(v, key=v.get) for Bd, v in sweep.get("samu", {}).items()}
    meta["decode_layout_choice"] = choice
    if DECODE_B in choice:
        x, a, state = step_inputs("samu", DECODE_B, DECODE_D, seed=1)
        g = graph_of(step_fn("samu", choice[DECODE_B], x, a, state), GRAPH_STEPS)
        rec = bench.timed(f"step-samu-chosen-B{DECODE_B}-fresh", g.replay, {"B": DECODE_B, "D": DECODE_D},
                          "samu", choice[DECODE_B], reps=reps,
                          extra={"kind": "decode_step", "timing": f"cuda_graph_of_{GRAPH_STEPS}_steps",
                                 "selected_from": "the sweep above (fresh run)"})
        if rec["status"] == "ok":
            rec["us_per_step"] = rec["stats"]["median_ms"] * 1e3 / GRAPH_STEPS
    print(f"[{time.time() - t_start:5.0f}s] decode done", flush=True)

    meta["finished"] = records.now()
    meta["wall_s"] = time.time() - t_start
    out = out_dir / "samu_bench.json"
    out.write_text(json.dumps({"meta": meta, "records": bench.records}, indent=1, default=str))
    write_summary(out_dir / "summary.md", bench.records, meta)
    summarize(bench.records, meta)


def summarize(recs, meta):
    """The short table (stdout): everything but the decode sweep, then the sweep."""
    print(f"\nGPU {meta['gpu'] and meta['gpu']['name']}  torch {meta['versions'].get('torch')}  "
          f"triton {meta['versions'].get('triton')}  copy {meta['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    sweep = {}
    for r in recs:
        cid = r["config_id"]
        if r["status"] != "ok":
            print(f"{cid:40s} {r['status']}: {r['error'][:90]}")
            continue
        if cid.startswith("step-") and "us_per_step" in r and f"-B{DECODE_B}-" not in cid:
            sweep.setdefault(r["shapes"]["B"], []).append(f"{r['mixer']}-{r['backend']} {r['us_per_step']:.2f}")
            continue
        extra = ""
        if "fraction_of_floor" in r:
            extra = f"  floor {r['floor_ms']:.4f} ms ({100 * r['fraction_of_floor']:.0f}%)"
        if "us_per_step" in r:
            extra = f"  {r['us_per_step']:.2f} us/step"
        print(f"{cid:40s} median {r['stats']['median_ms']:8.4f} ms  p10 {r['stats']['p10_ms']:8.4f}"
              f"  launches {r['logical']['launches']}{extra}")
    for Bd, row in sorted(sweep.items()):
        print(f"decode B={Bd:4d} us/step: " + ", ".join(row))
    print("decode layout choice:", meta.get("decode_layout_choice"))
    if meta["notes"]:
        print("notes:", json.dumps(meta["notes"])[:1500])


def write_summary(path, recs, meta):
    """summary.md, generated from the records (never edited by hand)."""
    ok = [r for r in recs if r["status"] == "ok"]
    g = meta["gpu"] or {}
    lines = ["# SAMU kernels: generated from samu_bench.json", "",
             f"GPU {g.get('name')} ({g.get('sm_count')} SMs), torch {meta['versions'].get('torch')}, "
             f"triton {meta['versions'].get('triton')}, commit {meta['commit']['sha']}, {meta['started']}; "
             f"measured copy bandwidth {meta['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write). "
             "Medians of CUDA-event samples; logical bytes/launches from the launchers' accounting.", "",
             f"GPU tests: {sum(meta['gpu_tests'].values())}/{len(meta['gpu_tests'])} passed "
             f"(failed: {[k for k, v in meta['gpu_tests'].items() if not v]}).", "",
             "## Forward + backward, B = 4, T = 2048, D = 2560, bf16", "",
             "| mixer | backend | K | AB ms | BA ms | CUDA graph ms | launches |", "|---|---|---|---|---|---|---|"]
    by = {r["config_id"]: r for r in ok}
    for r in ok:
        if r.get("kind") == "fwd+bwd" and r["order"] == "AB":
            stem = r["config_id"][:-3]
            ba, gr = by.get(stem + "-BA"), by.get(stem + "-graph")
            lines.append(f"| {r['mixer']} | {r.get('variant', r['backend'])} | {r.get('chunk_size') or ''} | "
                         f"{r['stats']['median_ms']:.4f} | {ba['stats']['median_ms'] if ba else float('nan'):.4f} | "
                         f"{gr['stats']['median_ms'] if gr else float('nan'):.4f} | {r['logical']['launches']} |")
    lines += ["", f"## Forward (prefill), B = {FLOOR_B}, D = {FLOOR_D}, bf16: fraction of the memory floor", "",
              "floor = (inputs read once + y written once) / measured copy bandwidth; median of AB and BA runs", "",
              "| mixer | backend | K | " + " | ".join(f"T={T} ms (floor %)" for T in FLOOR_TS) + " |",
              "|---|---|---|" + "---|" * len(FLOOR_TS)]
    seen = []
    for r in ok:
        if r.get("kind") == "forward" and (r["mixer"], r.get("variant"), r.get("chunk_size")) not in seen:
            key = (r["mixer"], r.get("variant"), r.get("chunk_size"))
            seen.append(key)
            cells = []
            for T in FLOOR_TS:
                rs = [x for x in ok if x.get("kind") == "forward" and x["shapes"]["T"] == T
                      and (x["mixer"], x.get("variant"), x.get("chunk_size")) == key]
                if rs:
                    med = sorted(x["stats"]["median_ms"] for x in rs)[len(rs) // 2]
                    cells.append(f"{med:.4f} ({100 * rs[0]['floor_ms'] / med:.0f}%)")
                else:
                    cells.append("-")
            lines.append(f"| {key[0]} | {key[1]} | {key[2] or ''} | " + " | ".join(cells) + " |")
    lines += ["", f"## Decode step, D = {DECODE_D}, bf16 (CUDA graph of {GRAPH_STEPS} steps; us per step)", "",
              "| B | " + " | ".join(f"{m}-{l}" for m, l in meta.get("decode_layouts", [])) + " |",
              "|---|" + "---|" * len(meta.get("decode_layouts", []))]
    for Bd in DECODE_BATCHES:
        cells = []
        for m, layout in meta.get("decode_layouts", []):
            r = by.get(f"step-{m}-{layout}-B{Bd}-graph")
            cells.append(f"{r['us_per_step']:.2f}" if r and "us_per_step" in r else "-")
        lines.append(f"| {Bd} | " + " | ".join(cells) + " |")
    fresh = by.get(f"step-samu-chosen-B{DECODE_B}-fresh")
    if fresh and "us_per_step" in fresh:
        lines += ["", f"Chosen layout at B = {DECODE_B} ({fresh['backend']}), fresh run: "
                      f"{fresh['us_per_step']:.2f} us/step. "
                      f"Layout choice per batch: {meta.get('decode_layout_choice')}"]
    Path(path).write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- look-back forward (--lookback)
# The chunk backend's single-pass forward (fwd="lookback", kernels/ops/samu_triton/lookback.py):
# every variant is first run in its own child process under a timeout (a look-back that never
# finishes is killed with its process and not timed): correctness at the benchmark shape
# against the float64 reference next to the chunk K = 16 forward; one child checks the
# gradients at the training shape; one runs the look-back GPU test. Then, in this process,
# device times from CUDA-graph replay for the variants that passed.

# sm_90 registers per thread (CPU compile, no spills): defaults (L 64, LS 4, 4 warps with
# four modes per thread, window 8; run 4's fastest) 244, two programs per SM;
# 8 warps LS 8 (run 4's first default) 219; 8 warps LS 4 window 2: 128; 4 warps LS 2: 160.
# Run 4 (results/kernels/samu/README.md) timed twelve variants; lb_order "fixed" is new.
LB_VARIANTS = [{}, {"lb_order": "fixed"}, {"lb_warps": 8, "lb_rows": 8}, {"lb_warps": 8, "lb_rows": 4, "lb_window": 2},
               {"lb_chunk": 128}, {"lb_chunk": 128, "lb_order": "fixed"}, {"lb_rows": 2, "lb_window": 4},
               {"lb_chunk": 32, "lb_order": "fixed"}]
LB_TS = (2048, 4096, 16384)
LB_PROBE_T = 4096
LB_TRAIN_VARIANTS = [{}, {"lb_order": "fixed"}]


def lb_label(opts):
    """lookback[-chunk<L>][-rows<LS>][-warps<n>][-window<W>] (defaults left out)."""
    return "lookback" + "".join(f"-{k[3:]}{v}" for k, v in opts.items())


def lb_segment_pos(B, T):
    """Resets at t = 0 in every other row and inside every row (a run of two included)."""
    pos = torch.arange(T, **cuda()).repeat(B, 1) + 3
    for r in range(B):
        for s in ([0] if r % 2 else []) + [100 + 37 * r, T // 4, T // 4 + 1, T - 97 - r]:
            if 0 <= s < T:
                pos[r, s:] -= pos[r, s].clone()
    return pos


def lb_rel(a, b):
    a = torch.view_as_real(a.to(torch.complex128)) if a.is_complex() else a.double()
    b = torch.view_as_real(b.to(torch.complex128)) if b.is_complex() else b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def lb_probe(which, out_file):
    """Child process: one variant's prefill at B = FLOOR_B, T = LB_PROBE_T, D = FLOOR_D
    (resets, initial state, final state) against float64 and the chunk K = 16 forward,
    or ("train") the training shape's gradients against chunk K = 16 (same backward)."""
    from kernels.ops import reference
    from kernels.ops.samu_triton import BACKENDS, poisoned

    t0 = time.time()
    chunk = BACKENDS["samu"]["chunk"]
    names = ["x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log"]
    out = {"which": which}
    if which != "train":
        opts = LB_VARIANTS[int(which)]
        out["variant"] = lb_label(opts)
        B, T, D = FLOOR_B, LB_PROBE_T, FLOOR_D
        p = samu_inputs(B, T, D, seed=3)
        seg = lb_segment_pos(B, T)
        g = torch.Generator(device=DEVICE).manual_seed(4)
        h0 = torch.complex(*(torch.randn(B, D // 2, generator=g, **cuda()) for _ in range(2)))
        args = [p[k] for k in names]
        y64, h64 = reference.samu(*[a.double() for a in args], seg, h0.to(torch.complex128), True)
        with torch.no_grad(), poisoned():
            yc, hc = chunk(*args, seg, h0, True, chunk_size=16)
            sync()
            out["compile_and_first_run_s"] = time.time()
            yl, hl = chunk(*args, seg, h0, True, chunk_size=16, fwd="lookback", **opts)
            sync()
            out["compile_and_first_run_s"] = round(time.time() - out["compile_and_first_run_s"], 2)
            # bitwise repeatability over three more runs (promised by lb_order="fixed" only)
            out["bitwise_repeat"] = all(
                torch.equal(yl, y2) and torch.equal(hl, h2)
                for y2, h2 in (chunk(*args, seg, h0, True, chunk_size=16, fwd="lookback", **opts) for _ in range(3)))
        out.update(err_y=lb_rel(yl, y64), err_h=lb_rel(hl, h64), err_y_chunk16=lb_rel(yc, y64),
                   err_h_chunk16=lb_rel(hc, h64), diff_y_vs_chunk16=lb_rel(yl, yc), diff_h_vs_chunk16=lb_rel(hl, hc))
        out["ok"] = bool(out["err_y"] <= 2 * out["err_y_chunk16"] + 1e-5
                         and out["err_h"] <= 2 * out["err_h_chunk16"] + 1e-5
                         and (out["bitwise_repeat"] or opts.get("lb_order") != "fixed"))
    else:
        out["variants"] = {}
        B, T, D = TRAIN["B"], TRAIN["T"], TRAIN["D"]
        p = samu_inputs(B, T, D, seed=5, grad=True)
        seg = lb_segment_pos(B, T)
        dy = torch.randn(B, T, D, **cuda()).to(BF16)
        leaves = list(p.values())

        def grads(**opts):
            with poisoned():
                y, _ = chunk(*[p[k] for k in names], seg, None, False, chunk_size=16, **opts)
                return [y] + list(torch.autograd.grad(y, leaves, dy))

        want = grads()
        for opts in LB_TRAIN_VARIANTS:
            got = grads(fwd="lookback", **opts)
            diffs = {n: lb_rel(a, b) for n, a, b in zip(["y"] + names, got, want)}
            out["variants"][lb_label(opts)] = {"diff_vs_chunk16": diffs, "ok": bool(max(diffs.values()) < 1e-2)}
        out["ok"] = all(v["ok"] for v in out["variants"].values())
    sync()
    out["seconds"] = round(time.time() - t0, 1)
    Path(out_file).write_text(json.dumps(out))


def lb_children(out_dir, timeout_s, dry):
    """Every probe (and the look-back GPU test) in its own child process, all at once;
    a child still running after timeout_s is killed and reported. The children's files
    live in a scratch folder (run 4 lost its main JSON: at most 8 files come back from a
    GPU call); their results and logs go into the one JSON this script writes."""
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix="samu_lb_"))
    children = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    flags = ["--dry"] if dry else []
    for which in [str(i) for i in range(len(LB_VARIANTS))] + ["train"]:
        f = out_dir / f"lb_probe_{which}.json"
        f.unlink(missing_ok=True)
        log = open(out_dir / f"lb_probe_{which}.log", "w")
        children[which] = (subprocess.Popen([sys.executable, __file__, "--out", str(out_dir), "--lb-probe", which,
                                             "--lb-probe-file", str(f)] + flags, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, env=env), f)
    if not dry:
        log = open(out_dir / "test_samu_lookback_gpu.log", "w")
        children["pytest"] = (subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/test_samu_lookback.py",
             "-k", "gpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env), None)
    t0 = time.time()
    res = {}
    for which, (proc, f) in children.items():
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = f"killed after {timeout_s} s"
        rec = json.loads(f.read_text()) if f is not None and f.exists() else {}
        rec["returncode"] = rc
        logf = out_dir / ("test_samu_lookback_gpu.log" if f is None else f"lb_probe_{which}.log")
        if logf.exists():
            rec["log_tail"] = logf.read_text()[-3000:]
        if f is None:
            rec["ok"] = rc == 0
        res[which] = rec
    return res


def lookback_main(args):
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    reps = 3 if args.dry else 30
    bench = Bench(args.commit)
    meta = {"started": records.now(), "gpu": records.facts.gpu(), "versions": records.facts.versions(),
            "commit": bench.commit, "notes": {}, "variants": {lb_label(o): o for o in LB_VARIANTS}}

    def say(msg):
        print(f"[{time.time() - t_start:5.0f}s] {msg}", flush=True)

    probes = lb_children(out_dir, args.lb_timeout, args.dry)
    meta["probes"] = probes
    for which, r in probes.items():
        say(f"probe {which}: " + json.dumps({k: (round(v, 9) if isinstance(v, float) else v)
                                              for k, v in r.items()})[:400])
    ok = [o for i, o in enumerate(LB_VARIANTS) if probes.get(str(i), {}).get("ok")]
    bw = copy_bandwidth(bench)
    meta["copy_bytes_per_s"] = bw
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s")

    def timed(cid, fn, shapes, variant, extra):
        if DEVICE == "cuda":
            try:
                g = graph_of(fn)
                return bench.timed(cid, g.replay, shapes, "samu", "chunk", reps=reps,
                                   extra={"timing": "cuda_graph", "variant": variant, **extra})
            except Exception as e:  # noqa: BLE001
                meta["notes"][cid] = f"{type(e).__name__}: {e}"[:300]
                return None
        return bench.timed(cid, fn, shapes, "samu", "chunk", reps=reps,
                           extra={"timing": "eager", "variant": variant, **extra})

    table = {}
    for T in LB_TS:
        if time.time() - t_start > args.budget_s:
            meta["notes"][f"skipped-T{T}"] = "time budget spent"
            continue
        q = samu_inputs(FLOOR_B, T, FLOOR_D)
        seg = documents(FLOOR_B, T)
        floor_bytes = 2 * FLOOR_B * T * FLOOR_D * 2
        for opts in [None] + ok:
            o = {} if opts is None else {"fwd": "lookback", **opts}
            variant = "chunk-16" if opts is None else lb_label(opts)
            rec = timed(f"fwd-samu-{variant}-T{T}-graph", forward_fn("samu", "chunk", 16, q, seg, o),
                        {"B": FLOOR_B, "T": T, "D": FLOOR_D, "dtype": "bfloat16"}, variant,
                        {"kind": "forward", "chunk_size": 16, "options": o, "floor_bytes": floor_bytes})
            if rec and rec["status"] == "ok":
                rec["floor_ms"] = floor_bytes / bw * 1e3
                rec["fraction_of_floor"] = rec["floor_ms"] / rec["stats"]["median_ms"]
                table.setdefault(variant, {})[T] = (rec["stats"]["median_ms"], rec["fraction_of_floor"])
        del q
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        say(f"forward T={T} done")
    train = {}
    train_ok = probes.get("train", {}).get("variants", {})
    p_s = samu_inputs(**TRAIN, grad=True)
    seg = documents(TRAIN["B"], TRAIN["T"])
    dy = torch.randn(TRAIN["B"], TRAIN["T"], TRAIN["D"], **cuda()).to(BF16)
    for opts in [None] + [o for o in LB_TRAIN_VARIANTS if train_ok.get(lb_label(o), {}).get("ok")]:
        o = {} if opts is None else {"fwd": "lookback", **opts}
        variant = "chunk-16" if opts is None else lb_label(opts)
        rec = timed(f"train-samu-{variant}-graph", train_step_fn("samu", "chunk", 16, p_s, seg, dy, o),
                    {**TRAIN, "dtype": "bfloat16"}, variant, {"kind": "fwd+bwd", "chunk_size": 16, "options": o})
        if rec and rec["status"] == "ok":
            train[variant] = rec["stats"]["median_ms"]
        try:
            meta.setdefault("kernel_profile_train", {})[variant] = kernel_profile(
                train_step_fn("samu", "chunk", 16, p_s, seg, dy, o))
        except Exception as e:  # noqa: BLE001
            meta["notes"][f"profile-{variant}"] = f"{type(e).__name__}: {e}"[:300]
    say("fwd+bwd done")
    meta["finished"] = records.now()
    meta["wall_s"] = time.time() - t_start
    (out_dir / "samu_lookback.json").write_text(json.dumps({"meta": meta, "records": bench.records}, indent=1,
                                                           default=str))
    g = meta["gpu"] or {}
    print(f"\nGPU {g.get('name')}  torch {meta['versions'].get('torch')}  triton {meta['versions'].get('triton')}  "
          f"copy {bw / 1e12:.2f} TB/s; forward B={FLOOR_B} D={FLOOR_D} bf16, device ms (CUDA graph) and % of floor")
    print(f"{'variant':44s}" + "".join(f"{'T=' + str(T):>20s}" for T in LB_TS))
    for variant, row in table.items():
        print(f"{variant:44s}" + "".join(f"{row[T][0]:11.4f} ({100 * row[T][1]:3.0f}%) " if T in row else
                                          f"{'-':>20s}" for T in LB_TS))
    for variant, ms in train.items():
        print(f"fwd+bwd B={TRAIN['B']} T={TRAIN['T']} D={TRAIN['D']} {variant:30s} {ms:.4f} ms")
    if meta["notes"]:
        print("notes:", json.dumps(meta["notes"])[:1500])


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
