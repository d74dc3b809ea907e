"""Triton RG-LRU backends (serial, chunk) and the fused decode step against the float64
reference and the official recurrentgemma RGLRU, on the CPU interpreter.

Shapes are tiny and odd (B = 2, T = 37, D = 24: partial final chunks and channel
blocks; T = 150 for chunks of 32 and 64). Outputs are allocated poisoned with NaN, so
an element a kernel fails to write fails the comparison.
"""

import math
import pytest
import torch
import triton
import triton.language as tl

import kernels
import parity
from kernels.ops import accounting, reference
from kernels.ops.rglru.common import one_minus_sq
from kernels.ops.triton_utils import poisoned

B, T, D = 2, 37, 24
LONG_T, LONG_D = 150, 12     # K = 32: 5 chunks, K = 64: 3 chunks; the last one partial (22 steps)
FP32_TOL = parity.BACKEND_TOL[torch.float32]
FP64_TOL = 1e-12

# (backend, options): the serial tile kernels (time_warps 1, chosen by block_d) with time
# tiles of 16 and 8; chunk 16 with the one-group prefix and chunk 8 with a two-summary
# group so the outer prefix over groups runs; chunks of 32 (the default K) and 64 at
# T = LONG_T, D = LONG_D (test_long_chunks_float64_is_exact: two channel blocks of 8,
# one partial), K = 64 with two-summary groups. The split kernels: test_split_triton.py.
VARIANTS = [
    ("serial", {"chunk_size": 16, "block_d": 32}),
    ("serial", {"chunk_size": 8, "block_d": 16}),
    ("chunk", {"chunk_size": 16, "block_d": 16}),
    ("chunk", {"chunk_size": 8, "group": 2, "block_d": 32}),
    ("chunk", {"chunk_size": 32, "block_d": 8}),
    ("chunk", {"chunk_size": 64, "group": 2, "block_d": 8}),
]
IDS = ["serial16", "serial8", "chunk16", "chunk8g2", "chunk32", "chunk64g2"]
SHORT, LONG = slice(0, 4), slice(4, None)


@pytest.fixture(autouse=True)
def poison():
    with poisoned():
        yield


def positions(t=T):
    """Row 0 continues an earlier document (no reset at t = 0), then resets inside a
    chunk (5), at chunk edges (8, 16, 32), a run (20, 21, 22) and at t = T - 1.
    Row 1 resets at t = 0 and 1 (a run), inside chunks (13, 27) and at 24.
    t = LONG_T adds, for K = 32 and 64: row 0 resets on the edges 64 and 128, inside
    chunks (70, 100) and as a run of two across the edge 95 | 96; row 1 inside chunks
    (45, 140) and as a run of two inside a chunk (80, 81). The last chunk is partial."""
    if t == T:
        return document_positions(T, [(5, 8, 16, 20, 21, 22, 32, 36), (0, 1, 13, 24, 27)])
    assert t == LONG_T
    return document_positions(t, [(5, 8, 16, 20, 21, 22, 32, 36, 64, 70, 95, 96, 100, 128, 149),
                                  (0, 1, 13, 24, 27, 45, 80, 81, 140)])


def document_positions(T, starts):
    """segment_pos [len(starts), T]: row b resets (0) at the steps in starts[b] and
    otherwise counts on from 11 (a document begun before t = 0)."""
    pos = torch.empty(len(starts), T, dtype=torch.int64)
    for b, s in enumerate(starts):
        p = 11
        for t in range(T):
            p = 0 if t in s else p + 1
            pos[b, t] = p
    return pos


def inputs(dtype, seed=0, t=T, d=D):
    torch.manual_seed(seed)
    x, gx, ga = (torch.randn(B, t, d, dtype=torch.float64) for _ in range(3))
    ga = ga * 2.0
    a_param = kernels.layers.rnn_param_init(torch.empty(d, dtype=torch.float64))
    h0 = torch.randn(B, d, dtype=torch.float64)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    return [x.to(dtype), gx.to(dtype), ga.to(dtype), a_param.to(pdt)], h0.to(pdt)


