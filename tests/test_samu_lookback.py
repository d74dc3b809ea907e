"""The SAMU chunk backend's single-pass forward (fwd="lookback", decoupled look-back,
kernels/ops/samu_triton/lookback.py) against the float64 complex reference, on the CPU
interpreter; outputs poisoned with NaN. Gradients run through the unchanged chunk
backward from the states, controls and projections the look-back forward saves.

The interpreter runs programs one after another in program order, so there every
look-back meets its predecessor's inclusive prefix at once; the launcher's test knob
inclusive_every = k lets only every k-th chunk publish one, so look-backs compose
several published aggregates over one or more windows before they meet it.
"""

import pytest
import torch

from kernels.ops import accounting, reference
from kernels.ops.samu_triton import BACKENDS, poisoned
from kernels.ops.samu_triton import lookback as lbmod

from test_samu_triton import (GRAD_NAMES, LOSSES, M, T, assert_close_all, call, leaves, make_inputs, rel, run,
                              segment_positions)

CHUNK = BACKENDS["samu"]["chunk"]

# (backward chunk_size K, look-back options); T = 37 (row 0 has resets at 8, 16, 20-22, 33;
# row 1 at 0, 5, 31; the initial state matters in row 0)
CONFIGS = {
    # one sub-tile per chunk (the scanned maps stay in registers), LS = 16 > K = 8: the
    # saved states come from inside the sub-tile; 3 chunks, the last partial
    "regs-L16": (8, {"lb_chunk": 16, "lb_rows": 16}),
    # four sub-tiles per chunk (phase C re-reads x), LS = 4 < K = 8; aggregates of two
    # chunks composed in one window before the inclusive prefix of chunk 0
    "subtiles-L16": (8, {"lb_chunk": 16, "lb_rows": 4, "lb_window": 2, "inclusive_every": 3,
                         "lb_order": "decoupled"}),
    # 10 chunks of 4, window 2, an inclusive prefix every 4th chunk: look-backs compose
    # aggregates over two windows; LS = 2 < K = 16
    "windows-L4": (16, {"lb_chunk": 4, "lb_rows": 2, "lb_window": 2, "inclusive_every": 4,
                        "lb_order": "decoupled"}),
    # LS = L = K, window 1, an inclusive prefix every other chunk
    "w1-L8": (8, {"lb_chunk": 8, "lb_rows": 8, "lb_window": 1, "inclusive_every": 2, "lb_order": "decoupled"}),
    # two sub-tiles per chunk, LS = K; an inclusive prefix every other chunk
    "two-subtiles-L16": (8, {"lb_chunk": 16, "lb_rows": 8, "inclusive_every": 2, "lb_order": "decoupled"}),
    # fixed composition order: 10 chunks of 4, anchors 0, 4, 8 (window 4); and window 1
    # (every chunk an anchor: a serial chain)
    "fixed-L4": (16, {"lb_chunk": 4, "lb_rows": 2, "lb_window": 4, "lb_order": "fixed"}),
    "fixed-w1-L8": (8, {"lb_chunk": 8, "lb_rows": 4, "lb_window": 1, "lb_order": "fixed"}),
    # defaults (L = 64: one partial chunk), backward K = 16
    "defaults": (16, {}),
}


def lb(**opts):
    return dict(fwd="lookback", **opts)


