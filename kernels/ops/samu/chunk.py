"""Exact two-level chunked SAMU (chunk_size K in 8, 16, 32, 64). Forward over chunks of K tokens (a partial last
chunk's missing steps are identity):
1. summary per (chunk, mode block): h_out = P_c h_in + Q_c (P_c = prod a_t, Q_c the state from zero);
2. prefix over the N summaries in groups of GS ~ sqrt(N) chunks, two launches: each group composed into one map;
   then every group walked again from its incoming state (its program composes the maps of the ~sqrt(N) groups
   before it) writing the state entering each chunk (kept for the backward);
3. replay per (chunk, mode block) from its entering state, writing y = relu(h).
Backward: the same on the adjoint, R_{c-1} = conj(P_c) R_c + Qbar_c, right to left, then each chunk's adjoint
replay. Resets are a_t = 0 inside the summaries, so they cut every prefix exactly.
"""

from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from ..accounting import account
from ..triton_utils import cdiv, launcher, replayed, scratch
from .common import (alloc, bwd_chunk, fwd_steps, load_pair, load_state, mode_block, next_pow2,
                     step_in, store_pair, store_param_partials, tl_dtype)
from .fused_recurrent import BM, BWD_UNROLL, FWD_UNROLL, serial_backward, serial_forward

PREFIX_BM = 128
PREFIX_UNROLL = 4


