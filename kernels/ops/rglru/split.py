"""Serial kernels with each tile's time axis split across W warps (time_warps > 1, the
serial backend's default).

A program owns BD = 64 channels of one sequence (2 per lane) and walks time in tiles of
W * TT steps (TT = chunk_size): warp w holds TT consecutive steps, each thread its two
channels' TT steps in registers. The tile is addressed in memory order [W, TT, BD] (so
Triton's coalescing picks that layout) and relabelled [TT, W, BD] (common.mem_order)
for the scans along axis 0. Offsets are int32 from one int64 base per tile; EVEN (T and
D multiples of the tile) forms no element masks.

Forward, per tile: each warp scans its TT steps from a zero state; the W segment maps
are composed across warps by one small scan carrying the exclusive and inclusive
compositions (common.affine_excl); the state entering segment w is its exclusive prefix
applied to the carry. The backward walks the tiles in reverse with the same split. With
TT >= 8 (WS) the forward saved the state entering every warp's segment, so each warp
recomputes its states alone and the warps hold the segments last first, so their
reverse adjoint maps compose across warps by a forward scan; shorter segments save per
tile and recompute states as the forward does.

Why: one thread per channel column leaves B * D / 2 threads on serial chains, too few
to cover memory latency; the split multiplies them by W while each element still costs
one in-register scan step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (adjoint_scans, affine, coeffs_vk, excl_scan, load_inputs, mem_order, out, program_end,
                     program_start, tile_grads_given)


def even(T: int, D: int, cfg: dict) -> bool:
    """Whether T and D are multiples of the tile, after checking the int32 tile offsets."""
    if (cfg["BT"] + 1) * D >= 2 ** 31:
        raise ValueError(f"expected (time_warps * chunk_size + 1) * D < 2**31 for the split kernels' int32 tile "
                         f"offsets, got D = {D} with a tile of {cfg['BT']} steps")
    return T % cfg["BT"] == 0 and D % cfg["BD"] == 0


@triton.jit
def split_offsets(i_b, t0, T, D, o_d, m_d, im, seg, TT: tl.constexpr, EVEN: tl.constexpr):
    """The tile of steps t0 .. t0 + W * TT - 1, warp row w holding segment seg[w]: time
    steps [W, TT], the tile's first element (int64), int32 element offsets from it in
    memory order [W, TT, BD] and the mask (EVEN: one uniform predicate for the whole
    tiles outside [0, T) that the prefetch reaches). Lanes go along the contiguous last
    axis, warps along axis 0 (Triton orders equal-contiguity dims by position), so axis
    1 stays in each thread's registers."""
    rt = seg * TT + im
    t = t0 + rt
    base = (i_b * T + t0) * D
    rel = (rt * D)[:, :, None] + o_d[None, None, :]
    if EVEN:
        m = tl.full(rel.shape, 1, tl.int1) & ((t0 >= 0) & (t0 < T))
    else:
        m = ((t >= 0) & (t < T))[:, :, None] & m_d[None, None, :]
    return t, base, rel, m


@triton.jit
def split_load(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, im, seg, TT: tl.constexpr, IS_SCAN: tl.constexpr,
               HAS_RESET: tl.constexpr, EVEN: tl.constexpr):
    """common.load_raw of a split tile: inputs [TT, W, BD], positions [TT, W]."""
    t, base, rel, m = split_offsets(i_b, t0, T, D, o_d, m_d, im, seg, TT, EVEN)
    r0, r1, r2, p = load_inputs(x + base, gx + base, ga + base, pos + i_b * T, rel, m, t, T, IS_SCAN, HAS_RESET)
    return mem_order(r0, True), mem_order(r1, True), mem_order(r2, True), tl.trans(p)


@triton.jit
def row_of(v, idx, k):
    """v [N, ...] -> v[k] (a sum of one non-zero term, exact); idx = tl.arange(0, N)
    shaped to broadcast along axis 0."""
    return tl.sum(tl.where(idx == k, v, 0.0), axis=0)


