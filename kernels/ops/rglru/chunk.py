"""Exact two-level chunked RG-LRU and affine scan (chunk sizes K = 8, 16, 32, 64).

Forward, three launches: (1) summary: each (sequence, chunk, channel block) composes its
K maps into one, h_out = P h_in + Q; (2) prefix over the NC = ceil(T / K) summaries in
linear work: an associative scan inside each group of G, an outer serial prefix carrying
the state from group to group in order; it gives the state entering every chunk, S
[B, NC, D] FP32 (kept for backward), and the final state; (3) replay: every chunk scans
again from S. Backward, the same algebra on the adjoint (common.py): summaries of the
maps (a_t, a_t dy_t), a reverse prefix from dL/dh_T (its last carry is dL/dh0), a replay
storing every gradient, and the deterministic reduction of the per-chunk a_param partials.
Options: chunk_size (K), block_d, num_warps, group (G).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..accounting import account
from ..checks import check_chunk_size, state_dtype
from ..triton_utils import INTERPRET, cdiv, check_pow2, empty, empty_like, launcher, next_pow2, out, scratch, tl_acc
from .common import affine, excl_scan, load_tile, param_sp, pass_inputs, row_of, tile_grads, tile_states


@triton.jit
def chunk_start(ap, D, K: tl.constexpr, BD: tl.constexpr, IS_SCAN: tl.constexpr, ACC: tl.constexpr):
    """A (channel block, chunk, sequence) program's (i_c, i_b, channels, mask, rows, sp)."""
    i_c, i_b = tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = o_d < D
    return i_c, i_b, o_d, m_d, tl.arange(0, K), param_sp(ap, o_d, m_d, BD, IS_SCAN, ACC)


@launcher
@triton.jit(do_not_specialize=["T", "NC"])
def chunk_fwd_kernel(x, gx, ga, ap, pos, S, P, Q, T, D, NC, REPLAY: tl.constexpr, IS_SCAN: tl.constexpr,
                     HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr):
    # REPLAY False: the chunk's summary map h_out = P h_in + Q; True: y (in P) from the
    # state S entering the chunk.
    i_c, i_b, o_d, m_d, rows, sp = chunk_start(ap, D, K, BD, IS_SCAN, ACC)
    o = (i_b * NC + i_c) * D + o_d
    if REPLAY:
        hin = tl.load(S + o, mask=m_d, other=0.0)
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * K, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC)
    A, Bs = tl.associative_scan((a, b), 0, affine)
    if REPLAY:
        tl.store(P + off, out(A * hin[None, :] + Bs, P, RNE), mask=m)
    else:
        tl.store(P + o, row_of(A, rows[:, None], K - 1), mask=m_d)
        tl.store(Q + o, row_of(Bs, rows[:, None], K - 1), mask=m_d)


@launcher
@triton.jit(do_not_specialize=["NC"])
def chunk_prefix_kernel(P, Q, h0, S, hN, NC, D, REVERSE: tl.constexpr, HAS_H0: tl.constexpr, STORE_HN: tl.constexpr,
                        G: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    # One program per (sequence, channel block); REVERSE runs the adjoint's prefix from
    # the last chunk to the first.
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, G)
    carry = tl.load(h0 + i_b * D + o_d, mask=m_d, other=0.0).to(ACC) if HAS_H0 else tl.zeros([BD], ACC)
    NG = tl.cdiv(NC, G)
    for j in range(0, NG):
        c = (NG - 1 - j if REVERSE else j) * G + rows
        m_c = c < NC
        off = (i_b * NC + c[:, None]) * D + o_d[None, :]
        m = m_c[:, None] & m_d[None, :]
        # [G, BD]; chunks past NC are identity maps
        p = tl.load(P + off, mask=m, other=1.0)
        q = tl.load(Q + off, mask=m, other=0.0)
        p = tl.where(m_c[:, None], p, 1.0)
        q = tl.where(m_c[:, None], q, 0.0)
        ea, eb, ia, ib = excl_scan(p, q, ACC, REVERSE)
        tl.store(S + off, ea * carry[None, :] + eb, mask=m)
        carry = row_of(ia * carry[None, :] + ib, rows[:, None], 0 if REVERSE else G - 1)
    if STORE_HN:
        tl.store(hN + i_b * D + o_d, carry, mask=m_d)


