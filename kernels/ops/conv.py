"""Fused depthwise causal convolution (layers.Conv1D without a cache), one launch each way:
    y[t] = b + sum_{s < W} w[W-1-s] x[t-s] keep_s[t],
    keep_s[t] = 1 iff t - s >= 0 and no document starts in (t-s, t] (segment_pos != 0),
accumulated in FP32 (float64 for float64); dw, db from per-tile partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import state_dtype
from .triton_utils import cdiv, empty, tl_acc

BT, BE = 64, 128


@triton.jit
def _keep(pos_ptr, t, T, HAS_POS: tl.constexpr):
    """segment_pos[t] != 0 where 0 <= t < T (rows outside count as no start)."""
    if HAS_POS:
        return tl.load(pos_ptr + t, mask=(t >= 0) & (t < T), other=1) != 0
    return t == t


@triton.jit
def _conv_fwd(x_ptr, w_ptr, b_ptr, pos_ptr, y_ptr, T, E, W: tl.constexpr, HAS_POS: tl.constexpr,
              ACC: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    row = tl.program_id(2).to(tl.int64) * T
    me = e < E
    keep = t < T
    y = tl.zeros((BT, BE), ACC) + tl.load(b_ptr + e, mask=me).to(ACC)[None, :]
    for s in tl.static_range(W):
        if s > 0:
            keep = keep & (t - s >= 0) & _keep(pos_ptr + row, t - s + 1, T, HAS_POS)
        x = tl.load(x_ptr + (row + t - s)[:, None] * E + e[None, :], mask=keep[:, None] & me[None, :], other=0)
        y += x.to(ACC) * tl.load(w_ptr + (W - 1 - s) * E + e, mask=me).to(ACC)[None, :]
    tl.store(y_ptr + (row + t)[:, None] * E + e[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & me[None, :])


@triton.jit
def _conv_bwd(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dwp_ptr, T, E, NT, W: tl.constexpr, HAS_POS: tl.constexpr,
              ACC: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    # dx[t] = sum_s w[W-1-s] keep_s[t+s] dy[t+s]; partial dw[W-1-s] = sum_t dy[t] x[t-s] keep_s[t]
    # and db = sum_t dy[t] over this tile, stored at dwp[tile, W-1-s] and dwp[tile, W].
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    row = tl.program_id(2).to(tl.int64) * T
    tile = (tl.program_id(2) * NT + tl.program_id(0)) * (W + 1) * E
    me = e < E
    mt = t < T
    dy = tl.load(dy_ptr + (row + t)[:, None] * E + e[None, :], mask=mt[:, None] & me[None, :], other=0).to(ACC)
    tl.store(dwp_ptr + tile + W * E + e, tl.sum(dy, axis=0), mask=me)
    dx = tl.zeros((BT, BE), ACC)
    keep_f = mt    # x[t] reaches y[t+s]
    keep_b = mt    # y[t] reads x[t-s]
    for s in tl.static_range(W):
        if s > 0:
            keep_f = keep_f & (t + s < T) & _keep(pos_ptr + row, t + s, T, HAS_POS)
            keep_b = keep_b & (t - s >= 0) & _keep(pos_ptr + row, t - s + 1, T, HAS_POS)
        w = tl.load(w_ptr + (W - 1 - s) * E + e, mask=me).to(ACC)
        dys = tl.load(dy_ptr + (row + t + s)[:, None] * E + e[None, :], mask=keep_f[:, None] & me[None, :], other=0)
        dx += dys.to(ACC) * w[None, :]
        x = tl.load(x_ptr + (row + t - s)[:, None] * E + e[None, :], mask=keep_b[:, None] & me[None, :], other=0)
        tl.store(dwp_ptr + tile + (W - 1 - s) * E + e, tl.sum(dy * x.to(ACC), axis=0), mask=me)
    tl.store(dx_ptr + (row + t)[:, None] * E + e[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mt[:, None] & me[None, :])


def _grid(B, T, E):
    return cdiv(T, BT), cdiv(E, BE), B


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, pos):
        B, T, E = x.shape
        y = empty(x.shape, x.dtype, x.device)
        _conv_fwd[_grid(B, T, E)](x, w, b, x if pos is None else pos, y, T, E, w.shape[0], pos is not None,
                                  tl_acc(x.dtype), BT, BE)
        ctx.save_for_backward(x, w, pos)
        ctx.b_dtype = b.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, pos = ctx.saved_tensors
        B, T, E = x.shape
        W, NT, dy = w.shape[0], cdiv(T, BT), dy.contiguous()
        dx = empty(x.shape, x.dtype, x.device)
        dwp = empty((B * NT, W + 1, E), state_dtype(x.dtype), x.device)
        _conv_bwd[_grid(B, T, E)](x, w, x if pos is None else pos, dy, dx, dwp, T, E, NT, W, pos is not None,
                                  tl_acc(x.dtype), BT, BE)
        d = dwp.sum(0)
        return dx, d[:W].to(w.dtype), d[W].to(ctx.b_dtype), None


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                  segment_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The convolution with an empty history. x: [B, T, E] contiguous; w: [W, E]; b: [E];
    segment_pos: [B, T] integer or None. Returns y [B, T, E] in x's dtype."""
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"expected x a contiguous [B, T, E] tensor, got shape {list(x.shape)}")
    E = x.shape[2]
    if w.dim() != 2 or w.shape[1] != E or b.shape != (E,) or not (w.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"expected contiguous w [W, {E}] and b [{E}], got {list(w.shape)} and {list(b.shape)}")
    if segment_pos is not None:
        if segment_pos.shape != x.shape[:2]:
            raise ValueError(f"expected segment_pos [B, T] = {list(x.shape[:2])}, got {list(segment_pos.shape)}")
        segment_pos = segment_pos.contiguous()
    return _CausalConv1d.apply(x, w, b, segment_pos)


__all__ = ["causal_conv1d"]
