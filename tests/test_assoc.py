"""The PyTorch associative-scan backends (kernels.ops.assoc): "assoc" is exact like
every other backend; "assoc_bf16" really accumulates in BF16 and is recorded by the
audit without being gated or ever counted exact."""

import sys
from pathlib import Path

import pytest
import torch

from kernels import ops
import parity
from kernels.ops import assoc, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow" / "scripts"))
from common import cases  # noqa: E402


@pytest.fixture(autouse=True)
def only_pytorch_backends(monkeypatch):
    """The gates run every registered backend; here only the reference and the two
    associative scans (the Triton kernels have their own tests)."""
    real = ops.backends

    def some(op):
        return {k: v for k, v in real(op).items() if k in ("reference", "assoc", "assoc_bf16")}

    monkeypatch.setattr(ops, "backends", some)


@pytest.mark.parametrize("op", ["rglru", "samu", "scan"])
@pytest.mark.parametrize("T", [1, 2, 37])
def test_assoc_is_exact_in_float64_and_bf16_variant_is_recorded_not_gated(op, T):
    rows = parity.check_backends(op, B=2, T=T, D=8, dtype=torch.float64)
    mine = [r for r in rows if r["backend"] == "assoc"]
    stages = {r["stage"] for r in mine}
    assert {"output", "final_state", "grad_initial_state"} <= stages and len(stages) >= 5
    for r in mine:                      # float64 against the float64 per-step loop
        assert r["passed"] and r["error"] <= 1e-12, r
    bf = [r for r in rows if r["backend"] == "assoc_bf16"]
    assert bf and all(r["role"] == "inexact-by-design" and r["passed"] for r in bf)


@pytest.mark.parametrize("op", ["rglru", "samu", "scan"])
def test_bf16_accumulation_is_visible_and_never_exact(op):
    rows = parity.check_backends(op, B=2, T=37, D=8, dtype=torch.float32)
    err = {(r["backend"], r["stage"]): r["error"] for r in rows}
    assert err[("assoc", "output")] <= 1e-5
    # Rounding every round's maps to BF16 moves the output by far more than FP32 does.
    assert err[("assoc_bf16", "output")] > 1e-4
    gated = cases.gated_backends({"checks": rows})
    assert "assoc" in gated[op] and "assoc_bf16" not in gated[op]
    assert cases.exact_backend_names(op, list(ops.backends(op)), {"checks": rows}).count("assoc_bf16") == 0
    assert "assoc_bf16" in ops.inexact_backends() and "assoc" not in ops.inexact_backends()


def test_resets_and_initial_state_through_the_public_op():
    torch.manual_seed(0)
    B, T, D = 2, 23, 6
    a, b = torch.rand(B, T, D, dtype=torch.float64), torch.randn(B, T, D, dtype=torch.float64)
    pos = torch.arange(T).repeat(B, 1)
    pos[0, 5:] -= 5            # a document starting at t = 5 in row 0
    pos[1, 0] = 0
    h0 = torch.randn(B, D, dtype=torch.float64)
    y, h = ops.scan(a, b, segment_pos=pos, initial_state=h0, output_final_state=True, backend="assoc")
    yr, hr = reference.scan(a, b, pos, h0, True)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, hr, rtol=1e-12, atol=1e-12)
    # T = 0: no outputs; the final state is the initial state
    y0, h0_out = assoc.BACKENDS["scan"]["assoc"](a[:, :0], b[:, :0], pos[:, :0], h0, True)
    assert y0.shape == (B, 0, D) and torch.equal(h0_out, h0)


def test_assoc_takes_no_launch_options():
    x = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="no launch options"):
        assoc.BACKENDS["scan"]["assoc"](torch.rand(1, 4, 2), x, None, None, False, block_d=32)
