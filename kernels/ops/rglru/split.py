"""Serial kernels with the time axis split across warps (the serial backend's default,
time_warps = W > 1).

A program owns BD = 64 channels of one sequence (2 per lane) and walks time in tiles of
W * TT steps (TT = chunk_size). Warp w holds the TT consecutive steps w * TT ..
w * TT + TT - 1 of a tile, each thread its two channels' TT steps in registers: the tile
is addressed in memory order [W, TT, BD], which makes Triton's coalescing choose that
layout, and tl.permute relabels the same registers as [TT, W, BD] (common.mem_order)
for the scans along axis 0. Offsets are int32 from one int64 base per tile; when T and
D are multiples of the tile (EVEN) no element masks are formed. num_stages > 1
pipelines the loads through shared memory (cp.async); num_stages = 1 prefetches the
next tile into registers instead.

Per tile, forward: (1) each warp scans its TT steps in registers from a zero state;
(2) the W segment maps ([W, BD]) are composed across warps by one small associative
scan carrying the exclusive and the inclusive composition (common.affine_excl);
(3) the state entering segment w is its exclusive prefix applied to the carry; the
outputs are stored and the carry becomes the inclusive composition applied to it.
The backward walks the tiles in reverse with the same split. With TT >= 8 (WS) the
forward saved the state entering every warp's segment ([B, T / TT, D] FP32), so each
warp recomputes its states alone and the warps hold the segments last first, so that
their reverse adjoint maps compose across warps by a forward scan; with shorter
segments the forward saved the state entering each tile and the backward recomputes
states with steps 1-3. The gradients are common.tile_grads_given's; the a_param
partials stay per warp until the end.

Why: one thread per channel column alone leaves B * D / 2 threads on serial chains,
too few to cover memory latency; the split multiplies the threads by W while each
element still costs one in-register scan step, and only 1 / TT of the elements take
part in the cross-warp composition. Inputs are read once per pass, outputs written once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import adjoint_scans, affine, affine_excl, coeffs_vk, mem_order, out, program_start, tile_grads_given


def even(T: int, D: int, cfg: dict) -> bool:
    """Whether T and D are multiples of the tile (no element masks), after checking that a
    tile's int32 offsets cannot overflow."""
    if (cfg["BT"] + 1) * D >= 2 ** 31:
        raise ValueError(f"expected (time_warps * chunk_size + 1) * D < 2**31 for the split kernels' int32 tile "
                         f"offsets, got D = {D} with a tile of {cfg['BT']} steps")
    return T % cfg["BT"] == 0 and D % cfg["BD"] == 0


@triton.jit
def split_offsets(i_b, t0, T, D, o_d, m_d, im, seg, TT: tl.constexpr, EVEN: tl.constexpr):
    """The tile of steps t0 .. t0 + W * TT - 1, warp row w holding segment seg[w]: [W, TT]
    time steps t0 + seg[w] * TT + i, the tile's first element (int64 scalar), element
    offsets from it in memory order [W, TT, BD] (int32: one wide multiply-add per
    address) and the mask (EVEN: T and D are multiples of the tile, so only whole tiles
    outside [0, T), which the prefetch reaches, are masked, by one uniform predicate).

    The last axis is contiguous, so Triton's coalescing puts lanes along it; the others
    have equal contiguity and Triton orders such dims by position, so the warps go along
    axis 0 and axis 1 stays in each thread's registers. common.mem_order relabels it as
    the [TT, W, BD] view the scans use."""
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
    """The tile's inputs as stored, [TT, W, BD], and its positions [TT, W]; as
    common.load_raw."""
    t, base, rel, m = split_offsets(i_b, t0, T, D, o_d, m_d, im, seg, TT, EVEN)
    if HAS_RESET:
        p = tl.load(pos + i_b * T + t, mask=(t >= 0) & (t < T), other=1)
    else:
        p = t * 0 + 1
    if IS_SCAN:
        r0 = tl.load(ga + base + rel, mask=m, other=1.0)
        r1 = tl.load(x + base + rel, mask=m, other=0.0)
        r2 = r1
    else:
        r0 = tl.load(x + base + rel, mask=m, other=0.0)
        r1 = tl.load(gx + base + rel, mask=m, other=0.0)
        r2 = tl.load(ga + base + rel, mask=m, other=0.0)
    return mem_order(r0, True), mem_order(r1, True), mem_order(r2, True), tl.trans(p)


@triton.jit
def row_of(v, idx, k):
    """v [N, ...] -> v[k] (a sum of one non-zero term, exact); idx = tl.arange(0, N)
    shaped to broadcast along axis 0."""
    return tl.sum(tl.where(idx == k, v, 0.0), axis=0)


@triton.jit
def split_states(a, b, hin, ii, wcol, TT: tl.constexpr, W: tl.constexpr, IS_SCAN: tl.constexpr,
                 ACC: tl.constexpr):
    """[TT, W, BD] states of a tile from the [BD] state entering it: (h, hprev, hout)
    with h_t, the state the scan's adjoint needs (h_{t-1} for the bare scan, h_t for the
    RG-LRU: see common.tile_states) and the [BD] state leaving the tile."""
    if IS_SCAN:
        ea, eb, A, Bs = tl.associative_scan((tl.full(a.shape, 1.0, ACC), tl.zeros(a.shape, ACC), a, b), 0,
                                            affine_excl)
    else:
        A, Bs = tl.associative_scan((a, b), 0, affine)
    last = ii[:, :, None]
    sa = row_of(A, last, TT - 1)
    sb = row_of(Bs, last, TT - 1)
    # [W, BD]: the composition of the segments before w (exclusive) and up to w
    xa, xb, ia, ib = tl.associative_scan((tl.full(sa.shape, 1.0, ACC), tl.zeros(sa.shape, ACC), sa, sb), 0,
                                         affine_excl)
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
    """split_states given hw [W, BD], the state entering every warp's segment (saved by
    the forward): (h, hprev), each warp on its own, no cross-warp step."""
    if IS_SCAN:
        ea, eb, A, Bs = tl.associative_scan((tl.full(a.shape, 1.0, ACC), tl.zeros(a.shape, ACC), a, b), 0,
                                            affine_excl)
        h = A * hw[None, :, :] + Bs
        hprev = ea * hw[None, :, :] + eb
    else:
        A, Bs = tl.associative_scan((a, b), 0, affine)
        h = A * hw[None, :, :] + Bs
        hprev = h
    return h, hprev


@triton.jit
def load_entry(hs, i_b, i_t, NT, D, o_d, m_d, seg, W: tl.constexpr, WS: tl.constexpr):
    """The saved state entering tile i_t: [W, BD] per warp row, the entry of its segment
    seg[w] (WS), or [BD]."""
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
    if STORE_HT:
        tl.store(ht + i_b * D + o_d, h, mask=m_d)


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
        if WS:
            xa, xb, ja, jb = tl.associative_scan((tl.full(ga_w.shape, 1.0, ACC), tl.zeros(ga_w.shape, ACC), ga_w,
                                                  gb_w), 0, affine_excl)
        else:
            xa, xb, ja, jb = tl.associative_scan((tl.full(ga_w.shape, 1.0, ACC), tl.zeros(ga_w.shape, ACC), ga_w,
                                                  gb_w), 0, affine_excl, reverse=True)
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
    if STORE_DH0:
        tl.store(dh0 + i_b * D + o_d, r, mask=m_d)
    if not IS_SCAN:
        tl.store(dsp_part + i_b * D + o_d, tl.sum(dsp, axis=0), mask=m_d)
