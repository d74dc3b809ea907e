"""Bad input raises ValueError naming the argument, what was expected and what was received."""

import pytest
import torch

import kernels
from kernels import from_recurrentgemma, layers, parity, to_recurrentgemma
from kernels.models import HawkConfig, HawkLM


def _raises(fn, *words):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert "expected" in msg and "got" in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HawkLM(HawkConfig.preset("tiny"))


def _samu_params(D):
    m = layers.SAMU(D + (D % 2))
    p = list(m._params())
    if D % 2:
        p[0], p[1] = torch.zeros(D + 1), torch.zeros(D + 1)
    return p


def test_odd_width_for_samu():
    x = torch.randn(2, 7, 33)
    _raises(lambda: kernels.samu(x, *_samu_params(33)), "x", "D even", "[2, 7, 33]")
    _raises(lambda: kernels.samu_step(x[:, 0], *_samu_params(33), torch.zeros(2, 16, dtype=torch.complex64)),
            "x", "even")
    _raises(lambda: layers.SAMU(33), "even", "33")
    _raises(lambda: HawkConfig.preset("tiny", mixer="samu", lru_width=95), "lru_width", "95")


def test_segment_pos_shape_and_dtype(model):
    r = layers.RGLRU(8, 2)
    x = torch.randn(2, 5, 8)
    _raises(lambda: r(x, torch.zeros(2, 6, dtype=torch.int64)), "segment_pos", "[2, 5]", "[2, 6]")
    _raises(lambda: r(x, torch.zeros(2, 5)), "segment_pos", "integer", "float32")
    _raises(lambda: r(x, torch.zeros(2, 5, dtype=torch.bool)), "segment_pos", "bool")
    _raises(lambda: layers.Conv1D(8)(x, torch.zeros(5, dtype=torch.int64)), "segment_pos", "[5]")
    tokens = torch.zeros(2, 5, dtype=torch.int64)
    _raises(lambda: model(tokens, torch.zeros(2, 4, dtype=torch.int64)), "segment_pos", "[2, 4]")
    _raises(lambda: model(tokens, torch.zeros(2, 5)), "segment_pos", "float32")
    _raises(lambda: model(tokens.float(), torch.zeros(2, 5, dtype=torch.int64)), "tokens", "integer")
    cache = model.init_cache(2)
    _raises(lambda: model.step(tokens[:, 0], torch.zeros(2, 1, dtype=torch.int64), cache), "segment_pos", "[2]")
    _raises(lambda: model.step(tokens[:, 0], torch.zeros(2), cache), "segment_pos", "integer")


def test_cache_for_another_batch_size(model):
    tokens, pos = torch.zeros(2, 5, dtype=torch.int64), torch.arange(5).expand(2, 5)
    cache = model.init_cache(3)
    _raises(lambda: model(tokens, pos, cache), "cache", "batch size 2", "batch size 3")
    _raises(lambda: model.step(tokens[:, 0], pos[:, 0], cache), "cache", "batch size 2", "batch size 3")
    r = layers.RGLRU(8, 2)
    _raises(lambda: r(torch.randn(2, 5, 8), pos, torch.zeros(3, 8)), "initial_state", "[2, 8]", "[3, 8]")
    _raises(lambda: r.step(torch.randn(2, 8), torch.zeros(3, 8)), "state", "[2, 8]", "[3, 8]")
    _raises(lambda: layers.Conv1D(8)(torch.randn(2, 5, 8), pos, torch.zeros(3, 3, 8)), "conv_state", "[3, 3, 8]")
    _raises(lambda: model(tokens, pos, cache="x"), "cache", "HawkCache", "str")
    _raises(lambda: model.init_cache(0), "batch", "0")


def test_unknown_preset_or_mixer():
    _raises(lambda: HawkConfig.preset("5b"), "preset", "'5b'", "1.3b")
    _raises(lambda: HawkConfig.preset("tiny", mixer="mamba"), "mixer", "'mamba'", "samu")
    _raises(lambda: HawkConfig.preset("tiny", widht=3), "widht")
    _raises(lambda: layers.RecurrentBlock(8, 2, mixer="lstm"), "mixer", "'lstm'")
    _raises(lambda: layers.make_mixer("gru", 8, 2), "mixer", "'gru'")
    _raises(lambda: HawkConfig.preset("tiny", gate_blocks=7), "gate_blocks", "96")
    _raises(lambda: kernels.rglru(*[torch.randn(1, 3, 4)] * 3, torch.zeros(4), backend="fastest"),
            "backend", "'fastest'")


def test_tensors_on_different_devices(model):
    meta = torch.device("meta")
    tokens, pos = torch.zeros(2, 5, dtype=torch.int64), torch.arange(5).expand(2, 5)
    _raises(lambda: model(tokens.to(meta), pos.to(meta)), "tokens", "meta", "cpu")
    _raises(lambda: model(tokens, pos.to(meta)), "segment_pos", "meta")
    _raises(lambda: model.generate(tokens.to(meta), 2), "prompt_tokens", "meta")
    cache = model.init_cache(2)
    cache.layers[1].rnn_state = cache.layers[1].rnn_state.to(meta)
    _raises(lambda: model(tokens, pos, cache), "cache.layers[1].rnn_state", "meta")
    x = torch.randn(2, 5, 8)
    _raises(lambda: kernels.rglru(x, x, x, torch.zeros(8, device=meta)), "a_param on meta", "x on cpu")
    _raises(lambda: layers.RGLRU(8, 2)(x, pos.to(meta)), "segment_pos on meta")
    _raises(lambda: kernels.samu(torch.randn(2, 5, 8), *[p.to(meta) for p in _samu_params(8)]), "meta")


def test_conversion_of_unsupported_modules():
    _raises(lambda: from_recurrentgemma(torch.nn.Linear(2, 2)), "recurrentgemma", "Linear")
    _raises(lambda: to_recurrentgemma(layers.SAMU(8)), "RG-LRU", "samu")
    _raises(lambda: to_recurrentgemma(HawkLM(HawkConfig.preset("tiny", mixer="samu"))), "samu")
    _raises(lambda: to_recurrentgemma(torch.nn.Linear(2, 2)), "Linear")
    rg = parity.load_official()
    cfg = rg.GriffinConfig(vocab_size=10, width=8, mlp_expanded_width=24, num_heads=2,
                           block_types=(rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION),
                           embeddings_scale_by_sqrt_dim=False, attention_window_size=4, logits_soft_cap=0.0)
    _raises(lambda: from_recurrentgemma(rg.Griffin(cfg, gradient_checkpointing=False)), "RECURRENT", "ATTENTION")
    cfg = cfg._replace(block_types=(rg.TemporalBlockType.RECURRENT,), logits_soft_cap=30.0)
    _raises(lambda: from_recurrentgemma(rg.Griffin(cfg, gradient_checkpointing=False)), "logits_soft_cap", "30")


def test_generate_arguments(model):
    _raises(lambda: model.generate(torch.zeros(2, 0, dtype=torch.int64), 3), "prompt_tokens", "P >= 1", "[2, 0]")
    _raises(lambda: model.generate(torch.zeros(2, 3, dtype=torch.int64), -1), "max_new_tokens", "-1")
    _raises(lambda: model.generate(torch.zeros(2, 3, dtype=torch.int64), 2, temperature=-1.0), "temperature")