@triton.jit
def split_states(a, b, hin, ii, wcol, TT: tl.constexpr, W: tl.constexpr, IS_SCAN: tl.constexpr,
                 ACC: tl.constexpr):
    """(h, hprev as common.tile_states, the state leaving the tile, the state entering
    each warp's segment) of a [TT, W, BD] tile entered with state hin [BD]."""
    if IS_SCAN:
        ea, eb, A, Bs = excl_scan(a, b, ACC)
    else:
        A, Bs = tl.associative_scan((a, b), 0, affine)
    last = ii[:, :, None]
    sa = row_of(A, last, TT - 1)
    sb = row_of(Bs, last, TT - 1)
    # [W, BD]: the composition of the segments before w (exclusive) and up to w
    xa, xb, ia, ib = excl_scan(sa, sb, ACC)
    hw = xa * hin[None, :] + xb
    h = A * hw[None, :, :] + Bs
    if IS_SCAN:
        hprev = ea * hw[None, :, :] + eb
    else:
        hprev = h
    hout = row_of(ia * hin[None, :] + ib, wcol, W - 1)
    return h, hprev, hout, hw


@triton.jit
def warp_states(a, b, hw, IS_SCAN: tl.constexpr, ACC: tl.constexpr):
    """(h, hprev) given hw [W, BD], the saved state entering each warp's segment."""
    if IS_SCAN:
        ea, eb, A, Bs = excl_scan(a, b, ACC)
        h = A * hw[None, :, :] + Bs
        hprev = ea * hw[None, :, :] + eb
    else:
        A, Bs = tl.associative_scan((a, b), 0, affine)
        h = A * hw[None, :, :] + Bs
        hprev = h
    return h, hprev


@triton.jit
def load_entry(hs, i_b, i_t, NT, D, o_d, m_d, seg, W: tl.constexpr, WS: tl.constexpr):
    """The saved state entering tile i_t: per warp row, its segment's (WS, [W, BD]), or [BD]."""
    if WS:
        return tl.load(hs + ((i_b * NT + i_t) * W + seg) * D + o_d[None, :], mask=m_d[None, :], other=0.0)
    else:
        return tl.load(hs + (i_b * NT + i_t) * D + o_d, mask=m_d, other=0.0)


@triton.jit(do_not_specialize=["T"])
def split_fwd_kernel(
    x, gx, ga, ap, pos, h0, y, ht, hs, T, D,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    SAVE: tl.constexpr, TT: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, PREFETCH: tl.constexpr,
    STAGES: tl.constexpr, EVEN: tl.constexpr, WS: tl.constexpr,
    ACC: tl.constexpr, RNE: tl.constexpr, VEC: tl.constexpr,
):
    i_b, o_d, m_d, sp, h = program_start(ap, h0, D, BD, VEC, IS_SCAN, HAS_H0, ACC)
    ii = tl.arange(0, TT)[:, None]
    wcol = tl.arange(0, W)[:, None]
    im = tl.arange(0, TT)[None, :]
    BT: tl.constexpr = TT * W
    NT = tl.cdiv(T, BT)
    if PREFETCH:
        r0, r1, r2, p = split_load(x, gx, ga, pos, i_b, 0, T, D, o_d, m_d, im, wcol, TT, IS_SCAN, HAS_RESET, EVEN)
    for i_t in tl.range(0, NT, num_stages=STAGES):
        t0 = i_t * BT
        if SAVE and not WS:
            tl.store(hs + (i_b * NT + i_t) * D + o_d, h, mask=m_d)
        t, base, rel, m = split_offsets(i_b, t0, T, D, o_d, m_d, im, wcol, TT, EVEN)
        if PREFETCH:
            n0, n1, n2, n_p = split_load(x, gx, ga, pos, i_b, t0 + BT, T, D, o_d, m_d, im, wcol, TT, IS_SCAN,
                                         HAS_RESET, EVEN)
        else:
            r0, r1, r2, p = split_load(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, im, wcol, TT, IS_SCAN, HAS_RESET, EVEN)
        valid = tl.trans(t < T)[:, :, None]
        keep = (p != 0)[:, :, None]
        a, b, xv, sx, sa, mult, u = coeffs_vk(r0, r1, r2, valid, keep, sp, IS_SCAN, ACC)
        hh, h_prev, h, hw = split_states(a, b, h, ii, wcol, TT, W, False, ACC)
        if SAVE and WS:
            tl.store(hs + ((i_b * NT + i_t) * W + wcol) * D + o_d[None, :], hw, mask=m_d[None, :])
        tl.store(y + base + rel, out(mem_order(hh, True), y, RNE), mask=m)
        if PREFETCH:
            r0, r1, r2, p = n0, n1, n2, n_p
    program_end(ht, ht, i_b, D, o_d, m_d, h, h, STORE_HT, False)


