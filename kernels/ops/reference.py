"""Float64-capable PyTorch references: the specification every kernel is tested against.

Shapes: B batch, T time, D recurrent width, M = D / 2 SAMU modes. Activations are
[B, T, D]; states are [B, D] (real) or [B, M] (complex). Low-precision inputs are
computed in FP32 with an FP32 state; float64 inputs stay in float64 throughout.
All functions are differentiable by autograd and return (y, final_state or None).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MAX_SQRT_GRADIENT = 1000.0


def _acc(t: torch.Tensor) -> torch.dtype:
    if t.is_complex():
        return torch.complex128 if t.dtype == torch.complex128 else torch.complex64
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class SqrtBoundDerivative(torch.autograd.Function):
    """sqrt whose backward is clipped to at most MAX_SQRT_GRADIENT (official RG-LRU)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / torch.sqrt(torch.clamp(4.0 * x, min=1.0 / MAX_SQRT_GRADIENT**2))


def scan(a, b, segment_pos=None, initial_state=None, output_final_state=False):
    """h_t = a_t * h_{t-1} + b_t with a_t = 0 where segment_pos == 0. a, b: [B, T, D] real
    or complex; initial_state: [B, D] in the state dtype. Returns (y in b's dtype, h)."""
    acc = _acc(b)
    if segment_pos is not None:
        a = torch.where((segment_pos == 0)[..., None], torch.zeros_like(a), a)
    B, T, D = b.shape
    h = torch.zeros(B, D, dtype=acc, device=b.device) if initial_state is None else initial_state.to(acc)
    ys = []
    for t in range(T):
        h = a[:, t].to(acc) * h + b[:, t].to(acc)
        ys.append(h)
    y = torch.stack(ys, dim=1).to(b.dtype) if T else b.new_zeros(B, 0, D)
    return y, (h if output_final_state else None)


def rglru_coefficients(x, gate_x, gate_a, a_param, segment_pos=None):
    """(a, b) of the RG-LRU recurrence, in the compute dtype (FP32 or float64)."""
    acc = _acc(x)
    x, gate_x, gate_a, a_param = (t.to(acc) for t in (x, gate_x, gate_a, a_param))
    log_a = -8.0 * torch.sigmoid(gate_a) * F.softplus(a_param)
    a = torch.exp(log_a)
    mult = SqrtBoundDerivative.apply(1.0 - torch.exp(2.0 * log_a))
    if segment_pos is not None:
        mult = torch.where((segment_pos == 0)[..., None], torch.ones_like(mult), mult)
    b = x * torch.sigmoid(gate_x) * mult
    return a, b


def rglru(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False):
    """RG-LRU from the two gate logits (official recurrentgemma semantics, SPEC 1.1).
    x, gate_x, gate_a: [B, T, D]; a_param: [D]; segment_pos: [B, T] int (0 = reset);
    initial_state: [B, D] FP32 (float64 for float64 inputs). y has x's dtype."""
    a, b = rglru_coefficients(x, gate_x, gate_a, a_param, segment_pos)
    y, h = scan(a, b, segment_pos, initial_state, output_final_state)
    return y.to(x.dtype), h


def samu_controls(x, phase_dir, radial_dir, phase_amp, radial_amp):
    """Per-token shared controls (eta [B, T], delta [B, T]) in the compute dtype."""
    acc = _acc(x)
    x, phase_dir, radial_dir = x.to(acc), phase_dir.to(acc), radial_dir.to(acc)
    # with dtype given, a python float goes straight into acc (not through float32)
    phase_amp, radial_amp = (torch.as_tensor(v, dtype=acc, device=x.device) for v in (phase_amp, radial_amp))
    M = x.shape[-1] // 2
    scale = 1.0 / math.sqrt(M)
    p = torch.tanh((x @ phase_dir[:-1] + phase_dir[-1]) / torch.linalg.vector_norm(phase_dir))
    r = torch.tanh((x @ radial_dir[:-1] + radial_dir[-1]) / torch.linalg.vector_norm(radial_dir))
    delta = scale * torch.tanh(phase_amp) * p
    eta = scale * torch.tanh(radial_amp) * r / (1.0 + r * r)
    return eta, delta


def samu_gamma(nu_log):
    nu = torch.exp(nu_log)
    return torch.sqrt(torch.clamp(1.0 - torch.exp(-2.0 * nu), min=0.0)) + 1e-8


