"""GPU checks of the Triton RG-LRU at the model's shape (B = 4, T = 2048, D = 2560, BF16):
every backend against float64 and against the same computation done by PyTorch at
BF16; FP32 against float64; determinism; memory kept for backward; int64 offsets past
2^31 elements; the bare scan at the section-4 shape; the decode step for batch 1..512
and under CUDA-graph capture. Skipped without CUDA."""

import pytest
import torch

import kernels
import parity
from kernels.ops import reference

pytestmark = pytest.mark.cuda

B, T, D, H = 4, 2048, 2560, 16
VARIANTS = [("serial", {}), ("chunk", {"chunk_size": 8}), ("chunk", {"chunk_size": 16}),
            ("chunk", {"chunk_size": 32}), ("chunk", {"chunk_size": 64}),
            ("serial", {"block_d": 32}), ("serial", {"time_warps": 1, "num_stages": 3, "chunk_size": 16}),
            ("chunk", {"chunk_size": 32, "block_d": 128, "num_warps": 1}),
            ("serial", {"time_warps": 1}), ("serial", {"time_warps": 8, "chunk_size": 8, "num_stages": 1}),
            ("serial", {"time_warps": 8, "chunk_size": 64})]
IDS = ["serial", "chunk8", "chunk16", "chunk32", "chunk64", "serial_tile_bd32", "serial_tile_stages3",
       "chunk32_bd128_w1", "serial_tile", "split_w8_prefetch", "split_w8_tc64"]
# split_w8_tc64 leaves num_stages to the launcher, which lowers it until the tiles fit
# shared memory (down to register prefetch for the FP32 tiles).
# Subsets for the slower checks: the default (split kernels), chunk 32, the tile serial,
# the split with register prefetch.
SUBSET = [0, 3, 8, 9]
NAMES = ["output", "final_state", "grad_x", "grad_gate_x", "grad_gate_a", "grad_a_param", "grad_initial_state"]


def run(fn, args, h0, pos, cot, **opts):
    leaves = [a.detach().clone().requires_grad_() for a in args]
    hs = h0.detach().clone().requires_grad_()
    y, h = fn(*leaves, pos, hs, True, **opts)
    loss = (y.double() * cot[0]).sum() + (h.double() * cot[1]).sum()
    grads = torch.autograd.grad(loss, leaves + [hs])
    return [t.detach() for t in (y, h, *grads)]


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    dev = "cuda"
    x, gx, ga = (torch.randn(B, T, D, device=dev, dtype=torch.float64) for _ in range(3))
    a_param = kernels.layers.rnn_param_init(torch.empty(D, device=dev, dtype=torch.float64))
    h0 = torch.randn(B, D, device=dev, dtype=torch.float64)
    pos = parity.make_segment_pos(B, T, True, 0, dev)
    cot = (torch.randn(B, T, D, device=dev, dtype=torch.float64), torch.randn(B, D, device=dev, dtype=torch.float64))
    args16 = [x.bfloat16(), gx.bfloat16(), ga.bfloat16(), a_param.float()]
    args32 = [x.float(), gx.float(), ga.float(), a_param.float()]
    return {
        "pos": pos, "cot": cot, "h0": h0.float(), "args16": args16, "args32": args32,
        "exact16": run(reference.rglru, [a.double() for a in args16], h0, pos, cot),
        "yard16": run(reference.rglru, args16, h0.float(), pos, cot),
        "exact32": run(reference.rglru, [a.double() for a in args32], h0, pos, cot),
    }


@pytest.mark.parametrize("backend,opts", VARIANTS, ids=IDS)
def test_bf16_model_shape(problem, backend, opts):
    got = run(kernels.backends("rglru")[backend], problem["args16"], problem["h0"], problem["pos"], problem["cot"],
              **opts)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for name, g, y, w in zip(NAMES, got, problem["yard16"], problem["exact16"]):
        tol = max(parity.LOWP_FACTOR * parity.rel_err(y, w), parity.LOWP_FLOOR[torch.bfloat16])
        err = parity.rel_err(g, w)
        print(f"{backend}{opts} bf16 {name}: err {err:.3e} pytorch-bf16 {parity.rel_err(y, w):.3e}")
        assert err <= tol, name


