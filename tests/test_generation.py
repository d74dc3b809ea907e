"""Generation engine on the CPU: prefill + decode logits equal a full forward (both
mixers, left-padded prompts, empty prompts), rows of different prompt lengths do not
affect each other, the fused step kernels (Triton interpreter) equal the layers'
decode path, stop tokens, sampling, the streaming iterator, the command line and
bad input. Graph replay is covered by test_generation_gpu.py."""

import copy
import json

import pytest
import torch

from kernels import generate, layers, to_recurrentgemma
from kernels.ops.geglu import geglu
from kernels.ops.triton_utils import poisoned
import parity
from kernels.models import HawkConfig, HawkLM
from kernels.models.generation import Engine
from kernels.models import decode as dk

V = 256
# Few, large tiles: the interpreter pays per program.
BIG_TILES = {k: {"BN": 128, "BK": 128, "num_warps": 4, "num_stages": 1} for k in ("xy", "out", "up", "down", "logits")}


def _model(mixer, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = HawkLM(HawkConfig.preset("tiny", mixer=mixer), backend="reference", dtype=dtype).eval()
    with torch.no_grad():   # biases and norm scales start at zero; exercise them
        for n, p in m.named_parameters():
            if n.endswith("bias") or n.endswith(".b") or n.endswith("scale"):
                p.normal_(std=0.1)
    return m


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g) for n in lengths]


def _decode(engine, prompts, n, **kw):
    steps = list(engine.stream(prompts, n, with_logits=True, **kw))
    return torch.stack([t for t, _ in steps], 1), torch.stack([lg for _, lg in steps], 1)


