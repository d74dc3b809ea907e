"""Exact two-level chunked RG-LRU and affine scan (chunk sizes K = 8, 16, 32, 64).

Forward, three launches:
1. summary: each (sequence, chunk, channel block) composes its K maps into one,
   h_out = P h_in + Q (P <- a_t P, Q <- a_t Q + b_t), from inputs formed in registers;
2. prefix over the NC = ceil(T / K) chunk summaries, linear work: groups of G
   summaries are composed locally (an associative scan inside the group gives every
   chunk's exclusive prefix), an outer serial prefix carries the state from group to
   group in order, and the local correction applies the carried state to the group's
   exclusive prefixes; the result is the state entering every chunk, S [B, NC, D] FP32
   (kept for backward: 4 / K bytes per element) and the final state;
3. replay: every chunk recomputes its inputs and scans from its entering state.
Backward, the same algebra on the adjoint (see common.py): summary of the maps
(a_t, a_t dy_t) per chunk, a reverse prefix from dL/dh_T (its last carry is dL/dh0),
a replay that recomputes the chunk's states from S and stores every gradient, and the
deterministic reduction of the per-(sequence, chunk) a_param partials.

Inside a chunk (option `inner`): "scan" combines the K steps of a [K, BD] tile with
Triton's associative scan (which runs across lanes and warps); "loop" gives each thread
a few channels and walks the K steps in registers (straight-line code, no shuffles or
shared memory; the backward keeps the chunk's h_{t-1} as a tuple of K registers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import accounting
from .._checks import check_chunk_size
from .common import (recurrence_function, INTERPRET, acc_dtype, affine, affine_excl, check_pow2, empty, fast,
                     first_row, g_exp, g_rsqrt, g_sigmoid, g_sqrt, last_row, load_a, load_tile, one_minus_sq, out,
                     softplus, tile_grads, tl_acc)
from .lookback import lookback_backward, lookback_config, lookback_forward


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_fwd_summary_kernel(
    x, gx, ga, ap, pos, P, Q, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr,
):
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, K)
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * K, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC, FAST)
    # [K, BD]
    A, Bs = tl.associative_scan((a, b), 0, affine)
    o = (i_b * NC + i_c) * D + o_d
    tl.store(P + o, last_row(A, rows, K), mask=m_d)
    tl.store(Q + o, last_row(Bs, rows, K), mask=m_d)


@triton.jit(do_not_specialize=["NC"])
def chunk_prefix_kernel(
    P, Q, h0, S, hN, NC, D,
    REVERSE: tl.constexpr, HAS_H0: tl.constexpr, STORE_HN: tl.constexpr, G: tl.constexpr, BD: tl.constexpr,
    ACC: tl.constexpr,
):
    # One program per (sequence, channel block); REVERSE runs the adjoint's prefix from
    # the last chunk to the first.
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, G)
    if HAS_H0:
        carry = tl.load(h0 + i_b * D + o_d, mask=m_d, other=0.0).to(ACC)
    else:
        carry = tl.zeros([BD], ACC)
    NG = tl.cdiv(NC, G)
    for j in range(0, NG):
        if REVERSE:
            g = NG - 1 - j
        else:
            g = j
        c = g * G + rows
        m_c = c < NC
        off = (i_b * NC + c[:, None]) * D + o_d[None, :]
        m = m_c[:, None] & m_d[None, :]
        # [G, BD]; chunks past NC are identity maps
        p = tl.load(P + off, mask=m, other=1.0)
        q = tl.load(Q + off, mask=m, other=0.0)
        p = tl.where(m_c[:, None], p, 1.0)
        q = tl.where(m_c[:, None], q, 0.0)
        ea, eb, ia, ib = tl.associative_scan((tl.full(p.shape, 1.0, ACC), tl.zeros(p.shape, ACC), p, q),
                                             0, affine_excl, reverse=REVERSE)
        tl.store(S + off, ea * carry[None, :] + eb, mask=m)
        if REVERSE:
            carry = first_row(ia * carry[None, :] + ib, rows)
        else:
            carry = last_row(ia * carry[None, :] + ib, rows, G)
    if STORE_HN:
        tl.store(hN + i_b * D + o_d, carry, mask=m_d)


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_fwd_replay_kernel(
    x, gx, ga, ap, pos, S, y, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr,
):
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, K)
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    hin = tl.load(S + (i_b * NC + i_c) * D + o_d, mask=m_d, other=0.0)
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * K, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC, FAST)
    A, Bs = tl.associative_scan((a, b), 0, affine)
    tl.store(y + off, out(A * hin[None, :] + Bs, y, RNE), mask=m)


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_bwd_summary_kernel(
    ga, ap, pos, dy, P, Q, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr,
):
    # The chunk's adjoint map mu_first = P r + Q over (a_t, a_t dy_t), reverse order.
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, K)
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    off, m, a = load_a(ga, sp, pos, i_b, i_c * K, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC, FAST)
    dyv = tl.load(dy + off, mask=m, other=0.0).to(ACC)
    A, Bs = tl.associative_scan((a, a * dyv), 0, affine, reverse=True)
    o = (i_b * NC + i_c) * D + o_d
    tl.store(P + o, first_row(A, rows), mask=m_d)
    tl.store(Q + o, first_row(Bs, rows), mask=m_d)


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_bwd_replay_kernel(
    x, gx, ga, ap, pos, S, R, dy, dx, dgx, dga, dsp_part, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr,
):
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, K)
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    o = (i_b * NC + i_c) * D + o_d
    hin = tl.load(S + o, mask=m_d, other=0.0)
    r = tl.load(R + o, mask=m_d, other=0.0)
    off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_tile(
        x, gx, ga, sp, pos, i_b, i_c * K, T, D, o_d, m_d, rows, IS_SCAN, HAS_RESET, ACC, FAST)
    if IS_SCAN:
        ea, eb, ia, ib = tl.associative_scan((tl.full(a.shape, 1.0, ACC), tl.zeros(a.shape, ACC), a, b),
                                             0, affine_excl)
        hprev = ea * hin[None, :] + eb
        h = hprev
    else:
        A, Bs = tl.associative_scan((a, b), 0, affine)
        h = A * hin[None, :] + Bs
        hprev = h
    r0, dsp = tile_grads(tl.load(dy + off, mask=m, other=0.0), dx, dgx, dga, off, m, valid, keep, a, b, xv, sx,
                         sa, mult, u, h, hprev, r, sp, rows, IS_SCAN, ACC, RNE, FAST)
    if not IS_SCAN:
        tl.store(dsp_part + o, dsp, mask=m_d)


@triton.jit
def load_row(x, gx, ga, pos, i_b, t, T, D, o_d, m_d, IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr,
             ACC: tl.constexpr, sp, FAST: tl.constexpr):
    """One time step [BD] of the chunk, coefficients in registers (the "loop" inner
    form: a thread owns a few channels and walks the chunk's steps one by one).
    Returns (off, m, valid, keep, a, b, xv, sx, sa, mult, u); past T an identity map."""
    valid = t < T
    off = (i_b * T + t) * D + o_d
    m = m_d & valid
    if HAS_RESET:
        keep = tl.load(pos + i_b * T + t, mask=valid, other=1) != 0
    else:
        keep = valid | True
    if IS_SCAN:
        a = tl.load(ga + off, mask=m, other=1.0).to(ACC)
        b = tl.load(x + off, mask=m, other=0.0).to(ACC)
        a = tl.where(keep, a, 0.0)
        a = tl.where(valid, a, 1.0)
        xv = b
        sx = b
        sa = a
        mult = a
        u = a
    else:
        xv = tl.load(x + off, mask=m, other=0.0).to(ACC)
        sx = g_sigmoid(tl.load(gx + off, mask=m, other=0.0).to(ACC), FAST)
        sa = g_sigmoid(tl.load(ga + off, mask=m, other=0.0).to(ACC), FAST)
        log_a = -8.0 * sa * sp
        a = g_exp(log_a, FAST)
        u = one_minus_sq(a, log_a)
        mult = tl.where(keep, g_sqrt(u, FAST), 1.0)
        a = tl.where(keep, a, 0.0)
        a = tl.where(valid, a, 1.0)
        b = xv * sx * mult
    return off, m, valid, keep, a, b, xv, sx, sa, mult, u


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_loop_fwd_kernel(
    x, gx, ga, ap, pos, S, P, Q, y, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, REPLAY: tl.constexpr, K: tl.constexpr, BD: tl.constexpr,
    ACC: tl.constexpr, RNE: tl.constexpr, FAST: tl.constexpr,
):
    # REPLAY False: the chunk's summary (P, Q); True: the outputs from the entering state S.
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    o = (i_b * NC + i_c) * D + o_d
    if REPLAY:
        h = tl.load(S + o, mask=m_d, other=0.0)
    else:
        pa = tl.full([BD], 1.0, ACC)
        h = tl.zeros([BD], ACC)
    for k in tl.static_range(K):
        off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_row(
            x, gx, ga, pos, i_b, i_c * K + k, T, D, o_d, m_d, IS_SCAN, HAS_RESET, ACC, sp, FAST)
        h = a * h + b
        if REPLAY:
            tl.store(y + off, out(h, y, RNE), mask=m)
        else:
            pa = a * pa
    if not REPLAY:
        tl.store(P + o, pa, mask=m_d)
        tl.store(Q + o, h, mask=m_d)


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_loop_bwd_summary_kernel(
    ga, ap, pos, dy, P, Q, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr,
):
    # mu_first = P r + Q over the chunk's steps in reverse: (P, Q) <- (a P, a (Q + dy)).
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    pa = tl.full([BD], 1.0, ACC)
    q = tl.zeros([BD], ACC)
    for j in tl.static_range(K - 1, -1, -1):
        t = i_c * K + j
        valid = t < T
        off = (i_b * T + t) * D + o_d
        m = m_d & valid
        if IS_SCAN:
            a = tl.load(ga + off, mask=m, other=1.0).to(ACC)
        else:
            a = g_exp(-8.0 * g_sigmoid(tl.load(ga + off, mask=m, other=0.0).to(ACC), FAST) * sp, FAST)
        if HAS_RESET:
            a = tl.where(tl.load(pos + i_b * T + t, mask=valid, other=1) != 0, a, 0.0)
        a = tl.where(valid, a, 1.0)
        q = a * (q + tl.load(dy + off, mask=m, other=0.0).to(ACC))
        pa = a * pa
    o = (i_b * NC + i_c) * D + o_d
    tl.store(P + o, pa, mask=m_d)
    tl.store(Q + o, q, mask=m_d)


@triton.jit(do_not_specialize=["T", "NC"])
def chunk_loop_bwd_replay_kernel(
    x, gx, ga, ap, pos, S, R, dy, dx, dgx, dga, dsp_part, T, D, NC,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
    RNE: tl.constexpr, FAST: tl.constexpr,
):
    # Forward over the chunk keeps h_{t-1} of every step in registers (a tuple of K
    # [BD] vectors); the adjoint then walks back, recomputing the coefficients.
    i_d, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if IS_SCAN:
        sp = tl.zeros([BD], ACC)
    else:
        sp = softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))
    o = (i_b * NC + i_c) * D + o_d
    h = tl.load(S + o, mask=m_d, other=0.0)
    hp = ()
    for k in tl.static_range(K):
        off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_row(
            x, gx, ga, pos, i_b, i_c * K + k, T, D, o_d, m_d, IS_SCAN, HAS_RESET, ACC, sp, FAST)
        hp = hp + (h,)
        h = a * h + b
    mu = tl.load(R + o, mask=m_d, other=0.0)
    dsp = tl.zeros([BD], ACC)
    for k in tl.static_range(K - 1, -1, -1):
        off, m, valid, keep, a, b, xv, sx, sa, mult, u = load_row(
            x, gx, ga, pos, i_b, i_c * K + k, T, D, o_d, m_d, IS_SCAN, HAS_RESET, ACC, sp, FAST)
        lam = tl.load(dy + off, mask=m, other=0.0).to(ACC) + mu
        if IS_SCAN:
            tl.store(dx + off, out(lam, dx, RNE), mask=m)
            tl.store(dga + off, out(tl.where(keep, lam * hp[k], 0.0), dga, RNE), mask=m)
        else:
            gxm = lam * mult
            tl.store(dx + off, out(gxm * sx, dx, RNE), mask=m)
            tl.store(dgx + off, out(gxm * xv * sx * (1.0 - sx), dgx, RNE), mask=m)
            du = lam * xv * sx * g_rsqrt(tl.maximum(4.0 * u, 1e-6), FAST)
            dlog = tl.where(keep & valid, lam * a * hp[k] - 2.0 * a * a * du, 0.0)
            tl.store(dga + off, out(dlog * (-8.0 * sp) * sa * (1.0 - sa), dga, RNE), mask=m)
            dsp += dlog * (-8.0 * sa)
        mu = a * lam
    if not IS_SCAN:
        tl.store(dsp_part + o, dsp, mask=m_d)


INNER = ("scan", "loop")


FWD = ("replay", "lookback")
BWD = ("replay", "lookback")


def _config(B, T, D, chunk_size=None, block_d=None, num_warps=None, group=None, inner=None, fast_math=None,
            fwd=None, vec=None, window=None, bwd=None, bwd_chunk=None, bwd_vec=None, bwd_warps=None,
            bwd_block_d=None, **unknown):
    if unknown:
        raise ValueError(f"expected chunk options among ['chunk_size', 'block_d', 'num_warps', 'group', 'inner', "
                         f"'fast_math', 'fwd', 'vec', 'window', 'bwd', 'bwd_chunk', 'bwd_vec', 'bwd_warps', "
                         f"'bwd_block_d'], got {sorted(unknown)}")
    inner = "scan" if inner is None else inner
    if inner not in INNER:
        raise ValueError(f"expected inner in {list(INNER)}, got {inner!r}")
    fwd = "replay" if fwd is None else fwd
    if fwd not in FWD:
        raise ValueError(f"expected fwd in {list(FWD)}, got {fwd!r}")
    bwd = "replay" if bwd is None else bwd
    if bwd not in BWD:
        raise ValueError(f"expected bwd in {list(BWD)}, got {bwd!r}")
    bwd_opts = {"bwd_chunk": bwd_chunk, "bwd_vec": bwd_vec, "bwd_warps": bwd_warps, "bwd_block_d": bwd_block_d}
    if bwd == "lookback" and fwd != "lookback":
        raise ValueError(f"expected bwd='lookback' only with fwd='lookback', got fwd={fwd!r}")
    if bwd != "lookback" and any(v is not None for v in bwd_opts.values()):
        named = sorted(k for k, v in bwd_opts.items() if v is not None)
        raise ValueError(f"expected {named} only with bwd='lookback', got bwd={bwd!r}")
    lb = lbb = None
    if fwd == "lookback":
        # chunk_size, block_d, num_warps, vec and window configure the look-back forward;
        # the replay backward keeps its defaults and runs on sub-chunks of K steps, the
        # look-back backward on its own chunks (bwd_ options), K then being the smaller
        # of the two chunks (the forward saves the state entering every K steps).
        lb = lookback_config(D, chunk_size, block_d, num_warps, vec, window)
        if bwd == "lookback":
            lbb = lookback_config(D, bwd_chunk, bwd_block_d, bwd_warps, bwd_vec, window, prefix="bwd_")
            K = min(lb["L"], lbb["L"])
        else:
            K = min(lb["L"], 16 if inner == "loop" else 32)
        chunk_size = block_d = num_warps = None
    elif vec is not None or window is not None:
        name = "vec" if vec is not None else "window"
        raise ValueError(f"expected {name} only with fwd='lookback', got {name}={vec if vec is not None else window!r}"
                         f" with fwd={fwd!r}")
    else:
        K = check_chunk_size((16 if inner == "loop" else 32) if chunk_size is None else chunk_size)
    NC = triton.cdiv(T, K)
    bd = (256 if inner == "loop" else 64) if block_d is None else check_pow2("block_d", block_d, 8, 1024)
    nw = (2 if inner == "loop" else 4) if num_warps is None else check_pow2("num_warps", num_warps, 1, 16)
    g = max(2, min(64, triton.next_power_of_2(NC))) if group is None else check_pow2("group", group, 2, 1024)
    return {"K": K, "BD": min(bd, max(8, triton.next_power_of_2(D))), "num_warps": nw, "G": g, "inner": inner,
            "FAST": bool(fast_math), "fwd": fwd, "lookback": lb, "bwd": bwd, "lookback_bwd": lbb}


def _prefix(P, Q, init, need_final, reverse, cfg):
    B, NC, D = P.shape
    S = empty((B, NC, D), P.dtype, P.device)
    hN = empty((B, D), P.dtype, P.device) if need_final else None
    BD = min(128, max(8, triton.next_power_of_2(D)))
    chunk_prefix_kernel[(triton.cdiv(D, BD), B)](
        P, Q, init if init is not None else P, S, hN if hN is not None else S, NC, D,
        REVERSE=reverse, HAS_H0=init is not None, STORE_HN=need_final, G=cfg["G"], BD=BD,
        ACC=tl_acc(P.dtype), num_warps=4,
    )
    accounting.record("chunk_prefix_bwd" if reverse else "chunk_prefix_fwd", accounting.nbytes(P, Q, init),
                      accounting.nbytes(S, hN))
    return S, hN


def _act_bytes(is_scan, x, pos):
    n = x.numel() * x.element_size()
    return (2 if is_scan else 3) * n + (0 if pos is None else pos.numel() * pos.element_size())


def chunk_forward(x, gx, ga, a_param, pos, h0, output_final_state, is_scan, cfg):
    """Launchers of the forward. Scan mode: x = b, ga = a. Returns (y, ht, S)."""
    B, T, D = x.shape
    K, BD = cfg["K"], cfg["BD"]
    NC = triton.cdiv(T, K)
    acc = acc_dtype(x.dtype)
    ap = a_param if a_param is not None else x
    p = pos if pos is not None else x
    grid = (triton.cdiv(D, BD), NC, B)
    kw = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, K=K, BD=BD, ACC=tl_acc(x.dtype), RNE=INTERPRET,
              FAST=fast(cfg, x),
              num_warps=cfg["num_warps"])
    P = empty((B, NC, D), acc, x.device)
    Q = empty((B, NC, D), acc, x.device)
    loop = cfg["inner"] == "loop"
    if loop:
        chunk_loop_fwd_kernel[grid](x, gx, ga, ap, p, P, P, Q, x, T, D, NC, REPLAY=False, **kw)
    else:
        chunk_fwd_summary_kernel[grid](x, gx, ga, ap, p, P, Q, T, D, NC, **kw)
    extra = None if is_scan else a_param
    accounting.record("chunk_fwd_summary", _act_bytes(is_scan, x, pos) + accounting.nbytes(extra),
                      accounting.nbytes(P, Q))
    S, ht = _prefix(P, Q, h0, output_final_state, False, cfg)
    y = empty((B, T, D), x.dtype, x.device)
    if loop:
        chunk_loop_fwd_kernel[grid](x, gx, ga, ap, p, S, S, S, y, T, D, NC, REPLAY=True, **kw)
    else:
        chunk_fwd_replay_kernel[grid](x, gx, ga, ap, p, S, y, T, D, NC, **kw)
    accounting.record("chunk_fwd_replay", _act_bytes(is_scan, x, pos) + accounting.nbytes(S, extra),
                      accounting.nbytes(y))
    return y, ht, S


def chunk_backward(x, gx, ga, a_param, pos, S, dy, dht, need_dh0, is_scan, cfg):
    """Launchers of the backward. Returns (dx, dgx, dga, dh0, dsp_part)."""
    B, T, D = x.shape
    K, BD = cfg["K"], cfg["BD"]
    NC = triton.cdiv(T, K)
    acc = acc_dtype(x.dtype)
    ap = a_param if a_param is not None else x
    p = pos if pos is not None else x
    grid = (triton.cdiv(D, BD), NC, B)
    kw = dict(IS_SCAN=is_scan, HAS_RESET=pos is not None, K=K, BD=BD, ACC=tl_acc(x.dtype), RNE=INTERPRET,
              FAST=fast(cfg, x),
              num_warps=cfg["num_warps"])
    extra = None if is_scan else a_param
    P = empty((B, NC, D), acc, x.device)
    Q = empty((B, NC, D), acc, x.device)
    loop = cfg["inner"] == "loop"
    (chunk_loop_bwd_summary_kernel if loop else chunk_bwd_summary_kernel)[grid](ga, ap, p, dy, P, Q, T, D, NC, **kw)
    accounting.record("chunk_bwd_summary", accounting.nbytes(ga, dy, pos, extra), accounting.nbytes(P, Q))
    R, dh0 = _prefix(P, Q, dht, need_dh0, True, cfg)
    dx = empty((B, T, D), x.dtype, x.device)
    dga = empty((B, T, D), ga.dtype, x.device)
    dgx = None if is_scan else empty((B, T, D), gx.dtype, x.device)
    part = None if is_scan else empty((B * NC, D), acc, x.device)
    (chunk_loop_bwd_replay_kernel if loop else chunk_bwd_replay_kernel)[grid](
        x, gx, ga, ap, p, S, R, dy, dx, dgx if dgx is not None else dx, dga, part if part is not None else S,
        T, D, NC, **kw)
    accounting.record("chunk_bwd_replay", _act_bytes(is_scan, x, pos) + accounting.nbytes(S, R, dy, extra),
                      accounting.nbytes(dx, dgx, dga, part))
    return dx, dgx, dga, dh0, part


def _forward(x, gx, ga, ap, pos, h0, ofs, save, is_scan, cfg):
    if cfg["fwd"] == "lookback":
        return lookback_forward(x, gx, ga, ap, pos, h0, ofs, save, is_scan, cfg)
    return chunk_forward(x, gx, ga, ap, pos, h0, ofs, is_scan, cfg)


def _backward(x, gx, ga, ap, pos, S, dy, dht, need_dh0, is_scan, cfg):
    if cfg["bwd"] == "lookback":
        return lookback_backward(x, gx, ga, ap, pos, S, dy, dht, need_dh0, is_scan, cfg)
    return chunk_backward(x, gx, ga, ap, pos, S, dy, dht, need_dh0, is_scan, cfg)


ChunkFunction = recurrence_function(
    "ChunkFunction",
    _forward,
    _backward,
    "RG-LRU or the bare scan through the chunked kernels (chunk states kept for backward).")

def chunk_rglru(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False,
                chunk_size=None, **opts):
    """RG-LRU from gate logits through the chunked kernels; the reference signature.
    chunk_size in (8, 16, 32, 64); options: block_d, num_warps, group (summaries per
    prefix group), inner ("scan": the chunk's steps combined by an associative scan over
    a [K, BD] tile; "loop": each thread walks the chunk's steps in registers), fast_math
    (approximate ex2/rcp/sqrt in FP32 on the GPU), fwd ("replay", the default: summary,
    prefix, replay; "lookback": one pass with decoupled look-back, lookback.py, correct
    on the H200 but slower than serial there, opt-in only; chunk_size is then its chunk L, a power of two
    in [16, 256], default 16; block_d, num_warps and the options vec and window configure
    its kernel (lookback.lookback_config), and the backward runs with its defaults on
    sub-chunks of min(L, 32) steps, min(L, 16) with inner="loop"), bwd ("replay", the
    default; "lookback", only with fwd="lookback": the backward in one pass with
    decoupled look-back from the end, lookback.lookback_backward, configured by bwd_chunk,
    bwd_vec, bwd_warps and bwd_block_d as chunk_size, vec, num_warps and block_d configure
    the forward). Returns (y [B, T, D], final state [B, D] FP32 or None)."""
    B, T, D = x.shape
    cfg = _config(B, T, D, chunk_size, **opts)
    if T == 0:
        from .fused_recurrent import _empty_sequence

        return _empty_sequence(x, initial_state, output_final_state)
    return ChunkFunction.apply(x, gate_x, gate_a, a_param, segment_pos, initial_state, output_final_state,
                               False, cfg)


def chunk_scan(a, b, segment_pos=None, initial_state=None, output_final_state=False, chunk_size=None, **opts):
    """h_t = a_t h_{t-1} + b_t (a_t = 0 at resets) through the chunked kernels, real
    inputs; complex inputs go to the PyTorch reference. Options as chunk_rglru's
    (fwd="lookback" included)."""
    if b.is_complex():
        from .. import reference

        return reference.scan(a, b, segment_pos, initial_state, output_final_state)
    B, T, D = b.shape
    cfg = _config(B, T, D, chunk_size, **opts)
    if T == 0:
        from .fused_recurrent import _empty_sequence

        return _empty_sequence(b, initial_state, output_final_state)
    a = a.to(b.dtype) if a.dtype != b.dtype else a
    return ChunkFunction.apply(b, b, a, None, segment_pos, initial_state, output_final_state, True, cfg)
