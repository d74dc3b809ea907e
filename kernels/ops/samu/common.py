"""Pieces every SAMU backend shares: the per-token controller, the per-element transition and write, the controller's
backward and the parameter reductions. D = 2M width, M complex modes. `ctrl` [B*T, 4] keeps per token (E = exp(eta),
cos(delta) keep, sin(delta) keep, 0), keep = 0 at resets, so that a_t[m] = exp(-nu[m] E_t) exp(i (theta[m] + delta_t))
is formed in registers by angle addition; `aux` [B*T, 2] keeps the normalised projections (v_p, v_r) for the backward.
Nothing of shape [B, T, M] is stored; complex states travel as view_as_real pairs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..accounting import account
from ..checks import MODE_CONSTS
from ..triton_utils import cdiv, launcher, next_pow2, replayed, scratch
from ..triton_utils import empty as alloc
from ..triton_utils import tl_acc as tl_dtype

_CONSTANTS: dict = {}     # kept for the process's life: a CUDA graph captured reading one must never see it freed
_KEPT: dict = {}          # the controls' replayed launches by site, sizes and each tensor's dtype (`replayed`)


def scalar_param(v, device, dtype) -> torch.Tensor:
    """Amplitude as a one-element tensor on the device: a float becomes a cached constant (no
    fill per call), except under torch.compile and a capture that finds none cached yet."""
    if isinstance(v, torch.Tensor):
        return v.reshape(1).to(device=device, dtype=dtype)
    v = float(v)
    if torch.compiler.is_compiling():
        return torch.full((1,), v, device=device, dtype=dtype)
    key = (v, math.copysign(1.0, v), device, dtype)     # the sign keys -0.0 apart from 0.0
    t = _CONSTANTS.get(key)
    if t is None:       # a capture would record the new constant's fill only
        t = torch.full((1,), v, device=device, dtype=dtype)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return t
        # neither a fake/traced tensor nor NaN (never equal to itself as a key)
        if type(t) is torch.Tensor and v == v:
            _CONSTANTS[key] = t
    return t


@triton.jit
def relu(h):
    # NaN propagates as in torch.relu (tl.maximum's default drops it on the GPU); the backwards pass dy where not
    # h <= 0, as torch's threshold_backward does.
    return tl.maximum(h, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tanh(x):
    # libdevice's tanh does not run in the interpreter.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def mode_consts64(nu_log, theta_log, offs_m, mask_m, ACC: tl.constexpr):
    """Per-mode constants in float64, rounded once: nu, theta, cos, sin theta, gamma = sqrt(1 - e^{-2 nu}) + 1e-8
    (cancels in FP32 for small nu), nu dgamma/dnu and lnr = log |(cos theta, sin theta)| of the rounded pair: the
    transition exp(-(nu E + lnr)) (cos theta, sin theta)(cos delta, sin delta) then has no |a| bias of a few 1e-8
    per step (a drift over the ~1/(1-|a|) steps a mode remembers)."""
    nu = tl.exp(tl.load(nu_log + offs_m, mask=mask_m, other=0.0).to(tl.float64))
    th = tl.exp(tl.load(theta_log + offs_m, mask=mask_m, other=0.0).to(tl.float64))
    ct, st = tl.cos(th).to(ACC), tl.sin(th).to(ACC)
    ct64, st64 = ct.to(tl.float64), st.to(tl.float64)
    lnr = 0.5 * tl.log(ct64 * ct64 + st64 * st64)
    e2 = tl.exp(-2.0 * nu)
    u = 1.0 - e2
    gam = tl.sqrt(tl.maximum(u, 0.0)) + 1e-8
    dgam = tl.where(u > 0.0, nu * e2 / tl.sqrt(tl.where(u > 0.0, u, 1.0)), 0.0)
    return nu.to(ACC), th.to(ACC), ct, st, gam.to(ACC), lnr.to(ACC), dgam.to(ACC)


def mode_table(nu_log, theta_log, acc):
    """[MODE_CONSTS, M]: mode_consts64's constants, one row each (one coalesced load per block of modes)."""
    return controls_fwd(None, None, None, None, None, None, nu_log, theta_log, acc)[2]


