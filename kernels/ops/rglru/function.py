"""The differentiable RG-LRU and bare scan over the serial and chunked launchers, and
the backend functions with the reference signature. Eager calls run
`RecurrenceFunction`; under torch.compile the custom ops kernels::rglru_fwd / _bwd run
(fake implementations, backward by torch.library.register_autograd: one graph node),
the launcher configuration travelling as a string (triton_utils.spec_of).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import reference
from ..checks import no_double_backward, state_dtype
from ..triton_utils import cfg_of, opts_items, opts_key, spec_of
from . import chunk, fused_recurrent
from .common import empty_sequence, reduce_dap

_BACKENDS = {"serial": fused_recurrent, "chunk": chunk}


def _config(backend, x, is_scan, grad, opts):
    # the serial kernels' default depends on the device's multiprocessors (positional:
    # not an option a caller can pass)
    dev = (fused_recurrent.multiprocessors(x.device),) if backend == "serial" else ()
    return _cached_config(backend, *x.shape, is_scan, grad, dev, opts_key(opts))


@functools.lru_cache(maxsize=1024)
def _cached_config(backend, B, T, D, is_scan, grad, dev, opts):
    return _BACKENDS[backend].config(B, T, D, is_scan, *dev, grad=grad, **opts_items(opts))


def _contiguous(*ts):
    # the kernels index every tensor as contiguous
    return [None if t is None else t.contiguous() for t in ts]


def _forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg):
    x, gx, ga, a_param, pos, h0 = _contiguous(x, gx, ga, a_param, pos, h0)
    return _BACKENDS[cfg["backend"]].forward(x, gx if gx is not None else x, ga, a_param, pos, h0, output_final_state,
                                             save, is_scan, cfg)


def _backward(x, gx, ga, a_param, pos, saved, dy, dht, need_dh0, is_scan, cfg):
    """(dx, dgx, dga, da_param, dh0); None where there is none."""
    x, gx, ga, a_param, pos, dy, dht = _contiguous(x, gx, ga, a_param, pos, dy, dht)
    dx, dgx, dga, dh0, part = _BACKENDS[cfg["backend"]].backward(
        x, gx if gx is not None else x, ga, a_param, pos, saved, dy, dht, need_dh0, is_scan, cfg)
    dap = None if is_scan or a_param is None else reduce_dap(part, a_param)
    return dx, dgx, dga, dap, dh0


class RecurrenceFunction(torch.autograd.Function):
    """RG-LRU (is_scan False: x, gate_x, gate_a, a_param) or the bare scan (True: x = b,
    gx None, ga = a) through the launchers `cfg` names."""

    @staticmethod
    def forward(ctx, x, gx, ga, a_param, pos, h0, output_final_state, is_scan, cfg):
        # an unused output's gradient arrives as None, not as a zero tensor filled per call
        ctx.set_materialize_grads(False)
        save = any(ctx.needs_input_grad)
        y, ht, saved = _forward(x, gx, ga, a_param, pos, h0, output_final_state, save, is_scan, cfg)
        if save:
            ctx.save_for_backward(x, gx, ga, a_param, pos, saved)
            ctx.is_scan, ctx.cfg, ctx.has_h0 = is_scan, cfg, h0 is not None
        return y, ht

    @staticmethod
    def backward(ctx, dy, dht):
        no_double_backward()
        x, gx, ga, a_param, pos, saved = ctx.saved_tensors
        dy = torch.zeros_like(x) if dy is None else dy
        dx, dgx, dga, dap, dh0 = _backward(x, gx, ga, a_param, pos, saved, dy, dht, ctx.has_h0, ctx.is_scan, ctx.cfg)
        return dx, dgx, dga, dap, None, dh0, None, None, None


def _none(t: Tensor) -> Optional[Tensor]:
    # custom ops return no None: an empty tensor (new_empty(0)) stands for "none"
    return None if t.numel() == 0 and t.dim() == 1 else t


@torch.library.custom_op("kernels::rglru_fwd", mutates_args=())
def rglru_fwd(x: Tensor, gx: Optional[Tensor], ga: Tensor, a_param: Optional[Tensor], pos: Optional[Tensor],
              h0: Optional[Tensor], save: bool, is_scan: bool, spec: str) -> tuple[Tensor, Tensor, Tensor]:
    y, ht, saved = _forward(x, gx, ga, a_param, pos, h0, True, save, is_scan, cfg_of(spec))
    return y, ht, (saved if save else ht.new_empty(0))


@rglru_fwd.register_fake
def _(x, gx, ga, a_param, pos, h0, save, is_scan, spec):
    B, T, D = x.shape
    cfg, acc = cfg_of(spec), state_dtype(x.dtype)
    saved = x.new_empty(_BACKENDS[cfg["backend"]].saved_shape(cfg, B, T, D) if save else (0,), dtype=acc)
    return torch.empty_like(x), x.new_empty(B, D, dtype=acc), saved


@torch.library.custom_op("kernels::rglru_bwd", mutates_args=())
def rglru_bwd(x: Tensor, gx: Optional[Tensor], ga: Tensor, a_param: Optional[Tensor], pos: Optional[Tensor],
              saved: Tensor, dy: Tensor, dht: Optional[Tensor], need_dh0: bool, is_scan: bool,
              spec: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _backward(x, gx, ga, a_param, pos, saved, dy, dht, need_dh0, is_scan, cfg_of(spec))
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@rglru_bwd.register_fake
def _(x, gx, ga, a_param, pos, saved, dy, dht, need_dh0, is_scan, spec):
    B, _, D = x.shape
    dgx = x.new_empty(0) if is_scan else torch.empty_like(x)
    dap = x.new_empty(0) if is_scan or a_param is None else torch.empty_like(a_param)
    dh0 = x.new_empty(B, D, dtype=state_dtype(x.dtype)) if need_dh0 else x.new_empty(0)
    return torch.empty_like(x), dgx, torch.empty_like(ga), dap, dh0


def _setup_context(ctx, inputs, output):
    x, gx, ga, a_param, pos, h0, save, is_scan, spec = inputs
    ctx.save_for_backward(x, gx, ga, a_param, pos, output[2])
    ctx.is_scan, ctx.spec, ctx.has_h0 = is_scan, spec, h0 is not None


def _op_backward(ctx, dy, dht, _):
    x, gx, ga, a_param, pos, saved = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    dx, dgx, dga, dap, dh0 = torch.ops.kernels.rglru_bwd(x, gx, ga, a_param, pos, saved, dy, dht, ctx.has_h0,
                                                         ctx.is_scan, ctx.spec)
    return dx, _none(dgx), dga, _none(dap), None, (dh0 if ctx.has_h0 else None), None, None, None


torch.library.register_autograd("kernels::rglru_fwd", _op_backward, setup_context=_setup_context)


def _run(backend, x, gx, ga, a_param, pos, h0, output_final_state, is_scan, opts):
    """(y, final state or None): the custom op under torch.compile, RecurrenceFunction
    where a gradient is needed (which also chose the configuration), else the launcher
    alone (no states kept)."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, gx, ga, a_param, h0))
    cfg = _config(backend, x, is_scan, grad, opts)
    if x.shape[1] == 0:
        return empty_sequence(x, h0, output_final_state)
    if torch.compiler.is_compiling():
        y, ht, _ = torch.ops.kernels.rglru_fwd(x, gx, ga, a_param, pos, h0, grad, is_scan, spec_of(cfg))
        return y, (ht if output_final_state else None)
    if grad:
        return RecurrenceFunction.apply(x, gx, ga, a_param, pos, h0, output_final_state, is_scan, cfg)
    return _forward(x, gx, ga, a_param, pos, h0, output_final_state, False, is_scan, cfg)[:2]


def rglru(backend, x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False, **opts):
    """RG-LRU through `backend`'s kernels ("serial", "chunk"; options: that module's OPTIONS)
    with the reference signature after `backend`."""
    return _run(backend, x, gate_x, gate_a, a_param, segment_pos, initial_state, output_final_state, False, opts)


def scan(backend, a, b, segment_pos=None, initial_state=None, output_final_state=False, **opts):
    """The bare scan as `rglru` runs the RG-LRU; complex inputs: the reference."""
    if b.is_complex():
        return reference.scan(a, b, segment_pos, initial_state, output_final_state)
    a = a.to(b.dtype) if a.dtype != b.dtype else a
    return _run(backend, b, None, a, None, segment_pos, initial_state, output_final_state, True, opts)
