"""Serial, state-stationary RG-LRU and affine scan: one program owns BD channels of one
sequence and walks time in tiles of BT steps, carrying the FP32 state in registers.

The default kernels split each tile's time axis across the program's warps (option
time_warps, split.py; on the H200 the bare scan went from 41-45% to 70-81% of the memory
floor and the RG-LRU fwd+bwd from 0.53 to 0.37 ms, 0.45 to 0.29 ms with fast_math,
results/kernels/rglru/README.md run 5). The tile kernels of this module run with
time_warps = 1, when a tile layout (vec, block_d, num_warps) is asked for, and by
default for an RG-LRU forward without gradient; what follows describes them.

Forward: per tile, load [BT, BD] inputs, form a_t and b_t in registers, one associative
scan, store y, carry the last row. The state entering every tile ([B, NT, D] FP32,
NT = ceil(T / BT), 4 / BT bytes per element) is the only thing kept for backward.
Backward walks the tiles in reverse: recompute the tile's states from the saved
entering state, run the adjoint scan (see common.py), store the gradients, and carry
mu_t = a_t lam_t to the previous tile. The a_param gradient is a per-program partial
[B, D] reduced in a fixed order.

Tile layout (option vec). vec = 0 (default, run 1's measured configuration): Triton's
coalescing gives a tile 8 BF16 per thread along D and spreads the time axis over lanes
and warps, so the tile scan costs shuffles and shared memory (181 / 327 SASS
instructions per element forward / backward, results/kernels/rglru/sass_sm90.txt).
vec in (2, 4, 8): each thread owns vec adjacent channels and their whole time column
(BD = 32 * num_warps * vec; block_d must then be left out or equal that), so the scan
along time is a serial loop in registers; the backward's reverse scan runs as flip,
forward scan, flip (register renaming). One channel per thread (vec = 1) is not
offered: with contiguity 1 Triton puts the time axis across lanes again. The price is
parallelism: B * D / vec threads in all. On an H200 (results/kernels/rglru, run 2) at
B=4, T=2048, D=2560 that is 160 warps, latency-bound: 1.7-3.4x slower than vec = 0
despite 3x fewer instructions, so vec stays opt-in (large B * D may differ; unmeasured).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import accounting
from .._checks import check_chunk_size
from . import split
from .common import (recurrence_function, INTERPRET, acc_dtype, fast, affine, blocks_for, check_pow2, coeffs, empty,
                     last_row, load_raw, out, program_start, tile_grads, tile_offsets, tile_states, tl_acc)


@triton.jit(do_not_specialize=["T"])
def serial_fwd_kernel(
    x, gx, ga, ap, pos, h0, y, ht, hs, T, D,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    SAVE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    ACC: tl.constexpr, RNE: tl.constexpr, FAST: tl.constexpr, VEC: tl.constexpr = 0,
):
    i_b, o_d, m_d, sp, h = program_start(ap, h0, D, BD, VEC, IS_SCAN, HAS_H0, ACC)
    rows = tl.arange(0, BT)
    NT = tl.cdiv(T, BT)
    if PREFETCH:
        # The next tile's loads are issued before this tile's scan, so a program keeps
        # two tiles in flight without relying on the compiler's loop pipelining.
        r0, r1, r2, p = load_raw(x, gx, ga, pos, i_b, 0, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET)
    for i_t in tl.range(0, NT, num_stages=STAGES):
        t0 = i_t * BT
        if SAVE:
            tl.store(hs + (i_b * NT + i_t) * D + o_d, h, mask=m_d)
        off, m = tile_offsets(i_b, t0, T, D, o_d, m_d, rows)
        if PREFETCH:
            n0, n1, n2, n_p = load_raw(x, gx, ga, pos, i_b, t0 + BT, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET)
        else:
            r0, r1, r2, p = load_raw(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET)
        valid, keep, a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, p, t0, T, rows, sp, IS_SCAN, ACC, FAST)
        # [BT, BD]
        A, Bs = tl.associative_scan((a, b), 0, affine)
        hh = A * h[None, :] + Bs
        tl.store(y + off, out(hh, y, RNE), mask=m)
        h = last_row(hh, rows, BT)
        if PREFETCH:
            r0, r1, r2, p = n0, n1, n2, n_p
    if STORE_HT:
        tl.store(ht + i_b * D + o_d, h, mask=m_d)


@triton.jit(do_not_specialize=["T"])
def serial_bwd_kernel(
    x, gx, ga, ap, pos, hs, dy, dht, dx, dgx, dga, dh0, dsp_part, T, D,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr, VEC: tl.constexpr = 0,
):
    i_b, o_d, m_d, sp, r = program_start(ap, dht, D, BD, VEC, IS_SCAN, HAS_DHT, ACC)
    rows = tl.arange(0, BT)
    dsp = tl.zeros([BD], ACC)
    NT = tl.cdiv(T, BT)
    if PREFETCH:
        t_last = (NT - 1) * BT
        off, m = tile_offsets(i_b, t_last, T, D, o_d, m_d, rows)
        r0, r1, r2, p = load_raw(x, gx, ga, pos, i_b, t_last, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET)
        dyr = tl.load(dy + off, mask=m, other=0.0)
        hin = tl.load(hs + (i_b * NT + NT - 1) * D + o_d, mask=m_d, other=0.0)
    for j in tl.range(0, NT, num_stages=STAGES):
        i_t = NT - 1 - j
        t0 = i_t * BT
        off, m = tile_offsets(i_b, t0, T, D, o_d, m_d, rows)
        if PREFETCH:
            offn, mn = tile_offsets(i_b, t0 - BT, T, D, o_d, m_d, rows)
            n0, n1, n2, n_p = load_raw(x, gx, ga, pos, i_b, t0 - BT, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET)
            n_dy = tl.load(dy + offn, mask=mn, other=0.0)
            n_hin = tl.load(hs + (i_b * NT + i_t - 1) * D + o_d, mask=m_d & (i_t > 0), other=0.0)
        else:
            r0, r1, r2, p = load_raw(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET)
            dyr = tl.load(dy + off, mask=m, other=0.0)
            hin = tl.load(hs + (i_b * NT + i_t) * D + o_d, mask=m_d, other=0.0)
        valid, keep, a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, p, t0, T, rows, sp, IS_SCAN, ACC, FAST)
        h, hprev = tile_states(a, b, hin, IS_SCAN, ACC)
        r, dsp_t = tile_grads(dyr, dx, dgx, dga, off, m, valid, keep, a, b, xv, sx, sa, mult, u,
                              h, hprev, r, sp, rows, IS_SCAN, ACC, RNE, FAST, VEC > 0)
        dsp += dsp_t
        if PREFETCH:
            r0, r1, r2, p, dyr, hin = n0, n1, n2, n_p, n_dy, n_hin
    if STORE_DH0:
        tl.store(dh0 + i_b * D + o_d, r, mask=m_d)
    if not IS_SCAN:
        tl.store(dsp_part + i_b * D + o_d, dsp, mask=m_d)


# Defaults of the split kernels: the fastest exact configurations of the sweep on an H200
# (results/kernels/rglru/run5_split): the RG-LRU at B=4, T=2048, D=2560 (fwd+bwd) and the
# bare scan at B=8, D=1024, T=2048..16384; block_t 8 and vec 2 for both.
SPLIT_DEFAULT = {"rglru": {"time_warps": 4, "num_stages": 3}, "scan": {"time_warps": 8, "num_stages": 4}}


def _config(B, T, D, is_scan, block_t=None, block_d=None, num_warps=None, num_stages=None, prefetch=None,
            fast_math=None, chunk_size=None, vec=None, time_warps=None, grad=True, **unknown):
    # Default: the split kernels (SPLIT_DEFAULT). With time_warps = 1 or a tile layout
    # asked for (vec, block_d or num_warps): the tile kernels, whose defaults were the
    # fastest of the probe sweep on an H200 (results/kernels/rglru, run 1): RG-LRU
    # fwd+bwd at B=4, T=2048, D=2560 -> 16 channels x 64 steps, 4 warps, prefetch; the
    # bare scan at B=8, D=1024 -> 32 channels x 128 steps, 4 warps, prefetch.
    if unknown:
        raise ValueError(f"expected serial options among ['block_t', 'chunk_size', 'block_d', 'num_warps', "
                         f"'num_stages', 'prefetch', 'fast_math', 'vec', 'time_warps'], got {sorted(unknown)}")
    if chunk_size is not None:
        check_chunk_size(chunk_size)
        if block_t is not None and block_t != chunk_size:
            raise ValueError(f"expected one of block_t and chunk_size (the serial time tile), got {block_t} and "
                             f"{chunk_size}")
        block_t = chunk_size
    stages_set = num_stages is not None
    if time_warps is None:
        # The split kernels (time_warps > 1) unless a tile layout of the others is asked for.
        # The RG-LRU forward alone (no gradient) defaults to the tile kernels: with exact
        # gate math they ran it faster (run5_split: 0.117 against 0.154-0.166 ms).
        legacy = vec is not None or block_d is not None or num_warps is not None or (not is_scan and not grad)
        time_warps = 1 if legacy else SPLIT_DEFAULT["scan" if is_scan else "rglru"]["time_warps"]
        if not legacy and num_stages is None and prefetch is None:
            num_stages = SPLIT_DEFAULT["scan" if is_scan else "rglru"]["num_stages"]
    tw = check_pow2("time_warps", time_warps, 1, 16)
    if tw > 1:
        return _split_config(tw, block_t, block_d, num_warps, num_stages, prefetch, fast_math, vec, stages_set)
    v = 0 if vec is None else vec
    if not isinstance(v, int) or isinstance(v, bool) or v not in (0, 2, 4, 8):
        raise ValueError(f"expected vec in [0, 2, 4, 8] (channels per thread, time inside each thread; 0: "
                         f"Triton's tile layout), got {vec!r}")
    nw = (4 if not v else 2) if num_warps is None else check_pow2("num_warps", num_warps, 1, 16)
    if v:
        bt = check_pow2("block_t", 16 if block_t is None else block_t, 8, 256)
        bd = 32 * nw * v
        if block_d is not None and block_d != bd:
            raise ValueError(f"expected block_d to be None or 32 * num_warps * vec = {bd} when vec > 0, "
                             f"got {block_d!r}")
    else:
        bt = check_pow2("block_t", (128 if is_scan else 64) if block_t is None else block_t, 8, 256)
        bd = blocks_for(B, D, lo=32 if is_scan else 16) if block_d is None else check_pow2("block_d", block_d, 8,
                                                                                         1024)
    ns = 1 if num_stages is None else num_stages
    if not isinstance(ns, int) or not 1 <= ns <= 4:
        raise ValueError(f"expected num_stages to be an integer in [1, 4], got {num_stages!r}")
    pf = (not v) if prefetch is None else bool(prefetch)
    return {"BT": bt, "BD": bd, "num_warps": nw, "STAGES": ns, "PREFETCH": pf, "FAST": bool(fast_math), "VEC": v,
            "TW": 1, "WS": False}


def _split_config(tw, block_t, block_d, num_warps, num_stages, prefetch, fast_math, vec, stages_set):
    # time_warps = W > 1 (split.py): W warps along time, each TT = block_t steps per tile,
    # vec channels per thread (default 2), BD = 32 * vec.
    v = 2 if vec is None else vec
    if not isinstance(v, int) or isinstance(v, bool) or v not in (1, 2, 4, 8):
        raise ValueError(f"expected vec in [1, 2, 4, 8] with time_warps > 1, got {vec!r}")
    if num_warps is not None and num_warps != tw:
        raise ValueError(f"expected num_warps to be None or time_warps = {tw} (every warp along time), "
                         f"got {num_warps!r}")
    bd = 32 * v
    if block_d is not None and block_d != bd:
        raise ValueError(f"expected block_d to be None or 32 * vec = {bd} with time_warps > 1, got {block_d!r}")
    ns = 1 if num_stages is None else num_stages
    if not isinstance(ns, int) or isinstance(ns, bool) or not 1 <= ns <= 4:
        raise ValueError(f"expected num_stages to be an integer in [1, 4], got {num_stages!r}")
    tt = check_pow2("block_t", 8 if block_t is None else block_t, 1, 64)
    pf = (ns == 1) if prefetch is None else bool(prefetch)
    # WS: the forward saves the state entering every warp's segment ([B, T / TT, D] FP32,
    # at most 1/8 of an FP32 activation for TT >= 8), so the backward recomputes states
    # per warp without the cross-warp step; shorter segments save per tile.
    return {"BT": tt * tw, "TT": tt, "BD": bd, "num_warps": tw, "STAGES": ns, "PREFETCH": pf, "WS": tt >= 8,
            "FAST": bool(fast_math), "VEC": v, "TW": tw, "STAGES_SET": stages_set, "PREFETCH_SET": prefetch is not None}


def smem_limit(device: torch.device):
    """Shared memory one program may use on a CUDA device (None elsewhere: no limit)."""
    if device.type != "cuda":
        return None
    return _smem_limit(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _smem_limit(index: int) -> int:
    # queried once per device: the launchers run on the host's critical path
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _fit_stages(cfg: dict, elsize: int, n_tiles: int, has_pos: bool, limit) -> dict:
    """The split kernels' pipelined loads hold num_stages - 1 tiles of each of the n_tiles
    inputs in shared memory. A default num_stages that would not fit `limit` bytes (FP32
    or float64 tiles) is lowered, down to register prefetch; one asked for explicitly
    that does not fit is an error."""
    if cfg["TW"] == 1 or cfg["STAGES"] == 1 or limit is None:
        return cfg
    tile = cfg["BT"] * cfg["BD"] * elsize * n_tiles + (cfg["BT"] * 8 if has_pos else 0)
    scratch = 8 * cfg["TW"] * cfg["BD"] * 4 + 4096       # the cross-warp scans and layout changes
    stages = cfg["STAGES"]
    while stages > 1 and (stages - 1) * tile + scratch > limit:
        if cfg["STAGES_SET"]:
            raise ValueError(f"expected num_stages with (num_stages - 1) x {tile} bytes of tiles within the "
                             f"device's {limit} bytes of shared memory (time_warps {cfg['TW']}, block_t "
                             f"{cfg['TT']}, {elsize}-byte elements), got {cfg['STAGES']}; lower num_stages or block_t")
        stages -= 1
    if stages == cfg["STAGES"]:
        return cfg
    return {**cfg, "STAGES": stages, "PREFETCH": cfg["PREFETCH"] if cfg["PREFETCH_SET"] else stages == 1}


def _tile_bytes(is_scan, x, pos):
    n = x.numel() * x.element_size()
    return (2 if is_scan else 3) * n + (0 if pos is None else pos.numel() * pos.element_size())


def serial_forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg):
    """Launcher. Scan mode: x = b, ga = a (gx, a_param unused). Returns (y, ht, hs)."""
    B, T, D = x.shape
    cfg = _fit_stages(cfg, x.element_size(), 2 if is_scan else 3, pos is not None, smem_limit(x.device))
    acc = acc_dtype(x.dtype)
    y = empty((B, T, D), x.dtype, x.device)
    ht = empty((B, D), acc, x.device) if output_final_state else None
    NT = triton.cdiv(T, cfg["BT"]) * (cfg["TW"] if cfg["WS"] else 1)
    hs = empty((B, NT, D), acc, x.device) if save else None
    grid = (triton.cdiv(D, cfg["BD"]), B)
    args = (x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x,
            h0 if h0 is not None else x, y, ht if ht is not None else y, hs if hs is not None else y, T, D)
    common = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, HAS_H0=h0 is not None, STORE_HT=ht is not None,
                  SAVE=save, BD=cfg["BD"], PREFETCH=cfg["PREFETCH"], ACC=tl_acc(x.dtype), RNE=INTERPRET,
                  FAST=fast(cfg, x), VEC=cfg["VEC"], num_warps=cfg["num_warps"])
    if cfg["TW"] > 1:
        split.split_fwd_kernel[grid](*args, TT=cfg["TT"], W=cfg["TW"], STAGES=cfg["STAGES"],
                                     EVEN=split.even(T, D, cfg), WS=cfg["WS"], MO=2 if cfg["VEC"] == 1 else 1,
                                     **common)
    else:
        serial_fwd_kernel[grid](*args, BT=cfg["BT"], STAGES=cfg["STAGES"], **common)
    accounting.record("scan_serial_fwd" if is_scan else "rglru_serial_fwd",
                      _tile_bytes(is_scan, x, pos) + accounting.nbytes(h0, None if is_scan else a_param),
                      accounting.nbytes(y, ht, hs))
    return y, ht, hs


def serial_backward(x, gx, ga, a_param, pos, hs, dy, dht, need_dh0, is_scan, cfg):
    """Launcher. Returns (dx, dgx, dga, dh0, dsp_part); scan mode: dx = db, dga = da."""
    B, T, D = x.shape
    cfg = _fit_stages(cfg, x.element_size(), 3 if is_scan else 4, pos is not None, smem_limit(x.device))
    acc = acc_dtype(x.dtype)
    dx = empty((B, T, D), x.dtype, x.device)
    dga = empty((B, T, D), ga.dtype, x.device)
    dgx = None if is_scan else empty((B, T, D), gx.dtype, x.device)
    dh0 = empty((B, D), acc, x.device) if need_dh0 else None
    part = None if is_scan else empty((B, D), acc, x.device)
    grid = (triton.cdiv(D, cfg["BD"]), B)
    args = (x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x, hs, dy,
            dht if dht is not None else hs, dx, dgx if dgx is not None else dx, dga,
            dh0 if dh0 is not None else hs, part if part is not None else hs, T, D)
    common = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, HAS_DHT=dht is not None, STORE_DH0=need_dh0,
                  BD=cfg["BD"], PREFETCH=cfg["PREFETCH"], ACC=tl_acc(x.dtype), RNE=INTERPRET, FAST=fast(cfg, x),
                  VEC=cfg["VEC"], num_warps=cfg["num_warps"])
    if cfg["TW"] > 1:
        split.split_bwd_kernel[grid](*args, TT=cfg["TT"], W=cfg["TW"], STAGES=cfg["STAGES"],
                                     EVEN=split.even(T, D, cfg), WS=cfg["WS"], MO=2 if cfg["VEC"] == 1 else 1,
                                     **common)
    else:
        serial_bwd_kernel[grid](*args, BT=cfg["BT"], STAGES=cfg["STAGES"], **common)
    accounting.record("scan_serial_bwd" if is_scan else "rglru_serial_bwd",
                      _tile_bytes(is_scan, x, pos) + accounting.nbytes(hs, dy, dht, None if is_scan else a_param),
                      accounting.nbytes(dx, dgx, dga, dh0, part))
    return dx, dgx, dga, dh0, part


SerialFunction = recurrence_function(
    "SerialFunction", serial_forward, serial_backward,
    "RG-LRU or the bare scan through the serial kernels (tile-boundary states kept for backward).")

def fused_recurrent_rglru(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None,
                          output_final_state=False, **opts):
    """RG-LRU from gate logits through the serial kernels; the reference signature.
    x, gate_x, gate_a: [B, T, D]; a_param: [D]; segment_pos: [B, T] int; initial_state:
    [B, D] FP32. Options: time_warps (W > 1: the split kernels of split.py, W warps
    along time, each warp block_t steps per tile, vec channels per thread (1, 2, 4, 8;
    default 2; 1 is unmeasured on a GPU), num_warps = W; default W = 4, block_t 8, num_stages 3 for the RG-LRU and
    W = 8, block_t 8, num_stages 4 for the bare scan (SPLIT_DEFAULT); 1: the tile
    kernels below, also chosen when vec, block_d or num_warps is given and, by default,
    for an RG-LRU forward that needs no gradient), chunk_size (the time tile: per warp
    with time_warps > 1; in kernels.ops.CHUNK_SIZES, as for every backend), block_t (the
    same tile, any power of two the kernels take: [1, 64] with time_warps > 1, else
    [8, 256]), block_d, num_warps, num_stages
    (software-pipelined loads), prefetch (load the next tile into registers before
    scanning this one; default on with one stage, off with vec), fast_math
    (approximate ex2/rcp/sqrt in FP32 on the GPU), vec (tile kernels: 0 is Triton's tile
    layout; 2, 4, 8: channels per thread with the time axis inside each thread, BD =
    32 * num_warps * vec, default block_t 16 and 2 warps; see the module docstring).
    Returns (y [B, T, D], final state [B, D] or None)."""
    B, T, D = x.shape
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, gate_x, gate_a, a_param, initial_state))
    cfg = _config(B, T, D, False, grad=grad, **opts)
    if T == 0:
        return _empty_sequence(x, initial_state, output_final_state)
    return SerialFunction.apply(x, gate_x, gate_a, a_param, segment_pos, initial_state, output_final_state,
                                False, cfg)


def fused_recurrent_scan(a, b, segment_pos=None, initial_state=None, output_final_state=False, **opts):
    """h_t = a_t h_{t-1} + b_t (a_t = 0 at resets) through the serial kernels, real
    inputs; complex inputs go to the PyTorch reference. Options as fused_recurrent_rglru
    (time_warps and vec included)."""
    if b.is_complex():
        from .. import reference

        return reference.scan(a, b, segment_pos, initial_state, output_final_state)
    B, T, D = b.shape
    cfg = _config(B, T, D, True, **opts)
    if T == 0:
        return _empty_sequence(b, initial_state, output_final_state)
    a = a.to(b.dtype) if a.dtype != b.dtype else a
    return SerialFunction.apply(b, b, a, None, segment_pos, initial_state, output_final_state, True, cfg)


def _empty_sequence(x, h0, output_final_state):
    B, _, D = x.shape
    h = None
    if output_final_state:
        h = h0 if h0 is not None else torch.zeros(B, D, dtype=acc_dtype(x.dtype), device=x.device)
    return x.new_zeros(B, 0, D), h
