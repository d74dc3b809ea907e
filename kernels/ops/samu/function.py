"""The differentiable SAMU over the serial and chunk launchers (forward: controls_fwd, then the scan; backward: the
scan's, then controls_bwd) and the backend functions with the reference signature. Eager calls run `SamuFunction`,
torch.compile the custom ops kernels::samu_fwd / _bwd; complex states cross them as view_as_real pairs [B, M, 2].
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..checks import MODE_CONSTS, check_chunk_size, no_double_backward, state_dtype
from ..triton_utils import cdiv, cfg_of, opts_items, opts_key, spec_of
from . import chunk, fused_recurrent
from .common import controls_bwd, controls_fwd, scalar_param

_LAUNCH = {"serial": (fused_recurrent.serial_forward, fused_recurrent.serial_backward),
           "chunk": (chunk.chunk_forward, chunk.chunk_backward)}


@functools.lru_cache(maxsize=256)
def _config(backend, opts):
    """The launch configuration as spec_of's string: the chunk (default 16) or serial tile (default 32) length."""
    opts = opts_items(opts)
    K = opts.pop("chunk_size", None)
    if opts:
        raise ValueError(f"expected {backend} options among ['chunk_size'], got {sorted(opts)}")
    return spec_of({"backend": backend, "K": check_chunk_size((32 if backend == "serial" else 16) if K is None else K)})


def _forward(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0, save, spec):
    """(y, final state [B, M, 2], ctrl, aux, modes, states or None); pa, ra: [1] tensors in the accumulation dtype."""
    x, h0 = x.contiguous(), None if h0 is None else h0.contiguous()
    ctrl, aux, modes = controls_fwd(x, phase_dir.contiguous(), radial_dir.contiguous(), pa, ra, pos,
                                    nu_log.contiguous(), theta_log.contiguous(), state_dtype(x.dtype))
    cfg = cfg_of(spec)
    y, h, states = _LAUNCH[cfg["backend"]][0](x, ctrl, modes, h0, save, cfg)
    return y, h, ctrl, aux, modes, states