@pytest.mark.parametrize("backend,opts", VARIANTS, ids=IDS)
def test_fp32_model_shape(problem, backend, opts):
    got = run(kernels.backends("rglru")[backend], problem["args32"], problem["h0"], problem["pos"], problem["cot"],
              **opts)
    for name, g, w in zip(NAMES, got, problem["exact32"]):
        err = parity.rel_err(g, w)
        print(f"{backend}{opts} fp32 {name}: err {err:.3e}")
        assert err <= parity.BACKEND_TOL[torch.float32], name


@pytest.mark.parametrize("backend,opts", [VARIANTS[i] for i in SUBSET], ids=[IDS[i] for i in SUBSET])
def test_bitwise_reproducible(problem, backend, opts):
    fn = kernels.backends("rglru")[backend]
    first = run(fn, problem["args16"], problem["h0"], problem["pos"], problem["cot"], **opts)
    second = run(fn, problem["args16"], problem["h0"], problem["pos"], problem["cot"], **opts)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend,opts", [VARIANTS[i] for i in SUBSET], ids=[IDS[i] for i in SUBSET])
def test_forward_keeps_only_boundary_states(problem, backend, opts):
    # What forward leaves allocated for backward, beyond y: FP32 states at tile or
    # chunk boundaries (at most 1/8 of a [B, T, D] FP32 tensor), nothing [B, T, D].
    args = [a.detach().clone().requires_grad_() for a in problem["args16"]]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y, _ = kernels.backends("rglru")[backend](*args, problem["pos"], None, False, **opts)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    assert kept <= B * T * D * 4 // 8, kept
    del y


@pytest.mark.parametrize("backend,opts", [VARIANTS[i] for i in SUBSET], ids=[IDS[i] for i in SUBSET])
def test_int64_offsets(backend, opts):
    # 2 x 262_200 x 4_100 > 2^31 elements: the last steps (offsets past 2^31) against the
    # reference continued from the kernel's own FP32 state 64 steps earlier.
    Bl, Tl, Dl = 2, 262_200, 4_100
    assert Bl * Tl * Dl > 2 ** 31
    torch.manual_seed(1)
    x = torch.randn(Bl, Tl, Dl, device="cuda")
    gx = torch.randn(Bl, Tl, Dl, device="cuda")
    ga = torch.randn(Bl, Tl, Dl, device="cuda")
    ap = kernels.layers.rnn_param_init(torch.empty(Dl, device="cuda"))
    y, h = kernels.backends("rglru")[backend](x, gx, ga, ap, None, None, True, **opts)
    k = 64
    tail = [t[:, -k:] for t in (x, gx, ga)]
    y_ref, h_ref = reference.rglru(*tail, ap, None, y[:, -k - 1].contiguous(), True)
    assert parity.rel_err(y[:, -k:], y_ref) <= parity.BACKEND_TOL[torch.float32]
    assert parity.rel_err(h, h_ref) <= parity.BACKEND_TOL[torch.float32]
    y0, _ = reference.rglru(*(t[:, :k] for t in (x, gx, ga)), ap)
    assert parity.rel_err(y[:, :k], y0) <= parity.BACKEND_TOL[torch.float32]


SCAN_VARIANTS = [("serial", {}), ("serial", {"time_warps": 1, "num_stages": 2, "chunk_size": 64}),
                 ("chunk", {"chunk_size": 32}), ("serial", {"time_warps": 1}),
                 ("serial", {"time_warps": 4, "chunk_size": 16, "num_stages": 3})]


@pytest.mark.parametrize("backend,opts", SCAN_VARIANTS,
                         ids=["serial", "serial_tile_stages2", "chunk32", "serial_tile", "split_w4"])
