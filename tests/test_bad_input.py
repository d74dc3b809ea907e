"""Bad input raises ValueError naming the argument, what was expected and what was received."""

import types

import pytest
import torch

import kernels
from kernels import from_recurrentgemma, layers, to_recurrentgemma
import parity
from kernels.ops.checks import cu_seqlens_to_segment_pos
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
    p = list(m.step_params())
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


# --- Audit fixes: strided parameters, decode-step and scan arguments, chunk_size, cu_seqlens.


def _strided(t):
    """The values of t (a vector or more) as a non-contiguous view: every other element
    along the last dimension of a buffer twice as wide, the gaps filled with garbage."""
    buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 1e3, dtype=t.dtype)
    buf[..., ::2] = t
    v = buf[..., ::2]
    assert not v.is_contiguous() and torch.equal(v, t)
    return v


def _rglru_small(seed=0, B=2, T=11, D=8):
    torch.manual_seed(seed)
    x, gx, ga = (torch.randn(B, T, D) for _ in range(3))
    ap = layers.rnn_param_init(torch.empty(D))
    pos = torch.arange(T).repeat(B, 1)
    pos[-1, 4:] -= 4
    return x, gx, ga, ap, pos


@pytest.mark.parametrize("backend,opts", [("serial", {}), ("chunk", {"chunk_size": 8})])
def test_strided_a_param_matches_contiguous(backend, opts):
    x, gx, ga, ap, pos = _rglru_small()
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    out = []
    for strided in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, gx, ga)]
        a = (_strided(ap) if strided else ap.clone()).requires_grad_()
        y, h = kernels.rglru(*leaves, a, pos, output_final_state=True, backend=backend, **opts)
        grads = torch.autograd.grad((y * gy).sum() + h.sum(), [*leaves, a])
        assert grads[3].shape == a.shape
        out.append([y, h, *grads])
    for name, s, c in zip(["y", "h", "dx", "dgate_x", "dgate_a", "da_param"], out[1], out[0]):
        assert torch.equal(s, c), name
    # A view of a larger parameter: the gradient lands on the viewed elements only.
    base = torch.stack([ap, torch.full_like(ap, 1e3)], 1).reshape(-1).requires_grad_()
    y, h = kernels.rglru(x, gx, ga, base[::2], pos, output_final_state=True, backend=backend, **opts)
    (g,) = torch.autograd.grad((y * gy).sum() + h.sum(), [base])
    assert torch.equal(g[::2], out[0][5]) and not g[1::2].any()