@triton.jit
def load_modes(modes, M, offs_m, mask_m):
    """The modes' (nu, cos theta, sin theta, gamma, lnr) from the mode table [MODE_CONSTS, M]."""
    nu = tl.load(modes + offs_m, mask=mask_m, other=1.0)
    ct = tl.load(modes + 2 * M + offs_m, mask=mask_m, other=1.0)
    st = tl.load(modes + 3 * M + offs_m, mask=mask_m, other=0.0)
    gam = tl.load(modes + 4 * M + offs_m, mask=mask_m, other=0.0)
    lnr = tl.load(modes + 5 * M + offs_m, mask=mask_m, other=0.0)
    return nu, ct, st, gam, lnr


@triton.jit
def mode_block(modes, M, BM: tl.constexpr, B_AXIS: tl.constexpr):
    """A program's (mode block pid_m, sequence b = program_id(B_AXIS), offs_m, mask_m, the modes' constants)."""
    pid_m = tl.program_id(0)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    nu, ct, st, gam, lnr = load_modes(modes, M, offs_m, mask_m)
    return pid_m, tl.program_id(B_AXIS).to(tl.int64), offs_m, mask_m, nu, ct, st, gam, lnr


@triton.jit
def step_in(ctrl_b, x_b, t, T, D, M, offs_m, mask_m, nu, ct, st, lnr, ACC: tl.constexpr):
    """Step t's (valid, mode mask, row offset, E, transition (ar, ai), input (xr, xi)); identity past T. No
    device-function call inside: each costs the interpreter milliseconds, once per step."""
    valid = t < T
    E = tl.load(ctrl_b + t * 4, mask=valid, other=0.0)
    ck, sk = tl.load(ctrl_b + t * 4 + 1, mask=valid, other=0.0), tl.load(ctrl_b + t * 4 + 2, mask=valid, other=0.0)
    mag = tl.exp(-(nu * E + lnr))
    ar, ai = tl.where(valid, mag * (ct * ck - st * sk), 1.0), tl.where(valid, mag * (st * ck + ct * sk), 0.0)
    lm = mask_m & valid
    row = t.to(tl.int64) * D
    xr = tl.load(x_b + row + offs_m, mask=lm, other=0.0).to(ACC)
    xi = tl.load(x_b + row + M + offs_m, mask=lm, other=0.0).to(ACC)
    return valid, lm, row, E, ar, ai, xr, xi


@triton.jit
def fwd_steps(hr, hi, pr, pi, x_b, y_b, ctrl_b, t0, T, D, M, offs_m, mask_m, nu, ct, st, gam, lnr,
              K: tl.constexpr, U: tl.constexpr, WRITE_Y: tl.constexpr, PROD: tl.constexpr, ACC: tl.constexpr):
    """K steps h <- a h + gamma x from t0, U unrolled at a time (full unrolling makes Triton's coalescing pass
    quadratic in compile time); optionally writes y = relu(h) and the chunk's product p <- a p."""
    for j0 in range(0, K, U):
        for u in tl.static_range(U):
            t = t0 + j0 + u
            valid, lm, row, E, ar, ai, xr, xi = step_in(ctrl_b, x_b, t, T, D, M, offs_m, mask_m, nu, ct, st, lnr, ACC)
            hr, hi = ar * hr - ai * hi + gam * xr, ar * hi + ai * hr + gam * xi
            if PROD:
                pr, pi = ar * pr - ai * pi, ar * pi + ai * pr
            if WRITE_Y:
                tl.store(y_b + row + offs_m, relu(hr).to(y_b.dtype.element_ty), mask=lm)
                tl.store(y_b + row + M + offs_m, relu(hi).to(y_b.dtype.element_ty), mask=lm)
    return hr, hi, pr, pi