@pytest.fixture(scope="module")
def ref64():
    return run(reference.samu, leaves(make_inputs(torch.float64)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float64_matches_reference(name, ref64):
    """Output, final state and every gradient to rounding: resets at t = 0, inside chunks,
    at chunk edges, in runs; initial state; partial last chunk."""
    K, opts = CONFIGS[name]
    p = leaves(make_inputs(torch.float64))
    with poisoned():
        got = run(CHUNK, p, chunk_size=K, **lb(**opts))
    assert_close_all(got, ref64, 1e-11)


def test_float32_and_composition_order():
    """FP32 against float64 (2e-5); publishing fewer inclusive prefixes, or the fixed
    (anchored) order, changes only the composition order (agreement to FP32 rounding),
    and each order is bitwise reproducible."""
    inputs = make_inputs(torch.float32, t=26, d=10, seed=3)
    seg = segment_positions(26, [{9, 16}, {0, 4}])
    want = run(reference.samu, leaves(inputs, torch.float64), loss="square", segment_pos=seg)
    opts = {"lb_chunk": 4, "lb_rows": 2, "lb_window": 2}
    with poisoned():
        a, b, a2, fx = (run(CHUNK, leaves(inputs), loss="square", segment_pos=seg, chunk_size=8, **lb(**opts, **o))
                        for o in ({"lb_order": "decoupled"}, {"lb_order": "decoupled", "inclusive_every": 5},
                                  {"lb_order": "decoupled"}, {}))
    assert a[0].dtype == torch.float32 and a[1].dtype == torch.complex64
    assert_close_all(a, want, 2e-5)
    assert_close_all(b, want, 2e-5)
    assert_close_all(fx, want, 2e-5)
    assert rel(a[0], b[0]) < 1e-6 and rel(a[1], b[1]) < 1e-6 and rel(a[1], fx[1]) < 1e-6
    assert torch.equal(a[0], a2[0]) and torch.equal(a[1], a2[1])
    for k in GRAD_NAMES:
        assert torch.equal(a[2][k], a2[2][k]), k


def test_bf16_against_pytorch_bf16():
    """BF16 in and out: every error against float64 at most twice that of PyTorch at
    BF16 (the larger of the reference's two formulations) plus FP32 rounding."""
    inputs = make_inputs(torch.bfloat16)
    truth = run(reference.samu, leaves(inputs, torch.float64))
    theirs = [run(reference.samu, leaves(inputs)), run(reference.samu_real, leaves(inputs))]
    with poisoned():
        got = run(CHUNK, leaves(inputs), chunk_size=16, **lb(lb_chunk=16, lb_rows=8))
    assert got[0].dtype == torch.bfloat16 and got[2]["x"].dtype == torch.bfloat16

    def parts(r):
        return [r[0], r[1], *[r[2][k] for k in GRAD_NAMES]]

    for name, mine, exact, *others in zip(["y", "final_state", *GRAD_NAMES], parts(got), parts(truth),
                                          *map(parts, theirs)):
        e_torch = max(rel(t, exact) for t in others)
        assert rel(mine, exact) <= 2 * e_torch + 1e-5, (name, rel(mine, exact), e_torch)


def test_prefill_one_launch():
    """No gradient: the prefill keeps no states, launches the mode table, the flags'
    memset and the look-back kernel only (no controller pass), and reads x once."""
    inputs = make_inputs(torch.float32, seed=7)
    y_ref, h_ref = call(reference.samu, leaves(inputs, torch.float64))
    with torch.no_grad(), poisoned(), accounting.counting() as c:
        y, h = call(CHUNK, inputs, chunk_size=16, **lb(lb_chunk=16))
    assert rel(y, y_ref) < 2e-6 and rel(h, h_ref) < 2e-6
    assert set(c.by_kernel) == {"samu_mode_table", "samu_lookback_flags", "samu_lookback_fwd"}, c.by_kernel
    x_bytes = inputs["x"].numel() * 4
    assert x_bytes <= c.bytes_read < 1.5 * x_bytes and c.bytes_written >= y.numel() * 4


@pytest.mark.parametrize("t", [1, 5])
def test_short_rows_no_resets_no_initial_state(t):
    """T = 1 and T shorter than one sub-tile; no resets, no initial state (zero start):
    output, final state and the gradients of x and nu_log."""
    inputs = make_inputs(torch.float64, t=t, seed=9)
    p, q = leaves(inputs), leaves(inputs)
    y_ref, h_ref = reference.samu(*[p[k] for k in GRAD_NAMES[:7]], None, None, True)
    with poisoned():
        y, h = CHUNK(*[q[k] for k in GRAD_NAMES[:7]], None, None, True, chunk_size=8, **lb(lb_chunk=8, lb_rows=2))
    assert rel(y, y_ref) < 1e-12 and rel(h, h_ref) < 1e-12
    g_ref = torch.autograd.grad(LOSSES["mixed"](y_ref, h_ref), [p["x"], p["nu_log"], p["phase_dir"]])
    g = torch.autograd.grad(LOSSES["mixed"](y, h), [q["x"], q["nu_log"], q["phase_dir"]])
    for a, b in zip(g, g_ref):
        assert rel(a, b) < 1e-12


def test_reset_every_step_and_runs():
    """Resets in long runs and at the first step of every chunk of 4 (the aggregates are
    then pure writes): float64, final state and the gradient of x."""
    seg = segment_positions(T, [set(range(0, T, 4)), set(range(10, 30))])
    inputs = make_inputs(torch.float64, seed=4)
    p, q = leaves(inputs), leaves(inputs)
    want = run(reference.samu, p, segment_pos=seg)
    with poisoned():
        got = run(CHUNK, q, segment_pos=seg, chunk_size=8, **lb(lb_chunk=4, lb_rows=2, lb_window=2,
                                                                 inclusive_every=3, lb_order="decoupled"))
    assert_close_all(got, want, 1e-11)


def test_bad_options():
    inputs = make_inputs(torch.float32)
    args = [inputs[k] for k in GRAD_NAMES[:7]]
    bad = [({"fwd": "scan"}, "fwd"), (lb(lb_chunk=3), "lb_chunk"), (lb(lb_chunk=2048), "lb_chunk"),
           (lb(lb_rows=128), "lb_rows"), (lb(lb_chunk=8, lb_rows=16), "lb_rows"), (lb(lb_warps=3), "lb_warps"),
           (lb(lb_window=0), "lb_window"),
           (lb(lb_order="any"), "lb_order"), (lb(fuse_controls=True), "fuse_controls"),
           ({"lb_chunk": 64}, "lb_"), (lb(inclusive_every=0), "inclusive_every")]
    for opts, match in bad:
        with pytest.raises(ValueError, match=match):
            CHUNK(*args, None, None, False, chunk_size=16, **opts)


def test_config_defaults():
    cfg = lbmod.lookback_config(512)
    assert cfg == {"L": 64, "LS": 4, "BM": 512, "num_warps": 4, "VEC": 4, "W": 8, "order": "fixed"}
    assert lbmod.lookback_config(1280)["LS"] == 4 and lbmod.lookback_config(1280)["num_warps"] == 16
    assert lbmod.lookback_config(M)["BM"] == 16


@pytest.mark.cuda
def test_gpu_bf16_gate_and_forward():
    """On the GPU at the training shape (B = 4, T = 2048, D = 2560): the look-back forward
    under the chunk backward passes the same BF16 gate as the chunk backend (each error
    against float64 at most twice PyTorch's BF16 error); and the prefill at B = 8,
    T = 4096, D = 1024 agrees with the two-level chunk forward to FP32 rounding."""
    import test_samu_gpu as g

    inputs, seg = g.make_inputs(), g.segment_pos()
    truth = g.run(reference.samu, g.leaves(inputs, to64=True), seg)
    theirs = [g.run(reference.samu, g.leaves(inputs), seg), g.run(reference.samu_real, g.leaves(inputs), seg)]
    with poisoned():
        got = g.run(CHUNK, g.leaves(inputs), seg, chunk_size=16, fwd="lookback")
    for name, mine, t1, t2, exact in zip(["y", "final_state", *g.NAMES], got, *theirs, truth):
        e_torch = max(g.rel(t1, exact), g.rel(t2, exact))
        assert g.rel(mine, exact) <= 2 * e_torch + 1e-5, (name, g.rel(mine, exact), e_torch)
    fin = g.make_inputs(b=8, t=4096, d=1024, seed=1)
    fseg = g.segment_pos(8, 4096)
    args = [fin[k] for k in g.NAMES[:7]]
    with torch.no_grad(), poisoned():
        y0, h0 = CHUNK(*args, fseg, fin["initial_state"], True, chunk_size=16)
        y1, h1 = CHUNK(*args, fseg, fin["initial_state"], True, chunk_size=16, fwd="lookback")
    assert g.rel(h1, h0) < 1e-5 and g.rel(y1, y0) < 1e-3
