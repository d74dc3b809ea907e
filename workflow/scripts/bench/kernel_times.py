"""Device time against host time of the fused ops: where the eager figures come from.

Eager timings of one call (CUDA events around the call) include the Python launcher
whenever the GPU finishes before the host has issued the next kernel. This script
separates the two, at the benchmark shapes, for a list of variants:

  graph   CUDA events around the replay of a CUDA graph holding one call (the device
          time of the call's kernels, memsets included; no Python);
  eager   CUDA events around one eager call (what the tracks time today);
  host    wall-clock microseconds per call of the Python launcher, measured over
          back-to-back calls at a tiny shape (the GPU idles; the host is the limit);
and a cProfile of the launchers (top functions by cumulative time) under --out.

    python workflow/scripts/bench/kernel_times.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "workflow" / "scripts"), str(ROOT / "workflow" / "scripts" / "bench")]

import torch  # noqa: E402

import bench_rglru as br  # noqa: E402
import bench_samu as bs  # noqa: E402
from kernels.timing import time_fn  # noqa: E402

SCAN = [("serial", {}), ("serial", {"block_d": 32}), ("serial", {"block_d": 64}),
        ("serial", {"block_d": 32, "block_t": 256}), ("serial", {"block_d": 64, "block_t": 64, "num_stages": 2}),
        ("serial", {"prefetch": True}), ("chunk", {"chunk_size": 32}),
        ("chunk", {"fwd": "lookback"}), ("chunk", {"fwd": "lookback", "chunk_size": 16, "vec": 8, "num_warps": 1}),
        ("chunk", {"fwd": "lookback", "chunk_size": 64, "vec": 4, "num_warps": 2}),
        ("chunk", {"fwd": "lookback", "chunk_size": 128, "vec": 0, "block_d": 64, "num_warps": 4})]
RGLRU = [("serial", {}), ("serial", {"fast_math": True}), ("chunk", {"fwd": "lookback", "fast_math": True}),
         ("chunk", {"fwd": "lookback", "fast_math": True, "chunk_size": 64}), ("chunk", {"chunk_size": 16})]
SAMU = [("serial", 32, {}), ("chunk", 8, {}), ("chunk", 16, {}), ("chunk", 32, {}),
        ("chunk", 16, {"prefix": "fill"}), ("chunk", 32, {"prefix": "fill"}),
        ("chunk", 16, {"block_m": 128, "num_warps": 2})]


def log(*a):
    print(*a, flush=True)


def name_of(backend, opts, chunk=None):
    return br.cfg_name(backend, opts) + (f"-K{chunk}" if chunk else "")


def timed(fn, reps, warmup, graph=True):
    """{"eager": time_fn record, "graph": time_fn record of a one-call graph} or an error."""
    rec = {}
    try:
        fn()
        rec["eager"] = time_fn(fn, reps=reps, warmup=warmup)
        if graph and torch.cuda.is_available():
            rec["graph"] = time_fn(br.graphed(fn), reps=reps, warmup=warmup)
    except Exception as e:                              # noqa: BLE001 -- recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"[:800]
        rec["traceback"] = traceback.format_exc()[-2000:]
    return rec


def host_us(fn, n):
    """Wall-clock microseconds per call over n back-to-back calls (then one sync)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def profile_text(fn, n):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    return s.getvalue()


