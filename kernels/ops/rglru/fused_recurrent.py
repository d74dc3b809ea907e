"""Serial, state-stationary RG-LRU and affine scan: one program owns BD channels of one
sequence and walks time in tiles, carrying the FP32 state in registers.

time_warps W > 1 (the default) splits each tile's time axis across W warps (split.py);
W = 1 runs the tile kernels below (also the default for an RG-LRU forward without
gradient: faster there on the H200). Tile kernels: per tile, load [BT, BD] inputs, form
a_t, b_t in registers, one associative scan, store y, carry the last row; the state
entering every tile ([B, NT, D] FP32) is all that is kept for backward, which walks the
tiles in reverse, recomputes their states and runs the adjoint (common.py). The a_param
gradient is a per-program partial [B, D] reduced in a fixed order.

Options: chunk_size (steps per warp segment with W > 1, default 8; the tile with W = 1,
default 64 for the RG-LRU, 128 for the scan), time_warps, block_d (W = 1 only) and
num_stages (pipelined loads; 1 prefetches the next tile into registers).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import accounting
from . import split
from ..triton_utils import INTERPRET, acc_dtype, cdiv, check_chunk_size, check_pow2, empty, out, tl_acc
from .common import (act_bytes, affine, blocks_for, coeffs, last_row, load_raw, program_end, program_start, tile_grads,
                     tile_offsets, tile_states)


@triton.jit(do_not_specialize=["T"])
def serial_fwd_kernel(
    x, gx, ga, ap, pos, h0, y, ht, hs, T, D,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    SAVE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    ACC: tl.constexpr, RNE: tl.constexpr, VEC: tl.constexpr = 0,
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
        valid, keep, a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, p, t0, T, rows, sp, IS_SCAN, ACC)
        # [BT, BD]
        A, Bs = tl.associative_scan((a, b), 0, affine)
        hh = A * h[None, :] + Bs
        tl.store(y + off, out(hh, y, RNE), mask=m)
        h = last_row(hh, rows, BT)
        if PREFETCH:
            r0, r1, r2, p = n0, n1, n2, n_p
    program_end(ht, ht, i_b, D, o_d, m_d, h, h, STORE_HT, False)


@triton.jit(do_not_specialize=["T"])
def serial_bwd_kernel(
    x, gx, ga, ap, pos, hs, dy, dht, dx, dgx, dga, dh0, dsp_part, T, D,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, VEC: tl.constexpr = 0,
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
        valid, keep, a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, p, t0, T, rows, sp, IS_SCAN, ACC)
        h, hprev = tile_states(a, b, hin, IS_SCAN, ACC)
        r, dsp_t = tile_grads(dyr, dx, dgx, dga, off, m, valid, keep, a, b, xv, sx, sa, mult, u,
                              h, hprev, r, sp, rows, IS_SCAN, ACC, RNE)
        dsp += dsp_t
        if PREFETCH:
            r0, r1, r2, p, dyr, hin = n0, n1, n2, n_p, n_dy, n_hin
    program_end(dh0, dsp_part, i_b, D, o_d, m_d, r, dsp, STORE_DH0, not IS_SCAN)


# Defaults: the fastest exact configurations on an H200 (the tune stage re-selects per GPU):
# split kernels W = 4, 8 steps per warp, 3 stages (RG-LRU fwd+bwd at B=4, T=2048, D=2560)
# and W = 8, 4 stages (the bare scan at B=8, D=1024); tile kernels 64 x 16 (RG-LRU) and
# 128 x 32 (scan) with 4 warps and register prefetch.
SPLIT_DEFAULT = {"rglru": {"time_warps": 4, "num_stages": 3}, "scan": {"time_warps": 8, "num_stages": 4}}
OPTIONS = ("chunk_size", "time_warps", "block_d", "num_stages")


def config(B, T, D, is_scan, chunk_size=None, time_warps=None, block_d=None, num_stages=None, grad=True,
           **unknown):
    if unknown:
        raise ValueError(f"expected serial options among {list(OPTIONS)}, got {sorted(unknown)}")
    stages_set = num_stages is not None
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    if time_warps is None:
        tile = block_d is not None or (not is_scan and not grad)
        time_warps = 1 if tile else SPLIT_DEFAULT["scan" if is_scan else "rglru"]["time_warps"]
        if not tile and num_stages is None:
            num_stages = SPLIT_DEFAULT["scan" if is_scan else "rglru"]["num_stages"]
    tw = check_pow2("time_warps", time_warps, 1, 16)
    ns = 1 if num_stages is None else num_stages
    if not isinstance(ns, int) or isinstance(ns, bool) or not 1 <= ns <= 4:
        raise ValueError(f"expected num_stages to be an integer in [1, 4], got {num_stages!r}")
    if tw > 1:
        if block_d is not None:
            raise ValueError(f"expected block_d only with time_warps = 1 (the split kernels own 64 channels), "
                             f"got block_d={block_d!r} with time_warps={tw}")
        tt = 8 if chunk_size is None else chunk_size
        # WS: the forward saves the state entering every warp's segment ([B, T / TT, D]
        # FP32, at most 1/8 of an FP32 activation for TT >= 8), so the backward recomputes
        # states per warp without the cross-warp step; shorter segments save per tile.
        return {"backend": "serial", "BT": tt * tw, "TT": tt, "BD": 64, "num_warps": tw, "STAGES": ns,
                "PREFETCH": ns == 1, "WS": tt >= 8, "VEC": 2, "TW": tw, "STAGES_SET": stages_set}
    bt = (128 if is_scan else 64) if chunk_size is None else chunk_size
    bd = blocks_for(B, D, lo=32 if is_scan else 16) if block_d is None else check_pow2("block_d", block_d, 8, 1024)
    return {"backend": "serial", "BT": bt, "BD": bd, "num_warps": 4, "STAGES": ns, "PREFETCH": ns == 1, "VEC": 0,
            "TW": 1, "WS": False}


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
                             f"device's {limit} bytes of shared memory (time_warps {cfg['TW']}, chunk_size "
                             f"{cfg['TT']}, {elsize}-byte elements), got {cfg['STAGES']}; lower num_stages or chunk_size")
        stages -= 1
    if stages == cfg["STAGES"]:
        return cfg
    return {**cfg, "STAGES": stages, "PREFETCH": stages == 1}


def _launch(kernels, x, pos, is_scan, cfg, n_tiles, args, **flags):
    """Runs the split kernel (time_warps > 1) or the tile kernel of `kernels` on `args`."""
    B, T, D = x.shape
    cfg = _fit_stages(cfg, x.element_size(), n_tiles, pos is not None, smem_limit(x.device))
    kw = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, BD=cfg["BD"], STAGES=cfg["STAGES"],
              PREFETCH=cfg["PREFETCH"], ACC=tl_acc(x.dtype), RNE=INTERPRET, VEC=cfg["VEC"],
              num_warps=cfg["num_warps"], **flags)
    grid = (cdiv(D, cfg["BD"]), B)
    if cfg["TW"] > 1:
        kernels[0][grid](*args, TT=cfg["TT"], W=cfg["TW"], EVEN=split.even(T, D, cfg), WS=cfg["WS"], **kw)
    else:
        kernels[1][grid](*args, BT=cfg["BT"], **kw)


def serial_forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg):
    """Scan mode: x = b, ga = a (gx, a_param unused). Returns (y, ht, hs)."""
    B, T, D = x.shape
    acc = acc_dtype(x.dtype)
    y = empty((B, T, D), x.dtype, x.device)
    ht = empty((B, D), acc, x.device) if output_final_state else None
    hs = empty(saved_shape(cfg, B, T, D), acc, x.device) if save else None
    _launch((split.split_fwd_kernel, serial_fwd_kernel), x, pos, is_scan, cfg, 2 if is_scan else 3,
            (x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x,
             h0 if h0 is not None else x, y, ht if ht is not None else y, hs if hs is not None else y, T, D),
            HAS_H0=h0 is not None, STORE_HT=ht is not None, SAVE=save)
    if accounting.on():
        accounting.record("scan_serial_fwd" if is_scan else "rglru_serial_fwd",
                          act_bytes(is_scan, x, pos) + accounting.nbytes(h0, None if is_scan else a_param),
                          accounting.nbytes(y, ht, hs))
    return y, ht, hs


def serial_backward(x, gx, ga, a_param, pos, hs, dy, dht, need_dh0, is_scan, cfg):
    """Returns (dx, dgx, dga, dh0, dsp_part); scan mode: dx = db, dga = da."""
    B, T, D = x.shape
    acc = acc_dtype(x.dtype)
    dx = empty((B, T, D), x.dtype, x.device)
    dga = empty((B, T, D), ga.dtype, x.device)
    dgx = None if is_scan else empty((B, T, D), gx.dtype, x.device)
    dh0 = empty((B, D), acc, x.device) if need_dh0 else None
    part = None if is_scan else empty((B, D), acc, x.device)
    _launch((split.split_bwd_kernel, serial_bwd_kernel), x, pos, is_scan, cfg, 3 if is_scan else 4,
            (x, gx, ga, a_param if a_param is not None else x, pos if pos is not None else x, hs, dy,
             dht if dht is not None else hs, dx, dgx if dgx is not None else dx, dga,
             dh0 if dh0 is not None else hs, part if part is not None else hs, T, D),
            HAS_DHT=dht is not None, STORE_DH0=need_dh0)
    if accounting.on():
        accounting.record("scan_serial_bwd" if is_scan else "rglru_serial_bwd",
                          act_bytes(is_scan, x, pos) + accounting.nbytes(hs, dy, dht, None if is_scan else a_param),
                          accounting.nbytes(dx, dgx, dga, dh0, part))
    return dx, dgx, dga, dh0, part


def saved_shape(cfg: dict, B: int, T: int, D: int) -> tuple:
    """What the forward keeps for backward: the FP32 state entering every tile (or warp
    segment, WS) [B, NT, D]."""
    return (B, cdiv(T, cfg["BT"]) * (cfg["TW"] if cfg["WS"] else 1), D)