def test_strided_a_param_and_reset_in_rglru_step():
    B, D, H = 3, 8, 2
    torch.manual_seed(2)
    wx, wa = (torch.randn(H, D // H, D // H) for _ in range(2))
    bx, ba = (torch.randn(H, D // H) for _ in range(2))
    ap = layers.rnn_param_init(torch.empty(D))
    x, state = torch.randn(B, D), torch.randn(B, D)
    reset = torch.tensor([True, False, False])
    reset_s = torch.tensor([True, True, False, True, False, True])[::2]
    assert not reset_s.is_contiguous() and torch.equal(reset_s, reset)
    s_c, s_s, s_r = state.clone(), state.clone(), state.clone()
    y_c = kernels.rglru_step(x, wx, bx, wa, ba, ap, s_c, reset, backend="fused")
    y_s = kernels.rglru_step(x, wx, bx, wa, ba, _strided(ap), s_s, reset_s, backend="fused")
    y_r = kernels.rglru_step(x, wx, bx, wa, ba, ap, s_r, reset, backend="reference")
    assert torch.equal(y_s, y_c) and torch.equal(s_s, s_c)
    assert parity.rel_err(y_c, y_r) <= parity.BACKEND_TOL[torch.float32]


def test_strided_samu_parameters_match_contiguous():
    torch.manual_seed(3)
    D, M = 8, 4
    p = [t.detach() for t in layers.SAMU(D).step_params()]
    ps = [_strided(t) if t.dim() == 1 else t for t in p]
    x = torch.randn(1, 6, D)
    for backend in ("serial", "chunk"):
        assert torch.equal(kernels.samu(x, *ps, backend=backend)[0], kernels.samu(x, *p, backend=backend)[0])
    xs, st = torch.randn(3, D), torch.randn(3, M, dtype=torch.complex64)
    reset_s = torch.tensor([False, True, True, True, False, False])[::2]
    s1, s2 = st.clone(), st.clone()
    y1 = kernels.samu_step(xs, *p, s1, reset_s.contiguous(), backend="fused")
    y2 = kernels.samu_step(xs, *ps, s2, reset_s, backend="fused")
    assert torch.equal(y1, y2) and torch.equal(s1, s2)


@pytest.mark.parametrize("op", ["samu", "rglru", "scan"])
@pytest.mark.parametrize("backend", ["serial", "chunk"])
def test_strided_inputs_with_gradients_match_contiguous(op, backend):
    """Strided activations and parameters give the contiguous call's output and every
    gradient bit for bit: the backward reads what the forward read, not the strided
    view's storage as if it were contiguous."""
    torch.manual_seed(4)
    B, T, D = 2, 9, 8
    if op == "samu":
        args = [torch.randn(B, T, D), *[t.detach() for t in layers.SAMU(D).step_params()]]
    elif op == "rglru":
        args = [*_rglru_small(B=B, T=T, D=D)[:4]]
    else:
        args = [torch.rand(B, T, D) * 0.5 + 0.45, torch.randn(B, T, D)]
    gy = torch.randn(B, T, D)
    out = []
    for strided in (False, True):
        leaves = [_strided(t) if strided and t.dim() else t.clone() for t in args]
        leaves = [t.requires_grad_() if t.is_floating_point() and t.dim() else t for t in leaves]
        y, _ = getattr(kernels, op)(*leaves, backend=backend)
        grads = torch.autograd.grad((y * gy).sum(), [t for t in leaves if t.requires_grad])
        out.append([y, *grads])
    assert len(out[0]) == len(out[1]) > 2
    for i, (s, c) in enumerate(zip(out[1], out[0])):
        assert torch.equal(s, c), i


def test_rglru_step_parameters():
    B, D, H, W = 2, 8, 2, 4
    x, state = torch.randn(B, D), torch.zeros(B, D)
    good = dict(gate_x_w=torch.randn(H, W, W), gate_x_b=torch.randn(H, W), gate_a_w=torch.randn(H, W, W),
                gate_a_b=torch.randn(H, W), a_param=torch.randn(D))

    def step(**kw):
        return lambda: kernels.rglru_step(x, **{**good, **kw}, state=state, backend="reference")

    step()()
    _raises(step(gate_x_w=torch.randn(H, W, W + 1)), "gate_x_w", "D = 8", "[2, 4, 5]")
    _raises(step(gate_x_w=torch.randn(4, W, W)), "gate_x_w", "D = 8", "[4, 4, 4]")
    _raises(step(gate_a_w=torch.randn(H, W, W + 1)), "gate_a_w", "[2, 4, 4]", "[2, 4, 5]")
    _raises(step(gate_a_w=torch.randn(4, 2, 2)), "gate_a_w", "[2, 4, 4]", "[4, 2, 2]")
    _raises(step(gate_x_b=torch.randn(D)), "gate_x_b", "[2, 4]", "[8]")
    _raises(step(gate_a_b=torch.randn(H, W + 1)), "gate_a_b", "[2, 4]", "[2, 5]")
    _raises(step(a_param=torch.randn(D + 1)), "a_param", "[8]", "[9]")
    _raises(step(gate_x_b=torch.zeros(H, W, dtype=torch.int64)), "gate_x_b", "int64")
    _raises(step(gate_a_w=torch.zeros(H, W, W, dtype=torch.int32)), "gate_a_w", "int32")
    _raises(step(a_param=torch.zeros(D, dtype=torch.bool)), "a_param", "bool")
    for n in good:
        _raises(step(**{n: good[n].to("meta")}), f"{n} on meta", "x on cpu")


def test_samu_step_and_samu_parameters():
    B, D, M = 2, 8, 4
    x, state = torch.randn(B, D), torch.zeros(B, M, dtype=torch.complex64)
    names = ["phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log"]
    good = dict(zip(names, [t.detach() for t in layers.SAMU(D).step_params()]))

    def step(**kw):
        return lambda: kernels.samu_step(x, **{**good, **kw}, state=state, backend="reference")

    def full(**kw):
        return lambda: kernels.samu(x[:, None], **{**good, **kw}, backend="reference")

    step()()
    step(phase_amp=0.5, radial_amp=torch.tensor([0.5]))()       # floats and one-element tensors
    full(phase_amp=0.5)()
    for call in (step, full):
        _raises(call(phase_dir=torch.randn(D)), "phase_dir", "[9]", "[8]")
        _raises(call(radial_dir=torch.randn(D + 2)), "radial_dir", "[9]", "[10]")
        _raises(call(nu_log=torch.randn(M + 1)), "nu_log", "[4]", "[5]")
        _raises(call(theta_log=torch.randn(M, 1)), "theta_log", "[4]", "[4, 1]")
        _raises(call(phase_amp=torch.randn(2)), "phase_amp", "scalar", "[2]")
        _raises(call(radial_amp="0.5"), "radial_amp", "scalar", "str")
        _raises(call(radial_amp=torch.tensor(1)), "radial_amp", "int64")
        _raises(call(nu_log=torch.zeros(M, dtype=torch.int64)), "nu_log", "int64")
        for n in names:
            _raises(call(**{n: good[n].to("meta")}), f"{n} on meta", "x on cpu")


def test_scan_dtypes():
    a, b = torch.rand(1, 3, 4), torch.randn(1, 3, 4)
    for backend in ("reference", "serial"):
        _raises(lambda: kernels.scan(a, torch.randint(0, 3, (1, 3, 4)), backend=backend), "b", "int64")
        _raises(lambda: kernels.scan(a.bool(), b, backend=backend), "a", "bool")
        _raises(lambda: kernels.scan(a.to(torch.complex64), b, backend=backend), "a", "complex64")
        _raises(lambda: kernels.scan(a, b.to(torch.complex64), backend=backend), "a", "complex", "float32")
    y, _ = kernels.scan(a.double(), b, backend="serial")              # a in another precision: cast to b's
    assert y.dtype == torch.float32
    assert torch.equal(y, kernels.scan(a, b, backend="serial")[0])


def test_chunk_size_only_for_backends_that_take_it(monkeypatch):
    x = torch.randn(1, 3, 4)
    for backend in ("reference", "assoc"):
        _raises(lambda: kernels.rglru(x, x, x, torch.zeros(4), backend=backend, chunk_size=16),
                "chunk_size", "'chunk'", repr(backend))
        _raises(lambda: kernels.scan(x.abs(), x, backend=backend, chunk_size=8), "chunk_size", repr(backend))
    assert kernels.ops.resolve("rglru", "chunk", x, 16) == ("chunk", {"chunk_size": 16})
    assert kernels.ops.resolve("samu", "serial", x, 16) == ("serial", {"chunk_size": 16})
    # "auto": a preference, dropped where the backend chosen takes none (the CPU: reference).
    assert kernels.ops.resolve("rglru", "auto", x, 16) == ("reference", {})
    kernels.rglru(x, x, x, torch.zeros(4), backend="auto", chunk_size=16)
    monkeypatch.delenv("KERNELS_TUNING_TABLE", raising=False)
    kernels.ops.tuning.env_table.cache_clear()
    fake = types.SimpleNamespace(device=torch.device("cuda"), shape=(1, 3, 4), dtype=torch.float32)
    assert kernels.ops.resolve("samu", "auto", fake, 16) == ("chunk", {"chunk_size": 16})
    # a Backend's own chunk_size, overridden by the call's
    assert kernels.ops.resolve("rglru", kernels.Backend("chunk", chunk_size=8, block_d=16), x) == \
        ("chunk", {"chunk_size": 8, "block_d": 16})
    assert kernels.ops.resolve("rglru", kernels.Backend("chunk", chunk_size=8), x, 16) == ("chunk", {"chunk_size": 16})


def test_backend_values_and_tuning_tables(tmp_path, monkeypatch):
    _raises(lambda: kernels.Backend("chunk", table=kernels.TuningTable.from_dict({"schema": 1})), "table", "auto")
    _raises(lambda: kernels.Backend("auto", chunk_size=8), "no launcher options", "auto")
    _raises(lambda: kernels.rglru(*_rglru_small()[:4], backend=3), "backend", "kernels.Backend", "int")
    _raises(lambda: kernels.TuningTable.from_dict({"schema": 2}), "schema 1")
    _raises(lambda: kernels.TuningTable.from_dict({"schema": 1, "entries": [{"op": "rglru"}]}), "lacking")
    assert kernels.Backend("serial") == "serial" and kernels.Backend("serial", chunk_size=8) != "serial"
    assert hash(kernels.Backend("serial", chunk_size=8)) == hash(kernels.Backend("serial", chunk_size=8))
    # the environment variable names a file that must exist (read once, on the first "auto" on a GPU)
    monkeypatch.setenv("KERNELS_TUNING_TABLE", str(tmp_path / "missing.json"))
    kernels.ops.tuning.env_table.cache_clear()
    _raises(kernels.ops.tuning.env_table, "KERNELS_TUNING_TABLE", "missing.json")
    monkeypatch.delenv("KERNELS_TUNING_TABLE")
    kernels.ops.tuning.env_table.cache_clear()
    # a Backend's options reach the launcher: serial with an unknown option is refused there
    x, gx, ga, ap, _ = _rglru_small()
    _raises(lambda: kernels.rglru(x, gx, ga, ap, backend=kernels.Backend("serial", tile=3)), "serial options", "tile")
    y = kernels.rglru(x, gx, ga, ap, backend=kernels.Backend("serial", time_warps=1, chunk_size=8))[0]
    assert parity.rel_err(y, kernels.rglru(x, gx, ga, ap, backend="reference")[0]) <= parity.BACKEND_TOL[torch.float32]


def test_cu_seqlens_against_hand_written_segment_pos():
    T = 10
    cu = torch.tensor([0, 3, 3, 7, 10])                    # an empty sequence at 3
    want = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]], dtype=torch.int32)
    got = cu_seqlens_to_segment_pos(cu, 1, T)
    assert got.dtype == torch.int32 and got.device == cu.device and torch.equal(got, want)
    assert torch.equal(cu_seqlens_to_segment_pos(torch.tensor([0, 0, T], dtype=torch.int32), 1, T),
                       torch.arange(T, dtype=torch.int32)[None])
    assert torch.equal(cu_seqlens_to_segment_pos(torch.tensor([0, 1, 2]), 1, 2), torch.zeros(1, 2, dtype=torch.int32))
    x, gx, ga, ap, _ = _rglru_small(B=1, T=T)
    ys = [kernels.rglru(x, gx, ga, ap, cu_seqlens=cu, backend="reference")[0],
          kernels.rglru(x, gx, ga, ap, cu_seqlens=cu, backend="serial")[0]]
    y_ref = kernels.rglru(x, gx, ga, ap, want, backend="reference")[0]
    assert torch.equal(ys[0], y_ref) and parity.rel_err(ys[1], y_ref) <= parity.BACKEND_TOL[torch.float32]


def test_cu_seqlens_validation_and_device():
    x = torch.randn(1, 6, 4)
    ap = torch.zeros(4)

    def run(cu, xx=x):
        return lambda: kernels.rglru(xx, xx, xx, ap, cu_seqlens=cu, backend="reference")

    _raises(run(torch.tensor([0, 4, 2, 6])), "cu_seqlens", "increasing", "[0, 4, 2, 6]")
    _raises(run(torch.tensor([1, 6])), "cu_seqlens", "from 0", "[1, 6]")
    _raises(run(torch.tensor([0, 5])), "cu_seqlens", "T = 6", "[0, 5]")
    _raises(run(torch.tensor([0])), "cu_seqlens", "[0]")
    _raises(run(torch.tensor([0.0, 6.0])), "cu_seqlens", "integer", "float32")
    _raises(run(torch.tensor([True, False])), "cu_seqlens", "bool")
    _raises(run(torch.tensor([[0, 6]])), "cu_seqlens", "1 dimensions", "[1, 2]")
    _raises(run(torch.tensor([0, 6]), torch.randn(2, 6, 4)), "batch size 1", "B = 2")
    _raises(run(torch.tensor([0, 6], device="meta")), "cu_seqlens on meta", "x on cpu")
    _raises(lambda: kernels.scan(x, x, cu_seqlens=torch.tensor([0, 6], device="meta")), "cu_seqlens on meta")
    _raises(lambda: kernels.samu(x, *_samu_params(4), cu_seqlens=torch.tensor([0, 6], device="meta")),
            "cu_seqlens on meta")


# --- Audit 2: double backward, zero width, conjugate complex states.


@pytest.mark.parametrize("op,backend", [("rglru", "serial"), ("rglru", "chunk"), ("scan", "serial"),
                                        ("scan", "chunk"), ("samu", "serial"), ("samu", "chunk")])
def test_double_backward_raises_instead_of_dropping_terms(op, backend):
    # The Triton backwards are not differentiable: a second-order term (a gradient
    # penalty) must raise, not vanish silently from the loss (reference: differentiable).
    torch.manual_seed(4)
    x = torch.randn(1, 4, 4, requires_grad=True)
    if op == "rglru":
        y, _ = kernels.rglru(x, torch.randn(1, 4, 4), torch.randn(1, 4, 4), torch.zeros(4), backend=backend)
    elif op == "scan":
        y, _ = kernels.scan(torch.rand(1, 4, 4), x, backend=backend)
    else:
        y, _ = kernels.samu(x, *[t.detach() for t in layers.SAMU(4).step_params()], backend=backend)
    _raises(lambda: torch.autograd.grad((y ** 2).sum(), x, create_graph=True), "create_graph", "reference")
    _raises(lambda: (y ** 2).sum().backward(create_graph=True), "create_graph")
    (g,) = torch.autograd.grad((y ** 2).sum(), x)                     # first order: unchanged
    assert g.shape == x.shape and not g.requires_grad


@pytest.mark.parametrize("backend", ["serial", "chunk"])
def test_zero_width(backend):
    x = torch.randn(2, 3, 0, requires_grad=True)
    ap = torch.zeros(0, requires_grad=True)
    y, h = kernels.rglru(x, x, x, ap, initial_state=torch.zeros(2, 0), output_final_state=True, backend=backend)
    gx, gap = torch.autograd.grad(y.sum() + h.sum(), [x, ap])
    assert y.shape == (2, 3, 0) and h.shape == (2, 0) and gx.shape == x.shape and gap.shape == (0,)
    y, _ = kernels.scan(x, x, backend=backend)
    assert torch.autograd.grad(y.sum(), x)[0].shape == x.shape
    empty = torch.zeros(0)
    _raises(lambda: kernels.samu(torch.randn(2, 3, 0), torch.zeros(1), torch.zeros(1), 0.5, 0.5, empty, empty,
                                 backend=backend), "x", "D even", "[2, 3, 0]")
    _raises(lambda: kernels.samu_step(torch.randn(2, 0), torch.zeros(1), torch.zeros(1), 0.5, 0.5, empty, empty,
                                      torch.zeros(2, 0, dtype=torch.complex64)), "x", "even", "[2, 0]")


def test_conjugate_complex_states_for_samu():
    torch.manual_seed(5)
    p = [t.detach() for t in layers.SAMU(4).step_params()]
    x = torch.randn(2, 3, 4)
    h0 = torch.randn(2, 2, dtype=torch.complex64)
    assert h0.conj().is_conj()
    for backend in ("reference", "serial", "chunk"):
        y, h = kernels.samu(x, *p, initial_state=h0.conj(), output_final_state=True, backend=backend)
        y_c, h_c = kernels.samu(x, *p, initial_state=h0.conj().resolve_conj(), output_final_state=True,
                                backend=backend)
        assert torch.equal(y, y_c) and torch.equal(h, h_c), backend
    # The decode state is updated in place: a conjugate view cannot be, so it is rejected.
    for backend in ("fused", "row", "blocked"):
        _raises(lambda: kernels.samu_step(x[:, 0], *p, h0.clone().conj(), backend=backend), "state", "conj")


def test_python_float_amplitudes_keep_float64():
    """A python float amplitude is taken in the computation's precision: in float64 the
    result equals that of the same amplitude as a float64 tensor (0.3 is not a float32)."""
    torch.manual_seed(6)
    pd, rd, _, _, nu, th = [t.detach().double() for t in layers.SAMU(6).step_params()]
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    amp, amp_t = 0.3, torch.tensor(0.3, dtype=torch.float64)
    for backend in ("reference", "serial", "chunk"):
        y, h = kernels.samu(x, pd, rd, amp, amp, nu, th, output_final_state=True, backend=backend)
        y_t, h_t = kernels.samu(x, pd, rd, amp_t, amp_t, nu, th, output_final_state=True, backend=backend)
        assert torch.equal(y, y_t) and torch.equal(h, h_t), backend
    for backend in ("reference", "row", "blocked"):
        s, s_t = torch.zeros(2, 3, dtype=torch.complex128), torch.zeros(2, 3, dtype=torch.complex128)
        y = kernels.samu_step(x[:, 0], pd, rd, amp, amp, nu, th, s, backend=backend)
        y_t = kernels.samu_step(x[:, 0], pd, rd, amp_t, amp_t, nu, th, s_t, backend=backend)
        assert torch.equal(y, y_t) and torch.equal(s, s_t), backend


# --- Edges: gradients through decode steps, long memory, conjugate cotangents, model arguments.


def _step_inputs(op, B=3, D=8, H=2):
    """Keyword inputs of one decode step (every tensor a leaf that does not require grad)."""
    torch.manual_seed(7)
    x = torch.randn(B, D)
    if op == "rglru":
        W = D // H
        return dict(x=x, gate_x_w=torch.randn(H, W, W), gate_x_b=torch.randn(H, W), gate_a_w=torch.randn(H, W, W),
                    gate_a_b=torch.randn(H, W), a_param=layers.rnn_param_init(torch.empty(D)),
                    state=torch.randn(B, D))
    names = ["phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log"]
    p = dict(zip(names, [t.detach() for t in layers.SAMU(D).step_params()]))
    return dict(x=x, **p, state=torch.randn(B, D // 2, dtype=torch.complex64))


STEP_FNS = {"rglru": kernels.rglru_step, "samu": kernels.samu_step}


@pytest.mark.parametrize("op,backend", [("rglru", "fused"), ("samu", "fused"), ("samu", "row"), ("samu", "blocked")])
def test_triton_decode_steps_refuse_inputs_that_require_grad(op, backend):
    # The Triton steps have no backward: an input that requires grad under grad mode
    # raises (its gradient would silently stay None); under no_grad the step runs.
    good = _step_inputs(op)
    want_state = good["state"].clone()
    want = STEP_FNS[op](**{**good, "state": want_state}, backend=backend)
    for n, t in good.items():
        if not (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())):
            continue
        inputs = {**good, "state": good["state"].clone(), n: t.clone().requires_grad_()}
        _raises(lambda: STEP_FNS[op](**inputs, backend=backend), n, "requires_grad", "no_grad", "reference")
        with torch.no_grad():
            y = STEP_FNS[op](**inputs, backend=backend)
        assert torch.equal(y, want) and not y.requires_grad, n
        assert torch.equal(inputs["state"], want_state), n


@pytest.mark.parametrize("mixer,backend", [("rglru", "fused"), ("samu", "fused"), ("samu", "row"),
                                           ("samu", "blocked")])
def test_hawk_step_with_a_triton_step_refuses_gradients(mixer, backend):
    torch.manual_seed(8)
    m = HawkLM(HawkConfig.preset("tiny", mixer=mixer)).set_backend("reference", backend)
    tokens, pos = torch.tensor([1, 2]), torch.tensor([0, 3])
    cache = m.init_cache(2)
    _raises(lambda: m.step(tokens, pos, cache), "requires_grad", "no_grad")
    with torch.no_grad():
        got = m.step(tokens, pos, cache)
        want = m.set_backend("reference", "reference").step(tokens, pos, m.init_cache(2))
    assert parity.rel_err(got, want) <= parity.BACKEND_TOL[torch.float32]


def _rglru_outputs(fn, inputs, grad=True):
    """y, the final state and (grad) the gradients of x, gate_x, gate_a, a_param of a
    fixed random projection of both."""
    leaves = [t.clone().requires_grad_(grad) for t in inputs]
    with torch.set_grad_enabled(grad):
        y, h = fn(*leaves, None, None, True)
    if not grad:
        return [y, h]
    g = torch.Generator().manual_seed(1)
    wy, wh = (torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype) for t in (y, h))
    return [y, h, *torch.autograd.grad((y * wy).sum() + (h * wh).sum(), leaves)]


@pytest.mark.parametrize("a_param", [-10.0, -12.0])
def test_long_memory_precision_of_every_rglru_backend(a_param):
    check_long_memory_precision(a_param, "cpu")


def check_long_memory_precision(a_param, device):
    """a_param -10 / -12: a = exp(-8 sigmoid(gate_a) softplus(a_param)) within ~1e-4 of 1,
    where 1 - a^2 from the rounded a keeps few digits. FP32 kernels stay within 2x of the
    FP32 reference's own error (both against float64) in y, h and every gradient, and in
    the decode step (test_rglru_gpu runs this on the GPU)."""
    torch.manual_seed(9)
    B, T, D = 2, 21, 12
    inputs = [torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(B, T, D), torch.full((D,), a_param)]
    inputs = [t.to(device) for t in inputs]
    names = ["y", "h", "dx", "dgate_x", "dgate_a", "da_param"]
    fns = kernels.backends("rglru")
    for grad in (True, False):                 # without gradient serial runs other (tile) kernels
        want = _rglru_outputs(fns["reference"], [t.double() for t in inputs], grad)
        ref = [parity.rel_err(g, w) for g, w in zip(_rglru_outputs(fns["reference"], inputs, grad), want)]
        for backend in ("serial", "chunk"):
            got = _rglru_outputs(fns[backend], inputs, grad)
            for n, g, w, r in zip(names, got, want, ref):
                assert parity.rel_err(g, w) <= 2 * r, (backend, grad, n, parity.rel_err(g, w), r)
    # The decode step's multiplier sqrt(1 - a^2).
    s = {n: t.to(device) for n, t in _step_inputs("rglru", B=2, D=12).items()}
    s["a_param"] = torch.full((12,), a_param, device=device)
    s64 = {n: t.double() for n, t in s.items()}
    want = kernels.rglru_step(**s64, backend="reference")
    ref = parity.rel_err(kernels.rglru_step(**{**s, "state": s["state"].clone()}, backend="reference"), want)
    got = kernels.rglru_step(**{**s, "state": s["state"].clone()}, backend="fused")
    assert parity.rel_err(got, want) <= 2 * ref, (parity.rel_err(got, want), ref)


@pytest.mark.parametrize("backend", ["reference", "serial", "chunk"])
def test_samu_gradient_through_the_conjugate_final_state(backend):
    torch.manual_seed(10)
    p = [t.detach() for t in layers.SAMU(4).step_params()]
    x = torch.randn(2, 5, 4, requires_grad=True)
    w = torch.randn(2, 2, dtype=torch.complex64)
    h0 = torch.randn(2, 2, dtype=torch.complex64, requires_grad=True)
    grads = []
    for conj in (True, False):
        _, h = kernels.samu(x, *p, initial_state=h0, output_final_state=True, backend=backend)
        # Re(conj(h) w) = Re(h conj(w)): the same loss with and without a pending conjugation.
        loss = (h.conj() * w).real.sum() if conj else (h * w.conj()).real.sum()
        grads.append(torch.autograd.grad(loss, [x, h0]))
    for g, g_plain in zip(*grads):
        assert torch.allclose(g, g_plain, rtol=1e-6, atol=1e-7)
    _, h = kernels.samu(x, *p, initial_state=h0, output_final_state=True, backend=backend)
    torch.autograd.grad(h.conj().real.sum() + (h.conj() * w).imag.sum(), [x, h0])


def test_chunk_size_one_range_checked_once():
    x = torch.randn(1, 8, 4)
    xg = x.clone().requires_grad_()
    p = _samu_params(4)
    for backend in ("serial", "chunk"):
        for cs in (12, 128, 4, 0, -8, 8.0, True, "16", None.__class__):
            for call in (lambda: kernels.rglru(x, x, x, torch.zeros(4), backend=backend, chunk_size=cs),
                         lambda: kernels.rglru(xg, x, x, torch.zeros(4), backend=backend, chunk_size=cs),
                         lambda: kernels.scan(x.abs(), x, backend=backend, chunk_size=cs),
                         lambda: kernels.samu(x, *p, backend=backend, chunk_size=cs),
                         lambda: kernels.rglru(x, x, x, torch.zeros(4), backend="auto", chunk_size=cs)):
                msg = _raises(call, "chunk_size", "[8, 16, 32, 64]", repr(cs))
                assert "block_t" not in msg
        # one range with and without gradients (serial runs other kernels without)
        y = kernels.rglru(x, x, x, torch.zeros(4), backend=backend, chunk_size=8)[0]
        yg = kernels.rglru(xg, x, x, torch.zeros(4), backend=backend, chunk_size=8)[0]
        assert parity.rel_err(yg, y) <= parity.BACKEND_TOL[torch.float32]
        assert torch.autograd.grad(yg.sum(), xg)[0].shape == x.shape
    # launchers called directly: the same check
    for fn in (kernels.backends("rglru")["serial"], kernels.backends("samu")["chunk"]):
        args = (x, x, x, torch.zeros(4)) if fn is kernels.backends("rglru")["serial"] else (x, *p)
        _raises(lambda: fn(*args, chunk_size=16.0), "chunk_size", "16.0")
        # after a valid call of equal hash: the launch configuration's cache keeps types
        fn(*args, chunk_size=16)
        _raises(lambda: fn(*args, chunk_size=16.0), "chunk_size", "16.0")
        fn(*args, chunk_size=8)
        _raises(lambda: fn(*args, chunk_size=8.0), "chunk_size", "8.0")


def test_hawk_token_arguments(model):
    V = model.config.vocab_size
    tokens, pos = torch.zeros(2, 5, dtype=torch.int64), torch.arange(5).expand(2, 5)
    cache = model.init_cache(2)
    for bad, lo, hi in ((tokens + V, V, V), (tokens - 1, -1, -1)):
        bad = bad.clone()
        bad[0, 0] = 0
        _raises(lambda: model(bad, pos), "tokens", f"[0, {V})", f"{lo}", f"{hi}")
        _raises(lambda: model.step(bad[:, 1], pos[:, 1], cache), "tokens", f"[0, {V})")
    for dt in (torch.uint8, torch.int16, torch.int8):
        _raises(lambda: model(tokens.to(dt), pos), "tokens", "int64", str(dt))
        _raises(lambda: model.step(tokens[:, 0].to(dt), pos[:, 0], cache), "tokens", str(dt))
    model(tokens.int(), pos.int())                                      # int32 is taken
    _raises(lambda: model(tokens, None), "segment_pos", "None")
    _raises(lambda: model.step(tokens[:, 0], None, cache), "segment_pos", "None")
    _raises(lambda: model(tokens[:, :0], pos[:, :0]), "tokens", "T >= 1", "[2, 0]")
    _raises(lambda: model("ab", pos), "tokens", "Tensor", "str")


def test_engine_prompts_that_are_not_token_ids(model):
    from kernels.models.generation import Engine

    eng = Engine(model, kernels="model")
    _raises(lambda: eng.generate(["ab"], 3), "prompt 0", "integer token ids", "'ab'")
    _raises(lambda: eng.generate([[1, 2], "ab"], 3), "prompt 1", "'ab'")
    _raises(lambda: eng.generate([[1, 2]], 3, stop_tokens="x"), "stop_tokens", "'x'")
    assert eng.generate([[1, 2]], 2).shape == (1, 2)