def _backward(x: Tensor, phase_dir: Tensor, radial_dir: Tensor, pa: Tensor, ra: Tensor, ctrl: Tensor, aux: Tensor,
              modes: Tensor, states: Tensor, dy: Tensor, dh: Optional[Tensor],
              spec: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d phase_dir, d radial_dir, d amplitudes [2], d (nu_log, theta_log) [M, 2], d h0 [B, M, 2]) in the
    accumulation dtype (dx in x's). The saved tensors are the caller's (what torch.compile hands the op): copied
    where strided."""
    x, phase_dir, radial_dir, dy = x.contiguous(), phase_dir.contiguous(), radial_dir.contiguous(), dy.contiguous()
    cfg = cfg_of(spec)
    dxw, dpart, ppart, dh0 = _LAUNCH[cfg["backend"]][1](x, dy, ctrl, modes, states,
                                                        None if dh is None else dh.contiguous(), cfg)
    return (*controls_bwd(dxw, x, aux, dpart, ppart, phase_dir, radial_dir, pa, ra), dh0)


def _grads(ctx, dy, dh, bwd):
    """The gradients of (x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0) by
    bwd (_backward, or the op kernels::samu_bwd under torch.compile) of the saved tensors."""
    x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, *saved = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    dx, dpd, drd, damp, dmode, dh0 = bwd(x, phase_dir, radial_dir, pa, ra, *saved, dy, dh, ctx.spec)
    return (dx, dpd.to(phase_dir.dtype), drd.to(radial_dir.dtype), damp[0:1], damp[1:2],
            dmode[:, 0].to(nu_log.dtype), dmode[:, 1].to(theta_log.dtype), None, dh0 if ctx.has_h0 else None)


class SamuFunction(torch.autograd.Function):
    """SAMU through the launchers `spec` names, applied where an input requires grad; pa, ra: [1] amplitude tensors
    in the accumulation dtype; h0: the initial state as [B, M, 2] or None."""

    @staticmethod
    def forward(ctx, x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0, spec):
        # an unused output's gradient arrives as None, not as a zero tensor filled per call
        ctx.set_materialize_grads(False)
        y, h, *saved = _forward(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0, True, spec)
        ctx.save_for_backward(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, *saved)
        ctx.spec, ctx.has_h0 = spec, h0 is not None
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        no_double_backward()
        return (*_grads(ctx, dy, dh, _backward), None)


@torch.library.custom_op("kernels::samu_fwd", mutates_args=())
def samu_fwd(x: Tensor, phase_dir: Tensor, radial_dir: Tensor, pa: Tensor, ra: Tensor, nu_log: Tensor,
             theta_log: Tensor, pos: Optional[Tensor], h0: Optional[Tensor], save: bool,
             spec: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    *out, states = _forward(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0, save, spec)
    return *out, (states if save else out[1].new_empty(0))


@samu_fwd.register_fake
def _(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0, save, spec):
    B, T, D = x.shape
    M, acc = D // 2, state_dtype(x.dtype)
    states = (B, cdiv(T, cfg_of(spec)["K"]), M, 2) if save else (0,)     # the states entering the chunks
    return (torch.empty_like(x), x.new_empty(B, M, 2, dtype=acc), x.new_empty(B * T, 4, dtype=acc),
            x.new_empty(B * T, 2, dtype=acc), x.new_empty(MODE_CONSTS, M, dtype=acc), x.new_empty(states, dtype=acc))


samu_bwd = torch.library.custom_op("kernels::samu_bwd", _backward, mutates_args=())


@samu_bwd.register_fake
def _(x, phase_dir, radial_dir, pa, ra, ctrl, aux, modes, states, dy, dh, spec):
    B, T, D = x.shape
    M, acc = D // 2, state_dtype(x.dtype)
    return (torch.empty_like(x), x.new_empty(D + 1, dtype=acc), x.new_empty(D + 1, dtype=acc),
            x.new_empty(2, dtype=acc), x.new_empty(M, 2, dtype=acc), x.new_empty(B, M, 2, dtype=acc))


def _setup_context(ctx, inputs, output):
    x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, pos, h0, save, spec = inputs
    ctx.save_for_backward(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, *output[2:])
    ctx.spec, ctx.has_h0 = spec, h0 is not None


def _op_backward(ctx, dy, dh, *_):
    return (*_grads(ctx, dy, dh, torch.ops.kernels.samu_bwd), None, None)


torch.library.register_autograd("kernels::samu_fwd", _op_backward, setup_context=_setup_context)


def _run(backend, x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos,
         initial_state, output_final_state, opts):
    spec = _config(backend, opts_key(opts))
    acc = state_dtype(x.dtype)
    pa, ra = scalar_param(phase_amp, x.device, acc), scalar_param(radial_amp, x.device, acc)
    # a conjugate view (h.conj()) has no real view for the kernels: materialise it
    h0 = None if initial_state is None else torch.view_as_real(initial_state.resolve_conj())
    args = (x, phase_dir, radial_dir, pa, ra, nu_log, theta_log)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*args, h0))
    if torch.compiler.is_compiling():
        y, h, *_ = torch.ops.kernels.samu_fwd(*args, segment_pos, h0, grad, spec)
    elif grad:
        y, h = SamuFunction.apply(*args, segment_pos, h0, spec)
    else:       # the prefill: no states kept
        y, h, *_ = _forward(*args, segment_pos, h0, False, spec)
    return y, (torch.view_as_complex(h) if output_final_state else None)


def fused_recurrent_samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
                         initial_state=None, output_final_state=False, **opts):
    """Serial SAMU (reference signature); option chunk_size: the tile and checkpoint length (default 32)."""
    return _run("serial", x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos,
                initial_state, output_final_state, opts)


def chunk_samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
               initial_state=None, output_final_state=False, **opts):
    """Two-level chunked SAMU (reference signature); option chunk_size (default 16)."""
    return _run("chunk", x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos,
                initial_state, output_final_state, opts)
