"""Fused Triton SAMU against the float64 complex reference (CPU: Triton interpreter).

Every backend and chunk size: output, final state and every gradient (x, both
directions, both amplitudes, nu_log, theta_log, initial state) on an odd shape with
resets inside chunks, at chunk edges and in runs; outputs allocated poisoned with NaN.
Also: FP32 and BF16 precision, |a| close to 1 over long rows with several losses,
bitwise determinism, the prefill, and decode steps against the sequence op.
"""

import math

import pytest
import torch

import kernels
from kernels.ops import accounting, reference
from kernels.ops.samu import BACKENDS, STEPS
from kernels.ops.triton_utils import poisoned

B, T, D = 2, 37, 24
M = D // 2
# (backend, chunk_size): chunk 8 / 16 / 32 / 64 give 5 / 3 / 2 / 1 chunks of T = 37, the last one partial.
CONFIGS = [("serial", 16), ("chunk", 8), ("chunk", 16), ("chunk", 32), ("chunk", 64)]
GRAD_NAMES = ["x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log", "initial_state"]


def segment_positions(T, resets_per_row, first_pos=5):
    """segment_pos [len(rows), T]: 0 at each listed reset, counting up elsewhere; a row
    without a reset at t = 0 continues a document (so the initial state matters)."""
    rows = []
    for resets in resets_per_row:
        pos, p = [], first_pos
        for t in range(T):
            p = 0 if t in resets else (p + 1 if t else p)
            pos.append(p)
        rows.append(pos)
    return torch.tensor(rows, dtype=torch.int64)


# Row 0: resets at the K = 8 and K = 16 chunk edges, a run of three, one inside a chunk.
# Row 1: reset at t = 0 (the initial state is erased), inside chunks, near the end.
SEGMENT_POS = segment_positions(T, [{8, 16, 20, 21, 22, 33}, {0, 5, 31}])


def make_inputs(dtype=torch.float64, b=B, t=T, d=D, seed=0, hard=False, param_dtype=None):
    g = torch.Generator().manual_seed(seed)
    m = d // 2
    pdt = param_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
    x = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    u = torch.rand(m, generator=g, dtype=torch.float64)
    if hard:
        # |a| = exp(-nu e^eta) within about 1e-3 of 1
        nu_log = torch.log(torch.full((m,), 1e-3, dtype=torch.float64) * (0.5 + u))
    else:
        nu_log = torch.log(-0.5 * torch.log(u * (0.999**2 - 0.9**2) + 0.9**2))
    cdt = torch.complex128 if dtype == torch.float64 else torch.complex64
    h0 = torch.complex(torch.randn(b, m, generator=g, dtype=torch.float64),
                       torch.randn(b, m, generator=g, dtype=torch.float64))
    return {
        "x": x.to(dtype),
        "phase_dir": (torch.randn(d + 1, generator=g, dtype=torch.float64) / math.sqrt(d)).to(pdt),
        "radial_dir": (torch.randn(d + 1, generator=g, dtype=torch.float64) / math.sqrt(d)).to(pdt),
        "phase_amp": torch.tensor(0.9, dtype=pdt),
        "radial_amp": torch.tensor(-1.3, dtype=pdt),
        "nu_log": nu_log.to(pdt),
        "theta_log": torch.log(torch.rand(m, generator=g, dtype=torch.float64) * math.pi / 10).to(pdt),
        "initial_state": h0.to(cdt),
    }


def leaves(inputs, dtype=None):
    """Fresh leaf tensors requiring grad (cast to `dtype`, complex to its complex kind)."""
    out = {}
    for k, v in inputs.items():
        if dtype is not None:
            v = v.to(torch.complex128 if v.is_complex() else dtype) if dtype == torch.float64 else v
        out[k] = v.detach().clone().requires_grad_()
    return out


def call(fn, p, segment_pos=SEGMENT_POS, **opts):
    return fn(p["x"], p["phase_dir"], p["radial_dir"], p["phase_amp"], p["radial_amp"], p["nu_log"],
              p["theta_log"], segment_pos, p["initial_state"], True, **opts)