@launcher
@triton.jit(do_not_specialize=["N", "NG", "M"])
def _group_kernel(A, Bv, init, S, AG, BG, final, N, NG, M, GS: tl.constexpr, V: tl.constexpr, BM: tl.constexpr,
                  REVERSE: tl.constexpr, FILL: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr):
    """Walks group g's GS chunk maps in order (REVERSE: the adjoint's conjugate maps, right to left). FILL False:
    composes them into one map (AG, BG [B, NG, M, 2]); True: from the state entering the group (init composed with the
    maps of the groups walked before it, a short serial prefix each program repeats instead of a launch of its own)
    writes the state entering every chunk to S [B, N, M, 2], and the last group the final state."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m, g, b = offs_m < M, tl.program_id(1), tl.program_id(2).to(tl.int64)
    w = NG - 1 - g if REVERSE else g        # the group's place in the walk
    if FILL:
        sr, si = load_state(init, b * M + offs_m, mask_m, HAS_INIT, BM, ACC)
        for j0 in range(0, w, V):
            for v in tl.static_range(V):
                j = j0 + v
                gg = NG - 1 - j if REVERSE else j
                lm = mask_m & (j < w)
                gidx = (b * NG + gg) * M + offs_m
                ar, ai = load_pair(AG, gidx, lm, 1.0, 0.0)
                br, bi = load_pair(BG, gidx, lm, 0.0, 0.0)
                sr, si = ar * sr - ai * si + br, ar * si + ai * sr + bi
    else:
        sr, si = tl.zeros([BM], ACC), tl.zeros([BM], ACC)
        pr, pi = tl.full([BM], 1.0, ACC), tl.zeros([BM], ACC)
    for j0 in range(0, GS, V):
        for v in tl.static_range(V):
            c = g * GS + GS - 1 - (j0 + v) if REVERSE else g * GS + j0 + v
            lm = mask_m & (c < N)
            idx = (b * N + c) * M + offs_m
            if FILL:
                store_pair(S, idx, sr, si, lm)
            ar, ai = load_pair(A, idx, lm, 1.0, 0.0)
            if REVERSE:
                ai = -ai
            br, bi = load_pair(Bv, idx, lm, 0.0, 0.0)
            sr, si = ar * sr - ai * si + br, ar * si + ai * sr + bi
            if not FILL:
                pr, pi = ar * pr - ai * pi, ar * pi + ai * pr
    if FILL:
        store_pair(final, b * M + offs_m, sr, si, mask_m & (w == NG - 1))
    else:
        gidx = (b * NG + g) * M + offs_m
        store_pair(AG, gidx, pr, pi, mask_m)
        store_pair(BG, gidx, sr, si, mask_m)


@launcher
@triton.jit(do_not_specialize=["T", "N", "D", "M"])
def _fwd_kernel(x, ctrl, modes, S, P, Q, T, N, D, M, REPLAY: tl.constexpr,
                K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    """Chunk c's summary (REPLAY False): P_c = prod a_t and Q_c, its state from zero; or (REPLAY) the chunk replayed
    from its entering state S [B, N, M, 2] writing y (in P)."""
    pid_m, b, offs_m, mask_m, nu, ct, st, gam, lnr = mode_block(modes, M, BM, 2)
    c = tl.program_id(1)
    idx = (b * N + c) * M + offs_m
    x_b = x + b * T * D
    if REPLAY:
        hr, hi = load_pair(S, idx, mask_m, 0.0, 0.0)
        fwd_steps(hr, hi, hr, hi, x_b, P + b * T * D, ctrl + b * T * 4, c * K, T, D, M, offs_m, mask_m,
                  nu, ct, st, gam, lnr, K, U, True, False, ACC)
    else:
        zero = tl.zeros([BM], ACC)
        hr, hi, pr, pi = fwd_steps(zero, zero, zero + 1.0, zero, x_b, x_b, ctrl + b * T * 4, c * K, T, D, M,
                                   offs_m, mask_m, nu, ct, st, gam, lnr, K, U, False, True, ACC)
        store_pair(P, idx, pr, pi, mask_m)
        store_pair(Q, idx, hr, hi, mask_m)


@launcher
@triton.jit(do_not_specialize=["T", "N", "D", "M"])
def _bwd_summary_kernel(x, dy, ctrl, modes, states, P, Qb, T, N, D, M,
                        K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    """P_c and Qbar_c = sum_t conj(prod_{u<=t} a_u) g_t in one forward sweep (g_t = relu'(h_t) dy_t)."""
    pid_m, b, offs_m, mask_m, nu, ct, st, gam, lnr = mode_block(modes, M, BM, 2)
    c = tl.program_id(1)
    x_b, dy_b, ctrl_b = x + b * T * D, dy + b * T * D, ctrl + b * T * 4
    idx = (b * N + c) * M + offs_m
    hr, hi = load_pair(states, idx, mask_m, 0.0, 0.0)
    pr, pi = tl.full([BM], 1.0, ACC), tl.zeros([BM], ACC)
    qr, qi = tl.zeros([BM], ACC), tl.zeros([BM], ACC)
    for j0 in range(0, K, U):
        for u in tl.static_range(U):
            t = c * K + j0 + u
            valid, lm, row, E, ar, ai, xr, xi = step_in(ctrl_b, x_b, t, T, D, M, offs_m, mask_m, nu, ct, st, lnr, ACC)
            dyr = tl.load(dy_b + row + offs_m, mask=lm, other=0.0).to(ACC)
            dyi = tl.load(dy_b + row + M + offs_m, mask=lm, other=0.0).to(ACC)
            hr, hi = ar * hr - ai * hi + gam * xr, ar * hi + ai * hr + gam * xi
            pr, pi = ar * pr - ai * pi, ar * pi + ai * pr
            gr, gi = tl.where(hr <= 0.0, 0.0, dyr), tl.where(hi <= 0.0, 0.0, dyi)
            qr, qi = qr + (pr * gr + pi * gi), qi + (pr * gi - pi * gr)
    store_pair(P, idx, pr, pi, mask_m)
    store_pair(Qb, idx, qr, qi, mask_m)


@launcher
@triton.jit(do_not_specialize=["T", "N", "D", "M", "NMB"])
def _bwd_kernel(x, dy, ctrl, modes, states, R, dxw, dpart, ppart, ckpt, T, N, D, M, NMB,
                K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    """The adjoint replay of chunk c from its state (states) and the adjoint entering it from the right
    (R [B, N, M, 2]): every gradient contribution of the chunk."""
    pid_m, b, offs_m, mask_m, nu, ct, st, gam, lnr = mode_block(modes, M, BM, 2)
    c = tl.program_id(1)
    hr, hi = load_pair(states, (b * N + c) * M + offs_m, mask_m, 0.0, 0.0)
    Rr, Ri = load_pair(R, (b * N + c) * M + offs_m, mask_m, 0.0, 0.0)
    zero = tl.zeros([BM], ACC)
    ckpt_p = ckpt + ((b * N + c) * NMB + pid_m) * (K // U) * BM * 2
    _, _, acc_nu, acc_th, acc_g = bwd_chunk(
        hr, hi, Rr, Ri, zero, zero, zero, ckpt_p, x + b * T * D, dy + b * T * D, dxw + b * T * D, dpart,
        ctrl + b * T * 4, b * T, c * K, T, D, M, NMB, pid_m, offs_m, mask_m, nu, ct, st, gam, lnr, K, U, BM, ACC)
    store_param_partials(ppart, b * N + c, modes, offs_m, mask_m, M, acc_nu, acc_th, acc_g)


@functools.lru_cache(maxsize=256)
class _Plan:
    """What a chunk launcher computes from the shape alone, once per (shape, config): the grids, the launch keywords,
    the scratch shapes (host time of every eager call) and the launches replayed from the second call (`kept`)."""

    def __init__(self, B, T, M, K, acc, backward):
        N, nmb = cdiv(T, K), cdiv(M, BM)
        gs = next_pow2(math.ceil(math.sqrt(N)))     # GS ~ sqrt(N) chunks per group, NG groups
        ng = cdiv(N, gs)
        self.N, self.nmb, self.grid, self.dims, self.kept = N, nmb, (nmb, N, B), (T, N, 2 * M, M), {}
        self.summary_kw = dict(K=K, U=min(K, FWD_UNROLL), BM=BM, ACC=tl_dtype(acc), num_warps=1)
        self.kw = {**self.summary_kw, "U": BWD_UNROLL} if backward else self.summary_kw
        # the grouped prefix (forward, or backward: the conjugate maps right to left)
        self.group_grid, self.group_args = (cdiv(M, PREFIX_BM), ng, B), (N, ng, M)
        self.group_kw = dict(GS=gs, V=min(gs, PREFIX_UNROLL), BM=PREFIX_BM, REVERSE=backward,
                             ACC=tl_dtype(acc), num_warps=4)
        maps = ((B, N, M, 2),) * (3 if backward else 2)
        ckpt = ((B * N * nmb * (K // BWD_UNROLL) * BM * 2,),) if backward else ()
        self.scratch = (*maps, *ckpt, *((B, ng, M, 2),) * 2)


def _prefix(p: _Plan, A, Bv, init, S, work):
    """Grouped prefix over the chunk maps A, Bv [B, N, M, 2] in two launches: writes the state entering every chunk to
    S (linear work) and returns the final one [B, M, 2]; work: the plan's group maps (AG, BG)."""
    AG, BG = work
    final = alloc((A.shape[0], A.shape[2], 2), A.dtype, A.device)
    args = (A, Bv, init if init is not None else final, S, AG, BG, final, *p.group_args)
    replayed(p.kept, "group", _group_kernel, p.group_grid, args, 7, FILL=False, HAS_INIT=False, **p.group_kw)
    account("samu_prefix_group", (A, Bv), (AG, BG))
    replayed(p.kept, ("fill", None if init is None else init.dtype), _group_kernel, p.group_grid, args, 7, FILL=True,
             HAS_INIT=init is not None, **p.group_kw)
    account("samu_prefix_fill", (A, Bv, AG, BG, init), (S, final))
    return final


def chunk_forward(x, ctrl, modes, h0, need_states, cfg):
    """Summary, prefix, replay (module docstring); T = 0 runs the serial launcher."""
    B, T, D = x.shape
    if T == 0:
        return serial_forward(x, ctrl, modes, h0, need_states, cfg)
    M, acc = D // 2, ctrl.dtype
    p = _Plan(B, T, M, cfg["K"], acc, False)
    P, Q, *work = scratch(acc, x.device, *p.scratch)
    replayed(p.kept, ("summary", x.dtype), _fwd_kernel, p.grid, (x, ctrl, modes, P, P, Q, *p.dims), 6,
             REPLAY=False, **p.kw)
    account("samu_chunk_summary", (x, ctrl), (P, Q))
    # the state entering every chunk, kept for the backward
    states = alloc((B, p.N, M, 2), acc, x.device)
    hT = _prefix(p, P, Q, h0, states, work)
    y = alloc(x.shape, x.dtype, x.device)
    replayed(p.kept, ("replay", x.dtype), _fwd_kernel, p.grid, (x, ctrl, modes, states, y, y, *p.dims), 6,
             REPLAY=True, **p.kw)
    account("samu_chunk_replay", (x, ctrl, states), (y,))
    return y, hT, (states if need_states else None)


def chunk_backward(x, dy, ctrl, modes, states, gh, cfg):
    B, T, D = x.shape
    if T == 0:
        return serial_backward(x, dy, ctrl, modes, states, gh, cfg)
    M, acc = D // 2, ctrl.dtype
    p = _Plan(B, T, M, cfg["K"], acc, True)
    N, nmb = p.N, p.nmb
    # scratch of this launcher (summaries, adjoints entering chunks, checkpoints, the prefix's groups) apart from the
    # partials dpart, ppart, which live on in controls_bwd
    P, Qb, R, ckpt, *work = scratch(acc, x.device, *p.scratch)
    dpart, ppart = scratch(acc, x.device, (B * T, nmb, 2), (B * N, M, 2))
    replayed(p.kept, ("bwd_summary", x.dtype, dy.dtype), _bwd_summary_kernel, p.grid,
             (x, dy, ctrl, modes, states, P, Qb, *p.dims), 7, **p.summary_kw)
    account("samu_chunk_bwd_summary", (x, dy, ctrl, states), (P, Qb))
    dh0 = _prefix(p, P, Qb, gh, R, work)
    dxw = alloc(x.shape, acc, x.device)
    replayed(p.kept, ("bwd", x.dtype, dy.dtype), _bwd_kernel, p.grid,
             (x, dy, ctrl, modes, states, R, dxw, dpart, ppart, ckpt, *p.dims, nmb), 10, **p.kw)
    # ckpt: every U-th state of the chunk, written and read back by the same program
    account("samu_chunk_bwd", (x, dy, ctrl, states, R, ckpt), (dxw, dpart, ppart, ckpt))
    return dxw, dpart, ppart, dh0