@triton.jit
def bwd_chunk(hr, hi, Rr, Ri, acc_nu, acc_th, acc_g, ckpt, x_b, dy_b, dxw_b, dpart, ctrl_b, tok0, t0, T, D, M,
              NMB, pid_m, offs_m, mask_m, nu, ct, st, gam, lnr,
              K: tl.constexpr, U: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    """Adjoint walk over the K tokens from t0 given h before t0 and the carry R = conj(a_{t0+K}) lam_{t0+K} (lam_t =
    g_t + R), U tokens at a time in reverse, each group's states recomputed from the one before it, saved in this
    program's slots ckpt [K/U, BM, 2] (read back by the same threads: no barrier). Writes gamma lam (dL/dx of the
    write) to dxw and the per-token sums over this mode block of dL/deta, dL/ddelta to dpart [B*T, NMB, 2];
    accumulates the per-mode sums of the nu / theta / gamma gradients; returns the carry conj(a_{t0}) lam_{t0}."""
    lane = tl.arange(0, BM)
    for q in range(0, K // U):
        store_pair(ckpt, q * BM + lane, hr, hi, mask_m)
        hr, hi, _, _ = fwd_steps(hr, hi, hr, hi, x_b, x_b, ctrl_b, t0 + q * U, T, D, M, offs_m, mask_m,
                                 nu, ct, st, gam, lnr, U, U, False, False, ACC)
    for qq in range(0, K // U):
        q = K // U - 1 - qq
        hr, hi = load_pair(ckpt, q * BM + lane, mask_m, 0.0, 0.0)
        t1 = t0 + q * U
        hs_r, hs_i = (hr,), (hi,)
        for j in tl.static_range(U):
            valid, lm, row, E, ar, ai, xr, xi = step_in(ctrl_b, x_b, t1 + j, T, D, M, offs_m, mask_m, nu, ct, st,
                                                        lnr, ACC)
            hr, hi = ar * hr - ai * hi + gam * xr, ar * hi + ai * hr + gam * xi
            hs_r, hs_i = hs_r + (hr,), hs_i + (hi,)
        for jj in tl.static_range(U):
            t = t1 + (U - 1 - jj)
            valid, lm, row, E, ar, ai, xr, xi = step_in(ctrl_b, x_b, t, T, D, M, offs_m, mask_m, nu, ct, st, lnr, ACC)
            dyr = tl.load(dy_b + row + offs_m, mask=lm, other=0.0).to(ACC)
            dyi = tl.load(dy_b + row + M + offs_m, mask=lm, other=0.0).to(ACC)
            lr = tl.where(hs_r[U - jj] <= 0.0, 0.0, dyr) + Rr
            li = tl.where(hs_i[U - jj] <= 0.0, 0.0, dyi) + Ri
            tl.store(dxw_b + row + offs_m, gam * lr, mask=lm)
            tl.store(dxw_b + row + M + offs_m, gam * li, mask=lm)
            # G = lam conj(h_{t-1}); dL/dlog|a| = Re(G conj a), dL/darg a = Im(G conj a)
            gr = lr * hs_r[U - 1 - jj] + li * hs_i[U - 1 - jj]
            gi = li * hs_r[U - 1 - jj] - lr * hs_i[U - 1 - jj]
            dl, dph = tl.where(valid, gr * ar + gi * ai, 0.0), tl.where(valid, gi * ar - gr * ai, 0.0)
            tok = ((tok0 + t).to(tl.int64) * NMB + pid_m) * 2
            tl.store(dpart + tok, -E * tl.sum(nu * dl, axis=0), mask=valid)
            tl.store(dpart + tok + 1, tl.sum(dph, axis=0), mask=valid)
            acc_nu += E * dl
            acc_th += dph
            acc_g += lr * xr + li * xi
            Rr, Ri = ar * lr + ai * li, ar * li - ai * lr
    return Rr, Ri, acc_nu, acc_th, acc_g


@triton.jit
def store_param_partials(ppart, row, modes, offs_m, mask_m, M, acc_nu, acc_th, acc_g):
    """Per-mode partial gradients of nu_log (transition + write) and theta_log."""
    nu = tl.load(modes + offs_m, mask=mask_m, other=0.0)
    th = tl.load(modes + M + offs_m, mask=mask_m, other=0.0)
    dgam = tl.load(modes + 6 * M + offs_m, mask=mask_m, other=0.0)
    base = ppart + (row.to(tl.int64) * M + offs_m) * 2
    tl.store(base, dgam * acc_g - nu * acc_nu, mask=mask_m)
    tl.store(base + 1, th * acc_th, mask=mask_m)


@triton.jit
def load_pair(ptr, idx, mask, other_re, other_im):
    return tl.load(ptr + idx * 2, mask=mask, other=other_re), tl.load(ptr + idx * 2 + 1, mask=mask, other=other_im)


@triton.jit
def store_pair(ptr, idx, re, im, mask):
    tl.store(ptr + idx * 2, re, mask=mask)
    tl.store(ptr + idx * 2 + 1, im, mask=mask)


@triton.jit
def load_state(ptr, idx, mask, HAS: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    # a complex [BM] state from ptr, or zeros
    if HAS:
        re, im = load_pair(ptr, idx, mask, 0.0, 0.0)
    else:
        re, im = tl.zeros([BM], ACC), tl.zeros([BM], ACC)
    return re, im


@triton.jit
def dir_cols(pd, rd, d0, n, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Columns d0 .. d0 + BLOCK - 1 (those < n: cols, cm) of both directions (wp, wr)."""
    cols = d0 + tl.arange(0, BLOCK)
    cm = cols < n
    return cols, cm, tl.load(pd + cols, mask=cm, other=0.0).to(ACC), tl.load(rd + cols, mask=cm, other=0.0).to(ACC)


@triton.jit
def dir_norms(pd, rd, D, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """|pd| and |rd| over their D + 1 entries (the bias included)."""
    wpp, wrr = tl.zeros([BLOCK], ACC), tl.zeros([BLOCK], ACC)
    for d0 in range(0, D + 1, BLOCK):
        cols, cm, wp, wr = dir_cols(pd, rd, d0, D + 1, BLOCK, ACC)
        wpp, wrr = wpp + wp * wp, wrr + wr * wr
    return tl.sqrt(tl.sum(wpp, axis=0)), tl.sqrt(tl.sum(wrr, axis=0))


@triton.jit
def controller(zp, zr, wpp, wrr, pd, rd, pa, ra, D, scale, ACC: tl.constexpr):
    """From the projections z = x . w[:D] and the squared norms of w[:D]: the normalised projections vp, vr (the
    biases pd[D], rd[D] added), eta and delta. Float64 where FP32 loses digits (tanh near 0, 1 + r^2); delta
    rounded to ACC for its cos and sin."""
    bp, br = tl.load(pd + D).to(ACC), tl.load(rd + D).to(ACC)
    vp, vr = (zp + bp) / tl.sqrt(wpp + bp * bp), (zr + br) / tl.sqrt(wrr + br * br)
    p, r = tanh(vp.to(tl.float64)), tanh(vr.to(tl.float64))
    delta = scale * tanh(tl.load(pa).to(tl.float64)) * p
    eta = scale * tanh(tl.load(ra).to(tl.float64)) * r / (1.0 + r * r)
    return vp, vr, eta, delta.to(ACC)


@launcher
@triton.jit(do_not_specialize=["NTOK", "NTB", "D", "M"])
def _controls_fwd_kernel(x, pd, rd, pa, ra, seg, ctrl, aux, nu_log, theta_log, tab, NTOK, NTB, D, M, scale,
                         HAS_SEG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
                         ACC: tl.constexpr):
    """Programs [0, NTB): ctrl and aux of BLOCK_T tokens (rows of x [B*T, D]) each; the rest: a block of the mode
    table (its own launch would cost a launch boundary per forward)."""
    pid = tl.program_id(0)
    if pid < NTB:
        tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = tok < NTOK
        # [BLOCK_T, BLOCK_D] accumulators reduced after the loop (a reduction inside it: shuffles and shared-memory
        # round trips per element)
        zp2, zr2 = tl.zeros([BLOCK_T, BLOCK_D], ACC), tl.zeros([BLOCK_T, BLOCK_D], ACC)
        wpp, wrr = tl.zeros([BLOCK_D], ACC), tl.zeros([BLOCK_D], ACC)
        for d0 in range(0, D, BLOCK_D):
            cols, cm, wp, wr = dir_cols(pd, rd, d0, D, BLOCK_D, ACC)
            xt = tl.load(x + tok[:, None] * D + cols[None, :], mask=tmask[:, None] & cm[None, :], other=0.0).to(ACC)
            zp2, zr2 = zp2 + xt * wp[None, :], zr2 + xt * wr[None, :]
            wpp, wrr = wpp + wp * wp, wrr + wr * wr
        vp, vr, eta, delta = controller(tl.sum(zp2, axis=1), tl.sum(zr2, axis=1), tl.sum(wpp, axis=0),
                                      tl.sum(wrr, axis=0), pd, rd, pa, ra, D, scale, ACC)
        c, s = tl.cos(delta), tl.sin(delta)
        if HAS_SEG:     # the phase zeroed at resets
            keep = tl.load(seg + tok, mask=tmask, other=1) != 0
            c, s = tl.where(keep, c, 0.0), tl.where(keep, s, 0.0)
        tl.store(ctrl + tok * 4, tl.exp(eta).to(ACC), mask=tmask)
        tl.store(ctrl + tok * 4 + 1, c, mask=tmask)
        tl.store(ctrl + tok * 4 + 2, s, mask=tmask)
        tl.store(ctrl + tok * 4 + 3, tl.zeros(c.shape, ACC), mask=tmask)
        tl.store(aux + tok * 2, vp, mask=tmask)
        tl.store(aux + tok * 2 + 1, vr, mask=tmask)
    else:
        offs_m = (pid - NTB) * BM + tl.arange(0, BM)
        mask_m = offs_m < M
        consts = mode_consts64(nu_log, theta_log, offs_m, mask_m, ACC)
        for i in tl.static_range(7):        # the table's rows, in mode_consts64's order
            tl.store(tab + i * M + offs_m, consts[i], mask=mask_m)


def controls_fwd(x, phase_dir, radial_dir, phase_amp, radial_amp, segment_pos, nu_log, theta_log, acc):
    """x [B, T, D] -> ctrl [B*T, 4], aux [B*T, 2] and the mode table [MODE_CONSTS, M] in the accumulation dtype
    `acc`, in one launch; x None: the table alone."""
    M = nu_log.shape[0]
    ntok = 0 if x is None else x.shape[0] * x.shape[1]
    # apart, not carved from one buffer: the custom op kernels::samu_fwd returns them, which must not alias
    ctrl, aux, tab = (alloc(s, acc, nu_log.device) for s in ((ntok, 4), (ntok, 2), (MODE_CONSTS, M)))
    BLOCK_T, BM = 16, 128
    ntb = cdiv(ntok, BLOCK_T)
    D = 2 * M
    seg = segment_pos.contiguous() if segment_pos is not None else ctrl
    tensors = (x, phase_dir, radial_dir, phase_amp, radial_amp) if ntok else (tab,) * 5
    args = (*tensors, seg, ctrl, aux, nu_log, theta_log, tab, ntok, ntb, D, M, 1.0 / math.sqrt(M))
    replayed(_KEPT, ("fwd", ntok, M, segment_pos is None, *[t.dtype for t in args[:11]]), _controls_fwd_kernel,
             (ntb + cdiv(M, BM),), args, 11, HAS_SEG=segment_pos is not None, BLOCK_T=BLOCK_T,
             BLOCK_D=min(256, next_pow2(D)), BM=BM, ACC=tl_dtype(acc), num_warps=4)
    account("samu_controls_fwd", (x, phase_dir, radial_dir, segment_pos, nu_log, theta_log), (ctrl, aux, tab))
    return ctrl, aux, tab


@launcher
@triton.jit(do_not_specialize=["NTOK", "D", "NMB"])
def _controls_bwd_kernel(dxw, x, aux, dpart, pd, rd, pa, ra, dx, colpart, scalpart, NTOK, D, NMB, scale,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NMBP: tl.constexpr, ACC: tl.constexpr):
    """dx = dx_write + dv_p pd / |pd| + dv_r rd / |rd| per token, plus per-block partial sums for the direction and
    amplitude gradients."""
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < NTOK
    mb = tl.arange(0, NMBP)
    pm = tmask[:, None] & (mb[None, :] < NMB)
    poffs = (tok[:, None] * NMB + mb[None, :]) * 2
    deta = tl.sum(tl.load(dpart + poffs, mask=pm, other=0.0), axis=1)
    ddel = tl.sum(tl.load(dpart + poffs + 1, mask=pm, other=0.0), axis=1)
    vp = tl.load(aux + tok * 2, mask=tmask, other=0.0).to(tl.float64)
    vr = tl.load(aux + tok * 2 + 1, mask=tmask, other=0.0).to(tl.float64)
    p, r = tanh(vp), tanh(vr)
    tpa, tra = tanh(tl.load(pa).to(tl.float64)), tanh(tl.load(ra).to(tl.float64))
    q = 1.0 + r * r
    dvp64 = scale * tpa * ddel * (1.0 - p * p)
    dvr64 = scale * tra * (1.0 - r * r) / (q * q) * deta * (1.0 - r * r)
    dvp, dvr = dvp64.to(ACC), dvr64.to(ACC)
    sbase = scalpart + pid.to(tl.int64) * 8
    tl.store(sbase + 0, tl.sum(dvp64, axis=0).to(ACC))
    tl.store(sbase + 1, tl.sum(dvr64, axis=0).to(ACC))
    tl.store(sbase + 2, tl.sum(dvp64 * vp, axis=0).to(ACC))
    tl.store(sbase + 3, tl.sum(dvr64 * vr, axis=0).to(ACC))
    tl.store(sbase + 4, tl.sum(ddel * p, axis=0).to(ACC))
    tl.store(sbase + 5, tl.sum(deta * r / q, axis=0).to(ACC))
    tl.store(sbase + 6, 0.0)
    tl.store(sbase + 7, 0.0)
    np_, nr_ = dir_norms(pd, rd, D, BLOCK_D, ACC)
    inv_np, inv_nr = 1.0 / np_, 1.0 / nr_
    for d0 in range(0, D, BLOCK_D):
        cols, cm, wp, wr = dir_cols(pd, rd, d0, D, BLOCK_D, ACC)
        m2 = tmask[:, None] & cm[None, :]
        offs = tok[:, None] * D + cols[None, :]
        g = (tl.load(dxw + offs, mask=m2, other=0.0) + dvp[:, None] * (wp * inv_np)[None, :]
             + dvr[:, None] * (wr * inv_nr)[None, :])
        tl.store(dx + offs, g.to(dx.dtype.element_ty), mask=m2)
        xt = tl.load(x + offs, mask=m2, other=0.0).to(ACC)
        cbase = colpart + pid.to(tl.int64) * 2 * D
        tl.store(cbase + cols, tl.sum(dvp[:, None] * xt, axis=0), mask=cm)
        tl.store(cbase + D + cols, tl.sum(dvr[:, None] * xt, axis=0), mask=cm)


@triton.jit
def _colsum(ptr, R, C, cols, cm, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """Sum over the R rows of a [R, C] matrix for the given columns, in a fixed order."""
    acc = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        acc += tl.load(ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
                       mask=(rows[:, None] < R) & cm[None, :], other=0.0)
    return tl.sum(acc, axis=0)


@launcher
@triton.jit(do_not_specialize=["NTB", "RP", "D", "M", "NDB"])
def _finalize_kernel(colpart, scalpart, ppart, pd, rd, pa, ra, dpd, drd, damp, dmode, NTB, RP, D, M, scale,
                     NDB, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """Deterministic reductions of the per-block partials into the parameter gradients. Programs [0, NDB) own
    direction columns, the rest own mode columns."""
    pid = tl.program_id(0)
    if pid < NDB:
        sc = tl.arange(0, 8)
        s = _colsum(scalpart, NTB, 8, sc, sc < 8, BLOCK_R, 8, ACC)
        s_vp = tl.sum(tl.where(sc == 2, s, 0.0), axis=0)
        s_vr = tl.sum(tl.where(sc == 3, s, 0.0), axis=0)
        np_, nr_ = dir_norms(pd, rd, D, BLOCK_C, ACC)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cols < D
        gp = _colsum(colpart, NTB, 2 * D, cols, cm, BLOCK_R, BLOCK_C, ACC)
        gr = _colsum(colpart + D, NTB, 2 * D, cols, cm, BLOCK_R, BLOCK_C, ACC)
        # bias entry (index D): sum of dv over tokens
        isb = cols == D
        gp = tl.where(isb, tl.sum(tl.where(sc == 0, s, 0.0), axis=0), gp)
        gr = tl.where(isb, tl.sum(tl.where(sc == 1, s, 0.0), axis=0), gr)
        _, wm, wp, wr = dir_cols(pd, rd, pid * BLOCK_C, D + 1, BLOCK_C, ACC)
        tl.store(dpd + cols, gp / np_ - wp * s_vp / (np_ * np_), mask=wm)
        tl.store(drd + cols, gr / nr_ - wr * s_vr / (nr_ * nr_), mask=wm)
        if pid == 0:
            tpa, tra = tanh(tl.load(pa).to(tl.float64)), tanh(tl.load(ra).to(tl.float64))
            s_dp = tl.sum(tl.where(sc == 4, s, 0.0), axis=0)
            s_de = tl.sum(tl.where(sc == 5, s, 0.0), axis=0)
            tl.store(damp, (scale * (1.0 - tpa * tpa) * s_dp).to(ACC))
            tl.store(damp + 1, (scale * (1.0 - tra * tra) * s_de).to(ACC))
    else:
        cols = (pid - NDB) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cols < 2 * M
        tl.store(dmode + cols, _colsum(ppart, RP, 2 * M, cols, cm, BLOCK_R, BLOCK_C, ACC), mask=cm)


def controls_bwd(dxw, x, aux, dpart, ppart, phase_dir, radial_dir, pa, ra):
    """dx and the parameters' gradients by fixed-order reductions of dxw [B, T, D] (the write's part of dL/dx),
    dpart [B*T, NMB, 2] (per mode block dL/deta, dL/ddelta) and ppart [R, M, 2] (nu_log, theta_log partials)."""
    B, T, D = x.shape
    M, acc, ntok, nmb = D // 2, dxw.dtype, B * T, dpart.shape[1]
    scale = 1.0 / math.sqrt(M)
    dx = dxw if x.dtype == acc else alloc(x.shape, x.dtype, x.device)
    BLOCK_T = 32
    ntb = cdiv(ntok, BLOCK_T)
    colpart, scalpart = scratch(acc, x.device, (max(ntb, 1), 2 * D), (max(ntb, 1), 8))
    if ntb:
        args = (dxw, x, aux, dpart, phase_dir, radial_dir, pa, ra, dx, colpart, scalpart, ntok, D, nmb, scale)
        replayed(_KEPT, ("bwd", ntok, D, nmb, *[t.dtype for t in args[:11]]), _controls_bwd_kernel, (ntb,), args,
                 11, BLOCK_T=BLOCK_T, BLOCK_D=min(128, next_pow2(D)), NMBP=next_pow2(nmb), ACC=tl_dtype(acc),
                 num_warps=8)
        account("samu_controls_bwd", (dxw, x, aux, dpart, phase_dir, radial_dir), (dx, colpart, scalpart))
    else:
        colpart.zero_()
        scalpart.zero_()
    dpd, drd, damp, dmode = (alloc(s, acc, x.device) for s in ((D + 1,), (D + 1,), (2,), (M, 2)))
    BLOCK_C = 128
    ndb = cdiv(D + 1, BLOCK_C)
    args = (colpart, scalpart, ppart, phase_dir, radial_dir, pa, ra, dpd, drd, damp, dmode, max(ntb, 1),
            ppart.shape[0], D, M, scale, ndb)
    replayed(_KEPT, ("finalize", *args[11:14], *[t.dtype for t in args[:11]]), _finalize_kernel,
             (ndb + cdiv(2 * M, BLOCK_C),), args, 11, BLOCK_R=16, BLOCK_C=BLOCK_C, ACC=tl_dtype(acc), num_warps=4)
    account("samu_finalize", (colpart, scalpart, ppart, phase_dir, radial_dir), (dpd, drd, damp, dmode))
    return dx, dpd, drd, damp, dmode