def weights(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


LOSSES = {
    # every output and the final state
    "mixed": lambda y, h: (y.double() * weights(y.shape, 1)).sum() + (h.real.double() ** 2).sum()
    - 0.5 * h.imag.double().sum(),
    "square": lambda y, h: (y.double() ** 2).mean(),
    "last_token": lambda y, h: (y[:, -1].double() * weights(y[:, -1].shape, 2)).sum(),
    "final_state_only": lambda y, h: (h.real.double() * weights(h.shape, 3)).sum() + h.imag.double().abs().sum(),
}


def run(fn, p, loss="mixed", segment_pos=SEGMENT_POS, **opts):
    y, h = call(fn, p, segment_pos, **opts)
    grads = torch.autograd.grad(LOSSES[loss](y, h), [p[k] for k in GRAD_NAMES])
    return y, h, dict(zip(GRAD_NAMES, grads))


def rel(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    a = a.to(torch.complex128 if a.is_complex() else torch.float64)
    b = b.to(torch.complex128 if b.is_complex() else torch.float64)
    assert torch.isfinite(torch.view_as_real(a) if a.is_complex() else a).all(), "non-finite values (unwritten?)"
    return ((a - b).abs().norm() / b.abs().norm().clamp_min(1e-30)).item()


def assert_close_all(got, want, tol):
    (y, h, g), (yr, hr, gr) = got, want
    errs = {"y": rel(y, yr), "final_state": rel(h, hr), **{k: rel(g[k], gr[k]) for k in GRAD_NAMES}}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"


@pytest.fixture(scope="module")
def ref64():
    p = leaves(make_inputs(torch.float64))
    return run(reference.samu, p)


# D = 70: M = 35 modes, odd, in two blocks of 32 (the second one partial).
WIDE_D = 70


@pytest.fixture(scope="module")
def ref64_wide():
    p = leaves(make_inputs(torch.float64, d=WIDE_D, seed=13))
    return run(reference.samu, p)


@pytest.mark.parametrize("backend,chunk", CONFIGS)
def test_float64_matches_reference(backend, chunk, ref64):
    """The kernels in float64 agree with the reference to rounding: exact algorithm."""
    p = leaves(make_inputs(torch.float64))
    with poisoned():
        got = run(BACKENDS["samu"][backend], p, chunk_size=chunk)
    assert_close_all(got, ref64, 1e-11)


@pytest.mark.parametrize("backend", ["serial", "chunk"])
def test_float32_matches_float64(backend):
    inputs = make_inputs(torch.float32)
    ref = run(reference.samu, leaves(inputs, torch.float64))
    with poisoned():
        got = run(BACKENDS["samu"][backend], leaves(inputs), chunk_size=8)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.complex64
    assert_close_all(got, ref, 2e-5)


def test_bf16_against_pytorch_bf16():
    """BF16 in and out: error against float64 at most twice that of the same computation
    done by PyTorch at BF16 (FP32 inside; the larger error of the reference's complex and
    real-arithmetic formulations), plus FP32 rounding."""
    inputs = make_inputs(torch.bfloat16)
    truth = run(reference.samu, leaves(inputs, torch.float64))
    torch_bf16 = [run(reference.samu, leaves(inputs)), run(reference.samu_real, leaves(inputs))]
    with poisoned():
        got = run(BACKENDS["samu"]["chunk"], leaves(inputs), chunk_size=16)
    assert got[0].dtype == torch.bfloat16 and got[2]["x"].dtype == torch.bfloat16

    def parts(r):
        return [r[0], r[1], *[r[2][k] for k in GRAD_NAMES]]

    for name, mine, exact, *theirs in zip(["y", "final_state", *GRAD_NAMES], parts(got), parts(truth),
                                          *map(parts, torch_bf16)):
        e_torch = max(rel(t, exact) for t in theirs)
        assert rel(mine, exact) <= 2 * e_torch + 1e-5, (name, rel(mine, exact), e_torch)


@pytest.mark.parametrize("backend", ["chunk", "serial"])
def test_hard_mode_several_losses(backend):
    """|a| within ~1e-3 of 1 over 112 steps (memory far longer than the row, so every
    gradient sums long products) and several different losses through one forward:
    FP32 kernels stay far under 1e-3."""
    inputs = make_inputs(torch.float32, b=1, t=112, d=8, seed=3, hard=True)
    seg = segment_positions(112, [{97}])
    p_ref, p = leaves(inputs, torch.float64), leaves(inputs)
    y_ref, h_ref = call(reference.samu, p_ref, seg)
    with poisoned():
        y, h = call(BACKENDS["samu"][backend], p, seg, chunk_size=16)
    assert (1 - (-torch.exp(inputs["nu_log"]) * 1.2).exp()).max() < 2e-3
    for name in ["mixed", "last_token", "final_state_only"]:
        loss = LOSSES[name]
        gr = torch.autograd.grad(loss(y_ref, h_ref), [p_ref[k] for k in GRAD_NAMES], retain_graph=True)
        g = torch.autograd.grad(loss(y, h), [p[k] for k in GRAD_NAMES], retain_graph=True)
        assert_close_all((y, h, dict(zip(GRAD_NAMES, g))), (y_ref, h_ref, dict(zip(GRAD_NAMES, gr))), 1e-4)


def test_deterministic_bitwise():
    inputs = make_inputs(torch.float32, seed=5)
    runs = [run(BACKENDS["samu"]["chunk"], leaves(inputs), chunk_size=8) for _ in range(2)]
    (y1, h1, g1), (y2, h2, g2) = runs
    assert torch.equal(y1, y2) and torch.equal(h1, h2)
    for k in GRAD_NAMES:
        assert torch.equal(g1[k], g2[k]), k


def test_prefill_and_dispatch():
    """No gradient needed: the forward-only path (no states kept) through kernels.samu."""
    inputs = make_inputs(torch.float32, seed=7)
    y_ref, h_ref = call(reference.samu, leaves(inputs, torch.float64))
    for backend in ["serial", "chunk"]:
        with torch.no_grad(), poisoned(), accounting.counting() as c:
            y, h = kernels.samu(*[inputs[k] for k in GRAD_NAMES[:7]], segment_pos=SEGMENT_POS,
                                initial_state=inputs["initial_state"], output_final_state=True,
                                backend=backend, chunk_size=16)
        assert rel(y, y_ref) < 2e-6 and rel(h, h_ref) < 2e-6
        k = c.by_kernel
        x_bytes, y_bytes = accounting.nbytes(inputs["x"]), accounting.nbytes(y)
        assert k["samu_controls_fwd"]["bytes_read"] >= x_bytes
        if backend == "serial":     # the sequence pass writes y and the final state, nothing else
            assert k["samu_serial_fwd"]["bytes_written"] == y_bytes + accounting.nbytes(h)
            assert c.launches == 2
        else:                       # no states kept: the replay writes y alone
            assert k["samu_chunk_replay"]["bytes_written"] == y_bytes
            assert k["samu_chunk_summary"]["bytes_read"] >= x_bytes and k["samu_chunk_replay"]["bytes_read"] >= x_bytes
            assert c.launches == 5 and k["samu_prefix_fill"]["launches"] == 1
    # "auto" on the CPU is the reference: no kernel launches.
    with torch.no_grad(), accounting.counting() as c:
        kernels.samu(*[inputs[k] for k in GRAD_NAMES[:7]], segment_pos=SEGMENT_POS, backend="auto")
    assert c.launches == 0
    # The backward counts its checkpoint slots (written, then read back by the same program).
    p = leaves(inputs)
    for backend, name in (("serial", "samu_serial_bwd"), ("chunk", "samu_chunk_bwd")):
        with accounting.counting() as c:
            y, h = BACKENDS["samu"][backend](*[p[k] for k in GRAD_NAMES[:7]], SEGMENT_POS, p["initial_state"], True,
                                             chunk_size=16)
            (y.sum() + h.abs().sum()).backward()
        dx_bytes = accounting.nbytes(p["x"])       # FP32 x: the write gradient is dx itself
        assert c.by_kernel[name]["bytes_written"] > dx_bytes and c.by_kernel[name]["bytes_read"] > 2 * dx_bytes


def test_no_resets_no_initial_state_and_empty():
    inputs = make_inputs(torch.float64, seed=9)
    p = leaves(inputs)
    y_ref, h_ref = reference.samu(*[p[k] for k in GRAD_NAMES[:7]], None, None, True)
    y, h = BACKENDS["samu"]["chunk"](*[p[k] for k in GRAD_NAMES[:7]], None, None, True, chunk_size=16)
    assert rel(y, y_ref) < 1e-12 and rel(h, h_ref) < 1e-12
    g_ref = torch.autograd.grad(LOSSES["mixed"](y_ref, h_ref), [p["x"], p["nu_log"]])
    g = torch.autograd.grad(LOSSES["mixed"](y, h), [p["x"], p["nu_log"]])
    assert rel(g[0], g_ref[0]) < 1e-12 and rel(g[1], g_ref[1]) < 1e-12
    x0 = inputs["x"][:, :0]
    for backend in ["serial", "chunk"]:
        y0, h0 = BACKENDS["samu"][backend](x0, *[inputs[k] for k in GRAD_NAMES[1:7]], None,
                                           inputs["initial_state"], True)
        assert y0.shape == (B, 0, D) and torch.equal(h0, inputs["initial_state"])


@pytest.mark.parametrize("layout", ["row", "blocked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_steps_equal_sequence(layout, dtype):
    """T decode steps, state updated in place, resets per step, equal the sequence op."""
    inputs = make_inputs(dtype, t=13, seed=11)
    seg = segment_positions(13, [{4, 5}, {9}])
    y_ref, h_ref = call(reference.samu, inputs, seg)
    state = inputs["initial_state"].clone()
    params = [inputs[k] for k in GRAD_NAMES[1:7]]
    ys = []
    for t in range(13):
        ys.append(STEPS["samu"][layout](inputs["x"][:, t], *params, state, seg[:, t] == 0))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert rel(torch.stack(ys, 1), y_ref) < tol and rel(state, h_ref) < tol
    y1 = kernels.samu_step(inputs["x"][:, 0], *params, state.clone(), backend=layout)
    assert y1.shape == (B, D)


@pytest.mark.parametrize("table,block_m", [(False, None), (True, None), (True, 2048)])
def test_row_step_walks_every_mode_block(table, block_m):
    """The row step covers a row's modes in blocks: M = 2052 takes nine of the default
    ROW_DEFAULT_BLOCK_M = 256, or two of the largest, 2048, the last partial; outputs and
    the state in place against the reference, with a reset, NaN-poisoned y."""
    from kernels.ops.samu.step import ROW_BLOCK_M, ROW_DEFAULT_BLOCK_M

    assert (ROW_DEFAULT_BLOCK_M, ROW_BLOCK_M) == (256, 2048)
    d = 4104
    inputs = make_inputs(torch.float32, b=2, t=2, d=d, seed=5)
    params = [inputs[k] for k in GRAD_NAMES[1:7]]
    tab = kernels.ops.samu_mode_table(inputs["nu_log"], inputs["theta_log"], torch.float32) if table else None
    s_ref, s = inputs["initial_state"].clone(), inputs["initial_state"].clone()
    for t, r in ((0, None), (1, torch.tensor([True, False]))):
        want = kernels.samu_step(inputs["x"][:, t], *params, s_ref, r, backend="reference")
        with poisoned():
            got = STEPS["samu"]["row"](inputs["x"][:, t], *params, s, r, modes=tab, block_m=block_m)
        assert rel(got, want) < 2e-6 and rel(s, s_ref) < 2e-6


@pytest.mark.parametrize("layout,opts", [("row", {"block_m": 16}), ("row", {"block_m": 32}), ("row", {"block_d": 16}),
                                         ("row", {"block_d": 32, "num_warps": 2}), ("blocked", {"block_m": 16}),
                                         ("blocked", {"block_m": 32, "num_warps": 2})],
                         ids=["row-bm16", "row-bm32", "row-bd16", "row-bd32w2", "blocked-bm16", "blocked-bm32w2"])
def test_step_options(layout, opts):
    """The steps' tuning options: M = 20 modes in blocks of 16 (two, the second partial) or
    32 (one), per iteration of the row step or per program of the blocked one (default 128:
    one); the row step's controller reduction over D = 40 in blocks of 16 (three, the last
    partial) or 32; fewer warps. With and without the mode table, each equals the
    reference; a block_m alone keeps the default's sums and equals it bit for bit. Bad
    values raise."""
    inputs = make_inputs(torch.float32, b=3, t=3, d=40, seed=7)
    params = [inputs[k] for k in GRAD_NAMES[1:7]]
    tab = kernels.ops.samu_mode_table(inputs["nu_log"], inputs["theta_log"], torch.float32)
    step = STEPS["samu"][layout]
    for modes in (None, tab):
        s0, s1, s_ref = (inputs["initial_state"].clone() for _ in range(3))
        for t, r in ((0, None), (1, torch.tensor([True, False, False])), (2, None)):
            x = inputs["x"][:, t]
            want = kernels.samu_step(x, *params, s_ref, r, backend="reference")
            y0 = step(x, *params, s0, r, modes=modes)
            with poisoned():
                y1 = step(x, *params, s1, r, modes=modes, **opts)
            if set(opts) == {"block_m"}:
                assert torch.equal(y1, y0) and torch.equal(s1, s0)
            assert rel(y1, want) < 2e-6 and rel(s1, s_ref) < 2e-6
    bad = [("block_m", 8), ("block_m", 24), ("block_m", 4096), ("block_m", 16.0), ("num_warps", 3), ("num_warps", 32),
           ("num_warps", True)]
    bad += [("block_d", 8), ("block_d", 48), ("block_d", 8192)] if layout == "row" else []
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            step(inputs["x"][:, 0], *params, s0, None, **{name: value})
    if layout == "blocked":     # the blocked step reduces the whole row
        with pytest.raises(TypeError, match="block_d"):
            step(inputs["x"][:, 0], *params, s0, None, block_d=16)


def test_row_step_default_reduction_width(monkeypatch):
    """The row step reduces the whole row (up to ROW_BLOCK_D columns) while two rows per
    multiprocessor hold the batch, and ROW_MANY_ROWS_BLOCK_D columns beyond; off CUDA
    (no multiprocessor count) the whole row."""
    from kernels.ops.samu import step

    monkeypatch.setattr(step, "multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert step._row_block_d(264, 2560, cuda) == step.ROW_BLOCK_D == 4096
    assert step._row_block_d(265, 2560, cuda) == step.ROW_MANY_ROWS_BLOCK_D == 2048
    assert step._row_block_d(4096, 40, cuda) == 64
    monkeypatch.setattr(step, "multiprocessors", lambda device: None)
    assert step._row_block_d(4096, 2560, torch.device("cpu")) == 4096


@pytest.mark.parametrize("layout", ["row", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_decode_step_reading_the_mode_table_is_bitwise_the_recomputing_one(layout, dtype):
    """samu_step(..., modes=samu_mode_table(...)) reads the constants the kernel would
    compute in float64 and round: outputs and states equal bit for bit over steps with
    resets; the table has the accumulation dtype and the reference ignores it."""
    inputs = make_inputs(torch.float64 if dtype == torch.float64 else torch.float32, t=5, seed=13)
    x = inputs["x"].to(dtype)
    params = [inputs[k] for k in GRAD_NAMES[1:7]]
    tab = kernels.ops.samu_mode_table(inputs["nu_log"], inputs["theta_log"], dtype)
    assert tab.shape == (7, M) and tab.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    s1, s2 = inputs["initial_state"].clone(), inputs["initial_state"].clone()
    reset = torch.tensor([True, False] * (B // 2) + [False] * (B % 2))
    for t in range(5):
        r = reset if t == 2 else None
        y1 = kernels.samu_step(x[:, t], *params, s1, r, backend=layout)
        y2 = kernels.samu_step(x[:, t], *params, s2, r, backend=layout, modes=tab)
        assert torch.equal(y1, y2) and torch.equal(s1, s2)
    s3 = inputs["initial_state"].clone()
    want = kernels.samu_step(x[:, 0], *params, s3.clone(), backend="reference")
    assert torch.equal(kernels.samu_step(x[:, 0], *params, s3, backend="reference", modes=tab), want)
    for bad, match in ((tab[:-1], "modes of shape"), (tab.to(torch.float16), "modes with dtype")):
        with pytest.raises(ValueError, match=match):
            kernels.samu_step(x[:, 0], *params, s3, backend=layout, modes=bad)


def test_fused_step_picks_its_layout_by_batch_and_table(monkeypatch):
    """"fused" runs "blocked" below ROW_MIN_BATCH rows (ROW_MIN_BATCH_TABLE with a mode
    table, whose "row" programs recompute nothing) and "row" from there."""
    from kernels.ops.samu import step

    seen = []
    monkeypatch.setattr(step, "_launch", lambda layout, x, *a: seen.append(layout) or torch.empty_like(x))
    p = make_inputs(torch.float32)
    params = [p[k] for k in GRAD_NAMES[1:7]]
    tab = kernels.ops.samu_mode_table(p["nu_log"], p["theta_log"], torch.float32)
    for rows, modes, want in ((step.ROW_MIN_BATCH_TABLE - 1, tab, "blocked"), (step.ROW_MIN_BATCH_TABLE, tab, "row"),
                              (step.ROW_MIN_BATCH - 1, None, "blocked"), (step.ROW_MIN_BATCH, None, "row")):
        x = torch.zeros(rows, D)
        step.samu_step(x, *params, torch.zeros(rows, M, dtype=torch.complex64), modes=modes)
        assert seen[-1] == want, (rows, modes is not None)
    assert step.ROW_MIN_BATCH_TABLE < step.ROW_MIN_BATCH


def test_bad_options():
    inputs = make_inputs(torch.float32)
    for bad in (12, 128):
        with pytest.raises(ValueError, match="chunk_size"):
            BACKENDS["samu"]["chunk"](*[inputs[k] for k in GRAD_NAMES[:7]], None, None, False, chunk_size=bad)
    with pytest.raises(ValueError, match="block_m"):
        BACKENDS["samu"]["serial"](*[inputs[k] for k in GRAD_NAMES[:7]], None, None, False, block_m=48)
    state = torch.zeros(B, M, 2, dtype=torch.complex64)[..., 0]
    with pytest.raises(ValueError, match="contiguous"):
        STEPS["samu"]["row"](inputs["x"][:, 0], *[inputs[k] for k in GRAD_NAMES[1:7]], state)


def test_bf16_long_row_state_as_accurate_as_pytorch():
    """Regression for the H200 audit at B=1, T=4096, D=2560 bf16 (grad_x, grad_nu_log
    above 2x the PyTorch error). Cause: not a lower-precision bf16 path but one element
    with exact h = 3.1e-9 (t=1045, Im of mode 28), below any FP32 resolution of h: the
    relu mask there follows the rounding, and the float64 audit's gradient jumps by
    gamma * dy. Guard the part the kernels own: over a long bf16 row with resets and
    an initial state, the Triton state is at least as accurate as PyTorch's FP32 one."""
    import parity

    Bq, Tq, Dq = 1, 512, 64
    args64, h064 = parity._inputs("samu", Bq, Tq, Dq, torch.float64, "cpu", 0)
    args = [args64[0].to(torch.bfloat16)] + [a.float() for a in args64[1:]]
    pos = parity.make_segment_pos(Bq, Tq, True, 0)
    h0 = h064.to(torch.complex64)
    _, want = reference.samu(*[a.double() for a in args], pos, h0.to(torch.complex128), True)
    _, theirs = reference.samu(*args, pos, h0, True)
    for name in ("serial", "chunk"):
        with poisoned():
            _, mine = BACKENDS["samu"][name](*args, pos, h0, True, chunk_size=32)
        assert rel(mine, want) <= max(rel(theirs, want), 1e-7), (name, rel(mine, want), rel(theirs, want))


@pytest.mark.parametrize("backend,chunk", [("serial", 16), ("chunk", 8), ("chunk", 16)])
def test_odd_modes_several_mode_blocks(backend, chunk, ref64_wide):
    """M = 35 (odd) over two mode blocks of 32, the second partial: float64 to rounding
    for the output, final state and every gradient, with SEGMENT_POS's resets inside and
    across chunks and an initial state (row 0 continues a document)."""
    p = leaves(make_inputs(torch.float64, d=WIDE_D, seed=13))
    with poisoned():
        got = run(BACKENDS["samu"][backend], p, chunk_size=chunk)
    assert got[1].shape == (B, WIDE_D // 2)
    assert_close_all(got, ref64_wide, 1e-11)


def test_controls_backward_column_blocks():
    """controls_bwd at D = 260 (three column blocks of 128, the last partial): every
    gradient to rounding in float64."""
    p = leaves(make_inputs(torch.float64, d=260, t=9, seed=5))
    want = run(reference.samu, p, segment_pos=SEGMENT_POS[:, :9])
    with poisoned():
        got = run(BACKENDS["samu"]["chunk"], p, segment_pos=SEGMENT_POS[:, :9], chunk_size=8)
    assert_close_all(got, want, 1e-11)
