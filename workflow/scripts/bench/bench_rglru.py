"""Benchmark of the Triton RG-LRU kernels (issue 3) with the peers in the same run.

One call does, in order:
1. in parallel: the GPU tests (tests/test_rglru_gpu.py, log kept), the build of the
   peers' extensions and the compilation of every kernel variant timed below (a pool
   of processes filling Triton's on-disk cache), so compilation stays out of the
   timed phase and off the critical path;
2. device copy bandwidth (bytes read + written over time) -> memory floors;
3. RG-LRU forward and forward+backward at B=4, T=2048, D=2560 BF16 for every backend
   and chunk size (probe sweep of block shapes, then fresh runs of the chosen ones),
   eager and as one CUDA-graph replay; the bare scans of the peers at that shape
   (accelerated-scan 0.3.1, flash-linear-attention 0.6.0 hgrn) and the official
   recurrentgemma RGLRU layer;
4. the bare forward scan at B=8, D=1024, T=2048..16384 (BF16 in and out, FP32 state)
   against the memory floor, ours and the peers, in both orders;
5. the decode step at D=2560, H=16, B=16 (and 1..512), eager and graph-replayed.
Every figure comes from kernels.timing.time_fn (CUDA events, raw samples kept); the
JSON holds GPU, versions, commit, shapes, samples and logical byte/launch counts.

    python workflow/scripts/bench/bench_rglru.py --out DIR [--tests] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

import torch  # noqa: E402

SHAPES = {
    "full": {"rglru": (4, 2048, 2560), "scan_B": 8, "scan_D": 1024, "scan_T": (2048, 4096, 8192, 16384),
             "step": (16, 2560, 16), "step_batches": (1, 16, 64, 256, 512), "copy_bytes": 2 << 30},
    "smoke": {"rglru": (2, 40, 32), "scan_B": 2, "scan_D": 32, "scan_T": (32, 64),
              "step": (4, 32, 2), "step_batches": (1, 4), "copy_bytes": 1 << 20},
}

# Probe sweeps (first phase); the chosen configuration is timed again on fresh runs.
SERIAL_SWEEP = [
    dict(block_d=16, block_t=64, num_warps=4, prefetch=False),
    dict(block_d=16, block_t=64, num_warps=4, prefetch=True),
    dict(block_d=16, block_t=64, num_warps=4, prefetch=True, fast_math=True),
    dict(block_d=32, block_t=64, num_warps=4, prefetch=False), dict(block_d=32, block_t=64, num_warps=4, prefetch=True),
    dict(block_d=32, block_t=32, num_warps=4, prefetch=True), dict(block_d=16, block_t=128, num_warps=4, prefetch=True),
    dict(block_d=32, block_t=64, num_warps=8, prefetch=True), dict(block_d=64, block_t=64, num_warps=8, prefetch=True),
    dict(block_d=16, block_t=64, num_warps=2, prefetch=True), dict(block_d=32, block_t=64, num_warps=4, num_stages=2),
    dict(block_d=16, block_t=64, num_warps=4, num_stages=3, prefetch=False),
]
CHUNK_SWEEP = [dict(chunk_size=k, block_d=bd, num_warps=nw) for k in (8, 32, 64)
               for bd, nw in ((64, 4), (64, 8))] + [
    dict(chunk_size=k, inner="loop", block_d=bd, num_warps=nw, fast_math=fm) for k in (8, 16, 32)
    for bd, nw in ((128, 1), (256, 2), (512, 4)) for fm in (False, True)]
SCAN_SERIAL_SWEEP = [
    dict(block_d=16, block_t=128, num_warps=4, prefetch=False),
    dict(block_d=16, block_t=128, num_warps=4, prefetch=True),
    dict(block_d=16, block_t=256, num_warps=4, prefetch=True),
    dict(block_d=32, block_t=128, num_warps=4, prefetch=True),
    dict(block_d=32, block_t=256, num_warps=8, prefetch=True), dict(block_d=16, block_t=64, num_warps=2, prefetch=True),
    dict(block_d=64, block_t=64, num_warps=4, prefetch=True), dict(block_d=8, block_t=256, num_warps=2, prefetch=True),
    dict(block_d=16, block_t=128, num_warps=4, num_stages=3), dict(block_d=32, block_t=128, num_warps=4, num_stages=2),
]
SCAN_CHUNK = [dict(chunk_size=32, block_d=64)] + [dict(chunk_size=k, inner="loop", block_d=bd, num_warps=nw)
                                                   for k in (16, 32) for bd, nw in ((256, 2), (512, 4))]


def log(*a):
    print(*a, flush=True)


def cfg_name(backend, opts):
    return backend + "".join(f"_{k}{v}" for k, v in sorted(opts.items()))


# ----------------------------------------------------------------------------- inputs

def rglru_inputs(B, T, D, dev, grad=True, seed=0):
    import kernels
    from kernels import parity

    g = torch.Generator(device="cpu").manual_seed(seed)
    x, gx, ga = (torch.randn(B, T, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    torch.manual_seed(seed)
    ap = kernels.layers.rnn_param_init(torch.empty(D)).to(dev)
    args = [x, gx, ga, ap]
    if grad:
        args = [a.requires_grad_() for a in args]
    pos = parity.make_segment_pos(B, T, True, seed, dev)
    dy = torch.randn(B, T, D, generator=g).to(dev, torch.bfloat16)
    return args, pos, dy


def scan_inputs(B, T, D, dev, seed=0, layout="btd"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (B, T, D) if layout == "btd" else (B, D, T)
    a = (torch.rand(shape, generator=g) * 0.1 + 0.899).to(dev, torch.bfloat16)
    b = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
    return a, b


# ----------------------------------------------------------------------------- callables

def ours_rglru(backend, opts, args, pos, dy, mode):
    import kernels

    fn = kernels.backends("rglru")[backend]
    if mode == "fwd":
        def go():
            with torch.no_grad():
                return fn(*args, pos, None, False, **opts)[0]
    else:
        def go():
            y, _ = fn(*args, pos, None, False, **opts)
            return torch.autograd.grad(y, args, dy)
    return go


def ours_scan(backend, opts, a, b, mode, dy=None):
    import kernels

    fn = kernels.backends("scan")[backend]
    if mode == "fwd":
        def go():
            with torch.no_grad():
                return fn(a, b, None, None, False, **opts)[0]
    else:
        la, lb = a.detach().requires_grad_(), b.detach().requires_grad_()

        def go():
            y, _ = fn(la, lb, None, None, False, **opts)
            return torch.autograd.grad(y, (la, lb), dy)
    return go


def peer_scan(name, a, b, mode, dy=None):
    """Peers on their own layout: accelerated-scan [B, D, T] (a, b); fla hgrn [B, T, D]
    with g = log a. Forward only under no_grad; else forward + backward."""
    if name.startswith("accelerated_scan"):
        mod = importlib.import_module("accelerated_scan.warp" if name.endswith("warp") else "accelerated_scan.scalar")

        def f(a_, b_):
            return mod.scan(a_, b_)
    else:
        from fla.ops.hgrn import chunk_hgrn, fused_recurrent_hgrn

        op = chunk_hgrn if name.endswith("chunk") else fused_recurrent_hgrn
        g = torch.log(a.float()).to(a.dtype)
        a = g

        def f(g_, x_):
            return op(x_, g_)[0]
    if mode == "fwd":
        def go():
            with torch.no_grad():
                return f(a, b)
    else:
        la, lb = a.detach().requires_grad_(), b.detach().requires_grad_()

        def go():
            return torch.autograd.grad(f(la, lb), (la, lb), dy)
    return go


def official_rglru(B, T, D, H, dev, dy, mode):
    from kernels import parity

    rg = parity.load_official()
    m = rg.RGLRU(D, H, device=dev, dtype=torch.bfloat16)
    x = torch.randn(B, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    pos = parity.make_segment_pos(B, T, True, 0, dev)
    params = [x, *m.parameters()]
    if mode == "fwd":
        def go():
            with torch.no_grad():
                return m(x, pos)[0]
    else:
        def go():
            return torch.autograd.grad(m(x, pos)[0], params, dy)
    return go


# ----------------------------------------------------------------------------- measuring

def graphed(fn):
    """fn captured in one CUDA graph (warm-up on a side stream first); returns replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def measure(fn, reps, warmup, graph=False, count=True):
    from kernels.ops import accounting
    from kernels.timing import time_fn

    rec = {}
    try:
        fn()
        if count:
            with accounting.counting() as c:
                fn()
            rec.update(c.as_dict())
        rec["eager"] = time_fn(fn, reps=reps, warmup=warmup)
        if graph and torch.cuda.is_available():
            try:
                rec["graph"] = time_fn(graphed(fn), reps=reps, warmup=warmup)
            except Exception as e:                      # noqa: BLE001 -- recorded, the run goes on
                rec["graph_error"] = f"{type(e).__name__}: {e}"[:500]
        rec["ok"] = True
    except Exception as e:                              # noqa: BLE001
        rec["ok"] = False
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    return rec


