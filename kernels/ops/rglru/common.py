"""Pieces shared by the serial and chunked RG-LRU / scan kernels.

B batch, T time, D channels; tiles [BT, BD] are time-major, channels contiguous; K
chunk length, NC = ceil(T / K). Recurrence values accumulate in ACC (FP32; float64
for float64 inputs). A step is the affine map z -> a z + b; tiles and chunks compose
their maps in order. The backward's adjoint runs the same scan in reverse over the maps
(a_t, a_t dy_t): mu_t = a_t mu_{t+1} + a_t dy_t, lam_t = dy_t + mu_{t+1}, mu_T = dL/dh_T,
dL/dh0 = mu_0; `affine_excl` carries the exclusive suffix lam needs with the inclusive one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..accounting import account
from ..checks import state_dtype
from ..triton_utils import INTERPRET, cdiv, empty, launcher, next_pow2, out, replayed, tl_acc


@triton.jit
def affine(a1, b1, a2, b2):
    # (a1, b1) is applied first: z -> a2 (a1 z + b1) + b2.
    return a1 * a2, a2 * b1 + b2


@triton.jit
def affine_excl(ea1, eb1, ia1, ib1, ea2, eb2, ia2, ib2):
    # A segment's (exclusive, inclusive) pair: "exclusive" composes every map of the
    # segment but its last one, "inclusive" composes all of them. One map alone is
    # (identity, itself). The pair of a concatenation L R is (ex_R o in_L, in_R o in_L).
    return ia1 * ea2, ea2 * ib1 + eb2, ia1 * ia2, ia2 * ib1 + ib2


@triton.jit
def excl_scan(a, b, ACC: tl.constexpr, REVERSE: tl.constexpr = False):
    # (exclusive, inclusive) compositions of the maps (a, b) along axis 0 (affine_excl)
    return tl.associative_scan((tl.full(a.shape, 1.0, ACC), tl.zeros(a.shape, ACC), a, b), 0, affine_excl,
                               reverse=REVERSE)


@triton.jit
def program_start(ap, init, D, BD: tl.constexpr, CH: tl.constexpr, VEC: tl.constexpr, IS_SCAN: tl.constexpr,
                  HAS_INIT: tl.constexpr, ACC: tl.constexpr):
    """A serial program's (i_b, channels, mask, softplus(a_param), its [BD] carry from `init`
    [B, D] or zeros): CH <= BD channels in a tile of BD lanes (CH < BD: the last BD - CH
    lanes idle, so that B x D / CH programs can match the multiprocessors)."""
    i_b = tl.program_id(1).to(tl.int64)
    o_d = tl.program_id(0) * CH + tl.arange(0, BD)
    if VEC > 0:
        # only VEC contiguous channels, so coalescing gives each thread VEC whole time
        # columns (the time scan is an in-register loop); VEC = 0: Triton decides
        o_d = tl.max_contiguous(o_d, VEC)
    m_d = o_d < D
    if CH < BD:
        m_d = m_d & (tl.arange(0, BD) < CH)
    sp = param_sp(ap, o_d, m_d, BD, IS_SCAN, ACC)
    v = tl.load(init + i_b * D + o_d, mask=m_d, other=0.0).to(ACC) if HAS_INIT else tl.zeros([BD], ACC)
    return i_b, o_d, m_d, sp, v


@triton.jit
def param_sp(ap, o_d, m_d, BD: tl.constexpr, IS_SCAN: tl.constexpr, ACC: tl.constexpr):
    # softplus(a_param) of the channels; zeros for the bare scan
    return tl.zeros([BD], ACC) if IS_SCAN else softplus(tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC))


@triton.jit
def softplus(x):
    # max(x, 0) + log1p(exp(-|x|)); log1p(z) = log(u) * z / (u - 1) with u = 1 + z is
    # accurate for small z (a_param sits near -9 to -4, where log(1 + z) is not).
    z = tl.exp(-tl.abs(x))
    u = 1.0 + z
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    return tl.maximum(x, 0.0) + tl.where(u == 1.0, z, tl.log(u) * (z / d))


@triton.jit
def one_minus_sq(a, log_a):
    # 1 - a^2 = -expm1(z), z = 2 log_a: near a = 1 (long memory) 1 - a*a from the rounded
    # a keeps few digits. FP32: for z > -1/2 the Taylor series of -expm1 through z^8 (the
    # rest is under 2^-26 relative; seven FMAs), else 1 - a*a (its rounding amplified at
    # most 1.6 times). Float64: Kahan's expm1(z) = (e - 1) z / log(e) with e = a*a.
    e = a * a
    z = 2.0 * log_a
    if a.dtype == tl.float64:
        near = (z > -1.0) & (e < 1.0)
        return tl.where(near, (1.0 - e) * (z / tl.log(tl.where(near, e, 0.5))), tl.where(z > -1.0, -z, 1.0 - e))
    s = z * (1.0 / 40320.0) + 1.0 / 5040.0
    s = s * z + 1.0 / 720.0
    s = s * z + 1.0 / 120.0
    s = s * z + 1.0 / 24.0
    s = s * z + 1.0 / 6.0
    s = s * z + 0.5
    s = s * z + 1.0
    return tl.where(z > -0.5, -z * s, 1.0 - e)


@triton.jit
def row_of(v, idx, k):
    """v [N, ...] -> v[k] (a sum of one non-zero term, exact); idx = tl.arange(0, N)
    shaped to broadcast along axis 0."""
    return tl.sum(tl.where(idx == k, v, 0.0), axis=0)


@triton.jit
def tile_offsets(i_b, t0, T, D, o_d, m_d, rows):
    """Element offsets (int64) and mask of the rows t0 + rows."""
    t = t0 + rows
    off = (i_b * T + t[:, None]) * D + o_d[None, :]
    m = ((t >= 0) & (t < T))[:, None] & m_d[None, :]
    return off, m


@triton.jit
def load_inputs(x, gx, ga, pos, off, m, t, T, IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr):
    """Inputs at `off` as stored and the positions of steps t. RG-LRU: (x, gate_x, gate_a,
    pos); scan: (a, b, b, pos)."""
    p = tl.load(pos + t, mask=(t >= 0) & (t < T), other=1) if HAS_RESET else t * 0 + 1
    if IS_SCAN:
        r0 = tl.load(ga + off, mask=m, other=1.0)
        r1 = tl.load(x + off, mask=m, other=0.0)
        r2 = r1
    else:
        r0 = tl.load(x + off, mask=m, other=0.0)
        r1 = tl.load(gx + off, mask=m, other=0.0)
        r2 = tl.load(ga + off, mask=m, other=0.0)
    return r0, r1, r2, p


@triton.jit
def coeffs(r0, r1, r2, valid, keep, ap_sp, IS_SCAN: tl.constexpr, ACC: tl.constexpr):
    """(a, b, xv, sx, sa, mult, u) of a loaded tile: rows past T (not `valid`) are identity
    maps, `keep` is False at resets."""
    if IS_SCAN:
        a = tl.where(valid, tl.where(keep, r0.to(ACC), 0.0), 1.0)
        b = r1.to(ACC)
        xv, sx, sa, mult, u = b, b, a, a, a
    else:
        xv = r0.to(ACC)
        sx = tl.sigmoid(r1.to(ACC))
        sa = tl.sigmoid(r2.to(ACC))
        log_a = -8.0 * sa * ap_sp
        a = tl.exp(log_a)
        u = one_minus_sq(a, log_a)
        mult = tl.where(keep, tl.sqrt(u), 1.0)
        a = tl.where(keep & valid, a, tl.where(valid, 0.0, 1.0))
        b = xv * sx * mult
    return a, b, xv, sx, sa, mult, u


@triton.jit
def load_tile(x, gx, ga, ap_sp, pos, i_b, t0, T, D, o_d, m_d, rows,
              IS_SCAN: tl.constexpr, HAS_RESET: tl.constexpr, ACC: tl.constexpr):
    """(off, m, valid, keep, a, b, xv, sx, sa, mult, u) of the rows t0 + rows."""
    off, m = tile_offsets(i_b, t0, T, D, o_d, m_d, rows)
    r0, r1, r2, p = load_inputs(x, gx, ga, pos + i_b * T, off, m, t0 + rows, T, IS_SCAN, HAS_RESET)
    valid = ((t0 + rows) < T)[:, None]
    keep = (p != 0)[:, None]
    a, b, xv, sx, sa, mult, u = coeffs(r0, r1, r2, valid, keep, ap_sp, IS_SCAN, ACC)
    return off, m, valid, keep, a, b, xv, sx, sa, mult, u


@triton.jit
def tile_states(a, b, hin, IS_SCAN: tl.constexpr, ACC: tl.constexpr):
    """The states h of a tile from the state entering it: h_t for the RG-LRU (its adjoint
    uses a h_{t-1} = h_t - b_t), h_{t-1} for the scan (da = lam h_{t-1})."""
    if IS_SCAN:
        A, Bs, _, _ = excl_scan(a, b, ACC)
    else:
        A, Bs = tl.associative_scan((a, b), 0, affine)
    return A * hin[None, :] + Bs


@triton.jit
def mem_order(v, SPLIT: tl.constexpr):
    """A split tile between scan order [TT, W, BD] and memory order [W, TT, BD] (the same
    registers relabelled); unchanged when not SPLIT."""
    return tl.permute(v, (1, 0, 2)) if SPLIT else v


@triton.jit
def tile_grads(dyv, dx, dgx, dga, off, m, valid, keep, a, b, xv, sx, sa, mult, u,
               h, r, sp, rows, IS_SCAN: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr,
               seg=None, W: tl.constexpr = 1):
    """Adjoint of one tile given its states h (tile_states) and r, mu after the tile [BD].
    Stores the activation gradients; returns (mu at its first row, d softplus partial).
    W > 1: a split tile (values in scan order [TT, W, BD], rows [TT, 1], off and m in
    memory order, warp row w holding segment seg[w]); the partial is [W, BD]."""
    dyv = dyv.to(ACC)
    ad = a * dyv
    # The reverse adjoint maps: lam_t = dy_t + ea_t r + eb_t for the carry r after the
    # tile (split: after the warp's segment); (ia, ib)'s first row maps r to mu there.
    if W > 1:
        # flip, scan, flip: Triton's reverse scan would add lane shuffles
        ea, eb, ia, ib = excl_scan(tl.flip(a, 0), tl.flip(ad, 0), ACC)
        ea, eb, ia, ib = tl.flip(ea, 0), tl.flip(eb, 0), tl.flip(ia, 0), tl.flip(ib, 0)
        first = rows[:, :, None]
        # [W, BD] across warps, from the tile's end: the carry entering segment w from
        # after it (exclusive) and leaving segment w at its first row (inclusive)
        xa, xb, ja, jb = excl_scan(row_of(ia, first, 0), row_of(ib, first, 0), ACC)
        rw = xa * r[None, :] + xb
    else:
        ea, eb, ia, ib = excl_scan(a, ad, ACC, True)
        rw = r
    lam = dyv + ea * rw[None, :] + eb
    if W > 1:
        # the carry leaving the tile at its first step: the first segment's
        r_new = row_of(ja * r[None, :] + jb, seg, 0)
    else:
        r_new = row_of(ia * r[None, :] + ib, rows[:, None], 0)
    if IS_SCAN:
        tl.store(dx + off, out(mem_order(lam, W > 1), dx, RNE), mask=m)
        tl.store(dga + off, out(mem_order(tl.where(keep, lam * h, 0.0), W > 1), dga, RNE), mask=m)
        dsp = tl.zeros(rw.shape, ACC)
    else:
        gxm = lam * mult
        tl.store(dx + off, out(mem_order(gxm * sx, W > 1), dx, RNE), mask=m)
        tl.store(dgx + off, out(mem_order(gxm * xv * sx * (1.0 - sx), W > 1), dgx, RNE), mask=m)
        # a h_{t-1} = h_t - b_t; d/dlog_a of a is a, of u = 1 - a^2 is -2 a^2; the
        # sqrt's derivative is clipped as in the official SqrtBoundDerivative.
        du = lam * xv * sx * tl.rsqrt(tl.maximum(4.0 * u, 1e-6))
        dlog = tl.where(keep & valid, lam * (h - b) - 2.0 * a * a * du, 0.0)
        tl.store(dga + off, out(mem_order(dlog * (-8.0 * sp[None, :]) * sa * (1.0 - sa), W > 1), dga, RNE), mask=m)
        dsp = tl.sum(dlog * (-8.0 * sa), axis=0)
    return r_new, dsp


@launcher
@triton.jit
def reduce_dap_kernel(part, ap, dap, R, D, BR: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, RNE: tl.constexpr):
    # dL/da_param = sigmoid(a_param) * sum over R rows of the d softplus partials, in a
    # fixed order (no atomics): bitwise reproducible.
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = o_d < D
    rows = tl.arange(0, BR)
    acc = tl.zeros([BD], ACC)
    for r0 in range(0, R, BR):
        r = r0 + rows
        v = tl.load(part + r[:, None].to(tl.int64) * D + o_d[None, :], mask=(r[:, None] < R) & m_d[None, :], other=0.0)
        acc += tl.sum(v, axis=0)
    apv = tl.load(ap + o_d, mask=m_d, other=0.0).to(ACC)
    tl.store(dap + o_d, out(acc * tl.sigmoid(apv), dap, RNE), mask=m_d)


_KEPT: dict = {}      # reduce_dap's replayed launches by sizes and dtypes (triton_utils.replayed)


def reduce_dap(part: torch.Tensor, a_param: torch.Tensor) -> torch.Tensor:
    """part: [R, D] partial d softplus(a_param) sums -> dL/da_param [D] in a_param's dtype."""
    part, a_param = part.contiguous(), a_param.contiguous()
    R, D = part.shape
    dap = empty((D,), a_param.dtype, part.device)
    BD = min(256, next_pow2(max(D, 1)))      # D = 0: one empty program, no division by 0
    replayed(_KEPT, (R, D, part.dtype, a_param.dtype), reduce_dap_kernel, (cdiv(D, BD),), (part, a_param, dap, R, D),
             3, BR=16, BD=BD, ACC=tl_acc(part.dtype), RNE=INTERPRET, num_warps=4)
    account("rglru_reduce_dap", (part, a_param), (dap,))
    return dap


def pass_inputs(is_scan, x, gx, ga, a_param, pos) -> tuple:
    """The tensors a pass reads besides states and gradients (accounting); scan: x = b, ga = a."""
    return (x, ga, pos) if is_scan else (x, gx, ga, pos, a_param)


def empty_sequence(x, h0, output_final_state):
    """(y [B, 0, D], the final state: h0 or zeros when asked) of a T = 0 call."""
    B, _, D = x.shape
    if output_final_state and h0 is None:
        h0 = torch.zeros(B, D, dtype=state_dtype(x.dtype), device=x.device)
    return x.new_zeros(B, 0, D), (h0 if output_final_state else None)
