"""Loop-body instruction mix of the split serial kernels (kernels/ops/rglru_triton/split.py)
for sm_90, on a machine without a GPU.

Triton compiles each variant to a cubin (its ptxas), cuobjdump lists the SASS and the
registers; the script finds the time loop (the longest backward branch) and counts its
instructions once: per element (loop instructions / (block_t * vec)), barriers (BAR),
shuffles (SHFL), shared-memory traffic (LDS/STS), special functions (MUFU) and local
memory (LDL/STL: spills). No device time.

    python workflow/scripts/bench/sass_split.py [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_rglru as S  # noqa: E402  (sets up the repository path and the sm_90 target)

import triton.language as tl  # noqa: E402

from kernels.ops.rglru_triton import split  # noqa: E402

ADDR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
KEYS = ("BAR", "SHFL", "LDS", "STS", "MUFU", "LDL", "STL")


def loop_mix(kernel):
    """(registers, stack bytes, instruction counter of the longest loop body)."""
    res = S.cuobjdump(kernel, "-res-usage")
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    ins = [(int(m.group(1), 16), m.group(2), line) for line in S.cuobjdump(kernel).splitlines()
           if (m := ADDR.match(line))]
    loops = []
    for addr, _, line in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", line)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return regs, stack, collections.Counter(op for addr, op, _ in ins if lo <= addr <= hi)


def variants():
    P, F, I64 = S.P, S.F, S.I64
    base = dict(T="i32", D="i32:16", ACC=tl.float32, RNE=False, FAST=True, EVEN=True)
    fwd = dict(x=P, gx=P, ga=P, ap=F, pos=I64, h0=F, y=P, ht=F, hs=F, HAS_H0=False, STORE_HT=False)
    bwd = dict(x=P, gx=P, ga=P, ap=F, pos=I64, hs=F, dy=P, dht=F, dx=P, dgx=P, dga=P, dh0=F, dsp_part=F,
               HAS_DHT=False, STORE_DH0=False)
    for scan, W, TT, st, vec in ((True, 8, 8, 4, 2), (True, 4, 16, 4, 2), (False, 4, 8, 3, 2), (True, 4, 8, 1, 1),
                                 (True, 8, 8, 1, 1), (False, 4, 8, 1, 1)):
        kw = {**base, **fwd, "IS_SCAN": scan, "HAS_RESET": not scan, "SAVE": not scan, "TT": TT, "W": W,
              "BD": 32 * vec, "PREFETCH": st == 1, "STAGES": st, "VEC": vec, "WS": TT >= 8, "MO": 2 if vec == 1 else 1}
        yield (f"fwd {'scan ' if scan else 'rglru'} W{W} TT{TT} vec{vec} stages{st}", split.split_fwd_kernel, kw, W,
               TT * vec)
    for W, TT, st, pf, ws, vec in ((4, 8, 3, False, True, 2), (4, 8, 1, True, True, 2), (4, 8, 3, False, False, 2),
                                   (4, 8, 1, True, True, 1)):
        kw = {**base, **bwd, "IS_SCAN": False, "HAS_RESET": True, "TT": TT, "W": W, "BD": 32 * vec, "PREFETCH": pf,
              "STAGES": st, "VEC": vec, "WS": ws, "MO": 2 if vec == 1 else 1}
        tag = f"bwd rglru W{W} TT{TT} vec{vec} stages{st}{' prefetch' if pf else ''}{' segment-states' if ws else ''}"
        yield tag, split.split_bwd_kernel, kw, W, TT * vec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    lines = [f"{'kernel (fast_math, EVEN)':48s} {'regs':>4s} {'stack':>5s} {'loop':>5s} {'/elem':>6s} "
             + " ".join(f"{k:>5s}" for k in KEYS) + "   (loop body, per tile per thread)"]
    for label, fn, kw, nw, per in variants():
        regs, stack, ops = loop_mix(S.compile_sm90(fn, kw, nw))
        n = sum(ops.values())
        counts = " ".join(f"{ops[k]:5d}" for k in KEYS)
        lines.append(f"{label:48s} {regs:4d} {stack:5d} {n:5d} {n / per:6.1f} {counts}")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