def med(rec, kind="eager"):
    return rec[kind]["median_ms"] if rec.get("ok") and kind in rec else math.inf


def both_orders(cands: dict, reps, warmup, graph=False):
    """Every candidate timed in the listed order, then in reverse; samples of both kept."""
    out = {k: {"runs": []} for k in cands}
    names = list(cands)
    for order in (names, names[::-1]):
        for k in order:
            out[k]["runs"].append(measure(cands[k], reps, warmup, graph=graph, count=not out[k]["runs"]))
    for k, v in out.items():
        ok = [r for r in v["runs"] if r.get("ok")]
        v["ok"] = len(ok) == len(v["runs"])
        samples = [s for r in ok for s in r["eager"]["samples_ms"]]
        v["median_ms"] = sorted(samples)[len(samples) // 2] if samples else None
        gs = [s for r in ok if "graph" in r for s in r["graph"]["samples_ms"]]
        v["graph_median_ms"] = sorted(gs)[len(gs) // 2] if gs else None
        if ok:
            v.update({k2: ok[0][k2] for k2 in ok[0] if k2.startswith("logical_")})
        if not v["ok"]:
            v["error"] = next(r.get("error") for r in v["runs"] if not r.get("ok"))
    return out


# ----------------------------------------------------------------------------- gates

_GATE_REF = {}


def gate_rglru(backend, opts, shape, dev):
    """Forward output and final state of the variant against the PyTorch reference on
    the same BF16 inputs (FP32 inside): a speed figure is only stored for a variant
    that passes (y within 2 BF16 ulps of max|y|, the FP32 state within 1e-4)."""
    from kernels import parity
    from kernels.ops import reference
    import kernels

    B, T, D = shape
    args, pos, _ = rglru_inputs(B, T, D, dev, grad=False, seed=11)
    with torch.no_grad():
        if shape not in _GATE_REF:
            _GATE_REF[shape] = reference.rglru(*args, pos, None, True)
        y_ref, h_ref = _GATE_REF[shape]
        y, h = kernels.backends("rglru")[backend](*args, pos, None, True, **opts)
    ey, eh = parity.rel_err(y, y_ref), parity.rel_err(h, h_ref)
    return {"error_output": ey, "error_final_state": eh, "passed": ey <= 2 * 2.0 ** -8 and eh <= 1e-4}


def gate_scan(backend, opts, a, b):
    """A bare-scan variant of ours against the PyTorch reference on the first 512 steps of
    the same BF16 inputs (FP32 inside)."""
    from kernels import parity
    from kernels.ops import reference
    import kernels

    a, b = a[:, :512].contiguous(), b[:, :512].contiguous()
    with torch.no_grad():
        y, h = kernels.backends("scan")[backend](a, b, None, None, True, **opts)
        y_ref, h_ref = reference.scan(a, b, None, None, True)
    ey, eh = parity.rel_err(y, y_ref), parity.rel_err(h, h_ref)
    return {"error_output": ey, "error_final_state": eh, "passed": ey <= 2 * 2.0 ** -8 and eh <= 1e-4}


# ----------------------------------------------------------------------------- phases

def copy_bandwidth(nbytes, dev):
    from kernels.timing import time_fn

    n = nbytes // 2
    src = torch.randn(n, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), reps=30, warmup=5)
    return {"bytes_per_copy": 2 * n * 2, "timing": t, "bytes_per_s": 2 * n * 2 / (t["median_ms"] * 1e-3)}


def phase_rglru(S, dev, reps, warmup, res):
    B, T, D = S["rglru"]
    args, pos, dy = rglru_inputs(B, T, D, dev)
    out = {"shape": [B, T, D], "dtype": "bfloat16", "segment_pos": "parity.make_segment_pos(resets=True)",
           "probe": {}, "gates": {}}
    variants = [("serial", o) for o in SERIAL_SWEEP] + [("chunk", o) for o in CHUNK_SWEEP]
    for backend, opts in variants:
        name = cfg_name(backend, opts)
        gate = gate_rglru(backend, opts, (B, T, D), dev)
        out["gates"][name] = gate
        if not gate["passed"]:
            log(f"GATE FAILED {name}: {gate}")
            continue
        out["probe"][name] = {"backend": backend, "options": opts,
                              "fwdbwd": measure(ours_rglru(backend, opts, args, pos, dy, "fwdbwd"), reps, warmup),
                              "fwd": measure(ours_rglru(backend, opts, args, pos, dy, "fwd"), reps, warmup)}
        p = out["probe"][name]
        log(f"probe {name:55s} fwd+bwd {med(p['fwdbwd']):.4f} ms  fwd {med(p['fwd']):.4f} ms")
    # Choose per backend (and per chunk size) from the probe; measure afresh.
    chosen = {}
    for name, p in out["probe"].items():
        key = p["backend"]
        if p["backend"] == "chunk":
            key += f"{p['options']['chunk_size']}_{p['options'].get('inner', 'scan')}"
        if med(p["fwdbwd"]) < med(out["probe"].get(chosen.get(key, ""), {}).get("fwdbwd", {})):
            chosen[key] = name
    out["chosen"] = {k: out["probe"][v]["options"] | {"backend": out["probe"][v]["backend"]} for k, v in chosen.items()}
    cands = {k: ours_rglru(out["probe"][v]["backend"], out["probe"][v]["options"], args, pos, dy, "fwdbwd")
             for k, v in chosen.items()}
    a_b, b_b = scan_inputs(B, T, D, dev, layout="btd")
    a_c, b_c = scan_inputs(B, T, D, dev, layout="bdt")
    dyc = dy.transpose(1, 2).contiguous()
    best_scan_serial = res.get("scan", {}).get("chosen_serial", dict(block_d=32, block_t=64))
    cands["scan_serial(ours, bare scan)"] = ours_scan("serial", best_scan_serial, a_b, b_b, "fwdbwd", dy)
    cands["scan_chunk32(ours, bare scan)"] = ours_scan("chunk", dict(chunk_size=32), a_b, b_b, "fwdbwd", dy)
    for peer in ("accelerated_scan_warp", "accelerated_scan_scalar"):
        if res["peers"].get(peer):
            cands[peer] = peer_scan(peer, a_c, b_c, "fwdbwd", dyc)
    for peer in ("fla_hgrn_chunk", "fla_hgrn_fused_recurrent"):
        if res["peers"].get("fla"):
            cands[peer] = peer_scan(peer, a_b, b_b, "fwdbwd", dy)
    out["fresh_fwdbwd"] = both_orders(cands, reps, warmup, graph=True)
    if res["peers"].get("recurrentgemma"):
        out["official_rglru_layer_fwdbwd"] = measure(official_rglru(B, T, D, 16, dev, dy, "fwdbwd"), 3, 1,
                                                     count=False)
        out["official_rglru_layer_fwd"] = measure(official_rglru(B, T, D, 16, dev, dy, "fwd"), 3, 1, count=False)
    return out


def phase_scan(S, dev, reps, warmup, res):
    B, D = S["scan_B"], S["scan_D"]
    bw = res["copy"]["bytes_per_s"]
    out = {"B": B, "D": D, "dtype": "bfloat16 in/out, FP32 state", "probe": {}, "by_T": {}}
    # Probe the serial configurations at T = 4096 (the middle of the track).
    Tp = S["scan_T"][min(1, len(S["scan_T"]) - 1)]
    a, b = scan_inputs(B, Tp, D, dev)
    for opts in SCAN_SERIAL_SWEEP:
        name = cfg_name("serial", opts)
        gate = gate_scan("serial", opts, a, b)
        if not gate["passed"]:
            log(f"GATE FAILED {name}: {gate}")
            continue
        out["probe"][name] = measure(ours_scan("serial", opts, a, b, "fwd"), reps, warmup)
        log(f"scan probe T={Tp} {name:50s} {med(out['probe'][name]):.4f} ms")
    best = min(SCAN_SERIAL_SWEEP, key=lambda o: med(out["probe"].get(cfg_name("serial", o), {})))
    out["chosen_serial"] = best
    for T in S["scan_T"]:
        a, b = scan_inputs(B, T, D, dev)
        ac, bc = scan_inputs(B, T, D, dev, layout="bdt")
        ours = {"ours_serial": ("serial", best), **{cfg_name("ours_chunk", o): ("chunk", o) for o in SCAN_CHUNK}}
        gates = {k: gate_scan(bk, o, a, b) for k, (bk, o) in ours.items()}
        out.setdefault("gates", {})[str(T)] = gates
        cands = {k: ours_scan(bk, o, a, b, "fwd") for k, (bk, o) in ours.items() if gates[k]["passed"]}
        for peer in ("accelerated_scan_warp", "accelerated_scan_scalar"):
            if res["peers"].get(peer):
                cands[peer] = peer_scan(peer, ac, bc, "fwd")
        if res["peers"].get("fla"):
            cands["fla_hgrn_chunk"] = peer_scan("fla_hgrn_chunk", a, b, "fwd")
            cands["fla_hgrn_fused_recurrent"] = peer_scan("fla_hgrn_fused_recurrent", a, b, "fwd")
        r = both_orders(cands, reps, warmup)
        floor_ms = 3 * a.numel() * a.element_size() / bw * 1e3
        for k, v in r.items():
            v["floor_fraction"] = floor_ms / v["median_ms"] if v.get("median_ms") else None
        out["by_T"][str(T)] = {"floor_ms": floor_ms, "bytes_moved": 3 * a.numel() * a.element_size(), "results": r}
        log(f"scan T={T}: floor {floor_ms:.4f} ms | " + " | ".join(
            f"{k} {v['median_ms'] or float('nan'):.4f}" for k, v in r.items()))
    return out


# Run 2: the serial kernels with the time axis inside each thread (option vec) against
# run 1's serial default, at the fwd+bwd target shape and on the bare-scan track.
VEC_RGLRU = [("serial", {}), ("serial", {"fast_math": True}),
             ("serial", dict(vec=2, block_t=16, num_warps=2)),
             ("serial", dict(vec=2, block_t=16, num_warps=2, fast_math=True)),
             ("serial", dict(vec=2, block_t=8, num_warps=2, fast_math=True)),
             ("serial", dict(vec=2, block_t=8, num_warps=1, fast_math=True)),
             ("serial", dict(vec=2, block_t=16, num_warps=1, fast_math=True, prefetch=True)),
             ("chunk", dict(chunk_size=16, inner="loop", block_d=256, num_warps=2, fast_math=True))]
VEC_SCAN = [("serial", {}), ("serial", dict(vec=2, block_t=32, num_warps=1)),
            ("serial", dict(vec=2, block_t=32, num_warps=1, prefetch=True)),
            ("serial", dict(vec=2, block_t=64, num_warps=1, prefetch=True)),
            ("serial", dict(vec=4, block_t=32, num_warps=1))]


def phase_vec(S, dev, reps, warmup, res, rglru_variants=None, scan_variants=None):
    """Old serial default vs the vec (time-in-thread) variants (or the given lists);
    gates first, then both orders. RG-LRU: fwd+bwd and fwd at S['rglru']; bare scan: fwd
    at every S['scan_T']."""
    rglru_variants = VEC_RGLRU if rglru_variants is None else rglru_variants
    scan_variants = VEC_SCAN if scan_variants is None else scan_variants
    B, T, D = S["rglru"]
    args, pos, dy = rglru_inputs(B, T, D, dev)
    out = {"rglru": {"shape": [B, T, D], "dtype": "bfloat16", "gates": {}}, "scan": {"by_T": {}, "gates": {}}}
    cands_fb, cands_f = {}, {}
    for backend, opts in rglru_variants:
        name = cfg_name(backend, opts)
        gate = gate_rglru(backend, opts, (B, T, D), dev)
        out["rglru"]["gates"][name] = gate
        if not gate["passed"]:
            log(f"GATE FAILED {name}: {gate}")
            continue
        cands_fb[name] = ours_rglru(backend, opts, args, pos, dy, "fwdbwd")
        cands_f[name] = ours_rglru(backend, opts, args, pos, dy, "fwd")
    out["rglru"]["fwdbwd"] = both_orders(cands_fb, reps, warmup, graph=True)
    out["rglru"]["fwd"] = both_orders(cands_f, reps, warmup)
    for k in cands_fb:
        fb, f = out["rglru"]["fwdbwd"][k], out["rglru"]["fwd"][k]
        log(f"rglru {k:60s} fwd+bwd {fb['median_ms'] or math.nan:.4f} ms "
            f"(graph {fb['graph_median_ms'] or math.nan:.4f})  fwd {f['median_ms'] or math.nan:.4f} ms")
    bw = res["copy"]["bytes_per_s"]
    Bs, Ds = S["scan_B"], S["scan_D"]
    for T in S["scan_T"]:
        a, b = scan_inputs(Bs, T, Ds, dev)
        cands = {}
        for backend, opts in scan_variants:
            name = cfg_name(backend, opts)
            gate = gate_scan(backend, opts, a, b)
            out["scan"]["gates"].setdefault(str(T), {})[name] = gate
            if gate["passed"]:
                cands[name] = ours_scan(backend, opts, a, b, "fwd")
            else:
                log(f"GATE FAILED scan {name}: {gate}")
        if res["peers"].get("accelerated_scan_scalar"):
            ac, bc = scan_inputs(Bs, T, Ds, dev, layout="bdt")
            cands["accelerated_scan_scalar"] = peer_scan("accelerated_scan_scalar", ac, bc, "fwd")
        r = both_orders(cands, reps, warmup)
        floor_ms = 3 * a.numel() * a.element_size() / bw * 1e3
        for v in r.values():
            v["floor_fraction"] = floor_ms / v["median_ms"] if v.get("median_ms") else None
        out["scan"]["by_T"][str(T)] = {"floor_ms": floor_ms, "bytes_moved": 3 * a.numel() * a.element_size(),
                                       "results": r}
        log(f"scan T={T}: floor {floor_ms:.4f} ms | " + " | ".join(
            f"{k} {v['median_ms'] or math.nan:.4f} ({(v['floor_fraction'] or 0) * 100:.0f}%)" for k, v in r.items()))
    return out


# Run 3 (results/kernels/rglru/run3_lookback): the chunk backend's single-pass forward with
# decoupled look-back (fwd="lookback", kernels/ops/rglru_triton/lookback.py). The defaults
# are chunk 16, vec 4, 2 warps, window 8. bench_lookback.py times the later variants.
LOOKBACK_RGLRU = [("serial", {}), ("serial", {"fast_math": True}),
                  ("chunk", dict(fwd="lookback")), ("chunk", dict(fwd="lookback", fast_math=True)),
                  ("chunk", dict(fwd="lookback", chunk_size=32, num_warps=1, fast_math=True)),
                  ("chunk", dict(fwd="lookback", vec=0, chunk_size=64, block_d=64, num_warps=4, fast_math=True)),
                  ("chunk", dict(fwd="lookback", inner="loop", fast_math=True))]
LOOKBACK_SCAN = [("serial", {}), ("chunk", dict(fwd="lookback")), ("chunk", dict(fwd="lookback", window=1)),
                 ("chunk", dict(fwd="lookback", window=32)), ("chunk", dict(fwd="lookback", num_warps=1)),
                 ("chunk", dict(fwd="lookback", chunk_size=32, num_warps=1)),
                 ("chunk", dict(fwd="lookback", chunk_size=32, vec=2, num_warps=2)),
                 ("chunk", dict(fwd="lookback", chunk_size=16, vec=8, num_warps=1)),
                 ("chunk", dict(fwd="lookback", vec=0, chunk_size=128, block_d=64, num_warps=4))]


def probe_lookback(S, out_file):
    """Child process of phase_lookback: every look-back variant once at the benchmark's
    shapes, with resets and an initial state, against the PyTorch reference on the same
    BF16 inputs (FP32 inside), one JSON line per variant written as soon as it is done,
    so that a hang (the parent kills this process) names the variant that hung."""
    import kernels
    from kernels import parity
    from kernels.ops import reference

    def line(rec):
        with open(out_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    B, T, D = S["rglru"]
    args, pos, dy = rglru_inputs(B, T, D, dev, grad=False, seed=12)
    h0 = torch.randn(B, D, device=dev)
    want = reference.rglru(*args, pos, h0, True)
    wgrad = None
    for backend, opts in LOOKBACK_RGLRU:
        if backend != "chunk":
            continue
        name = cfg_name(backend, opts)
        line({"op": "rglru", "variant": name, "started": True})
        with torch.no_grad():
            y, h = kernels.backends("rglru")[backend](*args, pos, h0, True, **opts)
        sync()
        rec = {"op": "rglru", "variant": name, "error_output": parity.rel_err(y, want[0]),
               "error_final_state": parity.rel_err(h, want[1])}
        leaves = [a.detach().clone().requires_grad_() for a in args]
        y, _ = kernels.backends("rglru")[backend](*leaves, pos, h0, False, **opts)
        grads = torch.autograd.grad(y, leaves, dy)
        if wgrad is None:
            ref_leaves = [a.detach().clone().requires_grad_() for a in args]
            wy, _ = reference.rglru(*ref_leaves, pos, h0, False)
            wgrad = torch.autograd.grad(wy, ref_leaves, dy)
        sync()
        rec["error_grads"] = [parity.rel_err(g, w) for g, w in zip(grads, wgrad)]
        line(rec)
    Bs, Ds = S["scan_B"], S["scan_D"]
    for T in S["scan_T"][-1:]:
        a, b = scan_inputs(Bs, T, Ds, dev, seed=13)
        spos = parity.make_segment_pos(Bs, T, True, 13, dev)
        h0 = torch.randn(Bs, Ds, device=dev)
        want = reference.scan(a, b, spos, h0, True)
        for backend, opts in LOOKBACK_SCAN:
            if backend != "chunk":
                continue
            name = cfg_name(backend, opts)
            line({"op": "scan", "T": T, "variant": name, "started": True})
            with torch.no_grad():
                y, h = kernels.backends("scan")[backend](a, b, spos, h0, True, **opts)
            sync()
            line({"op": "scan", "T": T, "variant": name, "error_output": parity.rel_err(y, want[0]),
                  "error_final_state": parity.rel_err(h, want[1])})


def phase_lookback(S, dev, reps, warmup, res, timeout_s=360, stall_s=100):
    """The look-back variants: first the probe in a child process under a timeout (a
    kernel that never finishes is killed with its process, and the variants are then not
    timed), then, if every variant finished, the vec phase's gates and timings."""
    stall_s = stall_s if dev == "cuda" else timeout_s  # the interpreter is slow
    probe_file = Path(res["out_dir"]) / "lookback_probe.jsonl"
    probe_file.unlink(missing_ok=True)
    t0 = time.time()
    child = subprocess.Popen([sys.executable, __file__, "--out", res["out_dir"], "--probe-lookback", str(probe_file)],
                             cwd=REPO, stdout=open(Path(res["out_dir"]) / "lookback_probe.log", "w"),
                             stderr=subprocess.STDOUT)
    rc = None
    while rc is None:
        # A variant that makes no progress for stall_s (its compile included) is taken
        # as hung: the child is killed, and the last variant started is named below.
        try:
            rc = child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            last = probe_file.stat().st_mtime if probe_file.exists() else t0
            if time.time() - t0 > timeout_s:
                child.kill()
                rc = "killed at the timeout"
            elif time.time() - last > stall_s:
                child.kill()
                rc = f"killed: no progress for {stall_s} s"
    lines = [json.loads(x) for x in probe_file.read_text().splitlines()] if probe_file.exists() else []
    out = {"probe": {"returncode": rc, "seconds": round(time.time() - t0, 1), "records": lines}}
    done = [r for r in lines if not r.get("started")]
    log(f"look-back probe: exit {rc} after {out['probe']['seconds']} s; " + "; ".join(
        f"{r['op']} {r['variant']}: y {r['error_output']:.2e} h {r['error_final_state']:.2e}"
        + (f" grads {max(r['error_grads']):.2e}" if "error_grads" in r else "") for r in done))
    if rc != 0:
        hung = [r for r in lines if r.get("started")][-1:] if lines else []
        log(f"look-back probe failed ({rc}); last variant started: {hung}; nothing timed")
        return out
    out.update(phase_vec(S, dev, reps, warmup, res, LOOKBACK_RGLRU, LOOKBACK_SCAN))
    return out


def phase_step(S, dev, reps, warmup):
    import kernels
    from kernels.timing import time_fn

    Bs, D, H = S["step"]
    W = D // H
    out = {"D": D, "H": H, "dtype": "bfloat16 x and gate weights, FP32 state", "by_B": {}}
    g = torch.Generator(device="cpu").manual_seed(5)
    wx, wa = ((torch.randn(H, W, W, generator=g) / W ** 0.5).to(dev, torch.bfloat16) for _ in range(2))
    bx, ba = (torch.randn(H, W, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    ap = kernels.layers.rnn_param_init(torch.empty(D)).to(dev)
    for B in sorted(set(S["step_batches"]) | {Bs}):
        x = torch.randn(B, D, generator=g).to(dev, torch.bfloat16)
        state = torch.randn(B, D, generator=g).to(dev)
        reset = torch.zeros(B, dtype=torch.bool, device=dev)

        def step():
            return kernels.rglru_step(x, wx, bx, wa, ba, ap, state, reset, backend="fused")
        rec = measure(step, reps * 4, warmup)
        if torch.cuda.is_available():
            try:
                n = 64
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(n):
                        step()
                t = time_fn(graph.replay, reps=reps, warmup=warmup)
                rec["graph_64_steps"] = t
                rec["graph_per_step_us"] = t["median_ms"] * 1e3 / n
                rec["graph_1_step"] = time_fn(graphed(step), reps=reps * 4, warmup=warmup)
            except Exception as e:                      # noqa: BLE001
                rec["graph_error"] = f"{type(e).__name__}: {e}"[:500]
        out["by_B"][str(B)] = rec
        log(f"step B={B}: eager {med(rec) * 1e3:.2f} us, graph 1-step "
            f"{rec.get('graph_1_step', {}).get('median_ms', float('nan')) * 1e3:.2f} us, "
            f"per step in a 64-step graph {rec.get('graph_per_step_us', float('nan')):.2f} us")
    return out


# ----------------------------------------------------------------------------- warm-up pool

def _warm_job(job):
    """Compile one variant (or build one peer) in a worker: Triton's on-disk cache and
    torch's extension cache are shared with the parent, which then only loads them."""
    kind, payload = job
    t0 = time.time()
    try:
        dev = "cuda"
        if kind == "import":
            importlib.import_module(payload)
        elif kind == "rglru":
            backend, opts, D = payload
            args, pos, dy = rglru_inputs(1, 256, D, dev)
            ours_rglru(backend, opts, args, pos, dy, "fwdbwd")()
            ours_rglru(backend, opts, args, pos, dy, "fwd")()
            if backend == "chunk" or opts.get("block_t") == 64:
                a, b = scan_inputs(1, 256, D, dev)
                ours_scan(backend, opts, a, b, "fwdbwd", torch.randn_like(b))()
        elif kind == "scan":
            backend, opts, D = payload
            a, b = scan_inputs(1, 512, D, dev)
            ours_scan(backend, opts, a, b, "fwd")()
        elif kind == "fla":
            D = payload
            a, b = scan_inputs(1, 256, D, dev)
            for name in ("fla_hgrn_chunk", "fla_hgrn_fused_recurrent"):
                peer_scan(name, a, b, "fwd")()
                peer_scan(name, a, b, "fwdbwd", torch.randn_like(b))()
        torch.cuda.synchronize()
        return job, None, time.time() - t0
    except Exception as e:                              # noqa: BLE001
        return job, f"{type(e).__name__}: {e}"[:500], time.time() - t0


def warm_jobs(S, peers):
    D = S["rglru"][2]
    jobs = [("rglru", ("serial", o, D)) for o in SERIAL_SWEEP]
    jobs += [("rglru", ("chunk", o, D)) for o in CHUNK_SWEEP]
    jobs += [("scan", ("serial", o, S["scan_D"])) for o in SCAN_SERIAL_SWEEP]
    jobs += [("scan", ("chunk", o, S["scan_D"])) for o in SCAN_CHUNK]
    if peers.get("fla"):
        jobs += [("fla", D), ("fla", S["scan_D"])]
    return jobs


def find_peers():
    have = {}
    for name, mod in (("accelerated_scan_warp", "accelerated_scan"), ("accelerated_scan_scalar", "accelerated_scan"),
                      ("fla", "fla"), ("recurrentgemma", "recurrentgemma")):
        have[name] = importlib.util.find_spec(mod) is not None
    if not torch.cuda.is_available():
        have = {k: False for k in have}
    versions = {}
    for dist in ("accelerated-scan", "fla-core", "flash-linear-attention", "recurrentgemma"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:                               # noqa: BLE001
            versions[dist] = None
    return have, versions


# ----------------------------------------------------------------------------- main

def summary(res):
    lines = []
    bw = res["copy"]["bytes_per_s"]
    lines.append(f"GPU {res['gpu'] and res['gpu']['name']} | copy {bw / 1e12:.3f} TB/s | commit {res['commit']}")
    r = res.get("rglru", {})
    if "fresh_fwdbwd" in r:
        lines.append(f"RG-LRU fwd+bwd {r['shape']} bf16 (target <= 0.25 ms), fresh runs, both orders:")
        for k, v in r["fresh_fwdbwd"].items():
            g = v.get("graph_median_ms")
            lines.append(f"  {k:40s} eager {v.get('median_ms') or float('nan'):8.4f} ms   graph "
                         f"{g if g is not None else float('nan'):8.4f} ms")
        for k in ("official_rglru_layer_fwdbwd", "official_rglru_layer_fwd"):
            if k in r:
                lines.append(f"  {k:40s} eager {med(r[k]):8.2f} ms")
    s = res.get("scan", {})
    if "by_T" in s:
        lines.append(f"scan fwd B={s['B']} D={s['D']} bf16 (target >= 85% of floor for T >= 4096, faster than "
                     "accelerated-scan):")
        for T, v in s["by_T"].items():
            row = " | ".join(f"{k} {x['median_ms'] or float('nan'):.4f} ({(x['floor_fraction'] or 0) * 100:.0f}%)"
                             for k, x in v["results"].items())
            lines.append(f"  T={T:>5s} floor {v['floor_ms']:.4f} ms | {row}")
    vr = res.get("vec", {})
    if "rglru" in vr:
        lines.append(f"run 2 vec: RG-LRU {vr['rglru']['shape']} bf16, both orders (target fwd+bwd <= 0.25 ms):")
        for k, v in vr["rglru"].get("fwdbwd", {}).items():
            f = vr["rglru"].get("fwd", {}).get(k, {})
            nan = float("nan")
            lines.append(f"  {k:62s} fwd+bwd {v.get('median_ms') or nan:8.4f} ms  graph "
                         f"{v.get('graph_median_ms') or nan:8.4f} ms  fwd {f.get('median_ms') or nan:8.4f} ms")
        lines.append("run 2 vec: bare scan fwd (target >= 85% of floor for T >= 4096):")
        for T, v in vr["scan"]["by_T"].items():
            lines.append(f"  T={T:>5s} floor {v['floor_ms']:.4f} ms")
            for k, x in v["results"].items():
                lines.append(f"    {k:56s} {x['median_ms'] or float('nan'):.4f} ms "
                             f"({(x['floor_fraction'] or 0) * 100:.0f}% of floor)")
    lb = res.get("lookback", {})
    if "probe" in lb:
        lines.append(f"run 3 look-back: probe exit {lb['probe']['returncode']} after {lb['probe']['seconds']} s")
    if "rglru" in lb:
        nan = float("nan")
        for k, v in lb["rglru"].get("fwdbwd", {}).items():
            f = lb["rglru"].get("fwd", {}).get(k, {})
            lines.append(f"  {k:62s} fwd+bwd {v.get('median_ms') or nan:8.4f} ms  graph "
                         f"{v.get('graph_median_ms') or nan:8.4f} ms  fwd {f.get('median_ms') or nan:8.4f} ms")
        lines.append("run 3 look-back: bare scan fwd (target >= 85% of floor for T >= 4096):")
        for T, v in lb["scan"]["by_T"].items():
            lines.append(f"  T={T:>5s} floor {v['floor_ms']:.4f} ms")
            for k, x in v["results"].items():
                lines.append(f"    {k:56s} {x['median_ms'] or nan:.4f} ms "
                             f"({(x['floor_fraction'] or 0) * 100:.0f}% of floor)")
    st = res.get("step", {})
    for B, v in st.get("by_B", {}).items():
        lines.append(f"step B={B:>3s} D={st['D']}: eager {med(v) * 1e3:7.2f} us | graph 1-step "
                     f"{v.get('graph_1_step', {}).get('median_ms', float('nan')) * 1e3:7.2f} us | per step in "
                     f"64-step graph {v.get('graph_per_step_us', float('nan')):6.2f} us (target < 10 us)")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_rglru.json, the test log and summary.txt")
    ap.add_argument("--tests", action="store_true", help="run tests/test_rglru_gpu.py alongside the warm-up")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a check of this script, not a benchmark)")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--vec", action="store_true",
                    help="only phase_vec (old serial default vs the vec variants); with --tests only the vec GPU tests")
    ap.add_argument("--lookback", action="store_true",
                    help="only phase_lookback (the chunk backend's fwd='lookback' variants, first probed for hangs "
                         "and correctness in a child process)")
    ap.add_argument("--probe-lookback", metavar="FILE", help=argparse.SUPPRESS)
    ap.add_argument("--build-deadline", type=float, default=150.0,
                    help="seconds from the start after which the accelerated-scan CUDA build is abandoned")
    args = ap.parse_args(argv)
    if args.probe_lookback:
        probe_lookback(SHAPES["smoke" if args.smoke else "full"], args.probe_lookback)
        return
    if args.smoke:
        for sweep in (SERIAL_SWEEP, CHUNK_SWEEP, SCAN_SERIAL_SWEEP, SCAN_CHUNK):
            del sweep[2:]
        for sweep in (VEC_RGLRU, VEC_SCAN, LOOKBACK_RGLRU, LOOKBACK_SCAN):
            del sweep[3:], sweep[1]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    S = SHAPES["smoke" if args.smoke else "full"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from common import facts

    peers, peer_versions = find_peers()
    res = {"schema": "bench_rglru/1", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": facts.gpu(),
           "versions": facts.versions() | peer_versions, "commit": os.environ.get("KERNELS_COMMIT")
           or facts.commit()["sha"], "shapes": S, "peers": peers, "reps": args.reps, "warmup": args.warmup,
           "timing": "kernels.timing.time_fn, CUDA events, median of raw samples"}
    log(json.dumps({k: res[k] for k in ("gpu", "versions", "commit", "peers")}))

    t0 = time.time()
    tests = warp_build = None
    if args.vec or args.lookback:
        peers["accelerated_scan_warp"] = False
        args.workers = 0
    res["out_dir"] = str(out_dir)
    if peers.get("accelerated_scan_warp"):
        # accelerated-scan's CUDA scan builds with nvcc at import (load_inline): in its
        # own process from the start, waited for only up to a deadline.
        warp_build = subprocess.Popen([sys.executable, "-c", "import accelerated_scan.warp"], cwd=REPO,
                                      stdout=open(out_dir / "accelerated_scan_build.log", "w"),
                                      stderr=subprocess.STDOUT)
    if args.tests:
        xdist = ["-n", "4"] if importlib.util.find_spec("xdist") else []
        tests = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rA", "tests/test_rglru_gpu.py", *xdist,
             *(["-k", "vec"] if args.vec else [])],
            cwd=REPO, stdout=open(out_dir / "test_rglru_gpu.log", "w"), stderr=subprocess.STDOUT)
    if dev == "cuda" and args.workers > 0:
        jobs = warm_jobs(S, peers)
        with mp.get_context("spawn").Pool(min(args.workers, len(jobs))) as pool:
            warm = list(pool.imap_unordered(_warm_job, jobs))
        res["warm"] = [{"job": str(j), "error": e, "seconds": round(s, 1)} for j, e, s in warm]
        for j, e, s in warm:
            if e:
                log(f"warm-up failed {j}: {e}")
    log(f"warm-up done in {time.time() - t0:.0f} s")
    if tests is not None:
        res["tests_returncode"] = tests.wait()
        log(f"GPU tests exit {res['tests_returncode']} after {time.time() - t0:.0f} s")
        log("".join((out_dir / "test_rglru_gpu.log").read_text().splitlines(keepends=True)[-15:]))
    if warp_build is not None:
        try:
            rc = warp_build.wait(timeout=max(1.0, args.build_deadline - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            warp_build.kill()
            rc = "killed at the deadline"
        res["accelerated_scan_warp_build"] = {"returncode": rc, "seconds": round(time.time() - t0, 1)}
        peers["accelerated_scan_warp"] = rc == 0
        log(f"accelerated-scan CUDA build: {rc} after {time.time() - t0:.0f} s")

    res["copy"] = copy_bandwidth(S["copy_bytes"], dev)
    log(f"copy bandwidth {res['copy']['bytes_per_s'] / 1e12:.3f} TB/s")
    phases = (("scan", lambda: phase_scan(S, dev, args.reps, args.warmup, res)),
              ("rglru", lambda: phase_rglru(S, dev, args.reps, args.warmup, res)),
              ("step", lambda: phase_step(S, dev, args.reps, args.warmup)))
    if args.vec:
        phases = (("vec", lambda: phase_vec(S, dev, args.reps, args.warmup, res)),)
    if args.lookback:
        phases = (("lookback", lambda: phase_lookback(S, dev, args.reps, args.warmup, res)),)
    for name, phase in phases:
        t1 = time.time()
        try:
            res[name] = phase()
        except Exception as e:                          # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            log(f"phase {name} failed: {res[name]['error']}")
        log(f"phase {name} took {time.time() - t1:.0f} s")
        (out_dir / "bench_rglru.json").write_text(json.dumps(res, indent=1, default=str))
    res["copy_after"] = copy_bandwidth(S["copy_bytes"], dev)
    res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (out_dir / "bench_rglru.json").write_text(json.dumps(res, indent=1, default=str))
    text = summary(res)
    (out_dir / "summary.txt").write_text(text + "\n")
    log(text)


if __name__ == "__main__":
    main()