def test_scan_track_shape(backend, opts):
    # Section-4 scan shape in BF16 (FP32 accumulation): output, final state, both gradients.
    Bs, Ts, Ds = 8, 4096, 1024
    torch.manual_seed(2)
    a = (torch.rand(Bs, Ts, Ds, device="cuda", dtype=torch.float64) * 0.1 + 0.899).bfloat16()
    b = torch.randn(Bs, Ts, Ds, device="cuda", dtype=torch.float64).bfloat16()
    pos = parity.make_segment_pos(Bs, Ts, True, 2, "cuda")
    h0 = torch.randn(Bs, Ds, device="cuda")
    cot = (torch.randn(Bs, Ts, Ds, device="cuda", dtype=torch.float64),
           torch.randn(Bs, Ds, device="cuda", dtype=torch.float64))

    def go(fn, a, b, h, **kw):
        la, lb, lh = (t.detach().clone().requires_grad_() for t in (a, b, h))
        y, hT = fn(la, lb, pos, lh, True, **kw)
        loss = (y.double() * cot[0]).sum() + (hT.double() * cot[1]).sum()
        return [y, hT, *torch.autograd.grad(loss, [la, lb, lh])]

    exact = go(reference.scan, a.double(), b.double(), h0.double())
    yard = go(reference.scan, a, b, h0)
    got = go(kernels.backends("scan")[backend], a, b, h0, **opts)
    for name, g, y, w in zip(["output", "final_state", "grad_a", "grad_b", "grad_h0"], got, yard, exact):
        tol = max(parity.LOWP_FACTOR * parity.rel_err(y, w), parity.LOWP_FLOOR[torch.bfloat16])
        assert parity.rel_err(g, w) <= tol, name


def step_weights(dtype, seed=3):
    torch.manual_seed(seed)
    W = D // H
    wx, wa = (torch.randn(H, W, W, device="cuda") / W ** 0.5 for _ in range(2))
    bx, ba = (torch.randn(H, W, device="cuda") for _ in range(2))
    ap = kernels.layers.rnn_param_init(torch.empty(D, device="cuda"))
    return [t.to(dtype) for t in (wx, bx, wa, ba)] + [ap]


@pytest.mark.parametrize("batch", [1, 16, 100, 512])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_step(batch, wdt):
    w = step_weights(wdt)
    x = torch.randn(batch, D, device="cuda").bfloat16()
    state = torch.randn(batch, D, device="cuda")
    reset = torch.rand(batch, device="cuda") < 0.25
    s_ref = state.clone()
    y = kernels.rglru_step(x, *w, state, reset, backend="fused")
    y_ref = reference.rglru_step(x, *w, s_ref, reset)
    assert parity.rel_err(state, s_ref) <= parity.BACKEND_TOL[torch.float32]
    assert parity.rel_err(y, y_ref) <= 2.0 ** -8


def test_step_cuda_graph():
    # Capture one step; replaying it advances the state in place exactly like eager steps.
    w = step_weights(torch.bfloat16, seed=4)
    xs = torch.randn(5, 16, D, device="cuda").bfloat16()
    resets = torch.rand(5, 16, device="cuda") < 0.2
    state = torch.randn(16, D, device="cuda")
    s_ref = state.clone()
    x_in, r_in = xs[0].clone(), resets[0].clone()
    kernels.rglru_step(x_in, *w, state.clone(), r_in, backend="fused")      # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_out = kernels.rglru_step(x_in, *w, state, r_in, backend="fused")
    for i in range(5):
        x_in.copy_(xs[i])
        r_in.copy_(resets[i])
        g.replay()
        y_ref = reference.rglru_step(xs[i], *w, s_ref, resets[i])
        assert parity.rel_err(state, s_ref) <= parity.BACKEND_TOL[torch.float32]
        assert parity.rel_err(y_out, y_ref) <= 2.0 ** -8


@pytest.mark.parametrize("a_param", [-10.0, -12.0])
def test_long_memory_precision_on_the_gpu(a_param):
    # 1 - a^2 near a = 1 through the GPU's exp and log (test_bad_input runs it on the interpreter)
    from test_bad_input import check_long_memory_precision

    check_long_memory_precision(a_param, "cuda")
