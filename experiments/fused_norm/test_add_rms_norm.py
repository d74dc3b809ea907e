"""add_rms_norm against float64 and against the model's own path. On a machine without a
GPU: `TRITON_INTERPRET=1 python -m pytest -q experiments/fused_norm` (not part of CI)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from add_rms_norm import add_rms_norm, hawk_loss  # noqa: E402
from parity import rel_err as rel  # noqa: E402
from kernels.models import HawkConfig, HawkLM  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, h, scale, eps, dtype):
    """The model's path: x + h in x's dtype, RMSNorm in FP32, the output in `dtype`."""
    s = x if h is None else x + h
    acc = torch.promote_types(s.dtype, torch.float32)
    y = torch.nn.functional.rms_norm(s.to(acc), (s.shape[-1],), scale.to(acc) + 1, eps).to(dtype)
    return y, s


@pytest.mark.parametrize("with_h", [True, False])
# (2, 9, 1024): 4 rows a program, 5 row blocks over 4 backward programs (one takes two)
@pytest.mark.parametrize("shape", [(2, 5, 24), (3, 7, 40), (1, 1, 8), (2, 9, 1024)])
def test_float64_forward_and_gradients(shape, with_h):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    h = torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV).requires_grad_() if with_h else None
    scale = (0.1 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(DEV).requires_grad_()
    dy, ds = (torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV) for _ in range(2))
    y, s = add_rms_norm(x, h, scale, 1e-6)
    ry, rs = reference(x, h, scale, 1e-6, torch.float64)
    assert rel(y, ry) < 1e-12 and rel(s, rs) < 1e-12
    ins = [t for t in (x, h, scale) if t is not None]
    got = torch.autograd.grad((y, s) if with_h else (y,), ins, (dy, ds) if with_h else (dy,))
    want = torch.autograd.grad((ry, rs) if with_h else (ry,), ins, (dy, ds) if with_h else (dy,))
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-12


def test_bf16_branch_over_fp32_stream_matches_the_model_path():
    """Autocast's case: a BF16 branch added to the FP32 stream, the norm written in BF16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, 40, generator=g).to(DEV).requires_grad_()
    h = torch.randn(4, 9, 40, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    scale = (0.1 * torch.randn(40, generator=g)).to(DEV).requires_grad_()
    dy = torch.randn(4, 9, 40, generator=g).to(DEV, torch.bfloat16)
    ds = torch.randn(4, 9, 40, generator=g).to(DEV)
    y, s = add_rms_norm(x, h, scale, 1e-6, torch.bfloat16)
    ry, rs = reference(x, h, scale, 1e-6, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32 and torch.equal(s, rs)
    assert rel(y, ry) <= 2 ** -8                  # one BF16 rounding apart at most
    got = torch.autograd.grad((y, s), (x, h, scale), (dy, ds))
    want = torch.autograd.grad((ry, rs), (x, h, scale), (dy, ds))
    assert got[1].dtype == torch.bfloat16
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-2


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_hawk_loss_equals_the_model_loss(mixer):
    torch.manual_seed(0)
    cfg = HawkConfig.preset("tiny", mixer=mixer, vocab_size=64)
    model = HawkLM(cfg, backend="reference", device=DEV, dtype=torch.float64)
    for p in model.parameters():                  # nonzero norm scales
        if p.dim() == 1:
            p.data.normal_(0, 0.1)
    tokens = torch.randint(0, 64, (2, 12), device=DEV)
    targets = torch.randint(0, 64, (2, 12), device=DEV)
    pos = torch.arange(12, device=DEV).expand(2, 12)
    want = model.loss(tokens, targets, pos)
    gw = torch.autograd.grad(want, list(model.parameters()))
    got = hawk_loss(model, tokens, targets, pos)
    gg = torch.autograd.grad(got, list(model.parameters()))
    assert rel(got, want) < 1e-12
    for (n, _), a, b in zip(model.named_parameters(), gg, gw):
        assert rel(a, b) < 1e-10, n


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_bench_gate(mixer, monkeypatch):
    """bench.py's gate at a tiny shape on this machine (its timing needs a GPU): the fused
    norms and the model itself pass against float64, a step whose loss is 1 % off fails."""
    import bench

    monkeypatch.setitem(bench.VARIANTS, "scaled", lambda m: setattr(
        m, "loss", lambda *a, f=m.loss: f(*a) * 1.01) or m)
    for variant, ok in (("fused", True), ("model", True), ("scaled", False)):
        got = bench.gate("tiny", mixer, variant, 2, 16, 64, device=DEV)
        assert got["passed"] is ok and got["grad_rel_variant"] > 0, (variant, got)
