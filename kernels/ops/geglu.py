"""Fused gated GeLU and its backward, one launch each way:
    h = gelu_tanh(gate) * value,  dgate = dh * value * gelu_tanh'(gate),  dvalue = dh * gelu_tanh(gate),
in FP32, rounded where the formula `gelu(gate) * value` rounds in the inputs' dtype, so the
model, the decode kernels and the formula on the CPU agree. `geglu(up)`: [gate | value] the
halves of up [..., 2E] (Hawk's MLP); `gelu_mul(gate, value)`: two tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .accounting import account
from .checks import check_same_device, check_tensor, shape_str
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
def _gelu_mul_fwd(g_ptr, v_ptr, h_ptr, E, S, RNE: tl.constexpr, BLOCK: tl.constexpr):
    # gate and value rows S elements apart (2E: the halves of one projection; E: two tensors)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < E
    g = tl.load(g_ptr + row * S + c, mask=m, other=0).to(tl.float32)
    v = tl.load(v_ptr + row * S + c, mask=m, other=0).to(tl.float32)
    gr = out(gelu_tanh(g), h_ptr, RNE).to(tl.float32)
    tl.store(h_ptr + row * E + c, out(gr * v, h_ptr, RNE), mask=m)


@launcher
@triton.jit
def _gelu_mul_bwd(g_ptr, v_ptr, dh_ptr, dg_ptr, dv_ptr, E, S, RNE: tl.constexpr, BLOCK: tl.constexpr):
    # dg, dv laid out as g, v (rows S apart)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < E
    g = tl.load(g_ptr + row * S + c, mask=m, other=0).to(tl.float32)
    v = tl.load(v_ptr + row * S + c, mask=m, other=0).to(tl.float32)
    dh = tl.load(dh_ptr + row * E + c, mask=m, other=0).to(tl.float32)
    dhv = out(dh * v, dg_ptr, RNE).to(tl.float32)
    tl.store(dg_ptr + row * S + c, out(dhv * _gelu_slope(g), dg_ptr, RNE), mask=m)
    tl.store(dv_ptr + row * S + c, out(dh * out(gelu_tanh(g), dv_ptr, RNE).to(tl.float32), dv_ptr, RNE), mask=m)


def _pair(tensors):
    """(gate, value, elements from one row to the next) of (up,), its halves, or of (gate, value)."""
    if len(tensors) == 2:
        return (*tensors, tensors[0].shape[-1])
    E = tensors[0].shape[-1] // 2
    return tensors[0][..., :E], tensors[0][..., E:], 2 * E


class _GeluMul(torch.autograd.Function):
    """On (up,) (geglu; the backward writes both halves of one gradient buffer) or (gate, value)."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.save_for_backward(*inputs)
        g, v, S = _pair(inputs)
        E = g.shape[-1]
        h = empty(g.shape, g.dtype, g.device)
        _gelu_mul_fwd[(h.numel() // E, cdiv(E, BLOCK))](g, v, h, E, S, INTERPRET, BLOCK, num_warps=4)
        account("gelu_mul", (h, h), (h,))       # gate and value: h's size each
        return h

    @staticmethod
    def backward(ctx, dh):
        grads = [empty(t.shape, t.dtype, t.device) for t in ctx.saved_tensors]
        (g, v, S), (dg, dv, _) = _pair(ctx.saved_tensors), _pair(grads)
        E = g.shape[-1]
        _gelu_mul_bwd[(dh.numel() // E, cdiv(E, BLOCK))](g, v, dh.contiguous(), dg, dv, E, S, INTERPRET, BLOCK,
                                                         num_warps=4)
        account("gelu_mul_bwd", (dh, dh, dh), (dh, dh))      # g, v, dh read; dg, dv written
        return tuple(grads)


def _check(name, t, last):
    check_tensor(name, t, dtypes=DTYPES)
    if t.dim() < 1 or t.shape[-1] == 0 or not t.is_contiguous():
        raise ValueError(f"expected a contiguous {name} [..., {last}] with E > 0, got shape {shape_str(t)}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def geglu(up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(up[..., :E]) * up[..., E:] for up [..., 2E] contiguous, in up's dtype."""
    _check("up", up, "2E")
    if up.shape[-1] % 2:
        raise ValueError(f"expected up [..., 2E] with an even last dimension, got shape {list(up.shape)}")
    return _GeluMul.apply(up)


def gelu_mul(gate: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * value for contiguous gate, value [..., E] of one shape and dtype."""
    _check("gate", gate, "E")
    _check("value", value, "E")
    check_same_device(("gate", "value"), (gate, value))
    if value.shape != gate.shape or value.dtype != gate.dtype:
        raise ValueError(f"expected value of gate's shape {list(gate.shape)} and dtype {gate.dtype}, got "
                         f"{list(value.shape)} and {value.dtype}")
    return _GeluMul.apply(gate, value)


__all__ = ["geglu", "gelu_mul"]
