"""Serial ("state-stationary") SAMU: one program per (sequence, block of modes) walks time, h in registers, in
unrolled tiles of K tokens (their loads are independent of h, so they are in flight together). With gradients the
state before every K-th token is kept ([B, T/K, M] complex); the backward recomputes each tile's states from it in
registers and runs the adjoint lam_t = g_t + conj(a_{t+1}) lam_{t+1} over the tile, tiles visited in reverse.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..accounting import account
from ..triton_utils import cdiv, launcher, scratch
from .common import (alloc, bwd_chunk, fwd_steps, load_pair, load_state, mode_block, store_pair,
                     store_param_partials, tl_dtype)

# Steps unrolled inside the time loops (the rest stays a loop; see common.fwd_steps).
FWD_UNROLL = 8
BWD_UNROLL = 4
# Modes per program of the serial and chunk kernels: one per thread of one warp.
BM = 32


@launcher
@triton.jit(do_not_specialize=["T", "N", "D", "M"])
def _serial_fwd_kernel(x, ctrl, modes, h0, y, states, hT, T, N, D, M, K: tl.constexpr, U: tl.constexpr,
                       BM: tl.constexpr, HAS_H0: tl.constexpr, STORE_STATES: tl.constexpr, ACC: tl.constexpr):
    pid_m, b, offs_m, mask_m, nu, ct, st, gam, lnr = mode_block(modes, M, BM, 1)
    x_b, y_b, ctrl_b = x + b * T * D, y + b * T * D, ctrl + b * T * 4
    hr, hi = load_state(h0, b * M + offs_m, mask_m, HAS_H0, BM, ACC)
    for c in range(N):
        if STORE_STATES:
            store_pair(states, (b * N + c) * M + offs_m, hr, hi, mask_m)
        hr, hi, _, _ = fwd_steps(hr, hi, hr, hi, x_b, y_b, ctrl_b, c * K, T, D, M, offs_m, mask_m,
                                 nu, ct, st, gam, lnr, K, U, True, False, ACC)
    store_pair(hT, b * M + offs_m, hr, hi, mask_m)


@launcher
@triton.jit(do_not_specialize=["T", "N", "D", "M", "NMB"])
def _serial_bwd_kernel(x, dy, ctrl, modes, states, gh, dxw, dpart, ppart, dh0, ckpt, T, N, D, M, NMB, K: tl.constexpr,
                       U: tl.constexpr, BM: tl.constexpr, HAS_GH: tl.constexpr, ACC: tl.constexpr):
    pid_m, b, offs_m, mask_m, nu, ct, st, gam, lnr = mode_block(modes, M, BM, 1)
    x_b, dy_b, dxw_b, ctrl_b = x + b * T * D, dy + b * T * D, dxw + b * T * D, ctrl + b * T * 4
    Rr, Ri = load_state(gh, b * M + offs_m, mask_m, HAS_GH, BM, ACC)
    acc_nu, acc_th, acc_g = tl.zeros([BM], ACC), tl.zeros([BM], ACC), tl.zeros([BM], ACC)
    ckpt_p = ckpt + (b * NMB + pid_m) * (K // U) * BM * 2
    for i in range(N):
        c = N - 1 - i
        hr, hi = load_pair(states, (b * N + c) * M + offs_m, mask_m, 0.0, 0.0)
        Rr, Ri, acc_nu, acc_th, acc_g = bwd_chunk(
            hr, hi, Rr, Ri, acc_nu, acc_th, acc_g, ckpt_p, x_b, dy_b, dxw_b, dpart, ctrl_b, b * T, c * K, T, D, M,
            NMB, pid_m, offs_m, mask_m, nu, ct, st, gam, lnr, K, U, BM, ACC)
    store_pair(dh0, b * M + offs_m, Rr, Ri, mask_m)
    store_param_partials(ppart, b, modes, offs_m, mask_m, M, acc_nu, acc_th, acc_g)


def serial_forward(x, ctrl, modes, h0, need_states, cfg):
    B, T, D = x.shape
    M, K, acc = D // 2, cfg["K"], ctrl.dtype
    N = cdiv(T, K)
    y = alloc(x.shape, x.dtype, x.device)
    hT = alloc((B, M, 2), acc, x.device)
    states = alloc((B, N, M, 2), acc, x.device) if need_states else None
    _serial_fwd_kernel[(cdiv(M, BM), B)](
        x, ctrl, modes, h0 if h0 is not None else hT, y, states if need_states else hT, hT,
        T, N, D, M, K=K, U=FWD_UNROLL, BM=BM, HAS_H0=h0 is not None, STORE_STATES=need_states, ACC=tl_dtype(acc),
        num_warps=1)
    account("samu_serial_fwd", (x, ctrl, modes, h0), (y, hT, states))
    return y, hT, states


def serial_backward(x, dy, ctrl, modes, states, gh, cfg):
    B, T, D = x.shape
    M, K, acc = D // 2, cfg["K"], ctrl.dtype
    N, nmb = cdiv(T, K), cdiv(M, BM)
    dxw = alloc(x.shape, acc, x.device)
    dh0 = alloc((B, M, 2), acc, x.device)
    # scratch: the partials (read by controls_bwd right after this launcher), the checkpoints
    dpart, ppart, ckpt = scratch(acc, x.device, (B * T, nmb, 2), (B, M, 2), (B * nmb * (K // BWD_UNROLL) * BM * 2,))
    _serial_bwd_kernel[(nmb, B)](
        x, dy, ctrl, modes, states, gh if gh is not None else dh0, dxw, dpart, ppart, dh0, ckpt,
        T, N, D, M, nmb, K=K, U=BWD_UNROLL, BM=BM, HAS_GH=gh is not None, ACC=tl_dtype(acc), num_warps=1)
    # ckpt: each program's slots, written and read back once per tile (N tiles)
    account("samu_serial_bwd", (x, dy, ctrl, modes, states, gh, *(ckpt,) * N), (dxw, dpart, ppart, dh0, *(ckpt,) * N))
    return dxw, dpart, ppart, dh0
