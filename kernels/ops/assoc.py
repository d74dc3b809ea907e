"""Associative-scan backends in plain PyTorch (SPEC 5): all prefixes of z -> a_t z + b_t
by log2(T) rounds of recursive doubling, h0 folded into b_0, resets as a_t = 0; autograd
backward. "assoc" keeps the maps in at least FP32 (exact up to reassociation); "assoc_bf16"
rounds every round to BF16, as some public scan kernels do: inexact by design, never chosen.
"""

from __future__ import annotations

import torch

from . import reference

INEXACT = frozenset({"assoc_bf16"})


def _round(t: torch.Tensor, bf16: bool) -> torch.Tensor:
    if not bf16:
        return t
    r = torch.view_as_real(t) if t.is_complex() else t
    r = r.to(torch.bfloat16).to(r.dtype)
    return torch.view_as_complex(r.contiguous()) if t.is_complex() else r


def prefix_scan(a, b, segment_pos, initial_state, output_final_state, bf16):
    """(every state [B, T, D], final state or None) of h_t = a_t h_{t-1} + b_t in b's dtype,
    a_t = 0 where segment_pos == 0; round k: a_t <- a_t a_{t-2^k}, b_t <- a_t b_{t-2^k} + b_t."""
    if segment_pos is not None:
        a = torch.where((segment_pos == 0)[..., None], torch.zeros_like(a), a)
    T = b.shape[1]
    h0 = None if initial_state is None else initial_state.to(b.dtype)
    if h0 is not None and T:
        b = torch.cat([b[:, :1] + a[:, :1] * h0[:, None], b[:, 1:]], dim=1)
    a, b = _round(a, bf16), _round(b, bf16)
    k = 1
    while k < T:
        a_hi = a[:, k:]
        b = torch.cat([b[:, :k], a_hi * b[:, :-k] + b[:, k:]], dim=1)
        a = torch.cat([a[:, :k], a_hi * a[:, :-k]], dim=1)
        a, b = _round(a, bf16), _round(b, bf16)
        k *= 2
    if not output_final_state:
        return b, None
    return b, (b[:, -1] if T else h0 if h0 is not None else b.new_zeros(b.shape[0], b.shape[2]))


def _backends(name: str) -> dict:
    bf16 = name == "assoc_bf16"

    def run(a, b, segment_pos, initial_state, output_final_state, opts):
        if any(v is not None for v in opts.values()):
            raise ValueError(f"expected no launch options for the {name} backend, got {sorted(opts)}")
        return prefix_scan(a, b, segment_pos, initial_state, output_final_state, bf16)

    def rglru(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False, **opts):
        a, b = reference.rglru_coefficients(x, gate_x, gate_a, a_param, segment_pos)
        h, ht = run(a, b, segment_pos, initial_state, output_final_state, opts)
        return h.to(x.dtype), ht

    def samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
             initial_state=None, output_final_state=False, **opts):
        a, b = reference.samu_coefficients(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
                                           segment_pos)
        h, ht = run(a, b, segment_pos, initial_state, output_final_state, opts)
        return torch.cat([torch.relu(h.real), torch.relu(h.imag)], dim=-1).to(x.dtype), ht

    def scan(a, b, segment_pos=None, initial_state=None, output_final_state=False, **opts):
        acc = reference._acc(b)
        h, ht = run(a.to(acc), b.to(acc), segment_pos, initial_state, output_final_state, opts)
        return h.to(b.dtype), ht

    return {"rglru": rglru, "samu": samu, "scan": scan}


_EXACT, _BF16 = _backends("assoc"), _backends("assoc_bf16")
BACKENDS = {op: {"assoc": _EXACT[op], "assoc_bf16": _BF16[op]} for op in _EXACT}