def samu_coefficients(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None):
    """Complex (a, b) of the SAMU recurrence, [B, T, M] in complex64/complex128."""
    acc = _acc(x)
    eta, delta = samu_controls(x, phase_dir, radial_dir, phase_amp, radial_amp)
    nu, theta = torch.exp(nu_log.to(acc)), torch.exp(theta_log.to(acc))
    M = x.shape[-1] // 2
    mag = torch.exp(-nu * torch.exp(eta)[..., None])
    ang = theta + delta[..., None]
    a = torch.complex(mag * torch.cos(ang), mag * torch.sin(ang))
    xa = x.to(acc)
    gamma = samu_gamma(nu_log.to(acc))
    b = torch.complex(gamma * xa[..., :M], gamma * xa[..., M:])
    if segment_pos is not None:
        a = torch.where((segment_pos == 0)[..., None], torch.zeros_like(a), a)
    return a, b


def samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None, initial_state=None,
         output_final_state=False):
    """SAMU (SPEC 1.2): complex diagonal recurrence of M = D/2 modes with shared controls.
    x: [B, T, D], D even; phase_dir, radial_dir: [D + 1]; phase_amp, radial_amp:
    scalars; nu_log, theta_log: [M]; initial_state: [B, M] complex64 (complex128
    for float64 inputs). y = concat(relu(Re h), relu(Im h)) in x's dtype."""
    a, b = samu_coefficients(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos)
    h_all, h = scan(a, b, segment_pos, initial_state, output_final_state)
    y = torch.cat([torch.relu(h_all.real), torch.relu(h_all.imag)], dim=-1)
    return y.to(x.dtype), h


def samu_real(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
              initial_state=None, output_final_state=False):
    """SAMU written in real arithmetic only (polar transition, explicit real and
    imaginary parts): an independent formulation used to check `samu`."""
    acc = _acc(x)
    eta, delta = samu_controls(x, phase_dir, radial_dir, phase_amp, radial_amp)
    nu, theta = torch.exp(nu_log.to(acc)), torch.exp(theta_log.to(acc))
    B, T, D = x.shape
    M = D // 2
    gamma = samu_gamma(nu_log.to(acc))
    xa = x.to(acc)
    cos_t, sin_t = torch.cos(theta), torch.sin(theta)
    if initial_state is None:
        hr = hi = torch.zeros(B, M, dtype=acc, device=x.device)
    else:
        hr, hi = initial_state.real.to(acc), initial_state.imag.to(acc)
    outs = []
    for t in range(T):
        E = torch.exp(eta[:, t])[:, None]
        cd, sd = torch.cos(delta[:, t])[:, None], torch.sin(delta[:, t])[:, None]
        c = cos_t * cd - sin_t * sd
        s = sin_t * cd + cos_t * sd
        mag = torch.exp(-nu * E)
        if segment_pos is not None:
            mag = mag * (segment_pos[:, t] != 0).to(acc)[:, None]
        ar, ai = mag * c, mag * s
        hr, hi = ar * hr - ai * hi + gamma * xa[:, t, :M], ar * hi + ai * hr + gamma * xa[:, t, M:]
        outs.append(torch.cat([torch.relu(hr), torch.relu(hi)], dim=-1))
    return torch.stack(outs, dim=1).to(x.dtype), (torch.complex(hr, hi) if output_final_state else None)


def block_diagonal(x, w, b):
    """Block-diagonal linear map: x [..., H*W], w [H, W, W], b [H, W] -> [..., H*W]."""
    H, W, _ = w.shape
    xs = x.reshape(*x.shape[:-1], H, W)
    y = torch.einsum("...hi,hij->...hj", xs, w) + b
    return y.reshape(*x.shape[:-1], H * W)


def rglru_step(x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, reset=None):
    """One RG-LRU decode step with both block-diagonal gate matvecs. x: [B, D]; gate_*_w:
    [H, D/H, D/H]; gate_*_b: [H, D/H]; a_param: [D]; state: [B, D] FP32, updated in
    place; reset: [B] bool or None. Returns y [B, D] in x's dtype."""
    acc = state.dtype
    xa = x.to(acc)
    gx = block_diagonal(xa, gate_x_w.to(acc), gate_x_b.to(acc))
    ga = block_diagonal(xa, gate_a_w.to(acc), gate_a_b.to(acc))
    sp = None if reset is None else torch.where(reset, 0, 1).view(-1, 1)
    y, h = rglru(xa[:, None], gx[:, None], ga[:, None], a_param, sp, state, True)
    with torch.no_grad():
        state.copy_(h)
    return y[:, 0].to(x.dtype)


def samu_step(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset=None, modes=None):
    """One decode step of SAMU. x: [B, D]; state: [B, M] complex64, updated in place;
    reset: [B] bool or None; modes: ignored. Returns y [B, D] in x's dtype."""
    sp = None if reset is None else torch.where(reset, 0, 1).view(-1, 1)
    acc = torch.float64 if state.dtype == torch.complex128 else torch.float32
    y, h = samu(x[:, None].to(acc), phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, sp, state, True)
    with torch.no_grad():
        state.copy_(h)
    return y[:, 0].to(x.dtype)
