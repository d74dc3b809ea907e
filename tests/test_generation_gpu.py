"""Generation engine on a CUDA GPU: graph replay gives the tokens of eager decoding
(every step-kernel family, both mixers, greedy and sampled), prefill + decode logits
equal a full forward (BF16 judged against the FP32 computation, at most LOWP_FACTOR
times the error of the same forward done by PyTorch at BF16), rows of different
prompt lengths do not affect each other. Model: 3 layers of width 256, BF16."""

import copy

import pytest
import torch

import parity
from kernels.models import HawkConfig, HawkLM
from kernels.models.generation import Engine

pytestmark = pytest.mark.cuda

V = 1024
LENGTHS = [9, 1, 4, 16, 2]


def _model(mixer, dtype=torch.bfloat16, backend="auto"):
    torch.manual_seed(0)
    cfg = HawkConfig(width=256, num_layers=3, lru_width=320, mlp_expanded_width=768, num_heads=2, gate_blocks=16,
                     vocab_size=V, mixer=mixer)
    m = HawkLM(cfg, backend=backend, device="cuda", dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias") or n.endswith(".b") or n.endswith("scale"):
                p.normal_(std=0.1)
    return m.to(dtype).requires_grad_(False)


def _prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g) for n in lengths]


def _decode(engine, prompts, n, **kw):
    steps = list(engine.stream(prompts, n, with_logits=True, **kw))
    return torch.stack([t for t, _ in steps], 1), torch.stack([lg for _, lg in steps], 1)


def _same(name, a, b):
    """Logits of two runs that should agree: reported bitwise, asserted within BF16's
    epsilon in max-norm relative error."""
    err = parity.rel_err(a, b)
    print(f"{name}: bitwise equal logits: {torch.equal(a, b)}; max-norm relative difference {err:.3g}")
    assert err <= torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
@pytest.mark.parametrize("kernels", ["model", "fused", "gemm"])
def test_graph_decoding_equals_eager(mixer, kernels):
    m = _model(mixer)
    for prompts, kw in ((_prompts(), {}), (None, {"batch_size": 16}), (None, {"batch_size": 80})):
        eager = Engine(m, kernels=kernels, graphs=False)
        graph = Engine(m, kernels=kernels, graphs=True)
        t_e, l_e = _decode(eager, prompts, 12, **kw)
        t_g, l_g = _decode(graph, prompts, 12, **kw)
        assert torch.equal(t_g, t_e)
        _same(f"{mixer}/{kernels}/{graph.describe()['kernels']} B={t_g.shape[0]} graph vs eager", l_g, l_e)
        # A second run replays the captured graph from a fresh prefill.
        t_g2, l_g2 = _decode(graph, prompts, 12, **kw)
        assert torch.equal(t_g2, t_g) and torch.equal(l_g2, l_g)


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_graph_sampling_equals_eager(mixer):
    m = _model(mixer)
    kw = dict(temperature=0.8, top_k=20)
    runs = []
    for graphs in (False, True, True):
        eng = Engine(m, graphs=graphs)
        runs.append(_decode(eng, _prompts(), 10, generator=torch.Generator("cuda").manual_seed(5), **kw)[0])
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])
    greedy = Engine(m).generate(_prompts(), 10)
    assert not torch.equal(runs[0], greedy)


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
@pytest.mark.parametrize("kernels", ["fused", "gemm"])
def test_prefill_and_decode_equal_full_forward(mixer, kernels):
    m = _model(mixer)
    m32 = copy.deepcopy(m).float()          # the same (BF16-representable) weights in FP32
    ref = copy.deepcopy(m).set_backend("reference")     # the forward done by PyTorch at BF16
    prompts = _prompts([40, 7, 23])
    eng = Engine(m, kernels=kernels, prefill_chunk=16)
    toks, logits = _decode(eng, prompts, 8)
    for b, p in enumerate(prompts):
        seq = torch.cat([p.cuda(), toks[b]])[None]
        pos = torch.arange(seq.shape[1], device="cuda")[None]
        n = len(p)
        with torch.no_grad():
            want = m32(seq, pos)[0][0, n - 1: n + 7]
            yard = ref(seq, pos)[0][0, n - 1: n + 7]
        err, err_pt = parity.rel_err(logits[b], want), parity.rel_err(yard, want)
        tol = max(parity.LOWP_FACTOR * err_pt, torch.finfo(torch.bfloat16).eps)
        print(f"{mixer}/{kernels} row {b}: engine vs FP32 forward {err:.3g}, BF16 forward vs FP32 {err_pt:.3g}, "
              f"tolerance {tol:.3g}")
        assert err <= tol


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_rows_with_different_prompt_lengths_are_independent(mixer):
    m = _model(mixer)
    prompts = _prompts()
    eng = Engine(m)
    toks, logits = _decode(eng, prompts, 10)
    for b, p in enumerate(prompts):
        t1, l1 = _decode(eng, [p], 10)
        assert torch.equal(t1[0], toks[b])
        _same(f"{mixer} row {b} alone vs in the batch", l1[0], logits[b])


def test_auto_step_kernels():
    from kernels.models.generation import AUTO_GEMM_MAX_ROWS

    eng = Engine(_model("rglru"))
    hopper = torch.cuda.get_device_capability()[0] >= 9
    small, large = eng.describe(AUTO_GEMM_MAX_ROWS), eng.describe(AUTO_GEMM_MAX_ROWS + 1)
    assert small["kernels"] == "gemm" and small["pdl"] == hopper
    assert large["kernels"] == "fused" and not large["pdl"]
    # PDL on and off decode the same tokens, bit for bit equal logits
    t_on, l_on = _decode(Engine(_model("samu"), kernels="gemm", pdl=True), _prompts(), 6)
    t_off, l_off = _decode(Engine(_model("samu"), kernels="gemm", pdl=False), _prompts(), 6)
    assert torch.equal(t_on, t_off) and torch.equal(l_on, l_off)
