"""The float64 references: gradients by torch.autograd.gradcheck (resets and an initial
state included), SAMU computed two independent ways, decode steps equal to sequences."""

import pytest
import torch
from torch.autograd import gradcheck

from kernels import layers
import parity
from kernels.ops import reference

B, T, D = 2, 6, 4


def _pos(resets):
    # Row 0 continues a document and restarts at t = 3; row 1 starts at t = 0 and has a
    # run of resets at t = 4, 5. Without resets: a pure continuation.
    if not resets:
        return None
    return torch.tensor([[5, 6, 7, 0, 1, 2], [0, 1, 2, 3, 0, 0]])


def _rglru_args():
    torch.manual_seed(0)
    x, gx, ga = (torch.randn(B, T, D, dtype=torch.float64) for _ in range(3))
    a_param = layers.rnn_param_init(torch.empty(D, dtype=torch.float64))
    h0 = torch.randn(B, D, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, gx, ga, a_param, h0)]


def _samu_args(d=D):
    torch.manual_seed(1)
    m = layers.SAMU(d, dtype=torch.float64)
    with torch.no_grad():
        m.phase_dir[-1], m.radial_dir[-1] = 0.3, -0.2
    x = torch.randn(B, T, d, dtype=torch.float64)
    h0 = torch.randn(B, d // 2, dtype=torch.complex128)
    return [t.detach().clone().requires_grad_() for t in (x, *m.step_params(), h0)]


@pytest.mark.parametrize("resets", [True, False])
def test_rglru_gradcheck(resets):
    pos = _pos(resets)
    *args, h0 = _rglru_args()

    def f(x, gx, ga, a_param, h0):
        y, h = reference.rglru(x, gx, ga, a_param, pos, h0, True)
        return y, h

    assert gradcheck(f, (*args, h0), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("fn", [reference.samu, reference.samu_real], ids=["complex", "real"])
@pytest.mark.parametrize("resets", [True, False])
def test_samu_gradcheck(fn, resets):
    pos = _pos(resets)
    args = _samu_args()

    def f(x, pd, rd, pa, ra, nu, th, h0):
        return fn(x, pd, rd, pa, ra, nu, th, pos, h0, True)

    assert gradcheck(f, tuple(args), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("complex_", [False, True])
@pytest.mark.parametrize("resets", [True, False])
def test_scan_gradcheck(complex_, resets):
    torch.manual_seed(2)
    pos = _pos(resets)
    dt = torch.complex128 if complex_ else torch.float64
    a = (torch.rand(B, T, D, dtype=torch.float64) * 0.5 + 0.5).to(dt)
    if complex_:
        a = a * torch.exp(1j * torch.rand(B, T, D, dtype=torch.float64))
    b = torch.randn(B, T, D, dtype=dt)
    h0 = torch.randn(B, D, dtype=dt)
    args = tuple(t.requires_grad_() for t in (a, b, h0))
    assert gradcheck(lambda a, b, h0: reference.scan(a, b, pos, h0, True), args, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("resets", [True, False])
def test_samu_complex_equals_real(resets):
    rows = parity.check_samu_reference(B=3, T=29, D=10, resets=resets)
    assert len(rows) == 19 and all(r["passed"] for r in rows), parity.failures(rows)


def test_scan_resets_erase_the_past():
    # After a reset, the output cannot depend on anything before it (state or inputs).
    torch.manual_seed(3)
    a, b = torch.rand(1, 9, 3, dtype=torch.float64), torch.randn(1, 9, 3, dtype=torch.float64)
    pos = torch.tensor([[4, 5, 6, 7, 0, 1, 2, 3, 4]])
    y1, _ = reference.scan(a, b, pos, torch.randn(1, 3, dtype=torch.float64))
    b2 = b.clone()
    b2[:, :4] = torch.randn(1, 4, 3, dtype=torch.float64)
    y2, _ = reference.scan(a, b2, pos, torch.randn(1, 3, dtype=torch.float64))
    assert torch.equal(y1[:, 4:], y2[:, 4:])
    assert not torch.equal(y1[:, :4], y2[:, :4])


def test_rglru_reset_write_is_not_normalised():
    # At a document start the write is x * sigmoid(gate_x) exactly (multiplier 1).
    x, gx, ga, a_param, _ = (t.detach() for t in _rglru_args())
    pos = torch.zeros(B, T, dtype=torch.int64)
    y, _ = reference.rglru(x, gx, ga, a_param, pos)
    torch.testing.assert_close(y, x * torch.sigmoid(gx), rtol=0, atol=0)


def test_rglru_step_equals_sequence():
    torch.manual_seed(4)
    H, W = 2, 3
    E = H * W
    x = torch.randn(B, T, E, dtype=torch.float64)
    wx, wa = torch.randn(H, W, W, dtype=torch.float64), torch.randn(H, W, W, dtype=torch.float64)
    bx, ba = torch.randn(H, W, dtype=torch.float64), torch.randn(H, W, dtype=torch.float64)
    a_param = layers.rnn_param_init(torch.empty(E, dtype=torch.float64))
    pos = torch.tensor([[5, 6, 7, 0, 1, 2], [0, 1, 2, 3, 0, 0]])
    h0 = torch.randn(B, E, dtype=torch.float64)
    y, h = reference.rglru(x, reference.block_diagonal(x, wx, bx), reference.block_diagonal(x, wa, ba),
                           a_param, pos, h0, True)
    state = h0.clone()
    ys = [reference.rglru_step(x[:, t], wx, bx, wa, ba, a_param, state, pos[:, t] == 0) for t in range(T)]
    torch.testing.assert_close(torch.stack(ys, 1), y, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(state, h, rtol=1e-13, atol=1e-13)


def test_samu_step_equals_sequence():
    x, *params, h0 = (t.detach() for t in _samu_args(6))
    pos = torch.tensor([[5, 6, 7, 0, 1, 2], [0, 1, 2, 3, 0, 0]])
    y, h = reference.samu(x, *params, pos, h0, True)
    state = h0.clone()
    ys = [reference.samu_step(x[:, t], *params, state, pos[:, t] == 0) for t in range(T)]
    torch.testing.assert_close(torch.stack(ys, 1), y, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(state, h, rtol=1e-13, atol=1e-13)
