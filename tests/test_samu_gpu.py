"""Fused Triton SAMU on the GPU at the benchmark shape (B = 4, T = 2048, D = 2560, BF16).

Each backend's output, final state and every gradient must be within twice the error of
the same computation done by PyTorch at BF16 (FP32 inside), both measured against the
float64 reference. The reference module has two PyTorch formulations of that computation
(complex `samu` and real-arithmetic `samu_real`); the larger of their two errors is the
PyTorch error: the parameter gradients are sums over 10^7 terms with heavy cancellation,
so their FP32 error depends on the order of operations and one formulation alone can be
lucky by a factor of two. Also: bitwise determinism, the decode step (both layouts) against the
sequence op and with the mode table, and the decode step replayed from a captured CUDA graph.
"""

import math

import pytest
import torch

from kernels.ops import reference
from kernels.ops.samu import BACKENDS, STEPS
from kernels.ops.triton_utils import poisoned

pytestmark = pytest.mark.cuda

B, T, D = 4, 2048, 2560
M = D // 2
# (backend, chunk_size, launcher options); ids backend-K
CONFIGS = [("serial", 32, {}), ("chunk", 8, {}), ("chunk", 16, {}), ("chunk", 32, {}), ("chunk", 64, {})]


def config_id(c):
    return f"{c[0]}-{c[1]}"


NAMES = ["x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log", "initial_state"]


