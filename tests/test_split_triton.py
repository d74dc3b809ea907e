"""The serial backend's split kernels (time across warps, option time_warps,
kernels/ops/rglru/fused_recurrent.py; the serial default) against the float64
reference, on the CPU interpreter; outputs poisoned with NaN.

Two layouts: W = 2 warps of 8 steps (tiles of 16) with register prefetch at T = 37,
D = 24 (partial last tile, one partial channel block: element masks), and W = 4 warps
of 8 steps with pipelined loads at T = 32, D = 64 (whole tiles: the unmasked EVEN
path); each also with 128- and 256-channel blocks (block_d 128: D = 24 and 256; 256: D = 24
and 256; T = 12, D = 40 in float64) and with 80 channels in 128-lane tiles (T = 21, D = 104: a
partial last program; D = 160: whole programs, idle lanes in each). The forward saves every
warp's entry state and the backward starts from them.
"""

import pytest
import torch

import kernels
import parity
from kernels.ops import accounting, reference
from kernels.ops.rglru import fused_recurrent
from kernels.ops.triton_utils import poisoned

from test_rglru_triton import document_positions, run

B = 2
FP32_TOL = parity.BACKEND_TOL[torch.float32]
FP64_TOL = 1e-12
ODD = {"T": 37, "D": 24, "opts": {"time_warps": 2, "chunk_size": 8}}
EVEN = {"T": 32, "D": 64, "opts": {"time_warps": 4, "chunk_size": 8, "num_stages": 2}}
# 128 channels per program (4 per lane): a partial block (D = 24) and whole ones (D = 256)
WIDE_ODD = {"T": 37, "D": 24, "opts": {"time_warps": 2, "chunk_size": 8, "block_d": 128}}
WIDE_EVEN = {"T": 32, "D": 256, "opts": {"time_warps": 4, "chunk_size": 8, "num_stages": 2, "block_d": 128}}
# 256 channels per program (8 per lane): a partial block and a whole one
WIDER_ODD = {"T": 12, "D": 40, "opts": {"time_warps": 2, "chunk_size": 8, "block_d": 256}}
WIDER_EVEN = {"T": 16, "D": 256, "opts": {"time_warps": 2, "chunk_size": 8, "num_stages": 2, "block_d": 256}}
# 80 channels per program in a tile of 128 lanes (48 idle): a partial last program (D = 104)
# and whole ones (D = 160)
NARROW_ODD = {"T": 21, "D": 104, "opts": {"time_warps": 2, "chunk_size": 8, "block_d": 80}}
NARROW_EVEN = {"T": 32, "D": 160, "opts": {"time_warps": 4, "chunk_size": 8, "num_stages": 2, "block_d": 80}}
# Resets at tile and warp edges (8, 16, 24, 32), inside segments (2, 5, 10, 13, 27), in
# runs (20-22), at t = 0 (row 1) and at the last step of the odd shape (36); row 0
# continues an earlier document.
STARTS = ((2, 5, 8, 16, 20, 21, 22, 32, 36), (0, 1, 10, 13, 24, 27))


@pytest.fixture(autouse=True)
def poison():
    with poisoned():
        yield