@launcher
@triton.jit(do_not_specialize=["T", "NC"])
def chunk_bwd_summary_kernel(ga, ap, pos, dy, P, Q, T, D, NC, IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr,
                             K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr):
    # The chunk's adjoint map mu_first = P r + Q over (a_t, a_t dy_t), reverse order; a_t
    # formed alone, as load_tile forms it.
    i_c, i_b, o_d, m_d, rows, sp = chunk_start(ap, D, K, BD, IS_SCAN, ACC)
    t = i_c * K + rows
    m_t = t < T
    off = (i_b * T + t[:, None]) * D + o_d[None, :]
    m = m_t[:, None] & m_d[None, :]
    if IS_SCAN:
        a = tl.load(ga + off, mask=m, other=1.0).to(ACC)
    else:
        a = tl.exp(-8.0 * tl.sigmoid(tl.load(ga + off, mask=m, other=0.0).to(ACC)) * sp[None, :])
    if HAS_RESET:
        a = tl.where((tl.load(pos + i_b * T + t, mask=m_t, other=1) != 0)[:, None], a, 0.0)
    a = tl.where(m_t[:, None], a, 1.0)
    dyv = tl.load(dy + off, mask=m, other=0.0).to(ACC)
    A, Bs = tl.associative_scan((a, a * dyv), 0, affine, reverse=True)
    o = (i_b * NC + i_c) * D + o_d
    tl.store(P + o, row_of(A, rows[:, None], 0), mask=m_d)
    tl.store(Q + o, row_of(Bs, rows[:, None], 0), mask=m_d)


@launcher
@triton.jit(do_not_specialize=["T", "NC"])
def chunk_bwd_replay_kernel(x, gx, ga, ap, pos, S, R, dy, dx, dgx, dga, dsp_part, T, D, NC, IS_SCAN: tl.constexpr,
                            HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                            RNE: tl.constexpr):
    i_c, i_b, o_d, m_d, rows, sp = chunk_start(ap, D, K, BD, IS_SCAN, ACC)
    o = (i_b * NC + i_c) * D + o_d
    hin = tl.load(S + o, mask=m_d, other=0.0)
    r = tl.load(R + o, mask=m_d, other=0.0)
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * K, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC)
    h = tile_states(a, b, hin, IS_SCAN, ACC)
    r0, dsp = tile_grads(tl.load(dy + off, mask=m, other=0.0), dx, dgx, dga, off, m, valid, keep, a, b, xv, sx,
                         sa, mult, u, h, r, sp, rows, IS_SCAN, ACC, RNE)
    if not IS_SCAN:
        tl.store(dsp_part + o, dsp, mask=m_d)


OPTIONS = ("chunk_size", "block_d", "num_warps", "group")


def config(B, T, D, is_scan, chunk_size=None, block_d=None, num_warps=None, group=None, grad=True, **unknown):
    if unknown:
        raise ValueError(f"expected chunk options among {list(OPTIONS)}, got {sorted(unknown)}")
    K = check_chunk_size(32 if chunk_size is None else chunk_size)
    NC = cdiv(T, K)
    bd = 64 if block_d is None else check_pow2("block_d", block_d, 8, 1024)
    nw = 4 if num_warps is None else check_pow2("num_warps", num_warps, 1, 16)
    return {"backend": "chunk", "K": K, "BD": min(bd, max(8, next_pow2(D))), "num_warps": nw,
            "G": max(2, min(64, next_pow2(NC))) if group is None else check_pow2("group", group, 2, 1024)}


