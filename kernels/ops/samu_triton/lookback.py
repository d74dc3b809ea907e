"""Single-pass SAMU forward with decoupled look-back (chunk backend, fwd="lookback").

Opt-in option of the chunk backend (chunk.py): fwd="lookback" with lb_chunk = L (steps
per program, a power of two in [2, 1024]), lb_rows = LS (rows per sub-tile, a power of
two dividing L, at most 64), lb_warps, lb_window, lb_order (lookback_config).
The chunk backward runs unchanged after it (chunk_size K of the backward; the forward
saves what it reads).

Measured on the H200 (run 4, results/kernels/samu/README.md): correct at the benchmark
shapes (prefill and every gradient through the chunk backward), 1.2-1.6x faster than the
two-level chunk forward, but only 16-24 % of the prefill's memory floor (target 80 %):
the programs are latency-bound (see the README), not bandwidth-bound. Not the default.

Why: the two-level chunk forward reads x three times (controller, chunk summaries,
replay) and runs six launches, so it cannot pass ~50 % of the memory floor of the
prefill (x read once, y written once). Here one launch (plus the flags' memset) reads x
from DRAM once: the controller needs each token's whole row, and a program owns whole
rows.

One launch. A program owns (chunk c of L steps, batch row b) with ALL M = D / 2 modes
(BM = next_pow2(M) lanes of the mode axis). It
1. (phase A) walks its chunk in sub-tiles of LS rows. Per sub-tile: loads the [LS, BM]
   real and imaginary halves of x once, forms both controller projections by row sums
   over the tile, and stores the normalised projections (v_p, v_r) to `aux`; after a
   barrier the per-token scalars (float64 tanh as in common.controls_tile, exp(eta),
   cos/sin(delta) zeroed at resets) are computed in a 1-D layout (one row per thread,
   not replicated over the mode axis: that work would otherwise be repeated by every
   thread) and stored to `ctrl` [B*T, 4]; after a barrier the tile reads them back,
   forms a_t = exp(-(nu E_t + lnr)) (cos, sin)(theta + delta_t) and b_t = gamma x_t in
   registers and scans the sub-tile (complex affine maps, tl.associative_scan along
   time, order kept); the sub-tile maps are composed into the chunk's aggregate (P, Q);
2. if c > 0 publishes (P, Q) with flag 1;
3. looks back over its predecessors, W chunks per step, exactly as the RG-LRU's
   look-back (rglru_triton/lookback.py: an inclusive prefix counts as the constant map
   z -> 0 z + s and ends the look-back; before chunk 0 the initial state or zero);
4. publishes its inclusive prefix P h_in + Q with flag 2 (chunk 0 always does);
   lb_order="fixed" (the default since run 5, where on the H200 it repeated bitwise and
   ran as fast as "decoupled", results/kernels/samu/run5_lookback) instead: only anchors (chunks W k) publish an
   inclusive prefix and only the others an aggregate; chunk c composes the inclusive
   prefix of the last anchor before it with the aggregates in between, one window. The
   composition then depends on c alone, so the result is bitwise reproducible (the
   decoupled order is not: which inclusive prefix a look-back meets depends on timing,
   which changes the FP32 rounding of h_in, and so the saved states and gradients, in the
   last bits). The anchors form a chain of NC / W dependent hops;
5. (phase C) y = relu(Re h) | relu(Im h): with one sub-tile (L == LS) from the scanned
   maps still in registers (h_t = A_t h_in + B_t); with several, each sub-tile is
   loaded again (the program read it moments before: L2, not DRAM, for
   L * D * 2 bytes per program), its coefficients re-formed from `ctrl`, and scanned
   with h folded into its first write. Under autograd it also stores the states entering
   every backward chunk of K steps (states [B, ceil(T / K), M, 2]); `ctrl` and `aux`
   are what the chunk backward and the controller backward read, so training runs the
   existing backward unchanged. The final state comes from the owner of the last chunk.
Workspaces per call: flags int32 [NC * B] zeroed plus one ticket counter; aggregates
[NC, B, 4, M] and inclusive prefixes [NC, B, 2, M] in the accumulation dtype; ctrl and
aux ([B*T, 4] and [B*T, 2], 24 bytes per token) are written even without autograd (the
sub-tile rows' controls are read back from them).

Order of programs and memory ordering: as the RG-LRU look-back (its docstring has the
details). Each program takes a ticket (relaxed atomic increment of one counter) and is
decoded from it as (chunk, batch row), chunk slowest-varying, so it only ever waits on
lower tickets, which are resident: no deadlock whatever order program ids are dispatched
in. Publish: plain stores, tl.debug_barrier, tl.atomic_xchg(flag, v, sem="release");
wait: tl.atomic_add(flag, 0, sem="acquire") until non-zero, then ".cg" loads. Flags only
grow (0 -> 1 -> 2); aggregates and inclusive prefixes live in separate buffers written
once.

The interpreter runs programs one after another in program order, so there every
look-back meets its predecessor's inclusive prefix at once. The constexpr
INCLUSIVE_EVERY = k (launcher argument inclusive_every, tests only) lets only every
k-th chunk publish an inclusive prefix, so composing several aggregates over several
windows runs on the CPU too; it never changes the result.

Layout: the mode offsets carry a max_contiguous hint of VEC = BM / (32 num_warps)
modes, so Triton gives the [LS, BM] tiles sizePerThread [1, VEC] with every lane and
warp along the modes: each thread owns VEC whole time columns of the sub-tile and the
scan along time is a serial loop in its registers. Registers per thread grow with
LS * VEC (x, a, and the scanned maps of LS * VEC complex elements).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import accounting
from .common import alloc, mode_consts, next_pow2, relu, store_token_controls, tanh, tl_dtype

L_RANGE = (2, 1024)
LS_RANGE = (2, 64)
# Defaults: chunks of 64 steps walked in sub-tiles of 16 / VEC rows, four modes per thread
# (num_warps = BM / 128, at most 16), look-back window 8: at M = 512 the fastest variant of
# run 4 (results/kernels/samu/README.md; 4 warps, 4 rows: 244 registers, two programs per SM).
DEFAULT_L, DEFAULT_LS, DEFAULT_WINDOW = 64, 8, 8


@triton.jit
def caffine(ar1, ai1, br1, bi1, ar2, ai2, br2, bi2):
    """Complex affine maps, (a1, b1) applied first: z -> a2 (a1 z + b1) + b2."""
    return (ar2 * ar1 - ai2 * ai1, ar2 * ai1 + ai2 * ar1,
            ar2 * br1 - ai2 * bi1 + br2, ar2 * bi1 + ai2 * br1 + bi2)


@triton.jit
def last_row(v, rows, R: tl.constexpr):
    # [R, BM] -> [BM]: the row R - 1 (a sum of one non-zero term, exact).
    return tl.sum(tl.where(rows[:, None] == R - 1, v, 0.0), axis=0)


@triton.jit
def _load_x(x_b, t0, T, D, M, o_m, m_m, rows, ok):
    """The raw (real, imaginary) halves [LS, BM] of rows t0 .. t0 + LS - 1 (nothing past T
    or when not ok), in x's dtype: a prefetch keeps them packed until used."""
    t = t0 + rows
    off = t[:, None].to(tl.int64) * D + o_m[None, :]
    m2 = ((t < T) & ok)[:, None] & m_m[None, :]
    return tl.load(x_b + off, mask=m2, other=0.0), tl.load(x_b + off + M, mask=m2, other=0.0)


