"""Layers and Hawk models: decode equals forward (both mixers, document starts while
decoding), caches, presets, initialisation, conversion round trips."""

import math

import pytest
import torch

import kernels

from kernels import from_recurrentgemma, layers, to_recurrentgemma
import parity
from kernels.models import PRESETS, HawkCache, HawkConfig, HawkLM
from kernels.ops import accounting, reference


def _model(mixer, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = HawkLM(HawkConfig.preset("tiny", mixer=mixer), backend="reference", dtype=dtype)
    with torch.no_grad():   # biases and norm scales start at zero; exercise them
        for n, p in m.named_parameters():
            if n.endswith("bias") or n.endswith(".b") or n.endswith("scale"):
                p.normal_(std=0.1)
    return m


def _positions():
    # Row 0: one document; row 1: starts at t = 6 and t = 10 (in the prompt tail and
    # while decoding); row 2: a continuation that starts over at t = 11.
    return torch.tensor([
        list(range(14)),
        [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3],
        [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 0, 1, 2],
    ])


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_decode_and_chunked_prefill_equal_forward(mixer):
    m = _model(mixer)
    pos = _positions()
    tokens = torch.randint(0, m.config.vocab_size, pos.shape)
    P = 8
    with torch.no_grad():
        full, full_cache = m(tokens, pos)
        head, cache = m(tokens[:, :P], pos[:, :P])
        steps = [m.step(tokens[:, t], pos[:, t], cache) for t in range(P, pos.shape[1])]
        dec = torch.cat([head, torch.stack(steps, 1)], 1)
        mid, c2 = m(tokens[:, :5], pos[:, :5])
        rest, c3 = m(tokens[:, 5:], pos[:, 5:], c2)
    torch.testing.assert_close(dec, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([mid, rest], 1), full, rtol=1e-12, atol=1e-12)
    for a, b, c in zip(cache.layers, full_cache.layers, c3.layers):
        torch.testing.assert_close(a.rnn_state, b.rnn_state, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.conv_state, b.conv_state, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c.conv_state, b.conv_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer,state_dtype", [("rglru", torch.float32), ("samu", torch.complex64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_layout(mixer, state_dtype, dtype):
    m = HawkLM(HawkConfig.preset("tiny", mixer=mixer), dtype=dtype)
    c = m.init_cache(3)
    assert isinstance(c, HawkCache) and c.batch_size == 3 and len(c.layers) == m.config.num_layers
    E = m.config.lru_width
    for layer in c.layers:
        assert layer.conv_state.shape == (3, 3, E) and layer.conv_state.dtype == dtype
        assert layer.rnn_state.dtype == state_dtype
        assert layer.rnn_state.shape == ((3, E) if mixer == "rglru" else (3, E // 2))
    # Decoding from an empty cache equals a one-token forward; the state stays FP32.
    tok, pos = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])
    with torch.no_grad():
        step = m.step(tok, pos, c)
        fwd, c2 = m(tok[:, None], pos[:, None])
    torch.testing.assert_close(step.float(), fwd[:, 0].float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert c2.layers[0].rnn_state.dtype == state_dtype


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_training_step_bf16_autocast(mixer):
    m = _model(mixer, torch.float32)
    tokens = torch.randint(0, m.config.vocab_size, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = m(tokens, pos, return_cache=False)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(p.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("mixer,backend", [("rglru", "serial"), ("rglru", "chunk"), ("samu", "chunk")])
def test_training_through_the_triton_kernels_equals_reference(mixer, backend):
    """The whole model's loss and every parameter gradient with the mixers on a Triton
    backend (interpreter, float64) equal the reference backend's: the layers wire the
    fused op's inputs, document starts and gradients as the reference does."""
    tokens = torch.randint(0, 256, (3, 14), generator=torch.Generator().manual_seed(5))
    pos = _positions()
    out = {}
    for be in ("reference", backend):
        m = _model(mixer)
        m.set_backend(be)
        with accounting.counting() as c:
            logits, _ = m(tokens, pos, return_cache=False)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        assert bool(c.by_kernel) == (be != "reference"), c.by_kernel     # the kernels ran
        out[be] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    (l_ref, g_ref), (l_k, g_k) = out["reference"], out[backend]
    torch.testing.assert_close(l_k, l_ref, rtol=1e-12, atol=0)
    assert g_ref.keys() == g_k.keys()
    for n in g_ref:
        torch.testing.assert_close(g_k[n], g_ref[n], rtol=1e-9, atol=1e-12, msg=n)


def test_block_diagonal_linear_under_autocast_rounds_once():
    """Under BF16 autocast the gates are (einsum + b) summed in FP32 and rounded once to
    BF16, bit for bit the wide formula then `.to(bf16)`, contiguous (flatten copies
    nothing). Gradients: x's one contiguous tensor for all the linears that share it, w's
    and b's per linear, all as the wide formula's within BF16 rounding (and exactly
    where one linear's dx needs no accumulation). Without autocast, the FP32 formula."""
    torch.manual_seed(0)
    m, m2 = layers.BlockDiagonalLinear(96, 16), layers.BlockDiagonalLinear(96, 16)
    with torch.no_grad():
        m.b.normal_()
        m2.b.normal_()
    x = torch.randn(2, 5, 96, requires_grad=True)

    def wide(x, m):
        return (torch.einsum("...hi,hij->...hj", x.unflatten(-1, (16, 6)), m.w) + m.b).flatten(-2)

    params = [x, m.w, m.b, m2.w, m2.b]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = m(x), wide(x, m).to(torch.bfloat16)
        pair, want2 = layers.block_diagonal(x, m, m2), wide(x, m2).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_contiguous() and torch.equal(got, want)
    assert all(p.is_contiguous() for p in pair) and torch.equal(pair[0], want) and torch.equal(pair[1], want2)
    g, g2 = torch.randn_like(got), torch.randn_like(got)
    gg = torch.autograd.grad(got, [x, m.w, m.b], g)
    gw = torch.autograd.grad(want, [x, m.w, m.b], g, retain_graph=True)
    assert gg[0].is_contiguous() and torch.equal(gg[0], gw[0]) and gg[2].dtype == torch.float32
    torch.testing.assert_close(gg[1], gw[1], rtol=0, atol=0)
    torch.testing.assert_close(gg[2], gw[2], rtol=1e-6, atol=1e-6)
    gp = torch.autograd.grad(pair, params, (g, g2), retain_graph=True)
    gq = torch.autograd.grad((want, want2), params, (g, g2), retain_graph=True)
    for a, b in zip(gp, gq):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-2 * b.abs().max().item())
    # an unused output passes no gradient
    one = torch.autograd.grad(pair[1], [x, m.w, m2.w], g2, allow_unused=True)
    ref = torch.autograd.grad(want2, [x, m2.w], g2)
    assert one[1] is None and torch.equal(one[0], ref[0]) and torch.equal(one[2], ref[1])
    assert torch.equal(m(x), wide(x, m))


def test_presets_match_their_size_labels():
    labels = {"100m": 100e6, "200m": 200e6, "400m": 400e6, "1.3b": 1.3e9, "3b": 3e9, "7b": 7e9}
    assert set(PRESETS) == set(labels) | {"tiny"}
    for name, n in labels.items():
        for mixer in ("rglru", "samu"):
            cfg = HawkConfig.preset(name, mixer=mixer)
            assert cfg.vocab_size == 32_000 and cfg.gate_blocks == 16 and cfg.mlp_expanded_width == 3 * cfg.width
            assert 0.85 < cfg.non_embedding_parameters() / n < 1.15, (name, cfg.non_embedding_parameters())
    for mixer in ("rglru", "samu"):
        cfg = HawkConfig.preset("1.3b", mixer=mixer)
        m = HawkLM(cfg, device="meta")
        counted = sum(p.numel() for p in m.parameters()) - m.embed.weight.numel()
        assert counted == cfg.non_embedding_parameters()
    c = HawkConfig.preset("1.3b")
    assert (c.width, c.num_layers, c.lru_width, c.num_heads) == (2048, 24, 2560, 16)
    with pytest.raises(Exception):
        c.width = 3   # frozen


def test_set_backend():
    m = HawkLM(HawkConfig.preset("tiny", mixer="samu"))
    m.set_backend("reference")
    assert all(b.recurrent_block.mixer.backend == "reference" for b in m.blocks)
    assert all(b.recurrent_block.mixer.step_backend == "reference" for b in m.blocks)
    m.set_backend("chunk")
    assert {(b.recurrent_block.mixer.backend, b.recurrent_block.mixer.step_backend) for b in m.blocks} == {("chunk", "auto")}
    chunk16 = kernels.Backend("chunk", chunk_size=16)
    m.set_backend(chunk16, step_backend="blocked")
    assert {(b.recurrent_block.mixer.backend, b.recurrent_block.mixer.step_backend) for b in m.blocks} == \
        {(chunk16, "blocked")}


def test_samu_initialisation():
    torch.manual_seed(0)
    s = layers.SAMU(4000, dtype=torch.float64)
    mag = torch.exp(-torch.exp(s.nu_log))
    assert mag.min() >= 0.9 - 1e-9 and mag.max() <= 0.999 + 1e-9
    # uniform by area: |a|^2 uniform on [0.81, 0.998]
    assert abs((mag**2).mean().item() - (0.81 + 0.998001) / 2) < 0.01
    theta = torch.exp(s.theta_log)
    assert theta.min() > 0 and theta.max() < math.pi / 10
    for d in (s.phase_dir, s.radial_dir):
        assert d[-1] == 0 and abs(d[:-1].std().item() * math.sqrt(4000) - 1) < 0.1
    assert s.phase_amp.item() == 0.5 and s.radial_amp.item() == 0.5
    assert sum(p.numel() for p in s.parameters()) == 2 * 2000 + 2 * 4001 + 2


def test_rglru_initialisation():
    torch.manual_seed(0)
    r = layers.RGLRU(4096, 16, dtype=torch.float64)
    rad = torch.exp(-torch.nn.functional.softplus(r.a_param))
    assert rad.min() >= 0.9 - 1e-6 and rad.max() <= 0.999 + 1e-6
    assert r.input_gate.w.shape == (16, 256, 256) and r.input_gate.b.shape == (16, 256)


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_mixer_modules_call_the_ops(mixer):
    torch.manual_seed(0)
    E = 12
    mod = layers.make_mixer(mixer, E, 3, backend="reference", dtype=torch.float64)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    pos = parity.make_segment_pos(2, 9)
    y, h = mod(x, pos)
    if mixer == "rglru":
        want, hw = reference.rglru(x, mod.input_gate(x), mod.a_gate(x), mod.a_param, pos, None, True)
    else:
        want, hw = reference.samu(x, *mod.step_params(), pos, None, True)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(h, hw, rtol=0, atol=0)


def test_conv1d_decode_through_document_starts():
    torch.manual_seed(0)
    conv = layers.Conv1D(5, dtype=torch.float64)
    with torch.no_grad():
        conv.b.normal_()
    x = torch.randn(2, 10, 5, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 0, 1], [3, 4, 5, 6, 0, 1, 2, 3, 4, 5]])
    full, _ = conv(x, pos)
    _, cache = conv(x[:, :4], pos[:, :4])
    ys = [conv.step(x[:, t], cache, pos[:, t] == 0) for t in range(4, 10)]
    torch.testing.assert_close(torch.stack(ys, 1), full[:, 4:], rtol=1e-14, atol=1e-14)
    # a document start hides every earlier input
    assert torch.equal(full[0, 6], x[0, 6] * conv.w[3] + conv.b)
    # no segment_pos: a plain causal convolution, equal to torch's depthwise conv1d
    plain, _ = conv(x, None)
    want = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)),
                                      conv.w.T[:, None, :], conv.b, groups=5).transpose(1, 2)
    torch.testing.assert_close(plain, want, rtol=1e-14, atol=1e-14)
    # short sequences (T < W - 1) keep a zero-padded cache
    y1, c1 = conv(x[:, :1], pos[:, :1])
    assert torch.equal(c1[:, :2], torch.zeros_like(c1[:, :2])) and torch.equal(c1[:, 2], x[:, 0])