def make(op, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = torch.randn(B, D, generator=g, dtype=torch.float64).to(pdt)
    if op == "scan":
        a = torch.rand(B, T, D, generator=g, dtype=torch.float64) * 0.2 + 0.79
        b = torch.randn(B, T, D, generator=g, dtype=torch.float64)
        return [a.to(dtype), b.to(dtype)], h0
    x, gx, ga = (torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(seed)
    ap = kernels.layers.rnn_param_init(torch.empty(D, dtype=torch.float64))
    return [x.to(dtype), gx.to(dtype), (2.0 * ga).to(dtype), ap.to(pdt)], h0


def compare(op, shape, dtype, seed=0, h0=True, resets=True, final=True):
    args, init = make(op, shape["T"], shape["D"], dtype, seed)
    init = init if h0 else None
    pos = document_positions(shape["T"], STARTS) if resets else None
    ref = reference.scan if op == "scan" else reference.rglru
    want = run(ref, [a.double() for a in args], None if init is None else init.double(), pos, final)
    got = run(kernels.backends(op)["serial"], args, init, pos, final, **shape["opts"])
    return got, want


FP32_CASES = {"odd": ODD, "even": EVEN, "wide-odd": WIDE_ODD, "wide-even": WIDE_EVEN, "narrow-odd": NARROW_ODD}
FP32_CASES = {**{f"{op}-{n}": (op, s) for n, s in FP32_CASES.items() for op in ("scan", "rglru")},
              "scan-wider-even": ("scan", WIDER_EVEN), "scan-narrow-even": ("scan", NARROW_EVEN)}


@pytest.mark.parametrize("op,shape", FP32_CASES.values(), ids=FP32_CASES.keys())
def test_fp32_against_float64_reference(op, shape):
    got, want = compare(op, shape, torch.float32)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for i, (g, w) in enumerate(zip(got, want)):
        assert parity.rel_err(g, w) <= FP32_TOL, i


@pytest.mark.parametrize("op,shape", [("rglru", ODD), ("scan", EVEN), ("rglru", WIDE_EVEN), ("scan", WIDER_ODD),
                                      ("rglru", NARROW_ODD)],
                         ids=["rglru-odd", "scan-even", "rglru-wide-even", "scan-wider-odd", "rglru-narrow-odd"])
def test_float64_is_exact(op, shape):
    # Any slip in the cross-warp composition, the tile carry, resets or the adjoint
    # would show far above rounding.
    got, want = compare(op, shape, torch.float64, seed=1)
    for i, (g, w) in enumerate(zip(got, want)):
        assert parity.rel_err(g, w) <= FP64_TOL, i


def test_no_resets_no_state():
    got, want = compare("rglru", EVEN, torch.float64, seed=2, h0=False, resets=False, final=False)
    assert got[1] is None
    for i, (g, w) in enumerate(zip(got, want)):
        if w is not None:
            assert parity.rel_err(g, w) <= FP64_TOL, i


def test_bf16_against_pytorch_at_bf16():
    args, h0 = make("rglru", ODD["T"], ODD["D"], torch.bfloat16, 3)
    pos = document_positions(ODD["T"], STARTS)
    exact = run(reference.rglru, [a.double() for a in args], h0.double(), pos)
    yard = run(reference.rglru, args, h0, pos)
    got = run(kernels.backends("rglru")["serial"], args, h0, pos, **ODD["opts"])
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    for i, (g, y, w) in enumerate(zip(got, yard, exact)):
        assert parity.rel_err(g, w) <= max(parity.LOWP_FACTOR * parity.rel_err(y, w), 1e-6), i


def test_gradients_are_bitwise_reproducible():
    first, _ = compare("rglru", ODD, torch.float32, seed=4)
    second, _ = compare("rglru", ODD, torch.float32, seed=4)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), i


def test_default_is_split_and_launches():
    # The serial default runs the split kernels; a tile layout asked for runs the tile
    # kernels. One launch forward, one backward plus the a_param reduction.
    cfg = fused_recurrent.config(B, 37, 24, False)
    assert cfg["TW"] == fused_recurrent.SPLIT_DEFAULT["rglru"]["time_warps"] > 1 and cfg["TT"] == 8
    assert fused_recurrent.config(B, 37, 24, True)["TW"] == fused_recurrent.SPLIT_DEFAULT["scan"]["time_warps"]
    assert fused_recurrent.config(B, 37, 24, False, block_d=32)["TW"] == 1
    wide = fused_recurrent.config(B, 37, 24, True, time_warps=4, block_d=128)
    assert (wide["TW"], wide["BD"], wide["CH"]) == (4, 128, 128)
    narrow = fused_recurrent.config(B, 37, 24, True, time_warps=4, block_d=80)
    assert (narrow["BD"], narrow["CH"]) == (128, 80)
    assert fused_recurrent.config(B, 37, 24, False, time_warps=1)["TW"] == 1
    # an RG-LRU forward without gradient defaults to the tile kernels (faster there)
    assert fused_recurrent.config(B, 37, 24, False, grad=False)["TW"] == 1
    assert fused_recurrent.config(B, 37, 24, False, grad=False, time_warps=2)["TW"] == 2
    assert fused_recurrent.config(B, 37, 24, True, grad=False)["TW"] > 1
    args, h0 = make("rglru", ODD["T"], ODD["D"], torch.float32, 5)
    leaves = [a.clone().requires_grad_() for a in args]
    with accounting.counting() as c:
        y, _ = kernels.backends("rglru")["serial"](*leaves, None, h0, False, **ODD["opts"])
    assert c.launches == 1 and set(c.by_kernel) == {"rglru_serial_fwd"}
    # saved for backward: one FP32 state per warp segment of 8 steps (3 tiles x 2 warps)
    assert c.by_kernel["rglru_serial_fwd"]["bytes_written"] == (B * 37 * 24 + B * 6 * 24) * 4
    with accounting.counting() as c:
        y.sum().backward()
    assert c.launches == 2 and set(c.by_kernel) == {"rglru_serial_bwd", "rglru_reduce_dap"}


def test_pipeline_stages_fit_shared_memory():
    # 232448 bytes (an H100 / H200): the RG-LRU backward at W = 4, chunk_size 32 holds 4 FP32
    # tiles of 32 KiB per stage; three stages do not fit, two do.
    cfg = fused_recurrent.config(B, 64, 256, False, chunk_size=32)
    fit = fused_recurrent._fit_stages(cfg, 4, 4, True, 232448)
    assert cfg["STAGES"] == 3 and fit["STAGES"] == 2
    assert fused_recurrent._fit_stages(cfg, 2, 4, True, 232448) is cfg
    low = fused_recurrent._fit_stages(cfg, 8, 4, True, 100_000)          # float64: register prefetch
    assert low["STAGES"] == 1
    assert fused_recurrent._fit_stages(cfg, 4, 4, True, None) is cfg     # no device limit (CPU)
    explicit = fused_recurrent.config(B, 64, 256, False, chunk_size=32, num_stages=3)
    with pytest.raises(ValueError, match="num_stages"):
        fused_recurrent._fit_stages(explicit, 4, 4, True, 232448)


@pytest.mark.parametrize("opts,match", [
    ({"time_warps": 3}, "time_warps"),
    ({"time_warps": 32}, "time_warps"),
    ({"time_warps": 2, "vec": 2}, "serial options"),
    ({"time_warps": 2, "block_d": 16}, "block_d"),
    ({"time_warps": 2, "block_d": 32}, "block_d"),
    ({"time_warps": 2, "block_d": 512}, "block_d"),
    ({"time_warps": 2, "block_d": 72}, "block_d"),
    ({"time_warps": 2, "block_d": 272}, "block_d"),
    ({"time_warps": 2, "block_d": 80.0}, "block_d"),
    ({"time_warps": 2, "chunk_size": 6}, "chunk_size"),
    ({"time_warps": 2, "chunk_size": 128}, "chunk_size"),
    ({"time_warps": 2, "num_stages": 5}, "num_stages"),
])
def test_bad_options(opts, match):
    args, _ = make("scan", 5, 24, torch.float32, 0)
    with pytest.raises(ValueError, match=match):
        kernels.backends("scan")["serial"](*args, **opts)
    with pytest.raises(ValueError, match=match):
        kernels.backends("rglru")["serial"](*make("rglru", 5, 24, torch.float32, 0)[0], **opts)


def test_scan_takes_wide_blocks_where_64_overfill_a_wave(monkeypatch):
    """Without options the scan takes SCAN_WIDE (4 stages forward, 3 with gradient) where
    B x D / 64 programs exceed the device's multiprocessors; never with options given
    (chunk_size aside), or off the GPU (sms None). End to end on the interpreter with the
    count patched to 1: the wide kernels run forward and backward and match float64."""
    cfg = fused_recurrent.config
    for grad, stages in ((False, 4), (True, 3)):
        wide = cfg(4, 2048, 2560, True, 132, grad=grad)
        assert (wide["TW"], wide["BD"], wide["STAGES"], wide["TT"]) == (4, 128, stages, 8)
        assert cfg(4, 2048, 2560, True, 132, grad=grad, chunk_size=16)["BD"] == 128
    for narrow in (cfg(8, 4096, 1024, True, 132, grad=False),       # 128 programs: one wave
                   cfg(4, 2048, 2048, True, 132, grad=True),
                   cfg(4, 2048, 2560, True, None, grad=False),
                   cfg(4, 2048, 2560, False, 132, grad=False),      # the RG-LRU: tile kernels
                   cfg(4, 2048, 2560, True, 132, grad=False, time_warps=8)):
        assert narrow["BD"] != 128
    with pytest.raises(ValueError, match="serial options"):
        kernels.scan(torch.rand(1, 4, 8), torch.rand(1, 4, 8), backend=kernels.Backend("serial", sms=1))
    monkeypatch.setattr(fused_recurrent, "multiprocessors", lambda device: 1)
    seen, launch = [], fused_recurrent._launch
    monkeypatch.setattr(fused_recurrent, "_launch", lambda k, x, pos, s, cfg, *a, **kw: (
        seen.append(cfg["BD"]), launch(k, x, pos, s, cfg, *a, **kw)))
    args, h0 = make("scan", WIDE_EVEN["T"], WIDE_EVEN["D"], torch.float32, 3)
    with accounting.counting() as c:
        y, h = kernels.scan(*args, initial_state=h0, output_final_state=True, backend="serial")
    assert c.launches == 1 and seen == [128]
    want, hw = reference.scan(*[a.double() for a in args], None, h0.double(), True)
    assert parity.rel_err(y, want) < FP32_TOL and parity.rel_err(h, hw) < FP32_TOL
    # with gradient and no options: forward and backward in 128-channel blocks; output, final
    # state and every gradient (resets, initial state) against float64
    seen.clear()
    got, want = compare("scan", {"T": WIDE_EVEN["T"], "D": WIDE_EVEN["D"], "opts": {}}, torch.float32, seed=3)
    assert seen == [128, 128]
    for i, (g, w) in enumerate(zip(got, want)):
        assert parity.rel_err(g, w) <= FP32_TOL, i
