"""The serial kernels with time split across warps (option time_warps) against the
serial default and accelerated-scan, device time from CUDA graph replay.

1. bare scan forward at B=8, D=1024, T = 2048 .. 16384 (the section-4 shape): every
   variant gated against the PyTorch reference first (bench_rglru.gate_scan), then timed
   (graph), as a share of the memory floor (6 bytes per element over the measured copy
   bandwidth); accelerated-scan (its [B, D, T] layout) in the same run;
2. RG-LRU at B=4, T=2048, D=2560: forward gated (bench_rglru.gate_rglru); forward and
   forward + backward gradients of every input against the serial default's and against
   a float64 reference; then forward and forward + backward timed (graph), both orders.

    KERNELS_COMMIT=<sha> python workflow/scripts/bench/bench_split.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "workflow" / "scripts"), str(ROOT / "workflow" / "scripts" / "bench")]

import torch  # noqa: E402

import bench_rglru as br  # noqa: E402
from kernels.timing import time_fn  # noqa: E402


def graph_ms(fn, reps, warm):
    try:
        fn()
        rec = time_fn(br.graphed(fn) if torch.cuda.is_available() else fn, reps=reps, warmup=warm)
        return {"median_ms": rec["median_ms"], "samples_ms": rec["samples_ms"]}
    except Exception as e:                              # noqa: BLE001 -- recorded, the run goes on
        return {"error": f"{type(e).__name__}: {e}"[:600], "traceback": traceback.format_exc()[-1500:]}


# (time_warps, block_t, vec, num_stages); num_stages 1 runs with register prefetch of the
# next tile, more stages with Triton's pipelined (cp.async) loads. Sweep 6's grid plus
# vec 1 (one channel per lane, twice the programs; not yet run on a GPU).
SCAN_GRID = [(4, 16, 2, 4), (8, 16, 2, 4), (4, 8, 1, 1), (8, 8, 1, 1), (4, 16, 1, 1), (8, 4, 1, 1)]
RGLRU_GRID = [(4, 8, 2, 4), (4, 8, 2, 2), (8, 8, 2, 3), (4, 16, 2, 3), (2, 16, 2, 3), (4, 8, 4, 3), (4, 8, 1, 1),
              (8, 8, 1, 1), (2, 8, 1, 1)]


def opts_of(tw, tt, vec, st, **extra):
    return {"time_warps": tw, "block_t": tt, "vec": vec, **({"num_stages": st} if st > 1 else {}), **extra}


def scan_variants(smoke):
    """The tile kernels (time_warps 1), the default (split) and the grid."""
    grid = [(2, 4, 2, 1), (2, 4, 2, 2)] if smoke else SCAN_GRID
    return [("serial", {"time_warps": 1}), ("serial", {})] + [("serial", opts_of(*g)) for g in grid]


def rglru_variants(smoke):
    grid = [(2, 4, 2, 1)] if smoke else RGLRU_GRID
    return ([("serial", {"time_warps": 1}), ("serial", {"time_warps": 1, "fast_math": True}), ("serial", {}),
             ("serial", {"fast_math": True})] + [("serial", opts_of(*g, fast_math=True)) for g in grid])


def grad_check(backend, opts, args, pos, dy, ref_grads, base_grads):
    """Relative max errors of y and every gradient against float64 and the serial default."""
    import kernels
    from kernels import parity

    fn = kernels.backends("rglru")[backend]
    y, _ = fn(*args, pos, None, False, **opts)
    g = torch.autograd.grad(y, args, dy)
    names = ("x", "gate_x", "gate_a", "a_param")
    return {"vs_float64": {n: parity.rel_err(a, b) for n, a, b in zip(names, g, ref_grads)},
            "vs_serial_default": {n: parity.rel_err(a, b) for n, a, b in zip(names, g, base_grads)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or dev == "cpu"
    from common import facts
    import kernels
    from kernels.ops import reference

    scan_T, scan_BD, train = ([40], (1, 64), (1, 40, 64)) if smoke else ([2048, 4096, 8192, 16384], (8, 1024),
                                                                          (4, 2048, 2560))
    reps, warm = (2, 1) if smoke else (args.reps, 5)
    res = {"schema": "bench_split/1", "gpu": facts.gpu(), "versions": facts.versions(),
           "commit": os.environ.get("KERNELS_COMMIT") or facts.commit()["sha"],
           "timing": "kernels.timing.time_fn (CUDA events) around the replay of a one-call CUDA graph",
           "scan": {}, "rglru": {}}
    res["copy"] = br.copy_bandwidth(1 << 30 if not smoke else 1 << 16, dev)
    bw = res["copy"]["bytes_per_s"]
    br.log(f"copy {bw / 1e12:.3f} TB/s")

    def save():
        (out / "bench_split.json").write_text(json.dumps(res, indent=1, default=str))

    peers, _ = br.find_peers()
    B, D = scan_BD
    for T in scan_T:
        a, b = br.scan_inputs(B, T, D, dev, seed=1)
        floor = 3 * a.numel() * 2 / bw * 1e3
        row = res["scan"][str(T)] = {"floor_ms": floor, "variants": {}}
        for backend, opts in scan_variants(smoke):
            n = br.cfg_name(backend, opts)
            gate = br.gate_scan(backend, opts, a, b) if T == scan_T[0] else None
            rec = {"gate": gate}
            if gate is None or gate["passed"]:
                rec.update(graph_ms(br.ours_scan(backend, opts, a, b, "fwd"), reps, warm))
            if rec.get("median_ms"):
                rec["floor_fraction"] = floor / rec["median_ms"]
            row["variants"][n] = rec
            br.log(f"scan T={T:5d} {n:50s} " + (f"{rec['median_ms']:.4f} ms {rec['floor_fraction'] * 100:5.1f}%"
                                             if rec.get("median_ms") else f"FAILED {rec.get('error', gate)}"))
        if peers.get("accelerated_scan_scalar") and not smoke:
            at, bt = br.scan_inputs(B, T, D, dev, seed=1, layout="bdt")
            rec = graph_ms(br.peer_scan("accelerated_scan_scalar", at, bt, "fwd"), reps, warm)
            if rec.get("median_ms"):
                rec["floor_fraction"] = floor / rec["median_ms"]
            row["accelerated_scan_scalar"] = rec
            br.log(f"scan T={T:5d} {'accelerated_scan_scalar':50s} {rec.get('median_ms', 0):.4f} ms "
                f"{rec.get('floor_fraction', 0) * 100:5.1f}%")
        save()

    argsr, pos, dy = br.rglru_inputs(*train, dev)
    ref_args = [t.detach().double().requires_grad_() for t in argsr]
    y_ref, _ = reference.rglru(*ref_args, pos, None, False)
    ref_grads = torch.autograd.grad(y_ref, ref_args, dy.double())
    y0, _ = kernels.backends("rglru")["serial"](*argsr, pos, None, False)
    base_grads = torch.autograd.grad(y0, argsr, dy)
    res["rglru"]["serial_default_vs_float64"] = {n: kernels.parity.rel_err(a, b) for n, a, b in
                                                 zip(("x", "gate_x", "gate_a", "a_param"), base_grads, ref_grads)}
    cands = {}
    for backend, opts in rglru_variants(smoke):
        n = br.cfg_name(backend, opts)
        rec = res["rglru"][n] = {"gate": br.gate_rglru(backend, opts, train, dev)}
        try:
            rec["grads"] = grad_check(backend, opts, argsr, pos, dy, ref_grads, base_grads)
        except Exception as e:                          # noqa: BLE001
            rec["grads"] = {"error": f"{type(e).__name__}: {e}"[:600]}
        br.log(f"rglru {n:50s} gate {rec['gate']} grads {rec['grads']}")
        if rec["gate"]["passed"] and "error" not in rec["grads"]:
            cands[n] = (backend, opts)
    save()
    del y0, base_grads, y_ref, ref_grads, ref_args
    for order in (list(cands), list(cands)[::-1]):
        for n in order:
            backend, opts = cands[n]
            rec = res["rglru"][n]
            for mode in ("fwd", "fwdbwd"):
                # fresh leaves: an autograd node of an earlier call must not reach the capture
                leaves = [t.detach().requires_grad_() for t in argsr]
                rec.setdefault(mode, []).append(graph_ms(br.ours_rglru(backend, opts, leaves, pos, dy, mode),
                                                         reps, warm))
    for n in cands:
        rec = res["rglru"][n]
        for mode in ("fwd", "fwdbwd"):
            s = sorted(x for r in rec[mode] if "samples_ms" in r for x in r["samples_ms"])
            rec[mode + "_median_ms"] = s[len(s) // 2] if s else None
        br.log(f"rglru {n:50s} fwd {rec['fwd_median_ms']} fwd+bwd {rec['fwdbwd_median_ms']}")
    save()
    br.log("done")


if __name__ == "__main__":
    main()