def test_conv1d_chained_short_chunks_equal_forward():
    # Chunks of 1-3 tokens (shorter than the cache) with document starts anywhere.
    torch.manual_seed(1)
    conv = layers.Conv1D(3, dtype=torch.float64)
    for trial in range(20):
        x = torch.randn(2, 12, 3, dtype=torch.float64)
        starts = torch.rand(2, 12) < 0.3
        pos = torch.zeros(2, 12, dtype=torch.int64)
        for t in range(1, 12):
            pos[:, t] = torch.where(starts[:, t], 0, pos[:, t - 1] + 1)
        full, full_cache = conv(x, pos)
        cuts = [0] + sorted(torch.randperm(11)[:5].add(1).tolist()) + [12]
        cache, ys = None, []
        for a, b in zip(cuts[:-1], cuts[1:]):
            y, cache = conv(x[:, a:b], pos[:, a:b], cache)
            ys.append(y)
        torch.testing.assert_close(torch.cat(ys, 1), full, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(cache, full_cache, rtol=0, atol=0)


def test_rmsnorm():
    torch.manual_seed(0)
    n = layers.RMSNorm(8, dtype=torch.float64)
    with torch.no_grad():
        n.scale.normal_()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + n.scale)
    torch.testing.assert_close(n(x), want, rtol=1e-14, atol=1e-14)


