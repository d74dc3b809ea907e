"""Associative-scan backends in plain PyTorch (the training track's diagnostics, SPEC 5):
all prefixes of the affine maps z -> a_t z + b_t by log2(T) rounds of recursive doubling
(Hillis-Steele; round k: a_t <- a_t a_{t-2^k}, b_t <- a_t b_{t-2^k} + b_t), the initial
state folded into b_0, resets as a_t = 0; autograd backward, every round's maps kept.

- "assoc": maps in FP32 (complex64; float64 / complex128 for float64), exact up to
  reassociation, audited like every backend;
- "assoc_bf16": every round rounded to BF16, as some public scan kernels accumulate;
  inexact by design (INEXACT): timed and labelled, never chosen.
No launch options; coefficients and outputs are those of kernels.ops.reference.
"""

from __future__ import annotations

import torch

from . import reference

INEXACT = frozenset({"assoc_bf16"})


def _no_options(name: str, opts: dict) -> None:
    opts = {k: v for k, v in opts.items() if v is not None}
    if opts:
        raise ValueError(f"expected no launch options for the {name} backend, got {sorted(opts)}")


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        r = torch.view_as_real(t)
        return torch.view_as_complex(r.to(torch.bfloat16).to(r.dtype).contiguous())
    return t.to(torch.bfloat16).to(t.dtype)


def prefix_scan(a: torch.Tensor, b: torch.Tensor, segment_pos=None, initial_state=None, bf16: bool = False):
    """Every state h_t ([B, T, D], a's compute dtype) of h_t = a_t h_{t-1} + b_t by
    recursive doubling; a_t = 0 where segment_pos == 0."""
    reset = reference._reset(segment_pos)
    if reset is not None:
        a = torch.where(reset[..., None], torch.zeros_like(a), a)
    T = a.shape[1]
    if initial_state is not None and T:
        b = torch.cat([b[:, :1] + a[:, :1] * initial_state.to(b.dtype)[:, None], b[:, 1:]], dim=1)
    if bf16:
        a, b = _round_bf16(a), _round_bf16(b)
    k = 1
    while k < T:
        a_hi, b_hi = a[:, k:], b[:, k:]
        b = torch.cat([b[:, :k], a_hi * b[:, :-k] + b_hi], dim=1)
        a = torch.cat([a[:, :k], a_hi * a[:, :-k]], dim=1)
        if bf16:
            a, b = _round_bf16(a), _round_bf16(b)
        k *= 2
    return b


def _final(h: torch.Tensor, initial_state, output_final_state: bool, shape, dtype, device):
    if not output_final_state:
        return None
    if h.shape[1]:
        return h[:, -1]
    B, _, D = shape
    return initial_state.to(dtype) if initial_state is not None else torch.zeros(B, D, dtype=dtype, device=device)


def _rglru(bf16):
    def run(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False, **opts):
        _no_options("assoc_bf16" if bf16 else "assoc", opts)
        a, b = reference.rglru_coefficients(x, gate_x, gate_a, a_param, segment_pos)
        h = prefix_scan(a, b, segment_pos, initial_state, bf16)
        ht = _final(h, initial_state, output_final_state, x.shape, a.dtype, x.device)
        return h.to(x.dtype), ht
    return run


def _samu(bf16):
    def run(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
            initial_state=None, output_final_state=False, **opts):
        _no_options("assoc_bf16" if bf16 else "assoc", opts)
        a, b = reference.samu_coefficients(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
                                           segment_pos)
        h = prefix_scan(a, b, segment_pos, initial_state, bf16)
        y = torch.cat([torch.relu(h.real), torch.relu(h.imag)], dim=-1)
        B, T, D = x.shape
        ht = _final(h, initial_state, output_final_state, (B, T, D // 2), a.dtype, x.device)
        return y.to(x.dtype), ht
    return run


def _scan(bf16):
    def run(a, b, segment_pos=None, initial_state=None, output_final_state=False, **opts):
        _no_options("assoc_bf16" if bf16 else "assoc", opts)
        acc = reference._acc(b)
        h = prefix_scan(a.to(acc), b.to(acc), segment_pos, initial_state, bf16)
        ht = _final(h, initial_state, output_final_state, b.shape, acc, b.device)
        return h.to(b.dtype), ht
    return run


BACKENDS = {
    "rglru": {"assoc": _rglru(False), "assoc_bf16": _rglru(True)},
    "samu": {"assoc": _samu(False), "assoc_bf16": _samu(True)},
    "scan": {"assoc": _scan(False), "assoc_bf16": _scan(True)},
}
