"""Exact two-level chunked SAMU (chunk_size K in 8, 16, 32, 64).

Forward, for chunks c of K tokens (the last one may be partial; its missing steps
are identity lanes):
  1. summary   per (chunk, mode block): P_c = prod a_t, Q_c = state from zero, so
               h_out = P_c h_in + Q_c (complex affine map);
  2. prefix    over the N chunk summaries, order kept, in groups of GS ~ sqrt(N)
               chunks: each group is composed serially into one map, an outer serial
               prefix over the groups gives each group's incoming state (and the final
               state), and the local correction carries it through the group's chunks.
               prefix="fill" (the default) does the correction in one more pass that
               walks every group once and writes the state entering each chunk (linear
               work: about 2N + N / GS map compositions); prefix="group" leaves it to
               the replay, each chunk composing the earlier chunks of its group itself
               (N * GS / 2 compositions, a chain of up to GS - 1 dependent loads on
               each replay program's critical path, no extra launch);
  3. replay    per (chunk, mode block): from the chunk's incoming state the chunk is
               replayed writing y = relu(h).
Backward runs the same algebra on the adjoint: R_{c-1} = conj(P_c) R_c + Qbar_c with
Qbar_c = sum_t conj(prod_{u<=t} a_u) g_t (chunk-local), composed right to left, then
per chunk the adjoint replay that writes every gradient contribution.
Resets are a_t = 0 inside the summaries, so they cut every prefix exactly.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import accounting
from .._checks import check_chunk_size
from .common import (acc_dtype, alloc, bwd_chunk, check_block_m, check_num_warps, controls_fwd,
                     controls_tile, fwd_steps, load_pair, mode_consts, next_pow2, store_pair, store_param_partials,
                     tl_dtype)
from .fused_recurrent import BWD_UNROLL, FWD_UNROLL, SerialPlan
from .function import samu_apply
from .lookback import lookback_config, lookback_forward

PREFIX_BM = 128
PREFIX_UNROLL = 4
# the fused controller+summary program: modes per trip of its mode loop, warps
FUSED_BM = 256
FUSED_WARPS = 4


def group_sizes(n: int) -> tuple[int, int, int]:
    """(GS chunks per group, NG groups, NGP = NG rounded up to a power of two) for n chunks."""
    gs = next_pow2(max(1, math.ceil(math.sqrt(n))))
    ng = triton.cdiv(n, gs)
    return gs, ng, next_pow2(ng)


@triton.jit
def group_start(A, Bv, carry, b, c, N, NG, M, offs_m, mask_m,
                GS: tl.constexpr, V: tl.constexpr, CONJ: tl.constexpr, REVERSE: tl.constexpr):
    """Map entering chunk c (the local correction): the group's carry composed with the
    chunks of the group before c (after c when REVERSE), each s <- A s + B (conj(A) when CONJ)."""
    g = c // GS
    sr, si = load_pair(carry, (b * NG + g) * M + offs_m, mask_m, 0.0, 0.0)
    for j0 in range(0, GS, V):
        for v in tl.static_range(V):
            if REVERSE:
                cj = g * GS + GS - 1 - (j0 + v)
                use = (cj > c) & (cj < N)
            else:
                cj = g * GS + j0 + v
                use = cj < c
            lm = mask_m & use
            idx = (b * N + cj) * M + offs_m
            ar, ai = load_pair(A, idx, lm, 1.0, 0.0)
            if CONJ:
                ai = -ai
            br, bi = load_pair(Bv, idx, lm, 0.0, 0.0)
            sr, si = ar * sr - ai * si + br, ar * si + ai * sr + bi
    return sr, si


@triton.jit(do_not_specialize=["N", "NG", "M"])
def _group_kernel(A, Bv, AG, BG, N, NG, M, GS: tl.constexpr, V: tl.constexpr, BM: tl.constexpr,
                  CONJ: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr):
    """Serial composition of each group's GS chunk maps into one map (group-local pass)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    pr = tl.full([BM], 1.0, ACC)
    pi = tl.zeros([BM], ACC)
    qr = tl.zeros([BM], ACC)
    qi = tl.zeros([BM], ACC)
    for j0 in range(0, GS, V):
        for v in tl.static_range(V):
            if REVERSE:
                c = g * GS + GS - 1 - (j0 + v)
            else:
                c = g * GS + j0 + v
            lm = mask_m & (c < N)
            idx = (b * N + c) * M + offs_m
            ar, ai = load_pair(A, idx, lm, 1.0, 0.0)
            if CONJ:
                ai = -ai
            br, bi = load_pair(Bv, idx, lm, 0.0, 0.0)
            qr, qi = ar * qr - ai * qi + br, ar * qi + ai * qr + bi
            pr, pi = ar * pr - ai * pi, ar * pi + ai * pr
    gidx = (b * NG + g) * M + offs_m
    store_pair(AG, gidx, pr, pi, mask_m)
    store_pair(BG, gidx, qr, qi, mask_m)


