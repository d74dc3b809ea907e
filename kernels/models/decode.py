"""Fused pieces of the Hawk decode step (one token per row) for the generation engine.

Notation: M rows, D model width, E recurrent width, F MLP hidden width, CW conv width.
Arithmetic in FP32, rounded to the model dtype (bf16, fp16, fp32) where `HawkLM.step` rounds,
so results differ from it only in FP32 summation order. Row kernels wrap library matmuls
(any M); `linear` is a weight-streaming split-K matmul for M <= 64 that fuses the row work
around it (a Hawk layer is four launches plus the mixer step); `advance` updates the decoding
state after the next-token choice. Nothing synchronises with the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..ops import accounting
from ..ops.checks import FLOAT_DTYPES, check_tensor
from ..ops.triton_utils import INTERPRET, cdiv, gelu_tanh, launcher, next_pow2, rne_bf16

MAX_STOP_TOKENS = 8
LINEAR_MAX_ROWS = 64


@triton.jit
def _rnd(v, TY: tl.constexpr, RNE: tl.constexpr):
    """FP32 v rounded to the storage type TY, returned as FP32."""
    if TY == tl.float32:
        return v
    elif RNE and TY == tl.bfloat16:
        return rne_bf16(v)
    else:
        return v.to(TY).to(tl.float32)


@launcher
@triton.jit
def rmsnorm_rows_kernel(src, tokens, x, scale, xn, D, eps, BD: tl.constexpr, EMBED: tl.constexpr, RNE: tl.constexpr):
    """Row m: x[m] = src[tokens[m]] (EMBED) or x[m] <- round(src[m] + x[m]); then
    xn[m] = round(x[m] / rms(x[m]) * (1 + scale))."""
    m = tl.program_id(0)
    o = tl.arange(0, BD)
    mk = o < D
    row = m.to(tl.int64) * D
    TY: tl.constexpr = x.dtype.element_ty
    if EMBED:
        v = tl.load(src + tl.load(tokens + m).to(tl.int64) * D + o, mask=mk, other=0.0)
        tl.store(x + row + o, v, mask=mk)
        v = v.to(tl.float32)
    else:
        hv = tl.load(src + row + o, mask=mk, other=0.0).to(tl.float32)
        v = _rnd(hv + tl.load(x + row + o, mask=mk, other=0.0).to(tl.float32), TY, RNE)
        tl.store(x + row + o, v.to(TY), mask=mk)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    s = tl.load(scale + o, mask=mk, other=0.0).to(tl.float32)
    tl.store(xn + row + o, _rnd(v * r * (s + 1.0), TY, RNE).to(TY), mask=mk)


@triton.jit
def _conv(v, cstate, cw, cb, reset, o_m, m_m, o_c, m_c, E, HAS_RESET: tl.constexpr, CW: tl.constexpr,
          TY: tl.constexpr, RNE: tl.constexpr):
    """Conv decode step on tile [BM, BC]: v, the new input (FP32 in the model's precision),
    shifts into the state [M, CW-1, E] in place."""
    m2 = m_m[:, None] & m_c[None, :]
    base = o_m.to(tl.int64)[:, None] * ((CW - 1) * E) + o_c[None, :]
    if HAS_RESET:
        keep = (tl.load(reset + o_m, mask=m_m, other=1) == 0).to(tl.float32)[:, None]
    s_prev = tl.load(cstate + base, mask=m2, other=0.0).to(tl.float32)
    if HAS_RESET:
        s_prev = s_prev * keep
    y = tl.load(cw + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :] * s_prev
    for s in tl.static_range(1, CW - 1):
        s_cur = tl.load(cstate + base + s * E, mask=m2, other=0.0).to(tl.float32)
        if HAS_RESET:
            s_cur = s_cur * keep
        y += tl.load(cw + s * E + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :] * s_cur
        tl.store(cstate + base + (s - 1) * E, s_cur.to(cstate.dtype.element_ty), mask=m2)
    y += tl.load(cw + (CW - 1) * E + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :] * v
    tl.store(cstate + base + (CW - 2) * E, v.to(cstate.dtype.element_ty), mask=m2)
    y += tl.load(cb + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    return _rnd(y, TY, RNE)


@launcher
@triton.jit
def conv_step_kernel(x, sx, cstate, cw, cb, reset, y, M, E, HAS_RESET: tl.constexpr, CW: tl.constexpr,
                     BM: tl.constexpr, BC: tl.constexpr, RNE: tl.constexpr):
    o_m = tl.program_id(1) * BM + tl.arange(0, BM)
    o_c = tl.program_id(0) * BC + tl.arange(0, BC)
    m_m, m_c = o_m < M, o_c < E
    m2 = m_m[:, None] & m_c[None, :]
    v = tl.load(x + o_m.to(tl.int64)[:, None] * sx + o_c[None, :], mask=m2, other=0.0).to(tl.float32)
    TY: tl.constexpr = y.dtype.element_ty
    out = _conv(v, cstate, cw, cb, reset, o_m, m_m, o_c, m_c, E, HAS_RESET, CW, TY, RNE)
    tl.store(y + o_m.to(tl.int64)[:, None] * E + o_c[None, :], out.to(TY), mask=m2)


@launcher
@triton.jit
def advance_kernel(nxt, tokens, pos, reset, done, stops, pad_id, M, S: tl.constexpr, BM: tl.constexpr):
    o = tl.program_id(0) * BM + tl.arange(0, BM)
    mk = o < M
    t = tl.load(nxt + o, mask=mk, other=0).to(tl.int64)
    d = tl.load(done + o, mask=mk, other=0) != 0
    hit = tl.zeros([BM], dtype=tl.int1)
    for s in tl.static_range(S):
        hit = hit | (t == tl.load(stops + s))
    tl.store(tokens + o, tl.where(d, pad_id, t), mask=mk)
    tl.store(done + o, (d | hit).to(tl.int8), mask=mk)
    p = tl.load(pos + o, mask=mk, other=1) + 1
    tl.store(pos + o, p, mask=mk)
    tl.store(reset + o, (p == 0).to(tl.int8), mask=mk)


# Prologues (input rows): plain; RMSNorm of `a` with `nscale`; rounded product a * a2.
PRO_PLAIN, PRO_NORM, PRO_MUL = 0, 1, 2
# Epilogues: +bias; +bias then + residual in place; split y/x halves (gelu | conv step);
# paired gate/value rows of one weight -> round(gelu(gate)) * value.
EPI_BIAS, EPI_RESIDUAL, EPI_XY, EPI_GATED = 0, 1, 2, 3


@triton.jit
def _mma(acc, at, wt, DOT: tl.constexpr, SWAP: tl.constexpr):
    """acc += at @ wt.T for at [BM, BK], wt [BN, BK]; acc is [BM, BN], or [BN, BM]
    with SWAP (the weight tile as the dot's M operand: M = BN >= 64 suits wgmma).
    DOT 1: exact products in FP32."""
    x, y = (wt, tl.trans(at)) if SWAP else (at, tl.trans(wt))
    if DOT == 0:
        return tl.dot(x, y, acc)
    else:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _w_tile(wp, o_n, m_n, o_k, m_k, K):
    # [BN, BK], K contiguous
    return tl.load(wp + o_n.to(tl.int64)[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _prefetch(wp, o_n, m_n, k_lo, k_hi, K):
    """This program's weight rows [o_n, k_lo:k_hi) into L2, one prefetch per 128-byte line: no earlier kernel writes
    the weights, so a dependent launch reads them before its wait, behind the previous kernel's tail."""
    LINE: tl.constexpr = 1024 // wp.dtype.element_ty.primitive_bitwidth
    for k0 in range(k_lo, k_hi, 8 * LINE):
        o_k = k0 + tl.arange(0, 8) * LINE
        p = wp + tl.where(m_n[:, None] & (o_k < k_hi)[None, :], o_n.to(tl.int64)[:, None] * K + o_k[None, :], 0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _a_tile(a, sa, a2, sa2, nscale, sq, o_m, m_m, o_k, m_k, PRO: tl.constexpr, TY: tl.constexpr, RNE: tl.constexpr):
    """Input tile [BM, BK] in the model dtype and the raw inputs' running squares [BM, BK]
    (PRO_NORM: round(a * (1 + scale)); 1 / rms scales the row sums after the K reduction)."""
    m2 = m_m[:, None] & m_k[None, :]
    rows = o_m.to(tl.int64)[:, None]
    t = tl.load(a + rows * sa + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
    if PRO == 1:
        sq += t * t
        s = tl.load(nscale + o_k, mask=m_k, other=0.0).to(tl.float32)
        t = _rnd(t * (s[None, :] + 1.0), TY, RNE)
    elif PRO == 2:
        t2 = tl.load(a2 + rows * sa2 + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
        t = _rnd(t * t2, TY, RNE)
    return t.to(TY), sq


@triton.jit
def _epilogue(acc, acc2, ss, bp, out, out2, res, cstate, cw, cb, reset, o_m, m_m, o_n, m_n, second, N, K, eps,
              PRO: tl.constexpr, EPI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESET: tl.constexpr,
              CW: tl.constexpr, TY: tl.constexpr, RNE: tl.constexpr):
    """acc, acc2 [BM, BN]: the full FP32 sums over K; ss [BM]: the rows' sums of squares."""
    if PRO == 1:
        # RMSNorm's 1 / rms is a per-row factor: applied to the sums instead of the inputs.
        rinv = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * rinv[:, None]
        acc2 = acc2 * rinv[:, None]
    if HAS_BIAS:
        acc += tl.load(bp + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        if EPI == 3:
            acc2 += tl.load(bp + N + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    v = _rnd(acc, TY, RNE)
    m2 = m_m[:, None] & m_n[None, :]
    offs = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    if EPI == 0:
        tl.store(out + offs, v.to(TY), mask=m2)
    elif EPI == 1:
        r = tl.load(res + offs, mask=m2, other=0.0).to(tl.float32)
        tl.store(out + offs, _rnd(v + r, TY, RNE).to(TY), mask=m2)
    elif EPI == 2:
        if second:
            y = _conv(v, cstate, cw, cb, reset, o_m, m_m, o_n, m_n, N, HAS_RESET, CW, TY, RNE)
            tl.store(out2 + offs, y.to(TY), mask=m2)
        else:
            tl.store(out + offs, _rnd(gelu_tanh(v), TY, RNE).to(TY), mask=m2)
    else:
        g = _rnd(gelu_tanh(v), TY, RNE)
        tl.store(out + offs, _rnd(g * _rnd(acc2, TY, RNE), TY, RNE).to(TY), mask=m2)


@launcher
@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    a, sa, a2, sa2, nscale, w, bias, w2, bias2, out, out2, res,
    cstate, cw, cb, reset, ws, counts,
    M, N, K, eps,
    PRO: tl.constexpr, EPI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESET: tl.constexpr, CW: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr, RG: tl.constexpr,
    SWAP: tl.constexpr, DOT: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
):
    """out[m, n] = epilogue(sum_k prologue(a)[m, k] * w[n, k] + bias[n]) for all M <= BM
    rows; w is [N, K] ([2N, K], gate rows first, for EPI_GATED). EPI_XY runs over 2N
    columns: n < N uses (w, bias) -> round(gelu) into out, n >= N uses (w2, bias2) -> the
    conv step into out2. Program (n, s) streams w[n-block, s*KS : (s+1)*KS] once in BK
    slices. With SPLIT > 1 it stores its FP32 partials (and partial sums of squares) in
    `ws` and counts itself in counts[n]; the last of the block's programs adds the
    partials (RG at a time, in a fixed order), runs the epilogue and resets the count."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    TY: tl.constexpr = out.dtype.element_ty
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    NB = tl.cdiv(N, BN)
    second = pid_n >= NB  # only EPI_XY has programs past NB
    o_n = (pid_n % NB) * BN + tl.arange(0, BN)
    m_n = o_n < N
    wp, bp = w, bias
    if EPI == 2 and second:
        wp, bp = w2, bias2
    k_lo = pid_s * KS
    k_hi = tl.minimum(k_lo + KS, K)
    acc = tl.zeros([BN, BM] if SWAP else [BM, BN], tl.float32)
    acc2 = tl.zeros_like(acc)
    sq = tl.zeros([BM, BK], tl.float32)
    if PDL:
        if PF:
            _prefetch(wp, o_n, m_n, k_lo, k_hi, K)
            if EPI == 3:
                _prefetch(wp + N * K, o_n, m_n, k_lo, k_hi, K)
        gdc_wait()
    for k0 in range(k_lo, k_hi, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < k_hi
        at, sq = _a_tile(a, sa, a2, sa2, nscale, sq, o_m, m_m, o_k, m_k, PRO, TY, RNE)
        acc = _mma(acc, at, _w_tile(wp, o_n, m_n, o_k, m_k, K), DOT, SWAP)
        if EPI == 3:
            acc2 = _mma(acc2, at, _w_tile(wp + N * K, o_n, m_n, o_k, m_k, K), DOT, SWAP)
    if PDL:
        gdc_launch_dependents()
    if SWAP:
        acc = tl.trans(acc)
        acc2 = tl.trans(acc2)
    ss = tl.sum(sq, axis=1) if PRO == 1 else tl.zeros([BM], tl.float32)
    if SPLIT == 1:
        _epilogue(acc, acc2, ss, bp, out, out2, res, cstate, cw, cb, reset, o_m, m_m, o_n, m_n, second, N, K, eps,
                  PRO, EPI, HAS_BIAS, HAS_RESET, CW, TY, RNE)
    else:
        # workspace: [programs, BM, BN] partials (a second such block for EPI_GATED), then [programs, BM] squares
        tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        n_prog = tl.num_programs(0) * SPLIT
        slot = (pid_n * SPLIT + pid_s).to(tl.int64)
        tl.store(ws + slot * (BM * BN) + tile, acc)
        if EPI == 3:
            tl.store(ws + (n_prog + slot) * (BM * BN) + tile, acc2)
        sq_base = n_prog.to(tl.int64) * (BM * BN) * (2 if EPI == 3 else 1)
        if PRO == 1:
            tl.store(ws + sq_base + slot * BM + o_m, ss)
        # Every thread's partials are stored before the count (release at GPU scope).
        tl.debug_barrier()
        arrived = tl.atomic_add(counts + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            acc = tl.zeros([BM, BN], tl.float32)
            acc2 = tl.zeros_like(acc)
            ss = tl.zeros([BM], tl.float32)
            first = pid_n.to(tl.int64) * SPLIT
            # RG partials per load (independent loads in flight), summed in a fixed order
            o_s = tl.arange(0, RG)
            for s0 in tl.static_range(0, SPLIT, RG):
                sl = first + s0 + o_s
                live = (s0 + o_s) < SPLIT
                acc += tl.sum(tl.load(ws + sl[:, None, None] * (BM * BN) + tile[None, :, :],
                                      mask=live[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
                if EPI == 3:
                    acc2 += tl.sum(tl.load(ws + (n_prog + sl)[:, None, None] * (BM * BN) + tile[None, :, :],
                                           mask=live[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
                if PRO == 1:
                    ss += tl.sum(tl.load(ws + sq_base + sl[:, None] * BM + o_m[None, :], mask=live[:, None],
                                         other=0.0, cache_modifier=".cg"), axis=0)
            tl.store(counts + pid_n, 0)
            _epilogue(acc, acc2, ss, bp, out, out2, res, cstate, cw, cb, reset, o_m, m_m, o_n, m_n, second, N, K,
                      eps, PRO, EPI, HAS_BIAS, HAS_RESET, CW, TY, RNE)


def rows_block(M: int) -> int:
    """The row block (BM) `linear` launches M rows with: 16 or, above 16 rows, 64."""
    return min(64, max(16, next_pow2(M)))


INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
FLAG_DTYPES = (torch.bool, torch.int8, torch.uint8)


def _arg(name, t, shape, dtypes, device, layout="rows"):
    """t, checked: a tensor of `shape` (None: any size) with a dtype in `dtypes` (None: any) on `device` (None:
    any). layout "rows": unit column stride (the kernels take the row stride); "dense": contiguous (written in
    place, or indexed densely); "copy": read-only, returned as a contiguous copy if it is a strided view."""
    check_tensor(name, t, shape, dtypes)
    if device is not None and t.device != device:
        raise ValueError(f"expected {name} on {device}, got {t.device}")
    if layout == "copy":
        return t.contiguous()
    if layout == "dense" and not t.is_contiguous():
        raise ValueError(f"expected a contiguous {name}, got shape {list(t.shape)} strides {list(t.stride())}")
    if t.stride(-1) != 1:
        raise ValueError(f"expected {name} with unit column stride, got strides {list(t.stride())}")
    return t


def _span(t) -> tuple[int, int]:
    """The byte range that tensor t may touch."""
    lo = t.data_ptr()
    return lo, lo + (sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _same_view(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def _apart(name, t, strict=(), same=()):
    """ValueError where t, written by a kernel, shares memory with an input that other programs read:
    `strict` (name, tensor) pairs may not overlap t at all; `same` ones, read at the element written,
    may be t itself."""
    for may_be_it, pairs in ((False, strict), (True, same)):
        for other, u in pairs:
            if u is None or not t.numel() or not u.numel() or t.device != u.device:
                continue
            (t0, t1), (u0, u1) = _span(t), _span(u)
            if t0 < u1 and u0 < t1 and not (may_be_it and _same_view(t, u)):
                raise ValueError(f"expected {name} not to overlap {other} in memory"
                                 f"{' unless it is ' + other + ' itself' if may_be_it else ''} ({other} is read "
                                 f"while {name} is written); pass a separate buffer")
    return t


def _out(name, t, M, N, dtype, device, strict=(), same=()):
    """The output buffer `t` [M, N], checked (aliasing as in `_apart`), or a new one."""
    if t is None:
        return torch.empty(M, N, dtype=dtype, device=device)
    return _apart(name, _arg(name, t, (M, N), (dtype,), device, "dense"), strict, same)


def _flags(name, t, M, device):
    """A [M] bool / int8 / uint8 flag vector, contiguous, bool viewed as uint8."""
    t = _arg(name, t, (M,), FLAG_DTYPES, device, "copy")
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _conv_args(conv_state, conv_w, conv_b, M, E, device):
    """(CW, conv_w [CW, E], conv_b [E]) as contiguous tensors; conv_state [M, CW-1, E], updated in place,
    must be contiguous."""
    conv_w = _arg("conv_w", conv_w, (None, E), None, device, "copy")
    conv_b = _arg("conv_b", conv_b, (E,), None, device, "copy")
    _arg("conv_state", conv_state, (M, conv_w.shape[0] - 1, E), None, device, "dense")
    return conv_w.shape[0], conv_w, conv_b


def embed_rmsnorm(tokens, table, scale, eps, x=None, xn=None):
    """x = table[tokens] [M, D]; xn = RMSNorm(x) with `scale`. Returns (x, xn).
    tokens: [M] ids in [0, V) (not checked: no host synchronisation); table: a
    contiguous [V, D]."""
    table = _arg("table", table, (None, None), None, None, "dense")
    dev, dt = table.device, table.dtype
    tokens = _arg("tokens", tokens, (None,), INT_DTYPES, dev, "copy")
    M, D = tokens.shape[0], table.shape[1]
    scale = _arg("scale", scale, (D,), FLOAT_DTYPES, dev, "copy")
    x = _out("x", x, M, D, dt, dev, strict=(("table", table),))
    xn = _out("xn", xn, M, D, dt, dev, strict=(("x", x), ("table", table)))
    rmsnorm_rows_kernel[(M,)](table, tokens, x, scale, xn, D, eps, BD=next_pow2(D), EMBED=True, RNE=INTERPRET)
    accounting.account("embed_rmsnorm", (tokens, x, scale), (x, xn))
    return x, xn


def add_rmsnorm(h, x, scale, eps, xn=None):
    """x <- round(h + x) in place; returns xn = RMSNorm(x) with `scale`. h, x: contiguous [M, D]."""
    x = _arg("x", x, (None, None), None, None, "dense")
    M, D = x.shape
    _arg("h", h, (M, D), (x.dtype,), x.device, "dense")
    scale = _arg("scale", scale, (D,), FLOAT_DTYPES, x.device, "copy")
    _apart("x", x, same=(("h", h),))
    xn = _out("xn", xn, M, D, x.dtype, x.device, strict=(("x", x),), same=(("h", h),))
    rmsnorm_rows_kernel[(M,)](h, h, x, scale, xn, D, eps, BD=next_pow2(D), EMBED=False, RNE=INTERPRET)
    accounting.account("add_rmsnorm", (h, x, scale), (x, xn))
    return xn


def conv_step(x, conv_state, conv_w, conv_b, reset=None, y=None):
    """Causal-conv decode step. x: [M, E] (row stride free); conv_state [M, CW-1, E]
    updated in place (inputs of a row with reset are dropped); returns y [M, E]."""
    x = _arg("x", x, (None, None), None, None)
    M, E = x.shape
    CW, conv_w, conv_b = _conv_args(conv_state, conv_w, conv_b, M, E, x.device)
    _apart("conv_state", conv_state, strict=(("x", x),))
    rst = None if reset is None else _flags("reset", reset, M, x.device)
    y = _out("y", y, M, E, x.dtype, x.device, strict=(("conv_state", conv_state),), same=(("x", x),))
    BM, BC = 16, 256
    conv_step_kernel[(cdiv(E, BC), cdiv(M, BM))](
        x, x.stride(0), conv_state, conv_w, conv_b, rst if rst is not None else conv_state, y, M, E,
        HAS_RESET=rst is not None, CW=CW, BM=BM, BC=BC, RNE=INTERPRET)
    accounting.account("conv_step", (x, conv_state, conv_w, conv_b, rst), (y, conv_state))
    return y


def advance(nxt, tokens, pos, reset, done, stops, pad_id: int):
    """After choosing `nxt` [M]: tokens <- nxt (pad_id in rows already done), done |=
    nxt in stops [MAX_STOP_TOKENS] (-1 = unused), pos += 1, reset <- pos == 0.
    tokens, pos (integer) and reset, done (bool, int8 or uint8) are [M] contiguous
    buffers updated in place."""
    tokens = _arg("tokens", tokens, (None,), INT_DTYPES, None, "dense")
    M, dev = tokens.shape[0], tokens.device
    nxt = _arg("nxt", nxt, (M,), INT_DTYPES, dev, "copy")
    stops = _arg("stops", stops, (None,), INT_DTYPES, dev, "copy")
    _arg("pos", pos, (M,), INT_DTYPES, dev, "dense")
    _arg("reset", reset, (M,), FLAG_DTYPES, dev, "dense")
    _arg("done", done, (M,), FLAG_DTYPES, dev, "dense")
    written = (("tokens", tokens), ("pos", pos), ("reset", reset), ("done", done))
    for i, (n, t) in enumerate(written):
        read = (("stops", stops),) if n == "tokens" else (("stops", stops), ("nxt", nxt))
        _apart(n, t, strict=written[i + 1:] + read, same=(("nxt", nxt),) if n == "tokens" else ())
    BM = 128
    advance_kernel[(cdiv(M, BM),)](nxt, tokens, pos, reset.view(torch.int8), done.view(torch.int8),
                                   stops, pad_id, M, S=stops.shape[0], BM=BM)
    accounting.account("advance", (nxt, done, pos, stops), (tokens, done, pos, reset))


# Fastest tiles of an H200 tile sweep for the five linears of preset 1.3b, keyed by
# (columns, K, row block); the 64-row block takes the same tiles but BK 128 for "down".
TUNED = {(cols, K, rows): dict(t, BK=128 if rows == 64 else t["BK"]) for rows in (16, 64) for (cols, K), t in {
    (5120, 2048): {"BN": 64, "BK": 128, "SPLIT": 4, "SWAP": 1, "num_warps": 8},     # xy
    (2048, 2560): {"BN": 32, "BK": 128, "SPLIT": 3, "SWAP": 0, "num_warps": 4},     # out
    (6144, 2048): {"BN": 64, "BK": 128, "SPLIT": 2, "SWAP": 1, "num_warps": 8},     # up (gated)
    (2048, 6144): {"BN": 32, "BK": 256, "SPLIT": 6, "SWAP": 0, "num_warps": 4},     # down
    (32000, 2048): {"BN": 128, "BK": 128, "SPLIT": 1, "SWAP": 1, "num_warps": 8},   # logits
}.items()}
CONFIG_KEYS = ("BN", "BK", "SPLIT", "SWAP", "num_warps", "num_stages", "PREFETCH")


def default_config(cols: int, K: int, rows: int = 16) -> dict:
    """Tiles of `linear` (CONFIG_KEYS) for `cols` output columns (both halves of EPI_XY, the
    gate half of EPI_GATED), reduction length K and `rows` rows: the TUNED entry, else what
    the sweep favoured: a few hundred programs (column blocks x K splits) streaming >= ~512
    of K each. BK: K per iteration; SPLIT: K splits (split_plan); SWAP: as in _mma; PREFETCH (0
    here): under programmatic dependent launch, each program's weights into L2 before its wait."""
    tuned = TUNED.get((cols, K, rows_block(rows)))
    if tuned is not None:
        return dict(tuned, num_stages=3, PREFETCH=0)
    bn = 128 if cols >= 128 * 200 else 64 if cols >= 64 * 80 else 32
    split = max(1, min(cdiv(K, 512), round(256 / cdiv(cols, bn))))
    return dict(BN=bn, BK=min(128, max(16, next_pow2(K))), SPLIT=split, SWAP=int(bn >= 64),
                num_warps=8 if bn >= 64 else 4, num_stages=3, PREFETCH=0)


SMEM_BUDGET = 160 * 1024


def _fit_smem(cfg: dict, BM: int, gated: bool, esize: int) -> dict:
    """Fewer pipeline stages, then shorter K slices, until the staged tiles fit in
    shared memory (Hopper has 227 KiB per block; the rest is left for the epilogue)."""
    cfg = dict(cfg)

    def need(c):
        return c["num_stages"] * c["BK"] * (BM + c["BN"] * (2 if gated else 1)) * esize

    while need(cfg) > SMEM_BUDGET and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while need(cfg) > SMEM_BUDGET and cfg["BK"] > 32:
        cfg["BK"] //= 2
    return cfg


def split_plan(K: int, BK: int, split: int) -> tuple[int, int]:
    """(KS, splits): K per program, a multiple of BK, and the number of K splits."""
    if split < 1:
        raise ValueError(f"expected SPLIT >= 1, got {split}")
    ks = cdiv(cdiv(K, split), BK) * BK
    return ks, cdiv(K, ks)


class Workspace:
    """Scratch of split-K linears: FP32 partials and per-column-block arrival counts (zero
    between launches); one stream per workspace. It grows on demand, never under CUDA-graph
    capture (a graph keeps the storage it captured): run the step once before capturing."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)
        self.counts = torch.zeros(0, dtype=torch.int32, device=self.device)

    def take(self, floats: int, counts: int):
        if self.partials.numel() < floats or self.counts.numel() < counts:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"expected a workspace of at least {floats} floats and {counts} counts under "
                                 f"CUDA-graph capture, got {self.partials.numel()} and {self.counts.numel()} "
                                 f"(run the step once before capturing)")
            self.partials = torch.empty(max(floats, self.partials.numel()), dtype=torch.float32, device=self.device)
            self.counts = torch.zeros(max(counts, self.counts.numel()), dtype=torch.int32, device=self.device)
        return self.partials, self.counts


def linear(a, w, bias=None, *, prologue=PRO_PLAIN, epilogue=EPI_BIAS, a2=None, norm_scale=None, eps=1e-6,
           residual=None, w2=None, bias2=None, conv=None, reset=None, out=None, out2=None, config=None,
           pdl=False, workspace=None):
    """Weight-streaming y = epilogue(prologue(a) @ w.T + bias) for M <= 64 rows.

    a: [M, K] (row stride free); w: [N, K] ([2N, K] for EPI_GATED); bias [N] or None.
    prologue: PRO_PLAIN, PRO_NORM (RMSNorm of a with norm_scale, eps), PRO_MUL (a * a2).
    epilogue: EPI_BIAS -> out [M, N]; EPI_RESIDUAL -> residual <- round(y + residual)
    (in place, returned); EPI_XY -> (round(gelu(y)) [M, N], conv step of a @ w2.T + bias2
    [M, N]) with conv = (conv_state [M, CW-1, N], conv_w [CW, N], conv_b [N]) and reset;
    EPI_GATED -> round(gelu(y_gate)) * y_value [M, N] from w's two halves.
    config: tile options overriding `default_config`; workspace: a `Workspace` (default:
    fresh scratch per call); pdl: programmatic dependent launch (Hopper). Weights, biases
    and a2 in a's dtype on its device (the dot reads a and w in one precision, as F.linear);
    out, out2, residual and conv_state must not overlap a, a2 or each other (ValueError).
    """
    a = _arg("a", a, (None, None), None, None)
    (M, K), dt, dev = a.shape, a.dtype, a.device
    if M > LINEAR_MAX_ROWS:
        raise ValueError(f"expected at most {LINEAR_MAX_ROWS} rows for the weight-streaming linear, got {M}")
    unknown = set(config or {}) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"expected config keys among {list(CONFIG_KEYS)}, got {sorted(unknown)}")
    if dt not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"expected a bf16, fp16 or fp32 model for the fused linear, got {dt}")
    gated, xy = epilogue == EPI_GATED, epilogue == EPI_XY
    w = _arg("w", w, (None, K), (dt,), dev, "dense")
    if gated and w.shape[0] % 2:
        raise ValueError(f"expected w of shape [2N, {K}] (gate rows, then value rows) with EPI_GATED, "
                         f"got {list(w.shape)}")
    N = w.shape[0] // 2 if gated else w.shape[0]
    if bias is not None:
        bias = _arg("bias", bias, (w.shape[0],), (dt,), dev, "copy")
    if prologue == PRO_MUL:
        _arg("a2", a2, (M, K), (dt,), dev)
    if prologue == PRO_NORM:
        norm_scale = _arg("norm_scale", norm_scale, (K,), FLOAT_DTYPES, dev, "copy")
    BM = rows_block(M)
    cfg = _fit_smem(dict(default_config(2 * N if xy else N, K, M), **(config or {})), BM, gated, dt.itemsize)
    if cfg["BN"] < 16 or cfg["BK"] < 16 or cfg["PREFETCH"] not in (0, 1):
        raise ValueError(f"expected BN and BK >= 16 (the dot's smallest tile) and PREFETCH 0 or 1, got {cfg}")
    KS, split = split_plan(K, cfg["BK"], cfg["SPLIT"])
    n_blocks = cdiv(N, cfg["BN"]) * (2 if xy else 1)
    inputs = (("a", a), ("a2", a2))
    if epilogue == EPI_RESIDUAL:
        _apart("residual", _arg("residual", residual, (M, N), (dt,), dev, "dense"), strict=inputs)
        if out is not None and not _same_view(out, residual):
            raise ValueError("expected out None (or the residual itself) with EPI_RESIDUAL: the result is "
                             "written into residual")
        out = residual
    else:
        out = _out("out", out, M, N, dt, dev, strict=inputs)
    rst = cstate = cw = cb = None
    CW = 1
    if xy:
        _arg("w2", w2, tuple(w.shape), (dt,), dev, "dense")
        if bias2 is not None:
            bias2 = _arg("bias2", bias2, (N,), (dt,), dev, "copy")
        if conv is None or len(conv) != 3:
            raise ValueError("expected conv = (conv_state, conv_w, conv_b) with EPI_XY")
        cstate, cw, cb = conv
        CW, cw, cb = _conv_args(cstate, cw, cb, M, N, dev)
        rst = None if reset is None else _flags("reset", reset, M, dev)
        out2 = _out("out2", out2, M, N, dt, dev, strict=(*inputs, ("out", out), ("conv_state", cstate)))
        _apart("conv_state", cstate, strict=(*inputs, ("out", out)))
    if split > 1:
        floats = n_blocks * split * BM * (cfg["BN"] * (2 if gated else 1) + 1)
        ws, counts = (workspace.take(floats, n_blocks) if workspace is not None else
                      (torch.empty(floats, dtype=torch.float32, device=dev),
                       torch.zeros(n_blocks, dtype=torch.int32, device=dev)))
    else:
        ws = counts = out

    def arg(t):     # a pointer the kernel does not read under this launch's flags
        return out if t is None else t

    pdl = bool(pdl) and not INTERPRET
    linear_kernel[(n_blocks, split)](
        a, a.stride(0), a if a2 is None else a2, 0 if a2 is None else a2.stride(0), arg(norm_scale),
        w, arg(bias), w2 if w2 is not None else w, arg(bias2), out, arg(out2), arg(residual), arg(cstate), arg(cw),
        arg(cb), arg(rst), ws, counts, M, N, K, eps,
        PRO=prologue, EPI=epilogue, HAS_BIAS=bias is not None, HAS_RESET=rst is not None, CW=CW,
        BM=BM, BN=cfg["BN"], BK=cfg["BK"], SPLIT=split, KS=KS,
        # partial tiles loaded at once by the reducing program: <= 8192 floats in registers
        RG=max(1, min(next_pow2(split), 8192 // (BM * cfg["BN"]))),
        # DOT 1: exact products in FP32 (FP32 models; the interpreter's BF16 dot is wrong in Triton 3.6)
        SWAP=int(bool(cfg["SWAP"])), DOT=int(dt == torch.float32 or INTERPRET), RNE=INTERPRET, PDL=pdl,
        PF=pdl and bool(cfg["PREFETCH"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if pdl else {}),
    )
    accounting.account("linear", (w, bias, w2, bias2, *(a, a2, residual, cstate) * (2 if xy else 1)),
                       (out, out2, cstate))
    return (out, out2) if xy else out


__all__ = ["embed_rmsnorm", "add_rmsnorm", "conv_step", "advance", "linear", "default_config",
           "PRO_PLAIN", "PRO_NORM", "PRO_MUL", "EPI_BIAS", "EPI_RESIDUAL", "EPI_XY", "EPI_GATED",
           "MAX_STOP_TOKENS", "LINEAR_MAX_ROWS", "Workspace", "split_plan", "CONFIG_KEYS", "TUNED",
           "rows_block"]