@triton.jit(do_not_specialize=["T"])
def split_bwd_kernel(
    x, gx, ga, ap, pos, hs, dy, dht, dx, dgx, dga, dh0, dsp_part, T, D,
    IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    TT: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    EVEN: tl.constexpr, WS: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr,
    VEC: tl.constexpr,
):
    i_b, o_d, m_d, sp, r = program_start(ap, dht, D, BD, VEC, IS_SCAN, HAS_DHT, ACC)
    ii = tl.arange(0, TT)[:, None]
    wcol = tl.arange(0, W)[:, None]
    im = tl.arange(0, TT)[None, :]
    # With saved segment states (WS) warp w holds segment W - 1 - w, so the adjoint's
    # composition from the tile's end runs forward over the warps (Triton's reverse scan
    # across warps costs lane shuffles); without, the forward order of split_states.
    if WS:
        seg = W - 1 - wcol
    else:
        seg = wcol
    dsp = tl.zeros([W, BD], ACC)
    BT: tl.constexpr = TT * W
    NT = tl.cdiv(T, BT)
    if PREFETCH:
        t_last = (NT - 1) * BT
        t_l, base_l, rel, m = split_offsets(i_b, t_last, T, D, o_d, m_d, im, seg, TT, EVEN)
        r0, r1, r2, p = split_load(x, gx, ga, pos, i_b, t_last, T, D, o_d, m_d, im, seg, TT, IS_SCAN, HAS_RESET, EVEN)
        dyr = mem_order(tl.load(dy + base_l + rel, mask=m, other=0.0), True)
        hin = load_entry(hs, i_b, NT - 1, NT, D, o_d, m_d, seg, W, WS)
    for j in tl.range(0, NT, num_stages=STAGES):
        i_t = NT - 1 - j
        t0 = i_t * BT
        t, base, rel, m = split_offsets(i_b, t0, T, D, o_d, m_d, im, seg, TT, EVEN)
        if PREFETCH:
            t_n, base_n, reln, mn = split_offsets(i_b, t0 - BT, T, D, o_d, m_d, im, seg, TT, EVEN)
            n0, n1, n2, n_p = split_load(x, gx, ga, pos, i_b, t0 - BT, T, D, o_d, m_d, im, seg, TT, IS_SCAN,
                                         HAS_RESET, EVEN)
            n_dy = mem_order(tl.load(dy + base_n + reln, mask=mn, other=0.0), True)
            n_hin = load_entry(hs, i_b, tl.maximum(i_t - 1, 0), NT, D, o_d, m_d, seg, W, WS)
        else:
            r0, r1, r2, p = split_load(x, gx, ga, pos, i_b, t0, T, D, o_d, m_d, im, seg, TT, IS_SCAN, HAS_RESET, EVEN)
            dyr = mem_order(tl.load(dy + base + rel, mask=m, other=0.0), True)
            hin = load_entry(hs, i_b, i_t, NT, D, o_d, m_d, seg, W, WS)
        valid = tl.trans(t < T)[:, :, None]
        keep = (p != 0)[:, :, None]
        a, b, xv, sx, sa, mult, u = coeffs_vk(r0, r1, r2, valid, keep, sp, IS_SCAN, ACC)
        if WS:
            h, hprev = warp_states(a, b, hin, IS_SCAN, ACC)
        else:
            h, hprev, h_out, h_w = split_states(a, b, hin, ii, wcol, TT, W, IS_SCAN, ACC)
        dyv = dyr.to(ACC)
        # per warp: the reverse adjoint maps from the segment's end (time in registers)
        ea, eb, ia, ib = adjoint_scans(dyv, a, ACC, True)
        first = ii[:, :, None]
        ga_w = row_of(ia, first, 0)
        gb_w = row_of(ib, first, 0)
        # [W, BD] across warps, from the tile's end: the carry entering segment w from
        # after it (exclusive) and leaving segment w at its first row (inclusive)
        xa, xb, ja, jb = excl_scan(ga_w, gb_w, ACC, not WS)
        rw = xa * r[None, :] + xb
        r_first, dsp_t = tile_grads_given(dyv, dx + base, dgx + base, dga + base, rel, m, valid, keep, a, b, xv,
                                          sx, sa, mult, u, h, hprev, rw, ea, eb, ia, ib, sp, ii, IS_SCAN, ACC, RNE,
                                          True)
        # the carry leaving the tile at its first step: the first segment's
        r = row_of(ja * r[None, :] + jb, seg, 0)
        if not IS_SCAN:
            dsp += dsp_t
        if PREFETCH:
            r0, r1, r2, p, dyr, hin = n0, n1, n2, n_p, n_dy, n_hin
    program_end(dh0, dsp_part, i_b, D, o_d, m_d, r, tl.sum(dsp, axis=0), STORE_DH0, not IS_SCAN)
