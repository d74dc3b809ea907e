"""The differentiable SAMU operator shared by every Triton backend.

A backend is a plan with two launchers (the recurrence's forward and backward); the
controller's forward/backward and the parameter reductions around them are common:

    forward:  controls_fwd, mode_table -> plan.forward (y, final state, states kept);
              a plan may fuse the controller into its forward (controls_and_forward)
    backward: plan.backward -> controls_bwd/finalize   (every gradient)
"""

from __future__ import annotations

import torch

from .._checks import no_double_backward
from .common import acc_dtype, controls_bwd, controls_fwd, mode_table, scalar_param


def controls_and_forward(plan, x, phase_dir, radial_dir, pa, ra, segment_pos, modes, h0, need_states):
    """(ctrl, aux, (y, final state, states)): the plan's own fused path when it has one."""
    if hasattr(plan, "controls_and_forward"):
        return plan.controls_and_forward(x, phase_dir, radial_dir, pa, ra, segment_pos, modes, h0, need_states)
    ctrl, aux = controls_fwd(x, phase_dir, radial_dir, pa, ra, segment_pos)
    return ctrl, aux, plan.forward(x, ctrl, modes, h0, need_states)


class SamuFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos,
                initial_state, plan):
        acc = acc_dtype(x.dtype)
        pa = scalar_param(phase_amp, x.device, acc)
        ra = scalar_param(radial_amp, x.device, acc)
        modes = mode_table(nu_log, theta_log, acc)
        h0 = None if initial_state is None else torch.view_as_real(initial_state)
        ctrl, aux, (y, h, states) = controls_and_forward(plan, x, phase_dir, radial_dir, pa, ra, segment_pos, modes,
                                                         h0, True)
        ctx.save_for_backward(x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, ctrl, aux, modes, states)
        ctx.plan = plan
        ctx.amps = tuple(v if isinstance(v, torch.Tensor) else None for v in (phase_amp, radial_amp))
        ctx.has_h0 = initial_state is not None
        return y, torch.view_as_complex(h)

    @staticmethod
    def backward(ctx, dy, dh):
        no_double_backward()
        x, phase_dir, radial_dir, pa, ra, nu_log, theta_log, ctrl, aux, modes, states = ctx.saved_tensors
        dy = dy.contiguous()
        # a cotangent through h.conj() arrives as a conjugate view: materialise it
        gh = None if dh is None else torch.view_as_real(dh.resolve_conj().contiguous())
        dxw, dpart, ppart, dh0 = ctx.plan.backward(x, dy, ctrl, modes, states, gh)
        dx, dpd, drd, damp, dmode = controls_bwd(dxw, x, aux, dpart, ppart, phase_dir, radial_dir, pa, ra)
        damps = [None if v is None else damp[i].reshape(v.shape).to(v.dtype) for i, v in enumerate(ctx.amps)]
        return (dx, dpd.to(phase_dir.dtype), drd.to(radial_dir.dtype), damps[0], damps[1],
                dmode[:, 0].to(nu_log.dtype), dmode[:, 1].to(theta_log.dtype), None,
                torch.view_as_complex(dh0) if ctx.has_h0 else None, None)


def samu_apply(plan, x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
               segment_pos=None, initial_state=None, output_final_state=False):
    """(y [B, T, D], final state [B, M] complex or None) through `plan`; the forward-only
    path (no tensor needs a gradient, or grad mode is off) keeps no states: that is the prefill."""
    x = x.contiguous()
    phase_dir, radial_dir = phase_dir.contiguous(), radial_dir.contiguous()
    nu_log, theta_log = nu_log.contiguous(), theta_log.contiguous()
    if initial_state is not None:
        # a conjugate view (h.conj()) has no real view for the kernels: materialise it
        initial_state = initial_state.resolve_conj().contiguous()
    if segment_pos is not None:
        segment_pos = segment_pos.contiguous()
    args = (x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, initial_state)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args):
        y, h = SamuFunction.apply(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
                                  segment_pos, initial_state, plan)
    else:
        acc = acc_dtype(x.dtype)
        pa = scalar_param(phase_amp, x.device, acc)
        ra = scalar_param(radial_amp, x.device, acc)
        h0 = None if initial_state is None else torch.view_as_real(initial_state)
        _, _, (y, hr, _) = controls_and_forward(plan, x, phase_dir, radial_dir, pa, ra, segment_pos,
                                                mode_table(nu_log, theta_log, acc), h0, False)
        h = torch.view_as_complex(hr)
    return y, (h if output_final_state else None)