def test_conversion_round_trip():
    rg = parity.load_official()
    torch.manual_seed(0)
    cfg = rg.GriffinConfig(vocab_size=50, width=16, mlp_expanded_width=48, num_heads=2,
                           block_types=(rg.TemporalBlockType.RECURRENT,) * 2, embeddings_scale_by_sqrt_dim=False,
                           attention_window_size=16, logits_soft_cap=0.0, lru_width=24)
    official = rg.Griffin(cfg, gradient_checkpointing=False)
    ours = from_recurrentgemma(official)
    assert isinstance(ours, HawkLM) and ours.config.gate_blocks == 2 and ours.config.lru_width == 24
    back = to_recurrentgemma(ours)
    sd, sd2 = official.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    tokens = torch.randint(0, 50, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, pos)[0], back(tokens, pos)[0], rtol=1e-5, atol=1e-6)
    for sub in (official.blocks[0], official.blocks[0].recurrent_block, official.blocks[0].recurrent_block.rg_lru,
                official.blocks[0].recurrent_block.conv_1d):
        mine = from_recurrentgemma(sub)
        again = to_recurrentgemma(mine)
        assert type(again) is type(sub)
        assert all(torch.equal(a, b) for a, b in zip(sub.state_dict().values(), again.state_dict().values()))
