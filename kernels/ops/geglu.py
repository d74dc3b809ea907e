"""Fused gated GeLU of Hawk's MLP block (layers.MLPBlock) and its backward, one launch each way:
    h = gelu_tanh(gate) * value,  [gate | value] = the two halves of up [..., 2E],
in FP32 from the stored inputs (16-bit or FP32), each output rounded once. The
backward writes both halves of dup in place, so no gradient of a half is copied into it:
    dgate = dh * value * gelu_tanh'(gate),  dvalue = dh * gelu_tanh(gate).
gelu_tanh is the one the decode kernels use (triton_utils: no libdevice call, so the
kernels run on the CPU interpreter as on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import INTERPRET, cdiv, empty, gelu_tanh, launcher, out

BLOCK = 1024
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gelu_slope(g):
    """d gelu_tanh / dg = 0.5 (1 + tanh z) + 0.5 g (1 - tanh z)(1 + tanh z) z'(g) for FP32 g,
    with 1 - tanh z = 2 / (e + 1) and 1 + tanh z = 2 e / (e + 1), e = exp(2z), each
    formed without cancellation (the latter as 2 - (1 - tanh z) where e overflows);
    0.79788... = sqrt(2 / pi)."""
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(2.0 * z)
    q = 2.0 / (e + 1.0)
    p = tl.where(z > 0, 2.0 - q, e * q)
    return 0.5 * p + 0.5 * g * q * p * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)


@launcher
@triton.jit
def _geglu_fwd(up_ptr, h_ptr, E, RNE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < E
    g = tl.load(up_ptr + row * 2 * E + c, mask=m, other=0).to(tl.float32)
    v = tl.load(up_ptr + row * 2 * E + E + c, mask=m, other=0).to(tl.float32)
    tl.store(h_ptr + row * E + c, out(gelu_tanh(g) * v, h_ptr, RNE), mask=m)


@launcher
@triton.jit
def _geglu_bwd(up_ptr, dh_ptr, dup_ptr, E, RNE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < E
    g = tl.load(up_ptr + row * 2 * E + c, mask=m, other=0).to(tl.float32)
    v = tl.load(up_ptr + row * 2 * E + E + c, mask=m, other=0).to(tl.float32)
    dh = tl.load(dh_ptr + row * E + c, mask=m, other=0).to(tl.float32)
    tl.store(dup_ptr + row * 2 * E + c, out(dh * v * _gelu_slope(g), dup_ptr, RNE), mask=m)
    tl.store(dup_ptr + row * 2 * E + E + c, out(dh * gelu_tanh(g), dup_ptr, RNE), mask=m)


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, up):
        E = up.shape[-1] // 2
        N = up.numel() // (2 * E)
        h = empty((*up.shape[:-1], E), up.dtype, up.device)
        _geglu_fwd[(N, cdiv(E, BLOCK))](up, h, E, INTERPRET, BLOCK, num_warps=4)
        ctx.save_for_backward(up)
        return h

    @staticmethod
    def backward(ctx, dh):
        (up,) = ctx.saved_tensors
        E = up.shape[-1] // 2
        N = up.numel() // (2 * E)
        dup = empty(up.shape, up.dtype, up.device)
        _geglu_bwd[(N, cdiv(E, BLOCK))](up, dh.contiguous(), dup, E, INTERPRET, BLOCK, num_warps=4)
        return dup


def geglu(up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(up[..., :E]) * up[..., E:] for up [..., 2E] contiguous, in up's dtype."""
    if up.dim() < 1 or up.shape[-1] % 2 or up.shape[-1] == 0 or not up.is_contiguous():
        raise ValueError(f"expected a contiguous up [..., 2E] with E > 0, got shape {list(up.shape)}"
                         f"{'' if up.is_contiguous() else ' (not contiguous)'}")
    if up.dtype not in DTYPES:
        raise ValueError(f"expected up in {[str(d) for d in DTYPES]}, got {up.dtype}")
    return _GeGLU.apply(up)


__all__ = ["geglu"]
