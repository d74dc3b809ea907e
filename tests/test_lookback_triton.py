"""The chunk backend's opt-in single-pass forward (fwd="lookback", decoupled look-back,
kernels/ops/rglru_triton/lookback.py) against the float64 reference, on the CPU
interpreter; outputs poisoned with NaN.

The interpreter runs programs one after another in program order, so every look-back
there finds its predecessor's inclusive prefix at once; the launcher's test knob
inclusive_every = k lets only every k-th chunk publish one, so look-backs compose
several published aggregates (over one or more windows) before they meet it.
"""

import pytest
import torch

import kernels
from kernels import parity
from kernels.ops import accounting, reference
from kernels.ops.rglru_triton import chunk, common, lookback

from test_rglru_triton import document_positions

B, D = 2, 24
FP32_TOL = parity.BACKEND_TOL[torch.float32]
FP64_TOL = 1e-12

# Look-back configurations (chunk options): Triton's tile layout with two channel blocks
# (the second partial), and the time-in-thread layout (vec 2: one partial block of 64).
TILE = {"chunk_size": 16, "block_d": 16, "vec": 0, "window": 4}
VEC = {"chunk_size": 16, "vec": 2, "num_warps": 1, "window": 2}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(common, "POISON", True)


def positions(T, starts=((5, 16, 20, 21, 22, 32, 48, 69), (0, 1, 13, 31, 33, 34, 35, 64))):
    """Row 0 continues an earlier document; resets at chunk edges of 16 (16, 32, 48, 64),
    inside chunks, in runs (20-22, 33-35, 0-1), at t = 0 (row 1) and at t = 69."""
    return document_positions(T, starts)


def scan_inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(B, T, D, generator=g, dtype=torch.float64) * 0.1 + 0.899
    b = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    h0 = torch.randn(B, D, generator=g, dtype=torch.float64)
    return [a.to(dtype), b.to(dtype)], h0.to(torch.float64 if dtype == torch.float64 else torch.float32)


