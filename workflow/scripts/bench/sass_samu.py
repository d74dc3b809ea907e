"""Static instruction mix of the SAMU kernels for sm_90, on a machine without a GPU.

Same method as sass_rglru.py (Triton -> PTX -> ptxas for sm_90 -> cuobjdump): for each
kernel the SASS instruction count of the whole kernel divided by the elements one
thread handles in one loop trip (a static count: each loop body once), plus the
instruction classes that matter (shuffles, shared memory, barriers, MUFU, global
loads/stores, FP64, spills). No device time.

    python workflow/scripts/bench/sass_samu.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.pop("TRITON_INTERPRET", None)

import triton.language as tl  # noqa: E402

from kernels.ops.samu_triton import chunk, common  # noqa: E402
from sass_rglru import compile_sm90, mix  # noqa: E402

P, F, I64 = "*bf16", "*fp32", "*i64"
KEYS = ("SHFL", "LDS", "STS", "BAR", "MUFU", "FFMA", "FMUL", "DFMA", "DMUL", "LDG", "STG", "LDL", "STL")


def variants():
    """(label, kernel, args, num_warps, elements per loop trip of the whole program)."""
    A = tl.float32
    for K, U, BM, nw in ((16, 8, 32, 1), (16, 8, 128, 1), (16, 8, 128, 4)):
        s = dict(x=P, ctrl=F, modes=F, P=F, Q=F, T="i32", N="i32", D="i32:16", M="i32:16", K=K, U=U, BM=BM, ACC=A)
        yield f"chunk summary K{K} U{U} bm{BM} w{nw}", chunk._summary_kernel, s, nw, U * BM
        for filled in (False, True):
            r = dict(s, carry=F, y=P, states=F, NG="i32", GS=32, V=4, STORE_STATES=False, FILLED=filled)
            yield f"chunk replay  K{K} U{U} bm{BM} w{nw}{' fill' if filled else ''}", chunk._replay_kernel, \
                {n: r[n] for n in chunk._replay_kernel.arg_names}, nw, U * BM
    for K, U, BM, nw in ((16, 4, 32, 1), (16, 4, 128, 1), (16, 4, 128, 2)):
        bs = dict(x=P, dy=P, ctrl=F, modes=F, states=F, P=F, Qb=F, T="i32", N="i32", D="i32:16", M="i32:16",
                  K=K, U=8, BM=BM, ACC=A)
        yield f"chunk bwd summary K{K} bm{BM} w{nw}", chunk._bwd_summary_kernel, bs, nw, 8 * BM
        for filled in (False, True):
            bw = dict(bs, carry=F, dxw=F, dpart=F, ppart=F, ckpt=F, NG="i32", NMB="i32", U=U, GS=32, V=4,
                      FILLED=filled)
            yield f"chunk bwd (adjoint) K{K} U{U} bm{BM} w{nw}{' fill' if filled else ''}", chunk._bwd_kernel, \
                {n: bw[n] for n in chunk._bwd_kernel.arg_names}, nw, U * BM
    for conj in (False, True):
        fk = dict(A=F, Bv=F, carry=F, S=F, N="i32", NG="i32", M="i32:16", GS=32, V=4, BM=chunk.PREFIX_BM,
                  CONJ=conj, REVERSE=conj)
        yield f"prefix fill{' reverse conj' if conj else ''}", chunk._fill_kernel, fk, 4, 4 * chunk.PREFIX_BM
    c = dict(x=P, pd=F, rd=F, pa=F, ra=F, seg=I64, ctrl=F, aux=F, NTOK="i32", D="i32:16", scale=1.0 / 32,
             HAS_SEG=False, ACC=A)
    for bt, bd, nw in ((16, 256, 4), (64, 128, 4)):
        yield f"controls fwd bt{bt} bd{bd} w{nw}", common._controls_fwd_kernel, \
            dict(c, BLOCK_T=bt, BLOCK_D=bd), nw, bt * bd
    cb = dict(dxw=F, x=P, aux=F, dpart=F, pd=F, rd=F, pa=F, ra=F, dx=P, colpart=F, scalpart=F, NTOK="i32",
              D="i32:16", NMB="i32", scale=1.0 / 32, BLOCK_T=32, BLOCK_D=128, NMBP=64, ACC=A)
    yield "controls bwd bt32 bd128 w8", common._controls_bwd_kernel, cb, 8, 32 * 128
    for K in (16, 32):
        f = dict(x=P, pd=F, rd=F, pa=F, ra=F, seg=I64, ctrl=F, aux=F, modes=F, P=F, Q=F, T="i32", N="i32",
                 D="i32:16", M="i32:16", scale=1.0 / 32, HAS_SEG=True, K=K, U=8, BM=chunk.FUSED_BM,
                 BLOCK_D=4096 // K, ACC=A)
        # elements per trip: the mode loop's U steps x BM modes (the controller loop adds K x BLOCK_D)
        yield f"summary+ctrl K{K} bm{chunk.FUSED_BM} w{chunk.FUSED_WARPS}", chunk._summary_ctrl_kernel, f, \
            chunk.FUSED_WARPS, 8 * chunk.FUSED_BM


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    head = f"{'kernel':40s} {'instr/elem':>10s} " + " ".join(f"{k:>6s}" for k in KEYS)
    lines = [head + "   (per element per thread)"]
    print(lines[0], flush=True)
    for label, fn, kw, nw, elems in variants():
        ops = mix(compile_sm90(fn, kw, nw))
        per = elems / (32 * nw)
        lines.append(f"{label:40s} {sum(ops.values()) / per:10.1f} " + " ".join(f"{ops[k] / per:6.1f}" for k in KEYS))
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
