"""Look-back kernels of the RG-LRU chunk backend on the GPU: correctness at the benchmark
shapes, then device time (CUDA-graph replay of one call) of every variant.

  1. compile every variant in worker processes (Triton's on-disk cache is shared);
  2. a child process runs the variants one by one -- gate (against the PyTorch
     reference on the same BF16 inputs, FP32 inside), then timing -- and appends one
     JSON line per result; the parent kills it when no line arrives for --stall
     seconds (a look-back that never finishes names itself as the last "started");
  3. a short table on stdout; the JSON lines and the table under --out.

Shapes: bare scan forward at B = 8, D = 1024, T = 2048 .. 16384 (section 4 track,
against the memory floor: BF16 a, b read and y written once / measured copy
bandwidth); RG-LRU forward and forward + backward at B = 4, T = 2048, D = 2560 (the
issue's training shape; resets at document starts).

    python workflow/scripts/bench/bench_lookback.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "workflow" / "scripts"), str(ROOT / "workflow" / "scripts" / "bench")]

import torch  # noqa: E402

import bench_rglru as br  # noqa: E402

LB = {"fwd": "lookback"}
SCAN = [("serial", {}),
        ("chunk", {**LB, "chunk_size": 16, "vec": 8, "num_warps": 1}),
        ("chunk", {**LB, "chunk_size": 64, "vec": 4, "num_warps": 4, "block_d": 128}),
        ("chunk", {**LB, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128}),
        ("chunk", {**LB, "chunk_size": 128, "vec": 2, "num_warps": 4, "block_d": 64}),
        ("chunk", {**LB, "chunk_size": 256, "vec": 2, "num_warps": 8, "block_d": 64}),
        ("chunk", {**LB, "chunk_size": 256, "vec": 4, "num_warps": 16, "block_d": 128}),
        ("chunk", {**LB, "chunk_size": 128, "vec": 8, "num_warps": 8, "block_d": 256}),
        ("chunk", {**LB, "chunk_size": 256, "vec": 2, "num_warps": 8, "block_d": 64, "window": 4}),
        ("chunk", {**LB, "chunk_size": 64, "vec": 2, "num_warps": 2, "block_d": 64})]
FM = {"fast_math": True}
BWD = {"bwd": "lookback"}
RGLRU = [("serial", FM),
         ("chunk", {**LB, **FM, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128}),
         ("chunk", {**LB, **FM, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128, **BWD,
                    "bwd_chunk": 64, "bwd_vec": 2, "bwd_warps": 4, "bwd_block_d": 64}),
         ("chunk", {**LB, **FM, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128, **BWD,
                    "bwd_chunk": 128, "bwd_vec": 2, "bwd_warps": 8, "bwd_block_d": 64}),
         ("chunk", {**LB, **FM, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128, **BWD,
                    "bwd_chunk": 32, "bwd_vec": 2, "bwd_warps": 2, "bwd_block_d": 64}),
         ("chunk", {**LB, **FM, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128, **BWD,
                    "bwd_chunk": 64, "bwd_vec": 4, "bwd_warps": 4, "bwd_block_d": 128}),
         ("chunk", {**LB, **FM, "chunk_size": 128, "vec": 4, "num_warps": 8, "block_d": 128, **BWD,
                    "bwd_chunk": 32, "bwd_vec": 0, "bwd_warps": 4, "bwd_block_d": 64}),
         ("chunk", {**LB, **FM, "chunk_size": 64, "vec": 2, "num_warps": 2, "block_d": 64, **BWD,
                    "bwd_chunk": 64, "bwd_vec": 2, "bwd_warps": 4, "bwd_block_d": 64})]


def shapes(smoke):
    if smoke:
        return {"scan_B": 1, "scan_D": 64, "scan_T": [40], "train": (1, 40, 64)}
    return {"scan_B": 8, "scan_D": 1024, "scan_T": [2048, 4096, 8192, 16384], "train": (4, 2048, 2560)}


def warm(job):
    kind, backend, opts, S = job
    t0 = time.time()
    try:
        dev = "cuda"
        if kind == "scan":
            a, b = br.scan_inputs(S["scan_B"], 256, S["scan_D"], dev)
            br.ours_scan(backend, opts, a, b, "fwd")()
        else:
            B, _, D = S["train"]
            args, pos, dy = br.rglru_inputs(B, 256, D, dev)
            br.ours_rglru(backend, opts, args, pos, dy, "fwdbwd")()
            br.ours_rglru(backend, opts, args, pos, dy, "fwd")()
        torch.cuda.synchronize()
        return kind, br.cfg_name(backend, opts), None, time.time() - t0
    except Exception as e:                              # noqa: BLE001
        return kind, br.cfg_name(backend, opts), f"{type(e).__name__}: {e}"[:300], time.time() - t0


def child(out_file, smoke, reps):
    """Gates then timings, one JSON line each (flushed), in a fixed order."""
    from kernels import parity
    from kernels.ops import reference
    from kernels.timing import time_fn

    S = shapes(smoke)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def line(rec):
        with open(out_file, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def timed(fn):
        fn()
        rec = {"eager": time_fn(fn, reps=reps, warmup=3)}
        if dev == "cuda":
            rec["graph"] = time_fn(br.graphed(fn), reps=reps, warmup=3)
        return rec

    bw = br.copy_bandwidth(1 << 30 if not smoke else 1 << 16, dev)
    line({"copy": bw})
    # RG-LRU first: its gates cover the new backward
    B, T, D = S["train"]
    args, pos, dy = br.rglru_inputs(B, T, D, dev, seed=3)
    h0 = torch.randn(B, D, device=dev)
    leaves = [a.detach().clone().requires_grad_() for a in args]
    wy, wh = reference.rglru(*leaves, pos, h0, True)
    wgrad = torch.autograd.grad(wy, leaves, dy)
    import kernels
    for backend, opts in RGLRU:
        name = br.cfg_name(backend, opts)
        line({"op": "rglru", "variant": name, "started": True})
        fn = kernels.backends("rglru")[backend]
        lv = [a.detach().clone().requires_grad_() for a in args]
        y, h = fn(*lv, pos, h0, True, **opts)
        grads = torch.autograd.grad(y, lv, dy)
        if dev == "cuda":
            torch.cuda.synchronize()
        gate = {"error_output": parity.rel_err(y, wy), "error_final_state": parity.rel_err(h, wh),
                "error_grads": [parity.rel_err(g, w) for g, w in zip(grads, wgrad)]}
        line({"op": "rglru", "variant": name, "opts": opts, "gate": gate})
        rec = {"op": "rglru", "variant": name, "opts": opts,
               "fwd": timed(br.ours_rglru(backend, opts, args, pos, dy, "fwd")),
               "fwdbwd": timed(br.ours_rglru(backend, opts, args, pos, dy, "fwdbwd"))}
        line(rec)
    Bs, Ds = S["scan_B"], S["scan_D"]
    for T in S["scan_T"]:
        a, b = br.scan_inputs(Bs, T, Ds, dev, seed=13)
        want = reference.scan(a, b, None, None, True)
        floor = 3 * a.numel() * 2 / bw["bytes_per_s"] * 1e3
        for backend, opts in SCAN:
            name = br.cfg_name(backend, opts)
            line({"op": "scan", "T": T, "variant": name, "started": True})
            with torch.no_grad():
                y, h = kernels.backends("scan")[backend](a, b, None, None, True, **opts)
            gate = {"error_output": parity.rel_err(y, want[0]), "error_final_state": parity.rel_err(h, want[1])}
            rec = {"op": "scan", "T": T, "variant": name, "opts": opts, "gate": gate, "floor_ms": floor,
                   "fwd": timed(br.ours_scan(backend, opts, a, b, "fwd"))}
            line(rec)


def table(lines):
    out = []
    copy = next((r["copy"] for r in lines if "copy" in r), None)
    if copy:
        out.append(f"copy {copy['bytes_per_s'] / 1e12:.3f} TB/s")
    for r in lines:
        if r.get("started") or "copy" in r:
            continue
        if "gate" in r and "fwd" not in r:
            g = r["gate"]
            out.append(f"gate {r['op']} {r['variant']}: y {g['error_output']:.2e} h {g['error_final_state']:.2e} "
                       f"grads {max(g['error_grads']):.2e}")
        elif r["op"] == "rglru":
            f, fb = r["fwd"], r["fwdbwd"]
            out.append(f"rglru {r['variant']:100s} fwd graph {f.get('graph', f['eager'])['median_ms']:.4f} "
                       f"fwd+bwd graph {fb.get('graph', fb['eager'])['median_ms']:.4f} "
                       f"eager {fb['eager']['median_ms']:.4f} ms")
        else:
            t = r["fwd"].get("graph", r["fwd"]["eager"])["median_ms"]
            out.append(f"scan T={r['T']:5d} {r['variant']:90s} {t:.4f} ms ({100 * r['floor_ms'] / t:.0f}% of floor) "
                       f"err {r['gate']['error_output']:.1e}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--stall", type=float, default=90.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    if args.child:
        child(args.child, smoke, 2 if smoke else args.reps)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from common import facts
    meta = {"gpu": facts.gpu(), "versions": facts.versions(),
            "commit": os.environ.get("KERNELS_COMMIT") or facts.commit()["sha"], "shapes": shapes(smoke),
            "timing": "kernels.timing.time_fn (CUDA events); graph = replay of a one-call CUDA graph"}
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    print(json.dumps({k: meta[k] for k in ("gpu", "commit")}, default=str), flush=True)
    t0 = time.time()
    if torch.cuda.is_available():
        S = shapes(smoke)
        jobs = [("rglru", b, o, S) for b, o in RGLRU] + [("scan", b, o, S) for b, o in SCAN]
        with mp.get_context("spawn").Pool(min(12, len(jobs))) as pool:
            for kind, name, err, sec in pool.imap_unordered(warm, jobs):
                if err:
                    print(f"warm-up failed {kind} {name}: {err}", flush=True)
        print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    res = out / "records.jsonl"
    res.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--out", str(out), "--child", str(res)]
                            + (["--smoke"] if smoke else []) + ["--reps", str(args.reps)], cwd=ROOT)
    rc = None
    while rc is None:
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            last = res.stat().st_mtime if res.exists() else t0
            if time.time() - last > args.stall and not smoke:
                proc.kill()
                rc = f"killed: no progress for {args.stall} s"
    lines = [json.loads(x) for x in res.read_text().splitlines()] if res.exists() else []
    text = table(lines) + f"\nchild exit: {rc}"
    if rc != 0:
        started = [r for r in lines if r.get("started")]
        text += f"; last started: {started[-1] if started else None}"
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