def short(rec):
    if "error" in rec:
        return "ERROR " + rec["error"][:100]
    g = rec.get("graph", {}).get("median_ms", float("nan"))
    return f"eager {rec['eager']['median_ms']:.4f} graph {g:.4f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (a check of this script)")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or dev == "cpu"
    from common import facts
    if smoke:
        bs.dry_run_shapes()
        scan_T, scan_BD, train, samu_T = [40], (1, 32), (1, 40, 32), [40]
        reps, warm = 2, 1
        del SCAN[3:], RGLRU[2:], SAMU[2:]
    else:
        scan_T, scan_BD, train, samu_T = [2048, 4096, 8192, 16384], (8, 1024), (4, 2048, 2560), [4096, 16384]
        reps, warm = args.reps, 5
    res = {"schema": "kernel_times/1", "gpu": facts.gpu(), "versions": facts.versions(),
           "commit": os.environ.get("KERNELS_COMMIT") or facts.commit()["sha"],
           "timing": "kernels.timing.time_fn (CUDA events); graph = replay of a one-call CUDA graph",
           "scan": {}, "rglru": {}, "samu": {}, "host_us": {}}
    res["copy"] = br.copy_bandwidth(1 << 30 if not smoke else 1 << 16, dev)
    bw = res["copy"]["bytes_per_s"]
    log(f"copy {bw / 1e12:.3f} TB/s")

    def save():
        (out / "kernel_times.json").write_text(json.dumps(res, indent=1, default=str))

    # 1. bare scan forward, the section-4 shape (no resets, as the scan track)
    B, D = scan_BD
    peers, _ = br.find_peers()
    for T in scan_T:
        a, b = br.scan_inputs(B, T, D, dev, seed=1)
        floor = 3 * a.numel() * 2 / bw * 1e3
        row = res["scan"][str(T)] = {"floor_ms": floor}
        for backend, opts in SCAN:
            rec = row[name_of(backend, opts)] = timed(br.ours_scan(backend, opts, a, b, "fwd"), reps, warm)
            log(f"scan T={T} {name_of(backend, opts):60s} {short(rec)}  floor {floor:.4f}")
        if peers.get("accelerated_scan_scalar") and not smoke:
            at, bt = br.scan_inputs(B, T, D, dev, seed=1, layout="bdt")
            rec = row["accelerated_scan_scalar"] = timed(br.peer_scan("accelerated_scan_scalar", at, bt, "fwd"),
                                                         reps, warm)
            log(f"scan T={T} {'accelerated_scan_scalar':60s} {short(rec)}")
        save()

    # 2. RG-LRU at the training shape: forward alone and forward + backward
    argsr, pos, dy = br.rglru_inputs(*train, dev)
    for backend, opts in RGLRU:
        n = name_of(backend, opts)
        res["rglru"][n] = {"fwd": timed(br.ours_rglru(backend, opts, argsr, pos, dy, "fwd"), reps, warm),
                           "fwdbwd": timed(br.ours_rglru(backend, opts, argsr, pos, dy, "fwdbwd"), reps, warm)}
        log(f"rglru {n:60s} fwd {short(res['rglru'][n]['fwd'])} | fwd+bwd {short(res['rglru'][n]['fwdbwd'])}")
    save()

    # 3. SAMU: forward at the floor shape, forward + backward at the training shape
    for T in samu_T:
        p = bs.samu_inputs(bs.FLOOR_B, T, bs.FLOOR_D)
        floor = 2 * p["x"].numel() * 2 / bw * 1e3
        row = res["samu"][f"fwd T={T}"] = {"floor_ms": floor}
        for backend, chunk, opts in SAMU:
            n = name_of(backend, opts, chunk)
            rec = row[n] = timed(bs.forward_fn("samu", backend, chunk, p, None, opts), reps, warm)
            log(f"samu fwd T={T} {n:55s} {short(rec)}  floor {floor:.4f}")
        save()
    p = bs.samu_inputs(bs.TRAIN["B"], bs.TRAIN["T"], bs.TRAIN["D"], grad=True)
    dys = torch.randn_like(p["x"])
    row = res["samu"]["fwdbwd"] = {}
    for backend, chunk, opts in SAMU[1:]:
        n = name_of(backend, opts, chunk)
        rec = row[n] = timed(bs.train_step_fn("samu", backend, chunk, p, bs.documents(bs.TRAIN["B"], bs.TRAIN["T"]),
                                              dys, opts), reps, warm)
        log(f"samu fwd+bwd {n:55s} {short(rec)}")
    save()

    # 4. host time per call at a tiny shape, and where it goes
    if not smoke:
        a, b = br.scan_inputs(1, 64, 256, dev)
        argst, post, dyt = br.rglru_inputs(1, 64, 256, dev)
        pt = bs.samu_inputs(1, 64, 256, grad=True)
        dyp = torch.randn_like(pt["x"])
        fns = {"scan serial fwd": br.ours_scan("serial", {}, a, b, "fwd"),
               "scan chunk lookback fwd": br.ours_scan("chunk", {"fwd": "lookback"}, a, b, "fwd"),
               "rglru serial fwd": br.ours_rglru("serial", {}, argst, post, dyt, "fwd"),
               "rglru serial fwd+bwd": br.ours_rglru("serial", {}, argst, post, dyt, "fwdbwd"),
               "samu chunk16 fwd": bs.forward_fn("samu", "chunk", 16, pt, None),
               "samu chunk16 fwd+bwd": bs.train_step_fn("samu", "chunk", 16, pt, None, dyp)}
        for n, fn in fns.items():
            res["host_us"][n] = host_us(fn, 200)
            log(f"host {n:30s} {res['host_us'][n]:8.1f} us per call")
        for n in ("rglru serial fwd+bwd", "samu chunk16 fwd+bwd", "scan serial fwd"):
            (out / f"profile_{n.replace(' ', '_').replace('+', '')}.txt").write_text(profile_text(fns[n], 50))
        save()
    log("done")


if __name__ == "__main__":
    main()
