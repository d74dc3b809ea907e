"""Triton backends of the bare affine scan h_t = a_t h_{t-1} + b_t (a_t = 0 at resets)
against the float64 reference, on the CPU interpreter; outputs poisoned with NaN."""

import pytest
import torch

import kernels
import parity
from kernels.ops import reference
from kernels.ops.triton_utils import poisoned
from test_rglru_triton import B, D, T, positions

VARIANTS = [("serial", {"chunk_size": 16, "block_d": 32}), ("chunk", {"chunk_size": 16, "block_d": 16}),
            ("chunk", {"chunk_size": 8, "group": 2, "block_d": 32})]
IDS = ["serial16", "chunk16", "chunk8g2"]


@pytest.fixture(autouse=True)
def poison():
    with poisoned():
        yield


def inputs(dtype, seed=0):
    torch.manual_seed(seed)
    a = torch.rand(B, T, D, dtype=torch.float64) * 0.1 + 0.899       # |a| near 1: long memory
    b = torch.randn(B, T, D, dtype=torch.float64)
    h0 = torch.randn(B, D, dtype=torch.float64)
    return a.to(dtype), b.to(dtype), h0.to(torch.float64 if dtype == torch.float64 else torch.float32)


def run(fn, a, b, h0, pos, **opts):
    la, lb, lh = (t.detach().clone().requires_grad_() for t in (a, b, h0))
    y, h = fn(la, lb, pos, lh, True, **opts)
    g = torch.Generator().manual_seed(3)
    loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum() \
        + (h.double() * torch.randn(h.shape, generator=g, dtype=torch.float64)).sum()
    return [y, h, *torch.autograd.grad(loss, [la, lb, lh])]


@pytest.mark.parametrize("backend,opts", VARIANTS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scan_against_float64_reference(backend, opts, dtype):
    a, b, h0 = inputs(dtype)
    pos = positions()
    want = run(reference.scan, a.double(), b.double(), h0.double(), pos)
    got = run(kernels.backends("scan")[backend], a, b, h0, pos, **opts)
    tol = 1e-12 if dtype == torch.float64 else parity.BACKEND_TOL[torch.float32]
    for name, g, w in zip(["output", "final_state", "grad_a", "grad_b", "grad_initial_state"], got, want):
        assert parity.rel_err(g, w) <= tol, name


def test_scan_bf16_and_through_dispatch():
    a, b, h0 = inputs(torch.bfloat16, seed=1)
    pos = positions()
    exact = run(reference.scan, a.double(), b.double(), h0.double(), pos)
    yard = run(reference.scan, a, b, h0, pos)
    got = run(lambda *args, **kw: kernels.scan(*args, backend="serial", **kw), a, b, h0, pos)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    for g, y, w in zip(got, yard, exact):
        assert parity.rel_err(g, w) <= max(parity.LOWP_FACTOR * parity.rel_err(y, w), 1e-6)


@pytest.mark.parametrize("backend", ["serial", "chunk"])
def test_complex_scan_goes_to_reference(backend):
    torch.manual_seed(2)
    a = torch.polar(torch.rand(B, 5, D // 2, dtype=torch.float64), torch.rand(B, 5, D // 2, dtype=torch.float64))
    b = torch.randn(B, 5, D // 2, dtype=torch.complex128)
    y, h = kernels.scan(a, b, output_final_state=True, backend=backend)
    want_y, want_h = reference.scan(a, b, None, None, True)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
