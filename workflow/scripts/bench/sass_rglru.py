"""Static instruction mix of the RG-LRU kernels for sm_90, on a machine without a GPU.

Triton compiles to PTX and ptxas (shipped in Triton's wheel) assembles it for sm_90;
cuobjdump lists the SASS. For each kernel variant this prints the instruction count
divided by the elements one thread handles per tile (a static count: the loop body
once), the shuffles (SHFL), shared-memory traffic (LDS/STS) and barriers (BAR) that
Triton's associative scan along the tile's time axis costs, the special-function
instructions (MUFU) of the gates, and local-memory spills (LDL/STL). No device time.

    python workflow/scripts/bench/sass_rglru.py [--vec] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.ops.rglru_triton import chunk, fused_recurrent  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)
P, F, I64 = "*bf16", "*fp32", "*i64"
KEYS = ("SHFL", "LDS", "STS", "BAR", "MUFU", "FFMA", "FMUL", "FADD", "LDG", "STG", "LDL", "STL")


def compile_sm90(fn, args, num_warps):
    """args: parameter -> '*dtype' (pointer, 16-byte aligned), 'i32' / 'i32:16' (an int,
    ':16' when divisible by 16 as Triton specialises it) or a constexpr value."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        v = args[name]
        if isinstance(v, str) and v[:1] in ("*", "i"):
            ty, _, div = v.partition(":")
            sig[name] = ty
            if ty.startswith("*") or div:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name], consts[name] = "constexpr", v
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": 1})


def cuobjdump(kernel, flag="-sass") -> str:
    """cuobjdump's listing of a compiled kernel's cubin (-sass, -res-usage, ...)."""
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(BIN / "cuobjdump"), flag, str(cubin)], capture_output=True, text=True,
                              check=True).stdout


def mix(kernel) -> collections.Counter:
    ops = collections.Counter()
    for line in cuobjdump(kernel).splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def variants():
    base = dict(T="i32", D="i32:16", ACC=tl.float32, RNE=False, HAS_RESET=True, FAST=False)
    sf = dict(x=P, gx=P, ga=P, ap=F, pos=I64, h0=F, y=P, ht=F, hs=F, HAS_H0=False, STORE_HT=False, STAGES=1)
    sb = dict(x=P, gx=P, ga=P, ap=F, pos=I64, hs=F, dy=P, dht=F, dx=P, dgx=P, dga=P, dh0=F, dsp_part=F,
              HAS_DHT=False, STORE_DH0=False, STAGES=1)
    cf = dict(x=P, gx=P, ga=P, ap=F, pos=I64, S=F, y=P, P=F, Q=F, NC="i32")
    cb = dict(x=P, gx=P, ga=P, ap=F, pos=I64, S=F, R=F, dy=P, dx=P, dgx=P, dga=P, dsp_part=F, NC="i32")
    for bt, bd, nw in ((64, 16, 4), (64, 32, 4), (128, 32, 4)):
        yield (f"serial fwd  rglru bt{bt} bd{bd} w{nw}", fused_recurrent.serial_fwd_kernel,
               {**base, **sf, "IS_SCAN": False, "SAVE": True, "BT": bt, "BD": bd, "PREFETCH": True}, nw, bt * bd)
        yield (f"serial bwd  rglru bt{bt} bd{bd} w{nw}", fused_recurrent.serial_bwd_kernel,
               {**base, **sb, "IS_SCAN": False, "BT": bt, "BD": bd, "PREFETCH": True}, nw, bt * bd)
    yield ("serial fwd  scan  bt128 bd32 w4", fused_recurrent.serial_fwd_kernel,
           {**base, **sf, "HAS_RESET": False, "IS_SCAN": True, "SAVE": False, "BT": 128, "BD": 32, "PREFETCH": True},
           4, 128 * 32)
    for K, bd, nw in ((32, 64, 8), (64, 64, 4), (16, 256, 8), (8, 256, 4)):
        for name, fn, extra in (("chunk fwd summary", chunk.chunk_fwd_summary_kernel, cf),
                                ("chunk fwd replay ", chunk.chunk_fwd_replay_kernel, cf),
                                ("chunk bwd replay ", chunk.chunk_bwd_replay_kernel, cb)):
            args = {**base, **extra, "IS_SCAN": False, "K": K, "BD": bd}
            yield f"{name} K{K} bd{bd} w{nw}", fn, {n: args[n] for n in fn.arg_names}, nw, K * bd
    for K, bd, nw in ((16, 256, 2), (16, 512, 4), (32, 256, 2), (8, 256, 2)):
        for name, fn, extra in (("loop fwd summary ", chunk.chunk_loop_fwd_kernel, {**cf, "REPLAY": False}),
                                ("loop fwd replay  ", chunk.chunk_loop_fwd_kernel, {**cf, "REPLAY": True}),
                                ("loop bwd summary ", chunk.chunk_loop_bwd_summary_kernel, cb | {"P": F, "Q": F}),
                                ("loop bwd replay  ", chunk.chunk_loop_bwd_replay_kernel, cb)):
            args = {**base, **extra, "IS_SCAN": False, "K": K, "BD": bd}
            yield f"{name} K{K} bd{bd} w{nw}", fn, {n: args[n] for n in fn.arg_names}, nw, K * bd
    for K, bd, nw in ((16, 256, 2),):
        for name, fn, extra in (("loop fwd summary ", chunk.chunk_loop_fwd_kernel, {**cf, "REPLAY": False}),
                                ("loop fwd replay  ", chunk.chunk_loop_fwd_kernel, {**cf, "REPLAY": True}),
                                ("loop bwd summary ", chunk.chunk_loop_bwd_summary_kernel, cb | {"P": F, "Q": F}),
                                ("loop bwd replay  ", chunk.chunk_loop_bwd_replay_kernel, cb)):
            args = {**base, **extra, "IS_SCAN": False, "K": K, "BD": bd, "FAST": True}
            yield f"{name}fast K{K} bd{bd} w{nw}", fn, {n: args[n] for n in fn.arg_names}, nw, K * bd
        yield ("serial fwd  rglru fast bt64 bd16 w4", fused_recurrent.serial_fwd_kernel,
               {**base, **sf, "IS_SCAN": False, "SAVE": True, "BT": 64, "BD": 16, "PREFETCH": True, "FAST": True}, 4,
               64 * 16)
        yield ("serial bwd  rglru fast bt64 bd16 w4", fused_recurrent.serial_bwd_kernel,
               {**base, **sb, "IS_SCAN": False, "BT": 64, "BD": 16, "PREFETCH": True, "FAST": True}, 4, 64 * 16)
        for name, fn, extra in (("loop fwd summary ", chunk.chunk_loop_fwd_kernel, {**cf, "REPLAY": False}),
                                ("loop fwd replay  ", chunk.chunk_loop_fwd_kernel, {**cf, "REPLAY": True})):
            args = {**base, **extra, "IS_SCAN": True, "HAS_RESET": False, "K": K, "BD": bd}
            yield f"{name}scan K{K} bd{bd} w{nw}", fn, {n: args[n] for n in fn.arg_names}, nw, K * bd


