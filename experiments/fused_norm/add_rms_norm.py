"""Fused residual add + RMSNorm for the Hawk training step (an experiment: nothing in
`kernels` imports it; bench.py measures it against the model's own step).

    stream' = stream + branch          (in the stream's dtype, the sum formed in at least FP32)
    y = stream' / rms(stream') * (1 + scale)   (at least FP32, written in `out_dtype`)

One launch forward and one backward, in place of the separate add, the FP32 RMSNorm and the
casts of its output into the BF16 matmuls that autocast makes. The model's norm reads the
stream as stored (rounded to its dtype), so it matches `x + h` then `RMSNorm` exactly up to
the order of the FP32 sums. `hawk_loss(model, ...)` is `HawkLM.loss` through it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.models.train import linear_cross_entropy
from kernels.ops.triton_utils import INTERPRET, cdiv, launcher, multiprocessors, next_pow2, out, tl_acc


@launcher
@triton.jit
def _add_rms_norm_fwd(x, h, scale, s_out, y, rstd, N, D, eps, HAS_H: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
         RNE: tl.constexpr, ACC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < N)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    r = tl.load(x + off, mask=m, other=0.0).to(ACC)
    if HAS_H:
        r += tl.load(h + off, mask=m, other=0.0).to(ACC)
        rs = out(r, s_out, RNE)
        tl.store(s_out + off, rs, mask=m)
        r = rs.to(ACC)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, 1) / D + eps)
    w = 1.0 + tl.load(scale + cols, mask=cols < D, other=0.0).to(ACC)
    tl.store(y + off, out(r * inv[:, None] * w[None, :], y, RNE), mask=m)
    tl.store(rstd + rows, inv, mask=rows < N)


@launcher
@triton.jit
def _add_rms_norm_bwd(s, scale, rstd, dy, ds, dx, dh, dw_part, N, D, HAS_DS: tl.constexpr, HAS_H: tl.constexpr,
         BR: tl.constexpr, BD: tl.constexpr, RNE: tl.constexpr, ACC: tl.constexpr):
    """Program p takes row blocks p, p + P, ...; its partial of d scale goes to dw_part[p]."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BD)
    w = 1.0 + tl.load(scale + cols, mask=cols < D, other=0.0).to(ACC)
    dw = tl.zeros([BD], ACC)
    for rb in range(pid, tl.cdiv(N, BR), nprog):
        rows = rb * BR + tl.arange(0, BR)
        m = (rows < N)[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        inv = tl.load(rstd + rows, mask=rows < N, other=0.0)[:, None]
        n = tl.load(s + off, mask=m, other=0.0).to(ACC) * inv
        g = tl.load(dy + off, mask=m, other=0.0).to(ACC)
        dn = g * w[None, :]
        d = inv * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        if HAS_DS:
            d += tl.load(ds + off, mask=m, other=0.0).to(ACC)
        tl.store(dx + off, out(d, dx, RNE), mask=m)
        if HAS_H:
            tl.store(dh + off, out(d, dh, RNE), mask=m)
        dw += tl.sum(g * n, 0)
    tl.store(dw_part + pid.to(tl.int64) * D + cols, dw, mask=cols < D)


def _blocks(D: int) -> tuple[int, int, int]:
    """(rows per program, padded width, warps): about 4096 elements a program."""
    bd = next_pow2(D)
    return max(1, 4096 // bd), bd, 8 if bd >= 2048 else 4


class AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, scale, eps, out_dtype):
        D = x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        h2 = None if h is None else h.reshape(-1, D).contiguous()
        N = x2.shape[0]
        s = torch.empty_like(x2) if h is not None else x2
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        acc = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.empty(N, dtype=acc, device=x.device)
        br, bd, warps = _blocks(D)
        _add_rms_norm_fwd[(cdiv(N, br),)](x2, h2 if h2 is not None else x2, scale, s, y, rstd, N, D, eps,
                                          HAS_H=h is not None, BR=br, BD=bd, RNE=INTERPRET, ACC=tl_acc(acc),
                                          num_warps=warps)
        ctx.save_for_backward(s, scale, rstd)
        ctx.has_h, ctx.shape, ctx.x_dtype = h is not None, x.shape, x.dtype
        ctx.h_dtype = None if h is None else h.dtype
        # without h the stream is x itself: only y is an output
        return (y.view(x.shape), s.view(x.shape)) if h is not None else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy, *rest):
        s, scale, rstd = ctx.saved_tensors
        ds = rest[0] if rest else None
        N, D = s.shape
        dy = dy.reshape(N, D).contiguous()
        ds = None if ds is None else ds.reshape(N, D).contiguous()
        br, bd, warps = _blocks(D)
        progs = max(1, min(cdiv(N, br), 4 * (multiprocessors(s.device) or 1)))
        dx = torch.empty(N, D, dtype=ctx.x_dtype, device=s.device)
        dh = torch.empty(N, D, dtype=ctx.h_dtype, device=s.device) if ctx.has_h else None
        part = torch.empty(progs, D, dtype=rstd.dtype, device=s.device)
        _add_rms_norm_bwd[(progs,)](s, scale, rstd, dy, ds if ds is not None else dy, dx,
                                    dh if dh is not None else dx, part, N, D, HAS_DS=ds is not None,
                                    HAS_H=ctx.has_h, BR=br, BD=bd, RNE=INTERPRET, ACC=tl_acc(rstd.dtype),
                                    num_warps=warps)
        return (dx.view(ctx.shape), None if dh is None else dh.view(ctx.shape), part.sum(0).to(scale.dtype), None,
                None)


def add_rms_norm(x, h, scale, eps: float, out_dtype=None):
    """(y, stream + h): `RMSNorm(x + h)` in `out_dtype` (default: autocast's dtype where it is
    on, else x's) and the new stream in x's dtype; h None: the norm of x alone (x returned)."""
    if out_dtype is None:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        got = AddRMSNorm.apply(x, h, scale, eps, out_dtype)
    return got if h is not None else (got, x)


def hawk_hidden(model, tokens, segment_pos):
    """HawkLM.hidden without a cache, every norm fused with the residual add before it:
    (the final norm's output, ...) as `model.final_norm(model.hidden(...)[0])`."""
    x, branch = model.embed(tokens), None
    for block in model.blocks:
        t, x = add_rms_norm(x, branch, block.temporal_pre_norm.scale, block.temporal_pre_norm.eps)
        h, _ = block.recurrent_block(t, segment_pos, None, False)
        c, x = add_rms_norm(x, h, block.channel_pre_norm.scale, block.channel_pre_norm.eps)
        branch = block.mlp_block(c)
    return add_rms_norm(x, branch, model.final_norm.scale, model.final_norm.eps)[0]


def hawk_loss(model, tokens, targets, segment_pos, ignore_index: int = -100):
    """HawkLM.loss through hawk_hidden."""
    y = hawk_hidden(model, tokens, segment_pos)
    return linear_cross_entropy(y.flatten(0, 1), model.embed.weight, targets.flatten(), ignore_index)