def _assert_full_forward(m, prompts, toks, logits, **tol):
    """Each row's decoded logits and tokens equal the full forward of prompt + tokens."""
    n_new = toks.shape[1]
    for b, p in enumerate(prompts):
        seq = torch.cat([p, toks[b]])[None]
        with torch.no_grad():
            full, _ = m(seq, torch.arange(seq.shape[1])[None])
        n = len(p)
        torch.testing.assert_close(logits[b], full[0, n - 1: n - 1 + n_new], **tol)
        assert torch.equal(toks[b], full[0, n - 1: n - 1 + n_new].argmax(-1))


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_prefill_and_decode_equal_full_forward(mixer):
    m = _model(mixer)
    prompts = _prompts([6, 1, 3, 9])
    eng = Engine(m, kernels="model", prefill_chunk=4)     # prefill in chunks, left padding
    toks, logits = _decode(eng, prompts, 5)
    _assert_full_forward(m, prompts, toks, logits, rtol=1e-12, atol=1e-12)
    # Empty prompts: decoding starts from BOS at position 0.
    toks0, logits0 = _decode(eng, None, 4, batch_size=2)
    seq = torch.cat([torch.full((2, 1), eng.bos_id), toks0[:, :-1]], 1)
    with torch.no_grad():
        full, _ = m(seq, torch.arange(4).expand(2, 4))
    torch.testing.assert_close(logits0, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer,backend", [("rglru", "chunk"), ("samu", "serial")])
def test_triton_prefill_and_step_equal_full_forward_fp32(mixer, backend):
    """The same check in FP32 through the Triton prefill and decode kernels (interpreter):
    the model's mixers run `backend` for the prompt and the "fused" step kernel."""
    m = _model(mixer, dtype=torch.float32)
    prompts = _prompts([5, 1, 3])
    m.set_backend(backend, step_backend="fused")
    toks, logits = _decode(Engine(m, kernels="model", prefill_chunk=3), prompts, 3)
    m.set_backend("reference")
    _assert_full_forward(m, prompts, toks, logits)


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_rows_with_different_prompt_lengths_are_independent(mixer):
    m = _model(mixer)
    prompts = _prompts([7, 2, 4])
    eng = Engine(m, kernels="model")
    toks, logits = _decode(eng, prompts, 4)
    for b, p in enumerate(prompts):
        t1, l1 = _decode(eng, [p], 4)
        assert torch.equal(t1[0], toks[b])
        torch.testing.assert_close(l1[0], logits[b], rtol=1e-12, atol=1e-12)
    # What fills the left padding cannot matter, bit for bit.
    lengths = torch.tensor([len(p) for p in prompts])
    for fill in (0, 1):
        g = torch.Generator().manual_seed(fill)
        padded = torch.randint(0, V, (3, 7), generator=g)
        for b, p in enumerate(prompts):
            padded[b, 7 - len(p):] = p
        t2, l2 = _decode(eng, padded, 4, lengths=lengths)
        assert torch.equal(t2, toks) and torch.equal(l2, logits)


@pytest.mark.parametrize("mixer,kernels", [("rglru", "gemm"), ("samu", "gemm"), ("samu", "fused")])
def test_fused_step_kernels_equal_the_layers(mixer, kernels):
    m = _model(mixer, dtype=torch.float32)
    prompts = _prompts([5, 1, 3])
    want_t, want_l = _decode(Engine(m, kernels="model"), prompts, 3, stop_tokens=[7])
    eng = Engine(m, kernels=kernels, linear_configs=BIG_TILES)
    got_t, got_l = _decode(eng, prompts, 3, stop_tokens=[7])
    assert torch.equal(got_t, want_t)
    torch.testing.assert_close(got_l, want_l)
    assert eng.describe()["kernels"] == kernels


def test_samu_steps_read_mode_tables_refreshed_at_every_start(monkeypatch):
    """With Triton SAMU steps the engine hands each layer its mode table: tokens and
    logits equal bit for bit those of steps that recompute the constants, and a
    parameter changed behind autograd's back (`.data`, no version bump) between two
    batches is seen by the next one."""
    m = _model("samu", dtype=torch.float32)
    m.set_backend("reference", step_backend="fused")
    prompts = _prompts([4, 2])
    eng = Engine(m, kernels="gemm", linear_configs=BIG_TILES)
    got = _decode(eng, prompts, 3)
    assert all("modes" in kw for kw in eng._step_kw)
    with monkeypatch.context() as mp:
        mp.setattr(layers.SAMU, "decode_modes", lambda self, dtype: None)
        want = _decode(Engine(m, kernels="gemm", linear_configs=BIG_TILES), prompts, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for blk in m.blocks:
        blk.recurrent_block.mixer.nu_log.data.add_(0.5)
    again = _decode(eng, prompts, 3)
    fresh = _decode(Engine(m, kernels="gemm", linear_configs=BIG_TILES), prompts, 3)
    assert torch.equal(again[1], fresh[1]) and not torch.equal(again[1], got[1])


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_row_kernels(dtype):
    torch.manual_seed(0)
    M, D, E, Fw = 3, 40, 36, 50
    norm = layers.RMSNorm(D, dtype=dtype)
    norm.scale.data.normal_()
    table = torch.randn(17, D).to(dtype)
    tok = torch.tensor([3, 16, 0])
    x, xn = dk.embed_rmsnorm(tok, table, norm.scale, norm.eps, _poisoned((M, D), dtype), _poisoned((M, D), dtype))
    assert torch.equal(x, table[tok])
    torch.testing.assert_close(xn, norm(table[tok]))
    h, x0 = torch.randn(M, D).to(dtype), torch.randn(M, D).to(dtype)
    x1 = x0.clone()
    xn = dk.add_rmsnorm(h, x1, norm.scale, norm.eps, _poisoned((M, D), dtype))
    assert torch.equal(x1, h + x0)
    torch.testing.assert_close(xn, norm(h + x0))
    conv = layers.Conv1D(E, dtype=dtype)
    conv.b.data.normal_()
    wide = torch.randn(M, 3 * E).to(dtype)
    xin = wide[:, E: 2 * E]                                   # a strided view
    st = torch.randn(M, 3, E).to(dtype)
    st_ref = st.clone()
    reset = torch.tensor([False, True, False])
    y = dk.conv_step(xin, st, conv.w, conv.b, reset, y=_poisoned((M, E), dtype))
    torch.testing.assert_close(y, conv.step(xin.contiguous(), st_ref, reset))
    assert torch.equal(st, st_ref)
    u = torch.randn(M, 2 * Fw).to(dtype)
    with poisoned():      # the "fused" step's gated GeLU: the training op's forward
        g = geglu(u)
    torch.testing.assert_close(g, layers.gelu(u[:, :Fw]) * u[:, Fw:])


def _judge(got, run):
    """FP32: close to the eager computation. BF16: error against float64 at most
    LOWP_FACTOR times the error of the eager BF16 computation (both max-norm relative),
    never below BF16's epsilon. run(dtype) computes the eager result in dtype."""
    eager = run(got.dtype)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, eager)
        return
    want = run(torch.float64)
    err, err_pt = parity.rel_err(got, want), parity.rel_err(eager, want)
    assert err <= max(parity.LOWP_FACTOR * err_pt, torch.finfo(got.dtype).eps), (err, err_pt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_streaming_linear(dtype):
    torch.manual_seed(1)
    M, D, E, Fw = 5, 48, 40, 36
    cfg = {"BN": 16, "BK": 32, "num_warps": 4, "num_stages": 1}     # several column and k blocks
    mods = torch.nn.ModuleDict({"norm": layers.RMSNorm(D), "ly": torch.nn.Linear(D, E), "lx": torch.nn.Linear(D, E),
                                "lo": torch.nn.Linear(E, D), "up": torch.nn.Linear(D, 2 * Fw),
                                "conv": layers.Conv1D(E)}).to(dtype)
    with torch.no_grad():
        for n, p in mods.named_parameters():
            if "bias" in n or "scale" in n or n.endswith(".b"):
                p.normal_()
    x, a, a2, res = (torch.randn(M, D).to(dtype), torch.randn(M, E).to(dtype), torch.randn(M, E).to(dtype),
                     torch.randn(M, D).to(dtype))
    st = torch.randn(M, 3, E).to(dtype)
    reset = torch.tensor([True, False, False, True, False])

    def eager(dt, part):
        md = {k: copy.deepcopy(v).to(dt) for k, v in mods.items()}   # Module.to works in place
        n = md["norm"](x.to(dt))
        if part == "y":
            return layers.gelu(md["ly"](n))
        if part in ("conv", "state"):
            s = st.to(dt).clone()
            y = md["conv"].step(md["lx"](n), s, reset)
            return y if part == "conv" else s
        if part == "out":
            return md["lo"](a.to(dt) * a2.to(dt)) + res.to(dt)
        if part == "gated":
            u = md["up"](n)
            return layers.gelu(u[:, :Fw]) * u[:, Fw:]
        return x[:, :E].to(dt) @ md["lo"].weight.T

    m = mods
    st_k = st.clone()
    gy, xc = dk.linear(x, m["ly"].weight, m["ly"].bias, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                       eps=m["norm"].eps, epilogue=dk.EPI_XY, w2=m["lx"].weight, bias2=m["lx"].bias,
                       conv=(st_k, m["conv"].w, m["conv"].b), reset=reset, out=_poisoned((M, E), dtype),
                       out2=_poisoned((M, E), dtype), config=cfg)
    _judge(gy, lambda dt: eager(dt, "y"))
    _judge(xc, lambda dt: eager(dt, "conv"))
    _judge(st_k, lambda dt: eager(dt, "state"))
    r = res.clone()
    out = dk.linear(a, m["lo"].weight, m["lo"].bias, prologue=dk.PRO_MUL, a2=a2, epilogue=dk.EPI_RESIDUAL,
                    residual=r, config=cfg)
    assert out.data_ptr() == r.data_ptr()
    _judge(r, lambda dt: eager(dt, "out"))
    got = dk.linear(x, m["up"].weight, m["up"].bias, prologue=dk.PRO_NORM, norm_scale=m["norm"].scale,
                    eps=m["norm"].eps, epilogue=dk.EPI_GATED, out=_poisoned((M, Fw), dtype), config=cfg)
    _judge(got, lambda dt: eager(dt, "gated"))
    got = dk.linear(x[:, :E], m["lo"].weight, None, out=_poisoned((M, D), dtype), config=cfg)   # strided a
    _judge(got, lambda dt: eager(dt, "plain"))


def test_advance():
    nxt = torch.tensor([5, 7, 9, 7])
    tokens = torch.zeros(4, dtype=torch.int64)
    pos = torch.tensor([-1, 0, 4, 2])
    reset = torch.ones(4, dtype=torch.bool)
    done = torch.tensor([False, False, True, False])
    stops = torch.full((dk.MAX_STOP_TOKENS,), -1)
    stops[3] = 7
    dk.advance(nxt, tokens, pos, reset, done, stops, pad_id=1)
    assert tokens.tolist() == [5, 7, 1, 7]
    assert done.tolist() == [False, True, True, True]
    assert pos.tolist() == [0, 1, 5, 3]
    assert reset.tolist() == [True, False, False, False]


def test_stop_tokens_and_stream():
    m = _model("rglru")
    prompts = _prompts([3, 5])
    eng = Engine(m, kernels="model", pad_id=0)
    free = eng.generate(prompts, 12)
    stop = int(free[0, 2])
    assert stop not in free[1].tolist()           # row 1 never stops
    got = eng.generate(prompts, 12, stop_tokens=[stop])
    first = free[0].tolist().index(stop)
    assert torch.equal(got[0, : first + 1], free[0, : first + 1])
    assert (got[0, first + 1:] == 0).all()
    assert torch.equal(got[1], free[1])
    # The iterator ends once every row has stopped (checked every sync_every steps).
    both = [int(free[0, 2]), int(free[1, 1])]
    steps = list(eng.stream(prompts, 12, stop_tokens=both, sync_every=4))
    assert len(steps) == 4
    assert bool(eng.done.all())


def test_sampling_temperature_top_k():
    m = _model("samu", dtype=torch.float32)
    prompts = _prompts([4, 2])
    eng = Engine(m, kernels="model")
    greedy = eng.generate(prompts, 5)
    assert torch.equal(eng.generate(prompts, 5, temperature=0.7, top_k=1), greedy)
    a = eng.generate(prompts, 6, temperature=1.5, generator=torch.Generator().manual_seed(3))
    b = eng.generate(prompts, 6, temperature=1.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    toks, logits = _decode(eng, prompts, 6, temperature=5.0, top_k=3, generator=torch.Generator().manual_seed(4))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == toks[..., None]).any(-1).all()
    assert not torch.equal(toks, logits.argmax(-1))   # at temperature 5 some choice is not the argmax


def test_empty_prompts_and_stop_token_containers():
    m = _model("rglru")
    eng = Engine(m, kernels="model")
    p = _prompts([3])[0]
    # An empty row of a list is the prompt [bos_id]; so is a row of lengths 0.
    mixed = eng.generate([p, []], 4)
    assert torch.equal(mixed[0], eng.generate([p], 4)[0])
    assert torch.equal(mixed[1], eng.generate(batch_size=1, max_new_tokens=4)[0])
    assert torch.equal(mixed[1], eng.generate([[eng.bos_id]], 4)[0])
    padded = torch.cat([torch.full((1, 3), 9), p[None]])
    user = padded.clone()
    got = eng.generate(padded, 4, lengths=[0, 3])
    assert torch.equal(got[0], mixed[1]) and torch.equal(got[1], mixed[0])
    assert torch.equal(padded, user)                   # the caller's tensor is left alone
    # Stop tokens as a list, a tensor or a numpy array stop the same rows.
    free = eng.generate([p], 8)
    stop = int(free[0, 2])
    want = eng.generate([p], 8, stop_tokens=[stop])
    for stops in (torch.tensor([stop]), torch.tensor([stop]).numpy(), (stop,)):
        assert torch.equal(eng.generate([p], 8, stop_tokens=stops), want)
    assert (want[0, 3:] == eng.pad_id).all() and torch.equal(want[0, :3], free[0, :3])


def test_small_temperature_is_greedy():
    m = _model("samu", dtype=torch.float32)
    prompts = _prompts([4, 2])
    eng = Engine(m, kernels="model")
    greedy = eng.generate(prompts, 5)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(eng.generate(prompts, 5, temperature=1e-6, generator=g), greedy)
    assert torch.equal(eng.generate(prompts, 5, temperature=0.5, top_k=torch.tensor(1).numpy(), generator=g),
                       greedy)


def test_start_and_step():
    m = _model("rglru")
    eng = Engine(m, kernels="model")
    eng.start(batch_size=2)
    first = eng.step().clone()
    assert first.shape == (2,) and eng.cache.batch_size == 2
    eng.start(torch.randint(0, V, (2, 3)))
    assert eng.step().shape == (2,)


def test_command_line_and_checkpoints(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    m = HawkLM(HawkConfig.preset("tiny"), dtype=torch.float32)
    torch.save(to_recurrentgemma(m).state_dict(), tmp_path / "official.pt")
    torch.save(m.state_dict(), tmp_path / "ours.pt")
    args = ["--dtype", "fp32", "--batch", "2", "--prompt-len", "3", "--new-tokens", "3", "--kernels", "model",
            "--device", "cpu"]
    r_off = generate.main(["--checkpoint", str(tmp_path / "official.pt"), *args])
    r_ours = generate.main(["--checkpoint", str(tmp_path / "ours.pt"), *args])
    r_rand = generate.main(args)                  # seed 0: the same random weights as m
    out = capsys.readouterr().out
    assert "ms/step" in out and "tokens/s" in out
    rows = [line for line in out.splitlines() if line.startswith("row 0:")]
    assert len(rows) == 3 and rows[0] == rows[1] == rows[2]
    assert r_off["ms_per_step"] > 0 and r_ours["mixer"] == r_rand["mixer"] == "rglru"
    # the same generation 1 + RUNS times: an untimed run, then the timed ones (their median)
    steps, step = [], generate.Engine.step
    monkeypatch.setattr(generate.Engine, "step", lambda self: steps.append(1) or step(self))
    r_json = generate.main([*args, "--json"])
    monkeypatch.undo()
    assert len(steps) == (1 + generate.RUNS) * 3 and len(r_json["runs_ms"]) == generate.RUNS == 3
    assert r_json["ms_per_step"] * 3 == pytest.approx(sorted(r_json["runs_ms"])[1])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(r_json)) and r_json["batch"] == 2
    # An official checkpoint with local-attention blocks (Griffin) is refused by name.
    state = torch.load(tmp_path / "official.pt")
    state["blocks.1.attention_block.proj_q.weight"] = torch.zeros(4, 4)
    torch.save(state, tmp_path / "griffin.pt")
    with pytest.raises(ValueError, match=r"local-attention blocks \(Griffin\) at layers \['1'\]"):
        generate.load_checkpoint(str(tmp_path / "griffin.pt"), preset="tiny", mixer="rglru", device="cpu",
                                 dtype=torch.float32)
    # A HawkLM checkpoint read with the wrong mixer, bad flags: argparse errors, exit 2.
    bad = [["--checkpoint", str(tmp_path / "ours.pt"), "--mixer", "samu", *args],
           ["--checkpoint", str(tmp_path / "missing.pt"), *args], ["--top-k", "0", *args],
           ["--top-k", "3", *args], ["--temperature", "-1", *args], ["--stop", "-1", *args]]
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            generate.main(argv)
        assert e.value.code == 2, argv
    # $KERNELS_TUNING_TABLE naming no file: an argparse error, not a traceback
    from kernels.ops import tuning

    monkeypatch.setenv(tuning.ENV, str(tmp_path / "no-table.json"))
    tuning.env_table.cache_clear()
    try:
        with pytest.raises(SystemExit) as e:
            generate.main(args)
        assert e.value.code == 2
    finally:
        monkeypatch.delenv(tuning.ENV)
        tuning.env_table.cache_clear()
    err = capsys.readouterr().err
    for what in ("cannot build the model", "no such file", "--top-k must be at least 1", "--top-k needs",
                 "--temperature must be", "--stop ids", "expected $KERNELS_TUNING_TABLE to name a tuning table"):
        assert what in err, what


def test_bad_input():
    m = _model("rglru")
    with pytest.raises(ValueError, match="kernels"):
        Engine(m, kernels="fast")
    with pytest.raises(ValueError, match="graphs"):
        Engine(m, graphs=True)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        Engine(m, kernels="gemm")                  # a float64 model
    eng = Engine(m, kernels="model")
    with pytest.raises(ValueError, match="start"):
        eng.step()
    with pytest.raises(ValueError, match=r"prompt length in \[0, 2\]"):
        eng.start(torch.ones(2, 2, dtype=torch.int64), lengths=[-1, 2])
    with pytest.raises(ValueError, match="prompt 1 a sequence of integer"):
        eng.start([[5, 6], [5.0, 6.5]])
    with pytest.raises(ValueError, match="prompt 0 a sequence of integer"):
        eng.start([[[5, 6]], [5]])
    with pytest.raises(ValueError, match="stop_tokens a sequence of integer"):
        eng.start(batch_size=1, stop_tokens=[7.5])
    with pytest.raises(ValueError, match="temperature 0 .greedy. or at least"):
        eng.start(batch_size=1, temperature=1e-45)
    with pytest.raises(ValueError, match="top_k"):
        eng.start(batch_size=1, temperature=1.0, top_k=True)
    with pytest.raises(ValueError, match=r"prompt length in \[0, 3\]"):
        eng.start(torch.ones(2, 3, dtype=torch.int64), lengths=[3, 4])
    with pytest.raises(ValueError, match="lengths of shape"):
        eng.start(torch.ones(2, 3, dtype=torch.int64), lengths=[3])
    with pytest.raises(ValueError, match="prompt tokens"):
        eng.start([[5, V]])
    with pytest.raises(ValueError, match="integer tensor"):
        eng.start(torch.ones(2, 3))
    with pytest.raises(ValueError, match="stop tokens"):
        eng.start(batch_size=1, stop_tokens=list(range(dk.MAX_STOP_TOKENS + 1)))
    with pytest.raises(ValueError, match="batch_size"):
        eng.start(None)
    with pytest.raises(ValueError, match="temperature"):
        eng.start(batch_size=1, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        eng.start(batch_size=1, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(batch_size=1, max_new_tokens=-1)
    with pytest.raises(ValueError, match="rows"):
        dk.linear(torch.zeros(65, 8), torch.zeros(16, 8))


def test_row_kernels_refuse_unsafe_buffers_and_copy_strided_inputs():
    """embed_rmsnorm, add_rmsnorm, conv_step and advance: strided read-only
    inputs (tokens, scale, conv weights, nxt) are copied and give PyTorch's result;
    output buffers of the wrong shape, dtype or strides, in-place buffers that are
    strided views or of the wrong dtype, and outputs aliasing an input raise."""
    torch.manual_seed(0)
    M, D, E, V_ = 3, 24, 20, 16
    sv = lambda t: torch.stack([t, torch.zeros_like(t)], -1)[..., 0]   # noqa: E731  (a strided copy)
    norm = layers.RMSNorm(D)
    norm.scale.data.normal_()
    table, tok = torch.randn(V_, D), torch.tensor([3, 7, 11])
    with torch.no_grad():
        x, xn = dk.embed_rmsnorm(sv(tok), table, sv(norm.scale.detach()), norm.eps)
        torch.testing.assert_close(x, table[tok])
        torch.testing.assert_close(xn, norm(table[tok]))
        buf = torch.empty(M, D)
        for kw in (dict(x=torch.empty(M, 2 * D)[:, :D]), dict(xn=torch.empty(M, D, dtype=torch.float64)),
                   dict(x=torch.empty(M + 1, D)), dict(x=buf, xn=buf)):
            with pytest.raises(ValueError):
                dk.embed_rmsnorm(tok, table, norm.scale, norm.eps, **kw)
        for bad_tok, bad_table in ((tok[None], table), (tok.float(), table), (tok, torch.randn(D, V_).T)):
            with pytest.raises(ValueError):
                dk.embed_rmsnorm(bad_tok, bad_table, norm.scale, norm.eps)
        h, x = torch.randn(M, D), torch.randn(M, D)
        with pytest.raises(ValueError, match="xn not to overlap x"):
            dk.add_rmsnorm(h, x, norm.scale, norm.eps, xn=x)
        with pytest.raises(ValueError, match="contiguous xn"):
            dk.add_rmsnorm(h, x, norm.scale, norm.eps, xn=torch.empty(M, 2 * D)[:, :D])
        conv = layers.Conv1D(E)
        conv.b.data.normal_()
        xe, st = torch.randn(M, E), torch.randn(M, 3, E)
        st_ref = st.clone()
        want = conv.step(xe, st_ref)
        got = dk.conv_step(xe, st, sv(conv.w.detach()), sv(conv.b.detach()))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(st, st_ref)
        with pytest.raises(ValueError, match="contiguous y"):
            dk.conv_step(xe, st, conv.w, conv.b, y=torch.empty(M, 2 * E)[:, :E])
    stops = torch.full((dk.MAX_STOP_TOKENS,), -1)
    stops[0] = 7

    def bufs():
        return (torch.zeros(4, dtype=torch.int64), torch.tensor([-1, 0, 4, 2]), torch.ones(4, dtype=torch.bool),
                torch.tensor([False, False, True, False]))

    tokens, pos, reset, done = bufs()
    dk.advance(sv(torch.tensor([5, 7, 9, 7])), tokens, pos, reset, done, stops, pad_id=1)
    assert tokens.tolist() == [5, 7, 1, 7] and pos.tolist() == [0, 1, 5, 3]
    assert done.tolist() == [False, True, True, True] and reset.tolist() == [True, False, False, False]
    for i, bad in ((0, sv(torch.zeros(4, dtype=torch.int64))), (1, sv(torch.zeros(4, dtype=torch.int64))),
                   (2, sv(torch.ones(4, dtype=torch.bool))), (2, torch.ones(4, dtype=torch.int64)),
                   (3, torch.zeros(4, dtype=torch.int32))):
        args = list(bufs())
        args[i] = bad
        with pytest.raises(ValueError):
            dk.advance(torch.tensor([5, 7, 9, 7]), *args, stops, pad_id=1)


def test_engine_refuses_non_integer_lengths_and_fused_steps_take_strided_params():
    m = _model("rglru", dtype=torch.float32)
    p = torch.randint(3, V, (2, 4), generator=torch.Generator().manual_seed(0))
    eng = Engine(m, kernels="model")
    for lengths in ([3.7, 4.0], torch.tensor([3.7, 4.0]), torch.tensor([True, True])):
        with pytest.raises(ValueError, match="lengths with an integer dtype"):
            eng.start(p, lengths=lengths)
    assert torch.equal(eng.generate(p, 2, lengths=torch.tensor([3, 4], dtype=torch.int32)),
                       eng.generate(p, 2, lengths=[3, 4]))
    with pytest.raises(ValueError, match="batch_size"):
        eng.start(batch_size=0)
    # parameters replaced by strided views (conv weights, norm scales): the fused and
    # gemm steps read them as the layers do
    with torch.no_grad():
        for blk in m.blocks:
            c, n = blk.recurrent_block.conv_1d, blk.channel_pre_norm
            c.w = torch.nn.Parameter(c.w.detach().T.contiguous().T)
            n.scale = torch.nn.Parameter(torch.stack([n.scale.detach()] * 2, 1)[:, 0])
    want = eng.generate(p, 3)
    for kernels in ("fused", "gemm"):
        assert torch.equal(Engine(m, kernels=kernels, linear_configs=BIG_TILES).generate(p, 3), want), kernels