@triton.jit(do_not_specialize=["NG", "M"])
def _outer_kernel(AG, BG, init, carry, final, NG, M, NGP: tl.constexpr, V: tl.constexpr, BM: tl.constexpr,
                  HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr):
    """Serial prefix over the group maps: each group's incoming state, and the final one."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    if HAS_INIT:
        sr, si = load_pair(init, b * M + offs_m, mask_m, 0.0, 0.0)
    else:
        sr = tl.zeros([BM], ACC)
        si = tl.zeros([BM], ACC)
    for j0 in range(0, NGP, V):
        for v in tl.static_range(V):
            if REVERSE:
                g = NG - 1 - (j0 + v)
                valid = g >= 0
            else:
                g = j0 + v
                valid = g < NG
            lm = mask_m & valid
            gidx = (b * NG + g) * M + offs_m
            store_pair(carry, gidx, sr, si, lm)
            ar, ai = load_pair(AG, gidx, lm, 1.0, 0.0)
            br, bi = load_pair(BG, gidx, lm, 0.0, 0.0)
            sr, si = ar * sr - ai * si + br, ar * si + ai * sr + bi
    store_pair(final, b * M + offs_m, sr, si, mask_m)


@triton.jit(do_not_specialize=["N", "NG", "M"])
def _fill_kernel(A, Bv, carry, S, N, NG, M, GS: tl.constexpr, V: tl.constexpr, BM: tl.constexpr,
                 CONJ: tl.constexpr, REVERSE: tl.constexpr):
    """prefix="fill": each group walked once more from its incoming state, writing the
    state entering every chunk to S [B, N, M, 2]; the replays then load one state instead
    of composing the earlier chunks of their group (group_start) themselves."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    sr, si = load_pair(carry, (b * NG + g) * M + offs_m, mask_m, 0.0, 0.0)
    for j0 in range(0, GS, V):
        for v in tl.static_range(V):
            if REVERSE:
                c = g * GS + GS - 1 - (j0 + v)
            else:
                c = g * GS + j0 + v
            lm = mask_m & (c < N)
            idx = (b * N + c) * M + offs_m
            store_pair(S, idx, sr, si, lm)
            ar, ai = load_pair(A, idx, lm, 1.0, 0.0)
            if CONJ:
                ai = -ai
            br, bi = load_pair(Bv, idx, lm, 0.0, 0.0)
            sr, si = ar * sr - ai * si + br, ar * si + ai * sr + bi