def _prefix(P, Q, init, need_final, reverse, cfg):
    B, NC, D = P.shape
    S = empty((B, NC, D), P.dtype, P.device)
    hN = empty((B, D), P.dtype, P.device) if need_final else None
    BD = min(128, max(8, next_pow2(D)))
    chunk_prefix_kernel[(cdiv(D, BD), B)](
        P, Q, init if init is not None else P, S, hN if hN is not None else S, NC, D, REVERSE=reverse,
        HAS_H0=init is not None, STORE_HN=need_final, G=cfg["G"], BD=BD, ACC=tl_acc(P.dtype), num_warps=4)
    account("chunk_prefix_bwd" if reverse else "chunk_prefix_fwd", (P, Q, init), (S, hN))
    return S, hN


def _setup(x, a_param, pos, is_scan, cfg):
    """(B, T, D, NC, grid, a_param or a dummy, pos or a dummy, constexprs) of a pass."""
    B, T, D = x.shape
    NC = cdiv(T, cfg["K"])
    kw = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, K=cfg["K"], BD=cfg["BD"], ACC=tl_acc(x.dtype),
              RNE=INTERPRET, num_warps=cfg["num_warps"])
    return (B, T, D, NC, (cdiv(D, cfg["BD"]), NC, B), a_param if a_param is not None else x,
            pos if pos is not None else x, kw)


def forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg):
    """Summary, prefix, replay (S is kept whatever `save`). Scan: x = b, ga = a.
    Returns (y, ht, S)."""
    B, T, D, NC, grid, ap, p, kw = _setup(x, a_param, pos, is_scan, cfg)
    ins = pass_inputs(is_scan, x, gx, ga, a_param, pos)
    P, Q = scratch(state_dtype(x.dtype), x.device, (B, NC, D), (B, NC, D))
    chunk_fwd_kernel[grid](x, gx, ga, ap, p, P, P, Q, T, D, NC, REPLAY=False, **kw)
    account("chunk_fwd_summary", ins, (P, Q))
    S, ht = _prefix(P, Q, h0, output_final_state, False, cfg)
    y = empty_like(x)
    chunk_fwd_kernel[grid](x, gx, ga, ap, p, S, y, y, T, D, NC, REPLAY=True, **kw)
    account("chunk_fwd_replay", (*ins, S), (y,))
    return y, ht, S


def backward(x, gx, ga, a_param, pos, S, dy, dht, need_dh0, is_scan, cfg):
    """Returns (dx, dgx, dga, dh0, dsp_part)."""
    B, T, D, NC, grid, ap, p, kw = _setup(x, a_param, pos, is_scan, cfg)
    acc = state_dtype(x.dtype)
    P, Q = scratch(acc, x.device, (B, NC, D), (B, NC, D))
    chunk_bwd_summary_kernel[grid](ga, ap, p, dy, P, Q, T, D, NC, **kw)
    account("chunk_bwd_summary", (ga, dy, pos, None if is_scan else a_param), (P, Q))
    R, dh0 = _prefix(P, Q, dht, need_dh0, True, cfg)
    dx = empty_like(x)
    dga = empty((B, T, D), ga.dtype, x.device)
    dgx = None if is_scan else empty((B, T, D), gx.dtype, x.device)
    part = None if is_scan else empty((B * NC, D), acc, x.device)
    chunk_bwd_replay_kernel[grid](
        x, gx, ga, ap, p, S, R, dy, dx, dgx if dgx is not None else dx, dga, part if part is not None else S,
        T, D, NC, **kw)
    account("chunk_bwd_replay", (*pass_inputs(is_scan, x, gx, ga, a_param, pos), S, R, dy), (dx, dgx, dga, part))
    return dx, dgx, dga, dh0, part


def saved_shape(cfg: dict, B: int, T: int, D: int) -> tuple:
    """What the forward keeps for backward: the state entering every chunk [B, NC, D]."""
    return (B, cdiv(T, cfg["K"]), D)