def run(fn, args, h0, pos, final=True, **opts):
    """Forward and backward with fixed random cotangents; returns the output, the final
    state and the gradients of x, gate_x, gate_a, a_param (and h0 when given)."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    hs = None if h0 is None else h0.detach().clone().requires_grad_()
    y, h = fn(*leaves, pos, hs, final, **opts)
    g = torch.Generator().manual_seed(7)
    loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum()
    if final:
        loss = loss + (h.double() * torch.randn(h.shape, generator=g, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, leaves + ([] if hs is None else [hs]))
    return [y, h, *grads]


NAMES = ["output", "final_state", "grad_x", "grad_gate_x", "grad_gate_a", "grad_a_param", "grad_initial_state"]


def check(got, want, tol):
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None, name
            continue
        err = parity.rel_err(g, w)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("backend,opts", VARIANTS[SHORT], ids=IDS[SHORT])
def test_fp32_against_float64_reference(backend, opts):
    args, h0 = inputs(torch.float32)
    pos = positions()
    want = run(reference.rglru, [a.double() for a in args], h0.double(), pos)
    got = run(kernels.backends("rglru")[backend], args, h0, pos, **opts)
    assert got[1].dtype == torch.float32
    check(got, want, FP32_TOL)


@pytest.mark.parametrize("backend,opts", [VARIANTS[1], VARIANTS[3]], ids=[IDS[1], IDS[3]])
def test_float64_is_exact(backend, opts):
    # In float64 the kernels differ from the reference loop only by rounding order:
    # any slip in chunk composition, reset handling or the adjoint would show far above this.
    args, h0 = inputs(torch.float64, seed=1)
    pos = positions()
    want = run(reference.rglru, args, h0, pos)
    got = run(kernels.backends("rglru")[backend], args, h0, pos, **opts)
    check(got, want, FP64_TOL)


@pytest.mark.parametrize("backend,opts", VARIANTS[LONG], ids=IDS[LONG])
def test_long_chunks_float64_is_exact(backend, opts):
    # K = 32 and 64 over T = 150 (several chunks, a partial last one), resets at t = 0,
    # on chunk edges, inside chunks and in runs, an initial state: output, final state
    # and every gradient (x, gate_x, gate_a, a_param, h0) to rounding.
    args, h0 = inputs(torch.float64, seed=11, t=LONG_T, d=LONG_D)
    pos = positions(LONG_T)
    want = run(reference.rglru, args, h0, pos)
    got = run(kernels.backends("rglru")[backend], args, h0, pos, **opts)
    check(got, want, FP64_TOL)


@pytest.mark.parametrize("backend,opts", [VARIANTS[0], VARIANTS[3]], ids=[IDS[0], IDS[3]])
def test_no_resets_no_state(backend, opts):
    args, _ = inputs(torch.float32, seed=2)
    want = run(reference.rglru, [a.double() for a in args], None, None, final=False)
    got = run(kernels.backends("rglru")[backend], args, None, None, final=False, **opts)
    assert got[1] is None
    check([got[0], None, *got[2:]], [want[0], None, *want[2:]], FP32_TOL)


@pytest.mark.parametrize("backend,opts", [VARIANTS[0], VARIANTS[2]], ids=[IDS[0], IDS[2]])
def test_bf16_against_pytorch_at_bf16(backend, opts):
    # BF16 in and out, FP32 inside: at most LOWP_FACTOR times the error of the same
    # computation done by the PyTorch reference on the same BF16 inputs.
    args, h0 = inputs(torch.bfloat16, seed=3)
    pos = positions()
    exact = run(reference.rglru, [a.double() for a in args], h0.double(), pos)
    yard = run(reference.rglru, args, h0, pos)
    got = run(kernels.backends("rglru")[backend], args, h0, pos, **opts)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    for name, g, y, w in zip(NAMES, got, yard, exact):
        tol = max(parity.LOWP_FACTOR * parity.rel_err(y, w), 1e-6)
        assert parity.rel_err(g, w) <= tol, name


@pytest.mark.parametrize("backend,opts", [VARIANTS[3]], ids=[IDS[3]])
def test_gradients_are_bitwise_reproducible(backend, opts):
    args, h0 = inputs(torch.float32, seed=4)
    pos = positions()
    first = run(kernels.backends("rglru")[backend], args, h0, pos, **opts)
    second = run(kernels.backends("rglru")[backend], args, h0, pos, **opts)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend,opts", [("serial", {}), *VARIANTS], ids=["serial_default", *IDS])
def test_matches_official_rglru(backend, opts):
    # The unmodified official layer (gates from its own block-diagonal projections),
    # with resets and a cached state: output, state and every gradient, incl. its weights,
    # for the serial default (the split kernels, time_warps = 4) and every variant.
    rg = parity.load_official()
    torch.manual_seed(5)
    m = rg.RGLRU(D, 4)
    x = torch.randn(B, T, D)
    pos = positions()
    h0 = torch.randn(B, D)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    hs = [h0.clone().requires_grad_() for _ in range(2)]
    want = m(xs[0], pos, hs[0])
    got = kernels.backends("rglru")[backend](xs[1], m.input_gate(xs[1]), m.a_gate(xs[1]), m.a_param, pos,
                                             hs[1], True, **opts)
    g = torch.Generator().manual_seed(8)
    gy, gh = torch.randn(B, T, D, generator=g), torch.randn(B, D, generator=g)
    params = list(m.parameters())
    gw = torch.autograd.grad((want[0] * gy).sum() + (want[1] * gh).sum(), [xs[0], hs[0], *params])
    gg = torch.autograd.grad((got[0] * gy).sum() + (got[1] * gh).sum(), [xs[1], hs[1], *params])
    assert parity.rel_err(got[0], want[0]) <= parity.OFFICIAL_FP32_TOL
    assert parity.rel_err(got[1], want[1]) <= parity.OFFICIAL_FP32_TOL
    for a, b in zip(gg, gw):
        assert parity.rel_err(a, b) <= FP32_TOL


def test_dispatch_cu_seqlens_and_prefill_state():
    # Packed sequences through kernels.rglru (cu_seqlens -> resets) and the prefill's
    # FP32 final state: output and final state equal the float64 reference (decode
    # steps from a prefill state: test_decode_steps_equal_forward).
    args, h0 = inputs(torch.float32, seed=6)
    x, gx, ga, ap = (a[:1] if a.dim() == 3 else a for a in args)
    cu = torch.tensor([0, 9, 16, 30, T])
    want_y, want_h = reference.rglru(*(a.double() for a in (x, gx, ga, ap)),
                                     kernels.ops.checks.cu_seqlens_to_segment_pos(cu, 1, T), None, True)
    y, h = kernels.rglru(x, gx, ga, ap, cu_seqlens=cu, output_final_state=True, backend="chunk", chunk_size=8)
    assert h.dtype == torch.float32
    assert parity.rel_err(y, want_y) <= FP32_TOL and parity.rel_err(h, want_h) <= FP32_TOL


def test_bad_options_raise():
    args, h0 = inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        kernels.rglru(*args, backend="chunk", chunk_size=12)
    with pytest.raises(ValueError, match="chunk_size"):
        kernels.backends("rglru")["serial"](*args, None, None, False, chunk_size=12)
    with pytest.raises(ValueError, match="expected serial options"):
        kernels.backends("rglru")["serial"](*args, None, None, False, vec=2)
    with pytest.raises(ValueError, match="expected chunk options"):
        kernels.backends("rglru")["chunk"](*args, None, None, False, chunk_size=8, tile=3)


def test_launch_and_byte_accounting():
    t = 9
    args, h0 = inputs(torch.float32)
    args = [a[:, :t].contiguous() if a.dim() == 3 else a for a in args]
    pos = positions()[:, :t]
    leaves = [a.clone().requires_grad_() for a in args]
    with accounting.counting() as c:
        y, _ = kernels.backends("rglru")["chunk"](*leaves, pos, h0, False, chunk_size=8)
    assert c.launches == 3 and set(c.by_kernel) == {"chunk_fwd_summary", "chunk_prefix_fwd", "chunk_fwd_replay"}
    act = B * t * D * 4
    assert c.by_kernel["chunk_fwd_replay"]["bytes_written"] == act
    with accounting.counting() as c:
        y.sum().backward()
    assert c.launches == 4
    with accounting.counting() as c:
        y, _ = kernels.backends("rglru")["serial"](*args, pos, h0, True)
    assert c.launches == 1 and c.bytes_written == act + B * D * 4     # y + final state, no saved states
    assert c.bytes_read >= 3 * act


def block_weights(H, dtype, seed):
    torch.manual_seed(seed)
    W = D // H
    wx, wa = (torch.randn(H, W, W, dtype=torch.float64) / W ** 0.5 for _ in range(2))
    bx, ba = (torch.randn(H, W, dtype=torch.float64) for _ in range(2))
    ap = kernels.layers.rnn_param_init(torch.empty(D, dtype=torch.float64))
    return [t.to(dtype) for t in (wx, bx, wa, ba, ap)]


@pytest.mark.parametrize("xdt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_step_against_reference(xdt, wdt):
    # H = 2 blocks of W = 12 (not a power of two: masked matvec slices), B = 3 with a reset.
    w = block_weights(2, wdt, seed=9)
    sdt = torch.float64 if xdt == torch.float64 else torch.float32
    x = torch.randn(3, D).to(xdt)
    state = torch.randn(3, D, dtype=sdt)
    reset = torch.tensor([False, True, False])
    s_ref = state.clone()
    y = kernels.rglru_step(x, *w, state, reset, backend="fused")
    y_ref = reference.rglru_step(x, *w, s_ref, reset)
    tol = FP64_TOL if xdt == torch.float64 else FP32_TOL
    assert y.dtype == xdt
    assert parity.rel_err(state, s_ref) <= tol
    if xdt == torch.bfloat16:     # same FP32 value, rounded once to BF16
        assert parity.rel_err(y, y_ref) <= 2.0 ** -8
    else:
        assert parity.rel_err(y, y_ref) <= tol


def test_decode_steps_equal_forward():
    # Prefill T0 tokens, then one-token fused steps (a reset among them) = one forward.
    H, T0, n = 4, 5, 6
    wx, bx, wa, ba, ap = block_weights(H, torch.float32, seed=10)
    x = torch.randn(B, T0 + n, D)
    pos = torch.arange(T0 + n).repeat(B, 1)
    pos[1, T0 + 2:] = torch.arange(n - 2)
    gx = reference.block_diagonal(x, wx, bx)
    ga = reference.block_diagonal(x, wa, ba)
    y_full, _ = kernels.rglru(x, gx, ga, ap, pos, backend="serial")
    _, state = kernels.rglru(x[:, :T0], gx[:, :T0], ga[:, :T0], ap, pos[:, :T0], output_final_state=True,
                             backend="chunk", chunk_size=8)
    ys = [kernels.rglru_step(x[:, T0 + i], wx, bx, wa, ba, ap, state, pos[:, T0 + i] == 0, backend="fused")
          for i in range(n)]
    assert parity.rel_err(torch.stack(ys, 1), y_full[:, T0:]) <= FP32_TOL


@triton.jit
def one_minus_sq_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    log_a = tl.load(x + o)
    tl.store(y + o, one_minus_sq(tl.exp(log_a), log_a))


def test_one_minus_sq_is_accurate_across_the_branch_points():
    """1 - a^2 for a = exp(log_a), log_a from -20 to -1e-9 (both sides of the FP32 series'
    switch at 2 log_a = -1/2 and of float64's at -1), against float64 -expm1(2 log_a)."""
    log_a = -torch.logspace(-9, math.log10(20.0), 256, dtype=torch.float64)
    want = -torch.expm1(2 * log_a)
    for dtype, tol in ((torch.float32, 8 * 2.0 ** -24), (torch.float64, 1e-13)):
        x = log_a.to(dtype)
        y = torch.full_like(x, float("nan"))
        one_minus_sq_kernel[(1,)](x, y, N=256)
        exact = -torch.expm1(2 * x.double())   # the function of the rounded input
        err = ((y.double() - exact).abs() / exact).max().item()
        assert err < tol, (dtype, err)
        assert torch.isfinite(y).all() and (want > 0).all()