@triton.jit(do_not_specialize=["T", "N", "D", "M"])
def _summary_kernel(x, ctrl, modes, P, Q, T, N, D, M,
                    K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    nu, th, ct, st, gam, lnr = mode_consts(modes, offs_m, mask_m)
    x_b = x + b * T * D
    zero = tl.zeros([BM], ACC)
    hr, hi, pr, pi = fwd_steps(zero, zero, zero + 1.0, zero, x_b, x_b, ctrl + b * T * 4, c * K, T, D, M,
                               offs_m, mask_m, nu, ct, st, gam, lnr, K, U, False, True, ACC)
    idx = (b * N + c) * M + offs_m
    store_pair(P, idx, pr, pi, mask_m)
    store_pair(Q, idx, hr, hi, mask_m)


@triton.jit(do_not_specialize=["T", "N", "D", "M"])
def _summary_ctrl_kernel(x, pd, rd, pa, ra, seg, ctrl, aux, modes, P, Q, T, N, D, M, scale,
                         HAS_SEG: tl.constexpr, K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr,
                         BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """The controller fused into the chunk summary: one program owns the K whole rows of
    chunk c of sequence b, computes their controls (written to ctrl/aux for the replay
    and the backward), then the summaries of every block of BM modes. x comes from DRAM
    once; the mode loop re-reads the chunk's rows while they are still in cache."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    tt = c * K + tl.arange(0, K)
    controls_tile(x, pd, rd, pa, ra, seg, ctrl, aux, b * T + tt, tt < T, D, scale, HAS_SEG, K, BLOCK_D, ACC)
    # the controls just stored by other threads of this program are read back below
    tl.debug_barrier()
    x_b = x + b * T * D
    for m0 in range(0, M, BM):
        offs_m = m0 + tl.arange(0, BM)
        mask_m = offs_m < M
        nu, th, ct, st, gam, lnr = mode_consts(modes, offs_m, mask_m)
        zero = tl.zeros([BM], ACC)
        hr, hi, pr, pi = fwd_steps(zero, zero, zero + 1.0, zero, x_b, x_b, ctrl + b * T * 4, c * K, T, D, M,
                                   offs_m, mask_m, nu, ct, st, gam, lnr, K, U, False, True, ACC)
        idx = (b * N + c) * M + offs_m
        store_pair(P, idx, pr, pi, mask_m)
        store_pair(Q, idx, hr, hi, mask_m)


@triton.jit(do_not_specialize=["T", "N", "NG", "D", "M"])
def _replay_kernel(x, ctrl, modes, P, Q, carry, y, states, T, N, NG, D, M,
                   K: tl.constexpr, U: tl.constexpr, GS: tl.constexpr, V: tl.constexpr, BM: tl.constexpr,
                   STORE_STATES: tl.constexpr, FILLED: tl.constexpr, ACC: tl.constexpr):
    """FILLED: `carry` holds the state entering every chunk ([B, N, M, 2], prefix="fill")."""
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    nu, th, ct, st, gam, lnr = mode_consts(modes, offs_m, mask_m)
    if FILLED:
        hr, hi = load_pair(carry, (b * N + c) * M + offs_m, mask_m, 0.0, 0.0)
    else:
        hr, hi = group_start(P, Q, carry, b, c, N, NG, M, offs_m, mask_m, GS, V, False, False)
    if STORE_STATES:
        store_pair(states, (b * N + c) * M + offs_m, hr, hi, mask_m)
    fwd_steps(hr, hi, hr, hi, x + b * T * D, y + b * T * D, ctrl + b * T * 4, c * K, T, D, M, offs_m, mask_m,
              nu, ct, st, gam, lnr, K, U, True, False, ACC)


@triton.jit(do_not_specialize=["T", "N", "D", "M"])
def _bwd_summary_kernel(x, dy, ctrl, modes, states, P, Qb, T, N, D, M,
                        K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    """P_c and Qbar_c = sum_t conj(prod_{u<=t} a_u) g_t in one forward sweep (g_t = relu'(h_t) dy_t)."""
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    nu, th, ct, st, gam, lnr = mode_consts(modes, offs_m, mask_m)
    x_b = x + b * T * D
    dy_b = dy + b * T * D
    ctrl_b = ctrl + b * T * 4
    idx = (b * N + c) * M + offs_m
    hr, hi = load_pair(states, idx, mask_m, 0.0, 0.0)
    pr = tl.full([BM], 1.0, ACC)
    pi = tl.zeros([BM], ACC)
    qr = tl.zeros([BM], ACC)
    qi = tl.zeros([BM], ACC)
    for j0 in range(0, K, U):
        for u in tl.static_range(U):
            t = c * K + j0 + u
            valid = t < T
            E = tl.load(ctrl_b + t * 4, mask=valid, other=0.0)
            ck = tl.load(ctrl_b + t * 4 + 1, mask=valid, other=0.0)
            sk = tl.load(ctrl_b + t * 4 + 2, mask=valid, other=0.0)
            mag = tl.exp(-(nu * E + lnr))
            ar = tl.where(valid, mag * (ct * ck - st * sk), 1.0)
            ai = tl.where(valid, mag * (st * ck + ct * sk), 0.0)
            lm = mask_m & valid
            row = t.to(tl.int64) * D
            xr = tl.load(x_b + row + offs_m, mask=lm, other=0.0).to(ACC)
            xi = tl.load(x_b + row + M + offs_m, mask=lm, other=0.0).to(ACC)
            dyr = tl.load(dy_b + row + offs_m, mask=lm, other=0.0).to(ACC)
            dyi = tl.load(dy_b + row + M + offs_m, mask=lm, other=0.0).to(ACC)
            hr, hi = ar * hr - ai * hi + gam * xr, ar * hi + ai * hr + gam * xi
            pr, pi = ar * pr - ai * pi, ar * pi + ai * pr
            gr = tl.where(hr <= 0.0, 0.0, dyr)
            gi = tl.where(hi <= 0.0, 0.0, dyi)
            qr += pr * gr + pi * gi
            qi += pr * gi - pi * gr
    store_pair(P, idx, pr, pi, mask_m)
    store_pair(Qb, idx, qr, qi, mask_m)


@triton.jit(do_not_specialize=["T", "N", "NG", "D", "M", "NMB"])
def _bwd_kernel(x, dy, ctrl, modes, states, P, Qb, carry, dxw, dpart, ppart, ckpt,
                T, N, NG, D, M, NMB, K: tl.constexpr, U: tl.constexpr, GS: tl.constexpr, V: tl.constexpr,
                BM: tl.constexpr, FILLED: tl.constexpr, ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    nu, th, ct, st, gam, lnr = mode_consts(modes, offs_m, mask_m)
    hr, hi = load_pair(states, (b * N + c) * M + offs_m, mask_m, 0.0, 0.0)
    if FILLED:
        Rr, Ri = load_pair(carry, (b * N + c) * M + offs_m, mask_m, 0.0, 0.0)
    else:
        Rr, Ri = group_start(P, Qb, carry, b, c, N, NG, M, offs_m, mask_m, GS, V, True, True)
    zero = tl.zeros([BM], ACC)
    ckpt_p = ckpt + ((b * N + c) * NMB + pid_m) * (K // U) * BM * 2
    _, _, acc_nu, acc_th, acc_g = bwd_chunk(
        hr, hi, Rr, Ri, zero, zero, zero, ckpt_p, x + b * T * D, dy + b * T * D, dxw + b * T * D, dpart,
        ctrl + b * T * 4, b * T, c * K, T, D, M, NMB, pid_m, offs_m, mask_m, nu, ct, st, gam, lnr, K, U, BM, ACC)
    store_param_partials(ppart, b * N + c, modes, offs_m, mask_m, M, acc_nu, acc_th, acc_g)


class ChunkPlan:
    """Launchers of the two-level chunked algorithm. Default K = 16: fastest forward+backward
    at B = 4, T = 2048, D = 2560 and forward at T >= 4096 on the H200
    (results/kernels/samu/summary_run2.md)."""

    def __init__(self, chunk_size: int = 16, block_m: int = 32, num_warps=None, fuse_controls=False,
                 prefix="fill", fwd="chunk", lb_chunk=None, lb_rows=None, lb_warps=None, lb_window=None,
                 lb_order=None, inclusive_every=1):
        self.K = check_chunk_size(chunk_size)
        self.BM = check_block_m(block_m)
        self.NW = check_num_warps(num_warps, self.BM)
        if fuse_controls not in (False, True):
            raise ValueError(f"expected fuse_controls True or False, got {fuse_controls!r}")
        self.fuse_controls = fuse_controls
        if prefix not in ("group", "fill"):
            raise ValueError(f"expected prefix 'group' or 'fill', got {prefix!r}")
        self.fill = prefix == "fill"
        if fwd not in ("chunk", "lookback"):
            raise ValueError(f"expected fwd 'chunk' or 'lookback', got {fwd!r}")
        lb_opts = {"lb_chunk": lb_chunk, "lb_rows": lb_rows, "lb_warps": lb_warps, "lb_window": lb_window,
                   "lb_order": lb_order}
        if fwd == "chunk" and any(v is not None for v in lb_opts.values()):
            raise ValueError(f"expected no lb_* options with fwd='chunk', got {lb_opts}")
        if fwd == "lookback" and fuse_controls:
            raise ValueError("expected fuse_controls=False with fwd='lookback' (the look-back forward computes "
                             "the controls itself), got True")
        if not isinstance(inclusive_every, int) or isinstance(inclusive_every, bool) or inclusive_every < 1:
            raise ValueError(f"expected inclusive_every a positive int, got {inclusive_every!r}")
        self.fwd = fwd
        self.lb = lb_opts
        self.inclusive_every = inclusive_every

    def controls_and_forward(self, x, phase_dir, radial_dir, pa, ra, segment_pos, modes, h0, need_states):
        """(ctrl, aux, (y, final state, states)): the controller and the forward; with
        fuse_controls the controller runs inside the chunk summary (x read from DRAM
        twice instead of three times)."""
        B, T, D = x.shape
        if self.fwd == "lookback" and B * T > 0:
            cfg = lookback_config(D // 2, *self.lb.values())
            return lookback_forward(x, phase_dir, radial_dir, pa, ra, segment_pos, modes, h0, need_states, self.K,
                                    cfg, self.inclusive_every)
        if not self.fuse_controls or B * T == 0:
            ctrl, aux = controls_fwd(x, phase_dir, radial_dir, pa, ra, segment_pos)
            return ctrl, aux, self.forward(x, ctrl, modes, h0, need_states)
        M, K = D // 2, self.K
        acc = acc_dtype(x.dtype)
        N = triton.cdiv(T, K)
        ctrl = alloc((B * T, 4), acc, x.device)
        aux = alloc((B * T, 2), acc, x.device)
        P = alloc((B, N, M, 2), acc, x.device)
        Q = alloc((B, N, M, 2), acc, x.device)
        seg = segment_pos if segment_pos is not None else ctrl
        _summary_ctrl_kernel[(N, B)](x, phase_dir, radial_dir, pa, ra, seg, ctrl, aux, modes, P, Q, T, N, D, M,
                                     1.0 / math.sqrt(M), HAS_SEG=segment_pos is not None, K=K,
                                     U=min(K, FWD_UNROLL), BM=FUSED_BM, BLOCK_D=min(next_pow2(D), 4096 // K),
                                     ACC=tl_dtype(acc), num_warps=FUSED_WARPS)
        accounting.record("samu_chunk_summary_ctrl", accounting.nbytes(x, phase_dir, radial_dir, segment_pos),
                          accounting.nbytes(ctrl, aux, P, Q))
        return ctrl, aux, self._finish_forward(x, ctrl, modes, h0, need_states, P, Q)

    def _prefix(self, A, Bv, init, B, N, M, conj, reverse, fill_into=None):
        """Grouped prefix: returns (carry per group [B, NG, M, 2], final map output); with
        fill_into [B, N, M, 2] (prefix="fill") the state entering every chunk is written
        there and returned as the carry (the local correction done here, linear work)."""
        acc = A.dtype
        gs, ng, ngp = group_sizes(N)
        AG = alloc((B, ng, M, 2), acc, A.device)
        BG = alloc((B, ng, M, 2), acc, A.device)
        carry = alloc((B, ng, M, 2), acc, A.device)
        final = alloc((B, M, 2), acc, A.device)
        nmb = triton.cdiv(M, PREFIX_BM)
        _group_kernel[(nmb, ng, B)](A, Bv, AG, BG, N, ng, M, GS=gs, V=min(gs, PREFIX_UNROLL), BM=PREFIX_BM,
                                    CONJ=conj, REVERSE=reverse, ACC=tl_dtype(acc), num_warps=4)
        accounting.record("samu_prefix_group", accounting.nbytes(A, Bv), accounting.nbytes(AG, BG))
        _outer_kernel[(nmb, B)](AG, BG, init if init is not None else final, carry, final, ng, M, NGP=ngp,
                                V=min(ngp, PREFIX_UNROLL), BM=PREFIX_BM, HAS_INIT=init is not None, REVERSE=reverse,
                                ACC=tl_dtype(acc), num_warps=4)
        accounting.record("samu_prefix_outer", accounting.nbytes(AG, BG, init), accounting.nbytes(carry, final))
        if fill_into is not None:
            _fill_kernel[(nmb, ng, B)](A, Bv, carry, fill_into, N, ng, M, GS=gs, V=min(gs, PREFIX_UNROLL), BM=PREFIX_BM,
                                       CONJ=conj, REVERSE=reverse, num_warps=4)
            accounting.record("samu_prefix_fill", accounting.nbytes(A, Bv, carry), accounting.nbytes(fill_into))
            carry = fill_into
        return carry, final, gs, ng

    def forward(self, x, ctrl, modes, h0, need_states):
        B, T, D = x.shape
        if T == 0:
            return SerialPlan(self.K, self.BM, self.NW).forward(x, ctrl, modes, h0, need_states)
        M, K, BM = D // 2, self.K, self.BM
        acc = ctrl.dtype
        N = triton.cdiv(T, K)
        grid = (triton.cdiv(M, BM), N, B)
        P = alloc((B, N, M, 2), acc, x.device)
        Q = alloc((B, N, M, 2), acc, x.device)
        _summary_kernel[grid](x, ctrl, modes, P, Q, T, N, D, M, K=K, U=min(K, FWD_UNROLL), BM=BM,
                              ACC=tl_dtype(acc), num_warps=self.NW)
        accounting.record("samu_chunk_summary", accounting.nbytes(x, ctrl), accounting.nbytes(P, Q))
        return self._finish_forward(x, ctrl, modes, h0, need_states, P, Q)

    def _finish_forward(self, x, ctrl, modes, h0, need_states, P, Q):
        """Prefix over the chunk summaries P, Q, then the replay."""
        B, T, D = x.shape
        M, K, BM = D // 2, self.K, self.BM
        acc = ctrl.dtype
        N = triton.cdiv(T, K)
        grid = (triton.cdiv(M, BM), N, B)
        # prefix="fill": the fill pass writes the chunk states themselves (kept for the backward)
        states = alloc((B, N, M, 2), acc, x.device) if need_states or self.fill else None
        carry, hT, gs, ng = self._prefix(P, Q, h0, B, N, M, conj=False, reverse=False,
                                         fill_into=states if self.fill else None)
        y = alloc(x.shape, x.dtype, x.device)
        _replay_kernel[grid](x, ctrl, modes, P, Q, carry, y, states if need_states else hT,
                             T, N, ng, D, M, K=K, U=min(K, FWD_UNROLL), GS=gs, V=min(gs, PREFIX_UNROLL), BM=BM,
                             STORE_STATES=need_states and not self.fill, FILLED=self.fill, ACC=tl_dtype(acc),
                             num_warps=self.NW)
        if not need_states:
            states = None
        accounting.record("samu_chunk_replay", accounting.nbytes(x, ctrl, P, Q, carry),
                          accounting.nbytes(y, states))
        return y, hT, states

    def backward(self, x, dy, ctrl, modes, states, gh):
        B, T, D = x.shape
        if T == 0:
            return SerialPlan(self.K, self.BM, self.NW).backward(x, dy, ctrl, modes, states, gh)
        M, K, BM = D // 2, self.K, self.BM
        acc = ctrl.dtype
        N = triton.cdiv(T, K)
        nmb = triton.cdiv(M, BM)
        grid = (nmb, N, B)
        P = alloc((B, N, M, 2), acc, x.device)
        Qb = alloc((B, N, M, 2), acc, x.device)
        _bwd_summary_kernel[grid](x, dy, ctrl, modes, states, P, Qb, T, N, D, M, K=K,
                                  U=min(K, FWD_UNROLL), BM=BM,
                                  ACC=tl_dtype(acc), num_warps=self.NW)
        accounting.record("samu_chunk_bwd_summary", accounting.nbytes(x, dy, ctrl, states), accounting.nbytes(P, Qb))
        carry, dh0, gs, ng = self._prefix(P, Qb, gh, B, N, M, conj=True, reverse=True,
                                          fill_into=alloc((B, N, M, 2), acc, x.device) if self.fill else None)
        dxw = alloc(x.shape, acc, x.device)
        dpart = alloc((B * T, nmb, 2), acc, x.device)
        ppart = alloc((B * N, M, 2), acc, x.device)
        ckpt = alloc((B * N * nmb * (K // BWD_UNROLL) * BM * 2,), acc, x.device)
        _bwd_kernel[grid](x, dy, ctrl, modes, states, P, Qb, carry, dxw, dpart, ppart, ckpt,
                          T, N, ng, D, M, nmb, K=K, U=BWD_UNROLL, GS=gs, V=min(gs, PREFIX_UNROLL), BM=BM,
                          FILLED=self.fill, ACC=tl_dtype(acc),
                          num_warps=self.NW)
        # ckpt: every U-th state of the chunk, written and read back by the same program
        accounting.record("samu_chunk_bwd", accounting.nbytes(x, dy, ctrl, states, P, Qb, carry, ckpt),
                          accounting.nbytes(dxw, dpart, ppart, ckpt))
        return dxw, dpart, ppart, dh0


def chunk_samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
               initial_state=None, output_final_state=False, chunk_size=16, block_m=32, num_warps=None,
               fuse_controls=False, prefix="fill", fwd="chunk", lb_chunk=None, lb_rows=None, lb_warps=None,
               lb_window=None, lb_order=None, inclusive_every=1):
    """Two-level chunked SAMU (reference signature). x: [B, T, D], D = 2M; returns
    (y [B, T, D], final state [B, M] complex or None). chunk_size K in 8, 16, 32, 64;
    block_m modes per program; num_warps per program (None: block_m // 32, one mode per
    thread; fewer: several adjacent modes per thread); fuse_controls: the controller
    inside the chunk summary (one program per chunk owns whole rows); prefix "fill"
    (default; one more pass over the chunk summaries writes every chunk's incoming state,
    linear work; the replays load it) or "group" (each replay composes the earlier chunks
    of its group itself: N * GS / 2 compositions for N chunks in groups of GS ~ sqrt(N)).
    fwd="lookback": the single-pass forward with decoupled look-back (lookback.py; options
    lb_chunk, lb_rows, lb_warps, lb_window, lb_order, see lookback_config; inclusive_every is a test
    knob); the backward (chunk_size K) is unchanged."""
    plan = ChunkPlan(chunk_size, block_m, num_warps, fuse_controls, prefix, fwd, lb_chunk, lb_rows, lb_warps,
                     lb_window, lb_order, inclusive_every)
    if fwd == "lookback":
        lookback_config(x.shape[-1] // 2, lb_chunk, lb_rows, lb_warps, lb_window, lb_order)
    return samu_apply(plan, x, phase_dir, radial_dir,
                      phase_amp, radial_amp, nu_log, theta_log, segment_pos, initial_state, output_final_state)
