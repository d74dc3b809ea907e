"""Split-K weight-streaming linear (kernels.models.decode.linear) in the Triton interpreter:
every prologue and epilogue with the K reduction split across programs (remainders in
N, K and the last split, M not a power of two, M = 1), the weight tile as the dot's M
operand (SWAP), results judged against float64 and the same computation in PyTorch
(BF16: at most LOWP_FACTOR times PyTorch's BF16 error), outputs poisoned with NaN,
deterministic results and arrival counts left at zero in a shared workspace."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import layers
from kernels.models import decode as dk

from test_generation import _judge as judge_against_eager

CONFIGS = {
    "split3": {"BN": 16, "BK": 16, "SPLIT": 3, "SWAP": 0, "num_warps": 4, "num_stages": 2},
    "split2-swap": {"BN": 32, "BK": 16, "SPLIT": 2, "SWAP": 1, "num_warps": 4, "num_stages": 3},
    # one partial tile per reducing load (BM * BN = 8192): three load groups
    "split3-wide": {"BN": 128, "BK": 16, "SPLIT": 3, "SWAP": 1, "num_warps": 4, "num_stages": 2},
}


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _judge(got, run):
    """No NaN left of the poisoned output, then test_generation's judgement (FP32: close
    to the eager computation; BF16: against float64 within LOWP_FACTOR times the eager
    BF16 error)."""
    assert not got.isnan().any()
    judge_against_eager(got, run)


def _setup(M, dtype, D=40, E=36, Fw=28, seed=1):
    torch.manual_seed(seed)
    mods = torch.nn.ModuleDict({"norm": layers.RMSNorm(D), "ly": torch.nn.Linear(D, E), "lx": torch.nn.Linear(D, E),
                                "lo": torch.nn.Linear(E, D), "up": torch.nn.Linear(D, 2 * Fw),
                                "down": torch.nn.Linear(Fw, D), "conv": layers.Conv1D(E)})
    with torch.no_grad():
        for n, p in mods.named_parameters():
            if "bias" in n or "scale" in n or n.endswith(".b"):
                p.normal_()
    data = {"x": torch.randn(M, D), "a": torch.randn(M, E), "a2": torch.randn(M, E), "res": torch.randn(M, D),
            "p": torch.randn(M, Fw), "st": torch.randn(M, 3, E),
            "reset": torch.arange(M) % 3 == 1}
    return mods.to(dtype), {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in data.items()}, (D, E, Fw)


def _eager(mods, d, dt, part, Fw):
    md = {k: copy.deepcopy(v).to(dt) for k, v in mods.items()}   # Module.to works in place
    n = md["norm"](d["x"].to(dt))
    if part == "y":
        return layers.gelu(md["ly"](n))
    if part in ("conv", "state"):
        s = d["st"].to(dt).clone()
        y = md["conv"].step(md["lx"](n), s, d["reset"])
        return y if part == "conv" else s
    if part == "out":
        return md["lo"](d["a"].to(dt) * d["a2"].to(dt)) + d["res"].to(dt)
    if part == "gated":
        u = md["up"](n)
        return layers.gelu(u[:, :Fw]) * u[:, Fw:]
    if part == "down":
        return md["down"](d["p"].to(dt)) + d["res"].to(dt)
    return n @ md["up"].weight.T        # logits-like: normed input, no bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,M", [("split3", 7), ("split2-swap", 19), ("split3", 1),
                                    ("split3-wide", 40)])
def test_split_k_linear_every_prologue_and_epilogue(dtype, name, M):
    cfg = CONFIGS[name]
    m, d, (D, E, Fw) = _setup(M, dtype)
    ws = dk.Workspace("cpu")
    kw = dict(config=cfg, workspace=ws)
    st = d["st"].clone()
    gy, xc = dk.linear(d["x"], m["ly"].weight, m["ly"].bias, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                       eps=m["norm"].eps, epilogue=dk.EPI_XY, w2=m["lx"].weight, bias2=m["lx"].bias,
                       conv=(st, m["conv"].w, m["conv"].b), reset=d["reset"], out=_poisoned((M, E), dtype),
                       out2=_poisoned((M, E), dtype), **kw)
    _judge(gy, lambda dt: _eager(m, d, dt, "y", Fw))
    _judge(xc, lambda dt: _eager(m, d, dt, "conv", Fw))
    _judge(st, lambda dt: _eager(m, d, dt, "state", Fw))
    r = d["res"].clone()
    out = dk.linear(d["a"], m["lo"].weight, m["lo"].bias, prologue=dk.PRO_MUL, a2=d["a2"], epilogue=dk.EPI_RESIDUAL,
                    residual=r, **kw)
    assert out.data_ptr() == r.data_ptr()
    _judge(r, lambda dt: _eager(m, d, dt, "out", Fw))
    got = dk.linear(d["x"], m["up"].weight, m["up"].bias, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                    eps=m["norm"].eps, epilogue=dk.EPI_GATED, out=_poisoned((M, Fw), dtype), **kw)
    _judge(got, lambda dt: _eager(m, d, dt, "gated", Fw))
    r = d["res"].clone()
    dk.linear(d["p"], m["down"].weight, m["down"].bias, epilogue=dk.EPI_RESIDUAL, residual=r, **kw)
    _judge(r, lambda dt: _eager(m, d, dt, "down", Fw))
    got = dk.linear(d["x"], m["up"].weight, None, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                    eps=m["norm"].eps, out=_poisoned((M, 2 * Fw), dtype), **kw)
    _judge(got, lambda dt: _eager(m, d, dt, "logits", Fw))
    assert ws.counts.numel() > 0 and not ws.counts.any()     # every column block reset its count


def test_split_k_is_deterministic_and_matches_one_split():
    m, d, (D, E, Fw) = _setup(5, torch.float32, seed=2)
    one = dict(CONFIGS["split3"], SPLIT=1)
    runs = []
    for cfg, ws in ((CONFIGS["split3"], None), (CONFIGS["split3"], dk.Workspace("cpu")), (one, None)):
        runs.append(dk.linear(d["x"][:, 3:3 + E], m["lo"].weight, m["lo"].bias,     # strided a
                              config=cfg, workspace=ws, out=_poisoned((5, D), torch.float32)))
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0], runs[2])         # FP32 summation order only
    with torch.no_grad():
        want = d["x"][:, 3:3 + E].double() @ m["lo"].weight.double().T + m["lo"].bias.double()
    torch.testing.assert_close(runs[0].double(), want, rtol=1e-5, atol=1e-5)


def test_split_plan_and_bad_config():
    assert dk.split_plan(2048, 128, 7) == (384, 6)
    assert dk.split_plan(100, 16, 3) == (48, 3)
    assert dk.split_plan(100, 16, 1) == (112, 1)
    c = dk.default_config(5120, 2048)
    assert c["BN"] * c["BK"] > 0 and set(c) == set(dk.CONFIG_KEYS)
    with pytest.raises(ValueError, match="SPLIT"):
        dk.split_plan(64, 16, 0)
    with pytest.raises(ValueError, match="config keys"):
        dk.linear(torch.zeros(2, 16), torch.zeros(16, 16), config={"BLOCK": 16})
    with pytest.raises(ValueError, match="BN and BK"):
        dk.linear(torch.zeros(2, 16), torch.zeros(16, 16), config={"BN": 8})
    for bad in (2, "yes", None):
        with pytest.raises(ValueError, match="PREFETCH 0 or 1"):
            dk.linear(torch.zeros(2, 16), torch.zeros(16, 16), config={"PREFETCH": bad})


def test_default_tiles():
    # the tuned 1.3b entries (any rows up to 16 share one entry) and, elsewhere, a few
    # hundred programs each streaming at least 512 of K
    assert dk.default_config(5120, 2048, 1) == dict(dk.default_config(5120, 2048, 16))
    assert dk.default_config(5120, 2048, 16)["SPLIT"] == dk.TUNED[(5120, 2048, 16)]["SPLIT"]
    for cols, K in ((4096, 3072), (24576, 4096), (11264, 4096), (300, 40)):
        c = dk.default_config(cols, K, 16)
        ks, split = dk.split_plan(K, c["BK"], c["SPLIT"])
        programs = -(-cols // c["BN"]) * split
        assert split == 1 or ks >= 512, (cols, K, c)
        assert programs <= 600 and (programs >= 100 or split == -(-K // 512)), (cols, K, c)


_HOPPER_PTX = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.models import decode as dk

fn = dk.linear_kernel.fn
kinds = {"ws": "*fp32", "nscale": "*fp32", "counts": "*i32", "reset": "*i8", "eps": "fp32",
         **dict.fromkeys(("sa", "sa2", "M", "N", "K"), "i32")}
sig = {n: "constexpr" if i in fn.constexprs else kinds.get(n, "*bf16") for i, n in enumerate(fn.arg_names)}
out = {}
for pf in (1, 0):
    const = dict(PRO=0, EPI=dk.EPI_GATED, HAS_BIAS=False, HAS_RESET=False, CW=1, BM=16, BN=64, BK=128, SPLIT=2,
                 KS=1024, RG=2, SWAP=1, DOT=0, RNE=False, PDL=True, PF=bool(pf))
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8, "num_stages": 3}).asm["ptx"].splitlines()
    out[pf] = [[i for i, line in enumerate(ptx) if op in line] for op in ("prefetch.global.L2", "griddepcontrol.wait")]
print(json.dumps(out))
"""