def rglru_inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, gx, ga = (torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(seed)
    a_param = kernels.layers.rnn_param_init(torch.empty(D, dtype=torch.float64))
    h0 = torch.randn(B, D, generator=g, dtype=torch.float64)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    return [x.to(dtype), gx.to(dtype), (2.0 * ga).to(dtype), a_param.to(pdt)], h0.to(pdt)


OPS = {"scan": (reference.scan, chunk.chunk_scan, scan_inputs),
       "rglru": (reference.rglru, chunk.chunk_rglru, rglru_inputs)}


def forward(op, T, dtype, opts, h0=True, final=True, seed=0):
    ref, fn, make = OPS[op]
    args, init = make(T, dtype, seed)
    init = init if h0 else None
    pos = positions(T)
    want = ref(*(a.double() for a in args), pos, None if init is None else init.double(), final)
    with torch.no_grad():
        got = fn(*args, pos, init, final, fwd="lookback", **opts)
    return got, want


@pytest.mark.parametrize("opts", [TILE, VEC], ids=["tile", "vec2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("op", ["scan", "rglru"])
def test_forward_against_float64_reference(op, dtype, opts):
    # T = 37: three chunks of 16, the last partial; resets at t = 0, at the edges 16 and
    # 32, inside chunks and in runs; an initial state and the final state.
    (y, h), (wy, wh) = forward(op, 37, dtype, opts)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    assert y.dtype == dtype and h.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert parity.rel_err(y, wy) <= tol
    assert parity.rel_err(h, wh) <= tol


@pytest.mark.parametrize("op", ["scan", "rglru"])
def test_one_step_and_no_state(op):
    (y, h), (wy, wh) = forward(op, 1, torch.float64, TILE)
    assert parity.rel_err(y, wy) <= FP64_TOL and parity.rel_err(h, wh) <= FP64_TOL
    (y, h), (wy, _) = forward(op, 37, torch.float64, {**TILE, "chunk_size": 32}, h0=False, final=False)
    assert h is None and parity.rel_err(y, wy) <= FP64_TOL


@pytest.mark.parametrize("op,every,window", [("scan", 2, 1), ("scan", 100, 2), ("rglru", 3, 4), ("rglru", 100, 1)])
def test_aggregate_path(op, every, window, monkeypatch):
    # T = 70 in chunks of 16: five chunks. Only chunks c with c % every == 0 publish an
    # inclusive prefix (every = 100: chunk 0 alone), so look-backs compose up to four
    # aggregates, over one or more windows. With poisoned workspaces a look-back that
    # read an unpublished prefix would give NaN. Resets are sparse here (row 0 has none,
    # row 1 one at t = 0 and one inside chunk 2): a reset erases the prefix, so a chunk
    # with a reset would hide a wrong composition of the chunks before it. The saved
    # states S (what the chunk backward reads, every K = 16 steps) are checked too.
    T, L = 70, 16
    ref, _, make = OPS[op]
    args, h0 = make(T, torch.float64, seed=1)
    pos = positions(T, starts=((), (0, 37)))
    want, want_h = ref(*args, pos, h0, True)
    seen = []
    monkeypatch.setattr(lookback, "workspace_flags",
                        lambda n, device: seen.append(torch.zeros(n, dtype=torch.int32)) or seen[-1])
    cfg = chunk._config(B, T, D, L, fwd="lookback", block_d=16, vec=0, window=window)
    if op == "scan":
        a, b = args
        y, h, S = lookback.lookback_forward(b, b, a, None, pos, h0, True, True, True, cfg, inclusive_every=every)
    else:
        y, h, S = lookback.lookback_forward(*args, pos, h0, True, True, False, cfg, inclusive_every=every)
    assert parity.rel_err(y, want) <= FP64_TOL and parity.rel_err(h, want_h) <= FP64_TOL
    K = cfg["K"]
    assert K == L and S.shape == (B, 5, D)
    states = torch.cat([h0[:, None], want[:, K - 1:T - 1:K]], dim=1)
    assert parity.rel_err(S, states) <= FP64_TOL
    flags = seen[0]
    nc, nd = 5, 2
    assert flags[-1].item() == nc * nd * B
    published = flags[:-1].view(nc, nd, B)
    for c in range(nc):
        assert (published[c] == (2 if c % every == 0 else 1)).all(), c


@pytest.mark.parametrize("op,T,opts,dtype", [
    ("rglru", 70, {"chunk_size": 64, "block_d": 32, "vec": 0, "window": 1}, torch.float32),
    ("scan", 37, VEC, torch.float32),
    ("rglru", 37, {**VEC, "chunk_size": 32, "inner": "loop"}, torch.float64),
], ids=["rglru-L64-fp32", "scan-vec2-fp32", "rglru-L32-loop-fp64"])
def test_gradients_through_chunk_backward(op, T, opts, dtype):
    # The look-back forward saves the states entering every K-step sub-chunk (K = 32 for
    # L = 64: two per chunk; K = 16 with inner="loop"), which the chunk backward reads.
    ref, fn, make = OPS[op]
    args, h0 = make(T, dtype, seed=2)
    pos = positions(T)

    def run(f, xs, h, **kw):
        leaves = [t.detach().clone().requires_grad_() for t in (*xs, h)]
        y, ht = f(*leaves[:-1], pos, leaves[-1], True, **kw)
        g = torch.Generator().manual_seed(7)
        loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum() \
            + (ht.double() * torch.randn(ht.shape, generator=g, dtype=torch.float64)).sum()
        return [y, ht, *torch.autograd.grad(loss, leaves)]

    want = run(ref, [a.double() for a in args], h0.double())
    got = run(fn, args, h0, fwd="lookback", **opts)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    for i, (g, w) in enumerate(zip(got, want)):
        assert parity.rel_err(g, w) <= tol, i


@pytest.mark.parametrize("op", ["scan", "rglru"])
def test_bf16_against_pytorch_at_bf16(op):
    ref, fn, make = OPS[op]
    args, h0 = make(37, torch.bfloat16, seed=3)
    pos = positions(37)
    exact = ref(*(a.double() for a in args), pos, h0.double(), True)
    yard = ref(*args, pos, h0, True)
    got = fn(*args, pos, h0, True, fwd="lookback", **TILE)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for g, y, w in zip(got, yard, exact):
        assert parity.rel_err(g, w) <= max(parity.LOWP_FACTOR * parity.rel_err(y, w), 1e-6)


def test_one_launch_and_default_unchanged():
    args, h0 = scan_inputs(37, torch.float32)
    with accounting.counting() as c:
        chunk.chunk_scan(*args, positions(37), h0, True, fwd="lookback", **VEC)
    assert set(c.by_kernel) == {"chunk_fwd_lookback", "chunk_fwd_lookback_flags"} and c.launches == 2
    cfg = chunk._config(B, 37, D)
    assert cfg["fwd"] == "replay" and cfg["lookback"] is None
    assert "lookback" not in kernels.backends("scan") and "lookback" not in kernels.backends("rglru")


@pytest.mark.parametrize("opts,match", [
    ({"fwd": "single"}, "fwd"),
    ({"fwd": "lookback", "chunk_size": 8}, "chunk_size"),
    ({"fwd": "lookback", "chunk_size": 512}, "chunk_size"),
    ({"fwd": "lookback", "chunk_size": 48}, "chunk_size"),
    ({"fwd": "lookback", "vec": 3}, "vec"),
    ({"fwd": "lookback", "vec": 2, "num_warps": 1, "block_d": 32}, "block_d"),
    ({"fwd": "lookback", "window": 3}, "window"),
    ({"fwd": "lookback", "window": 128}, "window"),
    ({"vec": 2}, "vec"),
    ({"window": 4}, "window"),
    ({"fwd": "lookback", "lookback": 1}, "fwd"),
])
def test_bad_options(opts, match):
    args, _ = scan_inputs(5, torch.float32)
    with pytest.raises(ValueError, match=match):
        chunk.chunk_scan(*args, **opts)
    with pytest.raises(ValueError, match=match):
        kernels.backends("rglru")["chunk"](*rglru_inputs(5, torch.float32)[0], **opts)


# The one-pass backward (bwd="lookback"): chunks taken last first, the adjoint carry
# looked back for over the chunks after each one. BWD_TILE: Triton's layout, two channel
# blocks; BWD_VEC: vec 2 with the forward's 2 warps and the backward's 2 warps along the
# chunk's time axis (block_d = 32 * vec), backward chunks of 16 inside forward chunks of 32.
BWD_TILE = {**TILE, "bwd": "lookback", "bwd_chunk": 16, "bwd_vec": 0, "bwd_block_d": 16}
BWD_VEC = {"chunk_size": 32, "vec": 2, "num_warps": 2, "block_d": 64, "window": 2, "bwd": "lookback",
           "bwd_chunk": 16, "bwd_vec": 2, "bwd_warps": 2, "bwd_block_d": 64}


def grads_of(fn, args, h0, pos, **kw):
    """(y, final state, every input gradient incl. h0) of a loss touching y and the
    final state with fixed random weights."""
    leaves = [t.detach().clone().requires_grad_() for t in (*args, h0)]
    y, ht = fn(*leaves[:-1], pos, leaves[-1], True, **kw)
    g = torch.Generator().manual_seed(7)
    loss = (y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum() \
        + (ht.double() * torch.randn(ht.shape, generator=g, dtype=torch.float64)).sum()
    return [y, ht, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("op,T,opts,dtype", [
    ("scan", 70, BWD_TILE, torch.float64),
    ("rglru", 70, BWD_TILE, torch.float32),
    ("rglru", 37, BWD_VEC, torch.float64),
    ("rglru", 1, BWD_VEC, torch.float32),
], ids=["scan-tile-fp64", "rglru-tile-fp32", "rglru-vec2-fp64", "rglru-T1"])
def test_lookback_backward_against_float64_reference(op, T, opts, dtype):
    ref, fn, make = OPS[op]
    args, h0 = make(T, dtype, seed=4)
    pos = positions(T)
    want = grads_of(ref, [a.double() for a in args], h0.double(), pos)
    got = grads_of(fn, args, h0, pos, fwd="lookback", **opts)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    for i, (g, w) in enumerate(zip(got, want)):
        assert parity.rel_err(g, w) <= tol, i


@pytest.mark.parametrize("op,every,window", [("scan", 2, 1), ("rglru", 3, 2), ("rglru", 100, 1)])
def test_lookback_backward_aggregate_path(op, every, window, monkeypatch):
    # Five backward chunks of 16 (T = 70); only chunks NC - 1 - c with c % every == 0
    # publish the carry at their first row, the others their map alone, so look-backs
    # (toward later chunks) compose several maps over one or more windows. Sparse resets
    # (a reset cuts the carry and would hide a wrong composition).
    T, L = 70, 16
    ref, _, make = OPS[op]
    args, h0 = make(T, torch.float64, seed=5)
    pos = positions(T, starts=((), (0, 37)))
    leaves = [t.detach().clone().requires_grad_() for t in (*args, h0)]
    y, ht = ref(*leaves[:-1], pos, leaves[-1], True)
    g = torch.Generator().manual_seed(8)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((y * dy).sum() + (ht * dht).sum(), leaves)
    seen = []
    monkeypatch.setattr(lookback, "workspace_flags",
                        lambda n, device: seen.append(torch.zeros(n, dtype=torch.int32)) or seen[-1])
    opts = dict(fwd="lookback", block_d=16, vec=0, window=window, bwd="lookback", bwd_chunk=L, bwd_vec=0,
                bwd_block_d=16)
    cfg = chunk._config(B, T, D, L, **opts)
    if op == "scan":
        a, b = (t.detach() for t in args)
        _, _, S = lookback.lookback_forward(b, b, a, None, pos, h0, True, True, True, cfg)
        dx, _, dga, dh0, _ = lookback.lookback_backward(b, b, a, None, pos, S, dy, dht, True, True, cfg,
                                                        inclusive_every=every)
        got = [dga, dx, dh0]
    else:
        xs = [t.detach() for t in args]
        _, _, S = lookback.lookback_forward(*xs, pos, h0, True, True, False, cfg)
        dx, dgx, dga, dh0, part = lookback.lookback_backward(*xs, pos, S, dy, dht, True, False, cfg,
                                                             inclusive_every=every)
        got = [dx, dgx, dga, common.reduce_dap(part, xs[3]), dh0]
    for i, (gg, w) in enumerate(zip(got, want)):
        assert parity.rel_err(gg, w) <= FP64_TOL, i
    flags = seen[1]
    nc, nd = 5, 2
    assert flags[-1].item() == nc * nd * B
    published = flags[:-1].view(nc, nd, B)
    for c in range(nc):
        assert (published[c] == (2 if (nc - 1 - c) % every == 0 else 1)).all(), c


def test_lookback_backward_launches_and_determinism():
    args, h0 = rglru_inputs(37, torch.float32, seed=6)
    pos = positions(37)
    with accounting.counting() as c:
        first = grads_of(chunk.chunk_rglru, args, h0, pos, fwd="lookback", **BWD_TILE)
    assert set(c.by_kernel) == {"chunk_fwd_lookback", "chunk_fwd_lookback_flags", "chunk_bwd_lookback",
                                "chunk_bwd_lookback_flags", "rglru_reduce_dap"}
    second = grads_of(chunk.chunk_rglru, args, h0, pos, fwd="lookback", **BWD_TILE)
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)


def test_warps_along_time_forward():
    # block_d = 32 * vec with 4 warps: all four warps along the chunk's time axis.
    (got, ht), (want, want_h) = forward("rglru", 70, torch.float32,
                                        {"chunk_size": 64, "vec": 2, "num_warps": 4, "block_d": 64})
    assert parity.rel_err(got, want) <= FP32_TOL and parity.rel_err(ht, want_h) <= FP32_TOL


@pytest.mark.parametrize("opts,match", [
    ({"bwd": "lookback"}, "bwd='lookback' only with fwd='lookback'"),
    ({"bwd": "back"}, "bwd"),
    ({"fwd": "lookback", "bwd_chunk": 16}, "only with bwd='lookback'"),
    ({"fwd": "lookback", "bwd": "lookback", "bwd_chunk": 12}, "bwd_chunk_size"),
    ({"fwd": "lookback", "bwd": "lookback", "bwd_vec": 2, "bwd_warps": 2, "bwd_block_d": 192}, "bwd_block_d"),
    ({"fwd": "lookback", "vec": 2, "num_warps": 2, "block_d": 256}, "block_d"),
])
def test_bad_backward_options(opts, match):
    args, _ = scan_inputs(5, torch.float32)
    with pytest.raises(ValueError, match=match):
        chunk.chunk_scan(*args, **opts)