@triton.jit
def _load_ctrl(ctrl, tok, valid):
    return (tl.load(ctrl + tok * 4, mask=valid, other=0.0), tl.load(ctrl + tok * 4 + 1, mask=valid, other=0.0),
            tl.load(ctrl + tok * 4 + 2, mask=valid, other=0.0))


@triton.jit
def _tile_coeffs(xr, xi, E, ck, sk, valid, nu, ct, st, gam, lnr, ACC: tl.constexpr):
    """The sub-tile's maps (ar, ai, br, bi) [LS, BM] from x and the per-token controls;
    rows past T identity."""
    mag = tl.exp(-(nu[None, :] * E[:, None] + lnr[None, :]))
    ar = mag * (ct[None, :] * ck[:, None] - st[None, :] * sk[:, None])
    ai = mag * (st[None, :] * ck[:, None] + ct[None, :] * sk[:, None])
    v2 = valid[:, None]
    ar = tl.where(v2, ar, 1.0)
    ai = tl.where(v2, ai, 0.0)
    return ar, ai, gam[None, :] * xr.to(ACC), gam[None, :] * xi.to(ACC)


@triton.jit
def _save_states(S, hr, hi, h_run_r, h_run_i, rows, t0, i_b, NCB, M, o_m, m_m, LS: tl.constexpr, KB: tl.constexpr):
    """States entering the backward chunks of KB steps that start in rows t0 .. t0 + LS - 1:
    h_run before the sub-tile, the others from the tile's states (hr, hi) [LS, BM]."""
    if LS <= KB:
        n = t0 // KB
        sm = m_m & (t0 % KB == 0) & (n < NCB)
        base = S + ((i_b * NCB + n) * M + o_m) * 2
        tl.store(base, h_run_r, mask=sm)
        tl.store(base + 1, h_run_i, mask=sm)
    else:
        for j in tl.static_range(LS // KB):
            n = t0 // KB + j
            sm = m_m & (n < NCB)
            base = S + ((i_b * NCB + n) * M + o_m) * 2
            if j == 0:
                tl.store(base, h_run_r, mask=sm)
                tl.store(base + 1, h_run_i, mask=sm)
            else:
                tl.store(base, tl.sum(tl.where(rows[:, None] == j * KB - 1, hr, 0.0), axis=0), mask=sm)
                tl.store(base + 1, tl.sum(tl.where(rows[:, None] == j * KB - 1, hi, 0.0), axis=0), mask=sm)


@triton.jit
def _phase_a_tile(xr, xi, aux, ctrl, seg, i_b, t0, T, rows, wpr, wpi, wrr, wri, bp, br, nrm_p, nrm_r,
                  tpa, tra, scale, nu, ct, st, gam, lnr, HAS_SEG: tl.constexpr, LS: tl.constexpr, ACC: tl.constexpr):
    """Phase A of one sub-tile (rows t0 .. t0 + LS - 1, x's halves xr, xi already loaded):
    controls stored to aux / ctrl, then the sub-tile's maps scanned from its first row:
    (A_t, B_t) [LS, BM] complex."""
    t = t0 + rows
    valid = t < T
    tok = i_b * T + t
    xr = xr.to(ACC)
    xi = xi.to(ACC)
    zp = tl.sum(xr * wpr[None, :] + xi * wpi[None, :], axis=1)
    zr = tl.sum(xr * wrr[None, :] + xi * wri[None, :], axis=1)
    tl.store(aux + tok * 2, (zp + bp) / nrm_p, mask=valid)
    tl.store(aux + tok * 2 + 1, (zr + br) / nrm_r, mask=valid)
    tl.debug_barrier()
    # per-token scalars, one row per thread (see the module docstring)
    t1 = t0 + tl.arange(0, LS)
    v1 = t1 < T
    tok1 = i_b * T + t1
    vp = tl.load(aux + tok1 * 2, mask=v1, other=0.0)
    vr = tl.load(aux + tok1 * 2 + 1, mask=v1, other=0.0)
    store_token_controls(ctrl, seg, tok1, v1, vp, vr, tpa, tra, scale, HAS_SEG, ACC)
    tl.debug_barrier()
    # back in the tile's layout (computing them there would repeat the float64 work in every thread)
    E, ck, sk = _load_ctrl(ctrl, tok, valid)
    ar, ai, b_r, b_i = _tile_coeffs(xr, xi, E, ck, sk, valid, nu, ct, st, gam, lnr, ACC)
    return tl.associative_scan((ar, ai, b_r, b_i), 0, caffine)


@triton.jit
def _wait_flags(f_ptr, m_c):
    """[W] the window's flags once all are set (acquire reads; 1 where m_c is False)."""
    f = tl.where(m_c, tl.atomic_add(f_ptr, 0, mask=m_c, sem="acquire"), 1)
    while tl.min(f, axis=0) == 0:
        f = tl.where(m_c, tl.atomic_add(f_ptr, 0, mask=m_c, sem="acquire"), 1)
    return f


@triton.jit
def _window(agg, incl, cw, m_c, incl_row, B, i_b, M, o_m, m_m, wv, W: tl.constexpr):
    """The composition of the W published maps of chunks cw (oldest first; rows not m_c
    are identity maps): an inclusive prefix (rows incl_row) is the constant map
    z -> 0 z + s_c, which, composed after older maps, discards them exactly."""
    o = (cw[:, None] * B + i_b) * 4 * M + o_m[None, :]
    oi = (cw[:, None] * B + i_b) * 2 * M + o_m[None, :]
    mm = m_c[:, None] & m_m[None, :]
    is_incl = incl_row[:, None]
    war = tl.load(agg + o, mask=mm & ~is_incl, other=1.0, cache_modifier=".cg")
    wai = tl.load(agg + o + M, mask=mm & ~is_incl, other=0.0, cache_modifier=".cg")
    war = tl.where(is_incl, 0.0, war)
    wai = tl.where(is_incl, 0.0, wai)
    wbr = tl.load(tl.where(is_incl, incl + oi, agg + o + 2 * M), mask=mm, other=0.0, cache_modifier=".cg")
    wbi = tl.load(tl.where(is_incl, incl + oi + M, agg + o + 3 * M), mask=mm, other=0.0, cache_modifier=".cg")
    WAr, WAi, WBr, WBi = tl.associative_scan((war, wai, wbr, wbi), 0, caffine)
    return last_row(WAr, wv, W), last_row(WAi, wv, W), last_row(WBr, wv, W), last_row(WBi, wv, W)


@triton.jit(do_not_specialize=["T", "NC", "NCB"])
def samu_lookback_kernel(
    x, pd, rd, pa, ra, seg, modes, h0, flags, agg, incl, ctrl, aux, y, hN, S,
    B, T, D, M, NC, NCB, scale,
    HAS_SEG: tl.constexpr, HAS_H0: tl.constexpr, STORE_HN: tl.constexpr, SAVE: tl.constexpr,
    L: tl.constexpr, LS: tl.constexpr, KB: tl.constexpr, BM: tl.constexpr, VEC: tl.constexpr,
    W: tl.constexpr, FIXED: tl.constexpr, ACC: tl.constexpr,
    INCLUSIVE_EVERY: tl.constexpr,
):
    # The ticket counter sits after the NC * B flags.
    ticket = tl.atomic_add(flags + NC * B, 1, sem="relaxed")
    i_c = ticket // B
    i_b = (ticket % B).to(tl.int64)
    o_m = tl.arange(0, BM)
    if VEC > 0:
        o_m = tl.max_contiguous(o_m, VEC)
    m_m = o_m < M
    rows = tl.arange(0, LS)
    NSUB: tl.constexpr = L // LS
    nu, th, ct, st, gam, lnr = mode_consts(modes, o_m, m_m)
    # controller directions split into the real / imaginary halves of the row, norms with the bias
    wpr = tl.load(pd + o_m, mask=m_m, other=0.0).to(ACC)
    wpi = tl.load(pd + M + o_m, mask=m_m, other=0.0).to(ACC)
    wrr = tl.load(rd + o_m, mask=m_m, other=0.0).to(ACC)
    wri = tl.load(rd + M + o_m, mask=m_m, other=0.0).to(ACC)
    bp = tl.load(pd + D).to(ACC)
    br = tl.load(rd + D).to(ACC)
    nrm_p = tl.sqrt(tl.sum(wpr * wpr + wpi * wpi, axis=0) + bp * bp)
    nrm_r = tl.sqrt(tl.sum(wrr * wrr + wri * wri, axis=0) + br * br)
    tpa = tanh(tl.load(pa).to(tl.float64))
    tra = tanh(tl.load(ra).to(tl.float64))
    x_b = x + i_b * T * D
    y_b = y + i_b * T * D

    # ---- phase A: controls, coefficients and the chunk's aggregate (P, Q)
    pr = tl.full([BM], 1.0, ACC)
    pi = tl.zeros([BM], ACC)
    qr = tl.zeros([BM], ACC)
    qi = tl.zeros([BM], ACC)
    if NSUB == 1:
        xr, xi = _load_x(x_b, i_c * L, T, D, M, o_m, m_m, rows, True)
        Ar, Ai, Br, Bi = _phase_a_tile(xr, xi, aux, ctrl, seg, i_b, i_c * L, T, rows, wpr, wpi, wrr, wri, bp, br,
                                       nrm_p, nrm_r, tpa, tra, scale, nu, ct, st, gam, lnr, HAS_SEG, LS, ACC)
        pr = last_row(Ar, rows, LS)
        pi = last_row(Ai, rows, LS)
        qr = last_row(Br, rows, LS)
        qi = last_row(Bi, rows, LS)
    else:
        # sub-tile s + 1 is loaded while sub-tile s is processed (registers: 2 LS VEC raw
        # values; run 4: 7-10 % faster than loading each sub-tile when it is needed)
        xr_n, xi_n = _load_x(x_b, i_c * L, T, D, M, o_m, m_m, rows, True)
        for s in range(NSUB):
            xr = xr_n
            xi = xi_n
            xr_n, xi_n = _load_x(x_b, i_c * L + (s + 1) * LS, T, D, M, o_m, m_m, rows, s + 1 < NSUB)
            Ar, Ai, Br, Bi = _phase_a_tile(xr, xi, aux, ctrl, seg, i_b, i_c * L + s * LS, T, rows, wpr, wpi, wrr,
                                           wri, bp, br, nrm_p, nrm_r, tpa, tra, scale, nu, ct, st, gam, lnr, HAS_SEG,
                                           LS, ACC)
            pr, pi, qr, qi = caffine(pr, pi, qr, qi, last_row(Ar, rows, LS), last_row(Ai, rows, LS),
                                     last_row(Br, rows, LS), last_row(Bi, rows, LS))

    # ---- publish the aggregate, look back, publish the inclusive prefix
    my_flag = flags + i_c * B + i_b
    my = (i_c * B + i_b) * 4 * M + o_m
    if FIXED:
        # anchors (chunks W k) publish only their inclusive prefix; nobody reads their aggregate
        publish_agg = (i_c > 0) & (i_c % W != 0)
        publish_incl = i_c % W == 0
    else:
        publish_agg = i_c > 0
        publish_incl = i_c % INCLUSIVE_EVERY == 0
    if publish_agg:
        tl.store(agg + my, pr, mask=m_m)
        tl.store(agg + my + M, pi, mask=m_m)
        tl.store(agg + my + 2 * M, qr, mask=m_m)
        tl.store(agg + my + 3 * M, qi, mask=m_m)
        tl.debug_barrier()
        tl.atomic_xchg(my_flag, 1, sem="release")
    # the map of chunks j + 1 .. c - 1 gathered so far, applied to the state s at the end of
    # chunk j (the initial state before chunk 0)
    car = tl.full([BM], 1.0, ACC)
    cai = tl.zeros([BM], ACC)
    cbr = tl.zeros([BM], ACC)
    cbi = tl.zeros([BM], ACC)
    if HAS_H0:
        sr = tl.load(h0 + (i_b * M + o_m) * 2, mask=m_m, other=0.0).to(ACC)
        si = tl.load(h0 + (i_b * M + o_m) * 2 + 1, mask=m_m, other=0.0).to(ACC)
    else:
        sr = tl.zeros([BM], ACC)
        si = tl.zeros([BM], ACC)
    wv = tl.arange(0, W)
    if FIXED:
        # one window from the last anchor j0 before c: its inclusive prefix, then the
        # aggregates of j0 + 1 .. c - 1 in order (a composition fixed by c alone). Anchors
        # only ever publish flag 2 and the others flag 1, so "every flag non-zero" is the
        # wait, and flag 2 marks the anchor; rows after c - 1 are identity maps. Written as
        # a loop of one trip (none for chunk 0), as the decoupled look-back below.
        j = i_c - 1
        while j >= 0:
            cw = (j // W) * W + wv
            m_c = cw <= j
            f_ptr = flags + cw * B + i_b
            f = _wait_flags(f_ptr, m_c)
            war, wai, wbr, wbi = _window(agg, incl, cw, m_c, f == 2, B, i_b, M, o_m, m_m, wv, W)
            car, cai, cbr, cbi = caffine(war, wai, wbr, wbi, car, cai, cbr, cbi)
            j = -1
    else:
        j = i_c - 1
        while j >= 0:
            # [W] predecessors j - W + 1 .. j, oldest first; before chunk 0 identity maps, ready
            cw = j - (W - 1) + wv
            m_c = cw >= 0
            f_ptr = flags + cw * B + i_b
            f = _wait_flags(f_ptr, m_c)
            war, wai, wbr, wbi = _window(agg, incl, cw, m_c, f == 2, B, i_b, M, o_m, m_m, wv, W)
            # the window's maps come before the gathered ones
            car, cai, cbr, cbi = caffine(war, wai, wbr, wbi, car, cai, cbr, cbi)
            j = tl.where(tl.max(f, axis=0) == 2, -1, j - W)
    hr = car * sr - cai * si + cbr
    hi = car * si + cai * sr + cbi
    outr = pr * hr - pi * hi + qr
    outi = pr * hi + pi * hr + qi
    if publish_incl:
        mi = (i_c * B + i_b) * 2 * M + o_m
        tl.store(incl + mi, outr, mask=m_m)
        tl.store(incl + mi + M, outi, mask=m_m)
        tl.debug_barrier()
        tl.atomic_xchg(my_flag, 2, sem="release")
    if STORE_HN:
        if i_c == NC - 1:
            tl.store(hN + (i_b * M + o_m) * 2, outr, mask=m_m)
            tl.store(hN + (i_b * M + o_m) * 2 + 1, outi, mask=m_m)

    # ---- phase C: the outputs (and the backward's chunk states)
    if NSUB == 1:
        t0 = i_c * L
        t = t0 + rows
        off = t[:, None].to(tl.int64) * D + o_m[None, :]
        m2 = (t < T)[:, None] & m_m[None, :]
        Hr = Ar * hr[None, :] - Ai * hi[None, :] + Br
        Hi = Ar * hi[None, :] + Ai * hr[None, :] + Bi
        tl.store(y_b + off, relu(Hr).to(y.dtype.element_ty), mask=m2)
        tl.store(y_b + off + M, relu(Hi).to(y.dtype.element_ty), mask=m2)
        if SAVE:
            _save_states(S, Hr, Hi, hr, hi, rows, t0, i_b, NCB, M, o_m, m_m, LS, KB)
    else:
        xr_n, xi_n = _load_x(x_b, i_c * L, T, D, M, o_m, m_m, rows, True)
        t = i_c * L + rows
        E_n, ck_n, sk_n = _load_ctrl(ctrl, i_b * T + t, t < T)
        for s in range(NSUB):
            t0 = i_c * L + s * LS
            t = t0 + rows
            valid = t < T
            off = t[:, None].to(tl.int64) * D + o_m[None, :]
            m2 = valid[:, None] & m_m[None, :]
            xr = xr_n
            xi = xi_n
            E = E_n
            ck = ck_n
            sk = sk_n
            nxt = s + 1 < NSUB
            xr_n, xi_n = _load_x(x_b, t0 + LS, T, D, M, o_m, m_m, rows, nxt)
            E_n, ck_n, sk_n = _load_ctrl(ctrl, i_b * T + t + LS, (t + LS < T) & nxt)
            ar, ai, b_r, b_i = _tile_coeffs(xr, xi, E, ck, sk, valid, nu, ct, st, gam, lnr, ACC)
            # the incoming state folded into the first write: the scanned writes are the states
            first = rows[:, None] == 0
            b_r = tl.where(first, b_r + ar * hr[None, :] - ai * hi[None, :], b_r)
            b_i = tl.where(first, b_i + ar * hi[None, :] + ai * hr[None, :], b_i)
            _, _, Hr, Hi = tl.associative_scan((ar, ai, b_r, b_i), 0, caffine)
            tl.store(y_b + off, relu(Hr).to(y.dtype.element_ty), mask=m2)
            tl.store(y_b + off + M, relu(Hi).to(y.dtype.element_ty), mask=m2)
            if SAVE:
                _save_states(S, Hr, Hi, hr, hi, rows, t0, i_b, NCB, M, o_m, m_m, LS, KB)
            hr = last_row(Hr, rows, LS)
            hi = last_row(Hi, rows, LS)


def _pow2(name, value, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"expected {name} to be a power of two in [{lo}, {hi}], got {value!r}")
    return value


def lookback_config(M: int, chunk=None, rows=None, num_warps=None, window=None, order=None) -> dict:
    """Launch configuration: L = chunk steps per program (power of two in [2, 1024],
    default 64); num_warps (power of two in [1, 16], default BM / 128 clamped to [1, 16]:
    four modes per thread); LS = rows per sub-tile (power of two in [2, 64] dividing L,
    default min(L, max(2, 16 / VEC)): 4 at M = 512 and M = 1280); window W (predecessors per look-back
    step, power of two in [1, 64], default 8). BM = next_pow2(M); VEC = BM / (32 num_warps)
    modes per thread (0, no layout hint, when the warps outnumber the modes); order "fixed"
    (default: anchors every W chunks, bitwise reproducible, see the module docstring) or
    "decoupled" (look back until any inclusive prefix; the composition order, and so the
    last bits, depend on timing)."""
    L = _pow2("lb_chunk", DEFAULT_L if chunk is None else chunk, *L_RANGE)
    BM = next_pow2(max(M, 1))
    nw = (min(16, max(1, BM // 128)) if num_warps is None else _pow2("lb_warps", num_warps, 1, 16))
    vec = BM // (32 * nw)
    # default: LS * VEC = 16 complex elements per thread (sm_90 compile: 244 registers at
    # M = 512, LS 4, 4 warps; 16 warps cap registers at 128 and spill a little at M = 1280)
    LS = _pow2("lb_rows", min(L, max(2, DEFAULT_LS * 2 // max(vec, 1))) if rows is None else rows, *LS_RANGE)
    if LS > L:
        raise ValueError(f"expected lb_rows <= lb_chunk = {L}, got {rows!r}")
    W = _pow2("lb_window", DEFAULT_WINDOW if window is None else window, 1, 64)
    if order not in (None, "decoupled", "fixed"):
        raise ValueError(f"expected lb_order 'decoupled', 'fixed' or None, got {order!r}")
    return {"L": L, "LS": LS, "BM": BM, "num_warps": nw, "VEC": vec, "W": W, "order": order or "fixed"}


def workspace_flags(n: int, device) -> torch.Tensor:
    """The zeroed int32 flags and ticket counter of one launch."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def lookback_forward(x, phase_dir, radial_dir, pa, ra, segment_pos, modes, h0, need_states, K, cfg,
                     inclusive_every=1):
    """Launcher. x [B, T, D] (B * T > 0), pa / ra one-element amplitude tensors, modes the
    [M, 8] table, h0 [B, M, 2] or None, K the backward's chunk size (states entering its
    chunks are saved when need_states). Returns (ctrl, aux, (y, final state [B, M, 2],
    states [B, ceil(T / K), M, 2] or None)). inclusive_every > 1: test knob (module docstring)."""
    B, T, D = x.shape
    M = D // 2
    acc = modes.dtype
    L, LS = cfg["L"], cfg["LS"]
    if need_states and LS > K and LS % K:
        raise ValueError(f"expected lb_rows and chunk_size powers of two, got {LS} and {K}")
    NC = triton.cdiv(T, L)
    NCB = triton.cdiv(T, K)
    flags = workspace_flags(NC * B + 1, x.device)
    accounting.record("samu_lookback_flags", 0, accounting.nbytes(flags))
    agg = alloc((NC, B, 4, M), acc, x.device)
    incl = alloc((NC, B, 2, M), acc, x.device)
    ctrl = alloc((B * T, 4), acc, x.device)
    aux = alloc((B * T, 2), acc, x.device)
    y = alloc(x.shape, x.dtype, x.device)
    hN = alloc((B, M, 2), acc, x.device)
    S = alloc((B, NCB, M, 2), acc, x.device) if need_states else None
    samu_lookback_kernel[(NC * B,)](
        x, phase_dir, radial_dir, pa, ra, segment_pos if segment_pos is not None else ctrl, modes,
        h0 if h0 is not None else hN, flags, agg, incl, ctrl, aux, y, hN, S if S is not None else hN,
        B, T, D, M, NC, NCB, 1.0 / math.sqrt(M),
        HAS_SEG=segment_pos is not None, HAS_H0=h0 is not None, STORE_HN=True, SAVE=need_states,
        L=L, LS=LS, KB=K, BM=cfg["BM"], VEC=cfg["VEC"], W=cfg["W"], FIXED=cfg["order"] == "fixed",
        ACC=tl_dtype(acc),
        INCLUSIVE_EVERY=inclusive_every, num_warps=cfg["num_warps"],
    )
    # x once; per chunk one aggregate / inclusive prefix written and at least one read;
    # ctrl/aux written (and read back by the program that wrote them: not counted)
    ws = NC * B * 6 * M * torch.finfo(acc).bits // 8
    accounting.record("samu_lookback_fwd",
                      accounting.nbytes(x, phase_dir, radial_dir, segment_pos, h0, modes) + ws // 3,
                      accounting.nbytes(y, hN, S, ctrl, aux) + ws)
    return ctrl, aux, (y, hN, S)