def test_prefetch_compiles_for_hopper():
    """PREFETCH under programmatic dependent launch: the kernel compiled for sm_90 on this
    machine (the Triton wheel's ptxas, outside the interpreter, no GPU) issues its L2
    prefetches before the dependency wait, and none without it; off the GPU (no dependent
    launch) the option changes nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = json.loads(subprocess.run([sys.executable, "-c", _HOPPER_PTX], env=env, capture_output=True, text=True,
                                    check=True, cwd=Path(__file__).resolve().parents[1]).stdout.splitlines()[-1])
    (at, wait), (none, wait0) = got["1"], got["0"]
    assert len(wait) == len(wait0) == 1 and at and max(at) < wait[0] and not none, got
    m, d, _ = _setup(5, torch.float32, seed=3)
    cfg = CONFIGS["split3"]
    want = dk.linear(d["x"], m["up"].weight, m["up"].bias, config=cfg, pdl=True)
    assert torch.equal(dk.linear(d["x"], m["up"].weight, m["up"].bias, config=dict(cfg, PREFETCH=1), pdl=True), want)


@pytest.mark.cuda
@pytest.mark.parametrize("pdl,prefetch", [(False, 0), (True, 0), (True, 1)])
def test_split_k_linear_graph_replays_on_gpu(pdl, prefetch):
    """Real K (2048, 2560, 6144-like), several splits, replayed from a CUDA graph: every
    replay equals the eager launch bit for bit (the counts are back at zero each time)
    and the results pass the BF16 judgement against float64."""
    M, dtype = 13, torch.bfloat16
    m, d, (D, E, Fw) = _setup(M, dtype, D=2048, E=640, Fw=1536, seed=4)
    m, d = m.cuda(), {k: v.cuda() for k, v in d.items()}
    cfg = dict(BN=64, BK=128, SPLIT=5, SWAP=1, PREFETCH=prefetch)
    ws = dk.Workspace("cuda")
    st, r1, r2 = d["st"].clone(), d["res"].clone(), d["res"].clone()
    outs = {"gy": _poisoned((M, E), dtype).cuda(), "xc": _poisoned((M, E), dtype).cuda(),
            "g": _poisoned((M, Fw), dtype).cuda()}

    def launch():
        st.copy_(d["st"])
        r1.copy_(d["res"])
        r2.copy_(d["res"])
        kw = dict(config=cfg, pdl=pdl, workspace=ws)
        dk.linear(d["x"], m["ly"].weight, m["ly"].bias, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                  eps=m["norm"].eps, epilogue=dk.EPI_XY, w2=m["lx"].weight, bias2=m["lx"].bias,
                  conv=(st, m["conv"].w, m["conv"].b), reset=d["reset"], out=outs["gy"], out2=outs["xc"], **kw)
        dk.linear(d["a"], m["lo"].weight, m["lo"].bias, prologue=dk.PRO_MUL, a2=d["a2"], epilogue=dk.EPI_RESIDUAL,
                  residual=r1, **kw)
        dk.linear(d["x"], m["up"].weight, m["up"].bias, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                  eps=m["norm"].eps, epilogue=dk.EPI_GATED, out=outs["g"], **kw)
        dk.linear(d["p"], m["down"].weight, m["down"].bias, epilogue=dk.EPI_RESIDUAL, residual=r2, **kw)
        return [outs["gy"], outs["xc"], st, r1, outs["g"], r2]

    eager = [t.clone() for t in launch()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        for t in outs.values():
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip([outs["gy"], outs["xc"], st, r1, outs["g"], r2], eager):
            assert torch.equal(a, b)
    assert not ws.counts.any()
    cpu = {k: v.cpu() for k, v in d.items()}
    mc = m.cpu()
    for got, part in zip(eager, ("y", "conv", "state", "out", "gated", "down")):
        _judge(got.cpu(), lambda dt: _eager(mc, cpu, dt, part, Fw))


def test_linear_refuses_unsafe_buffers_and_copies_strided_vectors():
    """Buffers the kernel would misread or race on raise ValueError (row-strided out and
    out2, mixed activation / weight dtypes, a bias of the wrong length, an odd gated
    weight, out aliasing the input, out= ignored by EPI_RESIDUAL); strided bias,
    norm_scale and conv parameters (read-only) are copied and give the right result."""
    M, dtype = 3, torch.float32
    m, d, (D, E, Fw) = _setup(M, dtype, seed=5)
    cfg = CONFIGS["split3"]
    x, w, b = d["x"], m["up"].weight, m["up"].bias
    bad = [
        dict(a=x, w=w, bias=b, out=torch.zeros(M, 4 * Fw)[:, :2 * Fw]),                 # row-strided out
        dict(a=x, w=w.half(), bias=b),                                                 # fp32 a, fp16 w
        dict(a=x.bfloat16(), w=w, bias=b),                                             # bf16 a, fp32 w
        dict(a=x, w=w, bias=torch.zeros(Fw)),                                          # bias [N / 2]
        dict(a=x, w=w[:-1].contiguous(), bias=b[:-1], epilogue=dk.EPI_GATED),          # odd gated rows
        dict(a=x, w=w, bias=b[:Fw], epilogue=dk.EPI_GATED),                            # gated bias [N]
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            dk.linear(config=cfg, **kw)
    sq = torch.randn(M, D)
    with pytest.raises(ValueError, match="overlap a"):
        dk.linear(sq, torch.randn(D, D), None, out=sq, config=cfg)     # out is a
    r = d["res"].clone()
    with pytest.raises(ValueError, match="overlap a"):
        dk.linear(r, torch.randn(D, D), None, epilogue=dk.EPI_RESIDUAL, residual=r, config=cfg)
    with pytest.raises(ValueError, match="EPI_RESIDUAL"):
        dk.linear(d["p"], m["down"].weight, m["down"].bias, epilogue=dk.EPI_RESIDUAL, residual=r,
                  out=torch.empty(M, D), config=cfg)
    o = torch.empty(M, E)
    with pytest.raises(ValueError, match="out2 not to overlap out"):
        dk.linear(x, m["ly"].weight, m["ly"].bias, epilogue=dk.EPI_XY, w2=m["lx"].weight, bias2=m["lx"].bias,
                  conv=(d["st"].clone(), m["conv"].w, m["conv"].b), out=o, out2=o, config=cfg)
    # strided read-only vectors: the same values as contiguous ones
    sv = lambda t: torch.stack([t.detach(), torch.full_like(t, float("nan"))], -1)[..., 0]  # noqa: E731
    st = d["st"].clone()
    with torch.no_grad():
        gy, xc = dk.linear(x, m["ly"].weight, sv(m["ly"].bias), prologue=dk.PRO_NORM, norm_scale=sv(m["norm"].scale),
                           eps=m["norm"].eps, epilogue=dk.EPI_XY, w2=m["lx"].weight, bias2=sv(m["lx"].bias),
                           conv=(st, sv(m["conv"].w), sv(m["conv"].b)), reset=sv(d["reset"]), config=cfg)
    _judge(gy, lambda dt: _eager(m, d, dt, "y", Fw))
    _judge(xc, lambda dt: _eager(m, d, dt, "conv", Fw))
    _judge(st, lambda dt: _eager(m, d, dt, "state", Fw))