def vec_variants():
    """The serial kernels with option vec (time axis inside each thread, BD = 32 * nw * vec)."""
    base = dict(T="i32", D="i32:16", ACC=tl.float32, RNE=False, HAS_RESET=True)
    sf = dict(x=P, gx=P, ga=P, ap=F, pos=I64, h0=F, y=P, ht=F, hs=F, HAS_H0=False, STORE_HT=False, STAGES=1)
    sb = dict(x=P, gx=P, ga=P, ap=F, pos=I64, hs=F, dy=P, dht=F, dx=P, dgx=P, dga=P, dh0=F, dsp_part=F,
              HAS_DHT=False, STORE_DH0=False, STAGES=1)
    for bt, vec, nw, pf, fast in ((16, 2, 2, False, False), (8, 2, 2, False, False), (16, 2, 2, True, False),
                                  (16, 2, 2, False, True), (8, 2, 2, False, True), (8, 2, 1, False, True),
                                  (16, 2, 1, True, True)):
        bd = 32 * nw * vec
        tag = f"bt{bt} vec{vec} w{nw}{' pf' if pf else ''}{' fast' if fast else ''}"
        kw = {**base, "IS_SCAN": False, "BT": bt, "BD": bd, "PREFETCH": pf, "VEC": vec, "FAST": fast}
        yield f"serial fwd  rglru {tag}", fused_recurrent.serial_fwd_kernel, {**kw, **sf, "SAVE": True}, nw, bt * bd
        yield f"serial bwd  rglru {tag}", fused_recurrent.serial_bwd_kernel, {**kw, **sb}, nw, bt * bd
    for bt, vec, nw, pf in ((32, 2, 1, False), (32, 2, 1, True), (64, 2, 1, True), (32, 4, 1, False),
                            (16, 8, 1, False)):
        bd = 32 * nw * vec
        tag = f"bt{bt} vec{vec} w{nw}{' pf' if pf else ''}"
        kw = {**base, "IS_SCAN": True, "HAS_RESET": False, "BT": bt, "BD": bd, "PREFETCH": pf, "VEC": vec,
              "FAST": False}
        yield f"serial fwd  scan  {tag}", fused_recurrent.serial_fwd_kernel, {**kw, **sf, "SAVE": False}, nw, bt * bd
        yield f"serial bwd  scan  {tag}", fused_recurrent.serial_bwd_kernel, {**kw, **sb}, nw, bt * bd


def main(argv=None):
    """Compile every variant for sm_90 and print its per-element instruction mix."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--vec", action="store_true", help="only the serial vec (time-in-thread) variants")
    args = ap.parse_args(argv)
    head = f"{'kernel':40s} {'instr/elem':>10s} " + " ".join(f"{k:>6s}" for k in KEYS)
    lines = [head + "   (per element per thread)"]
    for label, fn, kw, nw, elems in (vec_variants() if args.vec else variants()):
        ops = mix(compile_sm90(fn, kw, nw))
        per = elems / (32 * nw)
        lines.append(f"{label:40s} {sum(ops.values()) / per:10.1f} " + " ".join(f"{ops[k] / per:6.1f}" for k in KEYS))
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