def make_inputs(b=B, t=T, d=D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = d // 2
    u = torch.rand(m, generator=g, device="cuda", dtype=torch.float64)
    f32 = dict(device="cuda", dtype=torch.float32)
    return {
        "x": torch.randn(b, t, d, generator=g, device="cuda").to(torch.bfloat16),
        "phase_dir": torch.randn(d + 1, generator=g, **f32) / math.sqrt(d),
        "radial_dir": torch.randn(d + 1, generator=g, **f32) / math.sqrt(d),
        "phase_amp": torch.tensor(0.5, **f32),
        "radial_amp": torch.tensor(0.8, **f32),
        "nu_log": torch.log(-0.5 * torch.log(u * (0.999**2 - 0.9**2) + 0.9**2)).float(),
        "theta_log": torch.log(torch.rand(m, generator=g, **f32) * math.pi / 10),
        "initial_state": torch.complex(torch.randn(b, m, generator=g, **f32), torch.randn(b, m, generator=g, **f32)),
    }


def segment_pos(b=B, t=T):
    """Resets at t = 0 in half the rows, and inside every row at various offsets."""
    pos = torch.arange(t, device="cuda").repeat(b, 1) + 3
    for r in range(b):
        for s in ([0] if r % 2 else []) + [100 + 37 * r, 1024, 1025, 1999 - r]:
            if s < t:
                pos[r, s:] -= pos[r, s].clone()
    return pos


def leaves(inputs, to64=False):
    out = {}
    for k, v in inputs.items():
        if to64:
            v = v.to(torch.complex128 if v.is_complex() else torch.float64)
        out[k] = v.detach().clone().requires_grad_()
    return out


def run(fn, p, seg, **opts):
    y, h = fn(*[p[k] for k in NAMES[:7]], seg, p["initial_state"], True, **opts)
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(y.shape, generator=g, device="cuda", dtype=torch.float32)
    loss = (y.float() * w).sum() + (h.real ** 2).sum() - h.imag.sum()
    grads = torch.autograd.grad(loss, [p[k] for k in NAMES])
    return [y, h, *grads]


def rel(a, b):
    a = torch.view_as_real(a.to(torch.complex128)) if a.is_complex() else a.double()
    b = torch.view_as_real(b.to(torch.complex128)) if b.is_complex() else b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def refs():
    inputs, seg = make_inputs(), segment_pos()
    truth = run(reference.samu, leaves(inputs, to64=True), seg)
    torch_bf16 = [run(reference.samu, leaves(inputs), seg), run(reference.samu_real, leaves(inputs), seg)]
    return inputs, seg, truth, torch_bf16


@pytest.mark.parametrize("backend,chunk,opts", CONFIGS, ids=map(config_id, CONFIGS))
def test_bf16_gate(backend, chunk, opts, refs):
    inputs, seg, truth, torch_bf16 = refs
    with poisoned():
        got = run(BACKENDS["samu"][backend], leaves(inputs), seg, chunk_size=chunk, **opts)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    bad = []
    for name, mine, theirs, theirs_real, exact in zip(["y", "final_state", *NAMES], got, *torch_bf16, truth):
        e_mine, e_torch = rel(mine, exact), max(rel(theirs, exact), rel(theirs_real, exact))
        print(f"{config_id((backend, chunk, opts))} {name}: err {e_mine:.3e} (PyTorch bf16 {e_torch:.3e})")
        if not e_mine <= 2 * e_torch + 1e-5:
            bad.append((name, e_mine, e_torch))
    assert not bad, bad


def test_deterministic(refs):
    inputs, seg, _, _ = refs
    a = run(BACKENDS["samu"]["chunk"], leaves(inputs), seg, chunk_size=16)
    b = run(BACKENDS["samu"]["chunk"], leaves(inputs), seg, chunk_size=16)
    for name, u, v in zip(["y", "final_state", *NAMES], a, b):
        assert torch.equal(u, v), name


@pytest.mark.parametrize("layout", ["row", "blocked"])
@pytest.mark.parametrize("batch", [1, 16, 77])
def test_decode_equals_sequence(layout, batch):
    inputs = make_inputs(b=batch, t=6, seed=2)
    seg = (torch.arange(6, device="cuda") + torch.arange(batch, device="cuda")[:, None]) % 4
    y_ref, h_ref = reference.samu(*[inputs[k] for k in NAMES[:7]], seg, inputs["initial_state"], True)
    state = inputs["initial_state"].clone()
    ys = [STEPS["samu"][layout](inputs["x"][:, t], *[inputs[k] for k in NAMES[1:7]], state, seg[:, t] == 0)
          for t in range(6)]
    assert rel(torch.stack(ys, 1), y_ref) < 1e-2 and rel(state, h_ref) < 1e-5


@pytest.mark.parametrize("opts", [{}, {"block_d": 4096, "block_m": 512}, {"block_d": 1024, "block_m": 128, "num_warps": 4}],
                         ids=["default", "bd4096bm512", "bd1024bm128w4"])
def test_row_decode_options_equal_sequence(opts):
    """The row step's tuning options at 300 rows (more than two per multiprocessor: the
    default reduction is then ROW_MANY_ROWS_BLOCK_D wide), with the mode table, over steps
    with resets, against the sequence reference."""
    from kernels.ops import samu_mode_table

    batch = 300
    inputs = make_inputs(b=batch, t=4, seed=6)
    seg = (torch.arange(4, device="cuda") + torch.arange(batch, device="cuda")[:, None]) % 3
    y_ref, h_ref = reference.samu(*[inputs[k] for k in NAMES[:7]], seg, inputs["initial_state"], True)
    params = [inputs[k] for k in NAMES[1:7]]
    tab = samu_mode_table(inputs["nu_log"], inputs["theta_log"], inputs["x"].dtype)
    state = inputs["initial_state"].clone()
    ys = [STEPS["samu"]["row"](inputs["x"][:, t], *params, state, seg[:, t] == 0, modes=tab, **opts) for t in range(4)]
    assert rel(torch.stack(ys, 1), y_ref) < 1e-2 and rel(state, h_ref) < 1e-5


@pytest.mark.parametrize("layout", ["row", "blocked"])
@pytest.mark.parametrize("batch", [16, 512])
def test_decode_with_the_mode_table_is_bitwise_the_plain_step(layout, batch):
    """On the GPU's own exp / cos / sin: the table the engine passes gives the values the
    kernel computes in float64 itself, bit for bit, over steps with resets."""
    from kernels.ops import samu_mode_table

    inputs = make_inputs(b=batch, t=3, seed=4)
    params = [inputs[k] for k in NAMES[1:7]]
    tab = samu_mode_table(inputs["nu_log"], inputs["theta_log"], inputs["x"].dtype)
    s1, s2 = inputs["initial_state"].clone(), inputs["initial_state"].clone()
    reset = torch.arange(batch, device="cuda") % 3 == 0
    for t in range(3):
        r = reset if t == 1 else None
        y1 = STEPS["samu"][layout](inputs["x"][:, t], *params, s1, r)
        y2 = STEPS["samu"][layout](inputs["x"][:, t], *params, s2, r, modes=tab)
        assert torch.equal(y1, y2) and torch.equal(s1, s2)


def test_decode_cuda_graph():
    inputs = make_inputs(b=16, t=1, seed=3)
    params = [inputs[k] for k in NAMES[1:7]]
    x = inputs["x"][:, 0].contiguous()
    state_eager = inputs["initial_state"].clone()
    state = inputs["initial_state"].clone()
    y_eager = STEPS["samu"]["fused"](x, *params, state_eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        STEPS["samu"]["fused"](x, *params, state.clone())  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = STEPS["samu"]["fused"](x, *params, state)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y_eager) and torch.equal(state, state_eager)


@pytest.mark.parametrize("backend", ["serial", "chunk"])
def test_nan_propagates_as_in_the_reference(backend):
    # relu(NaN) is NaN in torch.relu; a GPU max that returns the non-NaN operand gives 0.
    # A NaN token in row 0 (every mode NaN from there) and a NaN mode of row 1's initial
    # state (that mode alone): y, the final state and every gradient are NaN exactly where
    # the reference's are, in the sequence op and in every decode step layout.
    inputs = make_inputs(b=2, t=37, d=64, seed=5)
    inputs["x"] = inputs["x"].float()
    inputs["x"][0, 7, 3] = float("nan")
    inputs["initial_state"][1, 5] = complex(float("nan"), 0.0)
    outs = {}
    for name, fn in (("reference", reference.samu), (backend, BACKENDS["samu"][backend])):
        ts = [inputs[k].clone().requires_grad_() for k in NAMES]
        y, h = fn(*ts[:7], None, ts[7], True)
        grads = torch.autograd.grad(y.sum() + h.real.sum(), ts)
        outs[name] = {"y": y, "h": h, **{f"d{k}": g for k, g in zip(NAMES, grads)}}
    assert torch.isnan(outs["reference"]["y"][1]).any() and not torch.isnan(outs["reference"]["y"][1]).all()
    for k, want in outs["reference"].items():
        assert torch.equal(torch.isnan(outs[backend][k]), torch.isnan(want)), k
    params = [inputs[k] for k in NAMES[1:7]]
    x0 = inputs["x"][:, 7].contiguous()
    s_ref = inputs["initial_state"].clone()
    y_ref = reference.samu_step(x0, *params, s_ref)
    for layout in ("fused", "row", "blocked"):
        s = inputs["initial_state"].clone()
        y = STEPS["samu"][layout](x0, *params, s)
        assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.equal(torch.isnan(s), torch.isnan(s_ref)), layout
