"""The training step (kernels.models.train) and the fused non-mixer kernels it runs:
the chunked fused linear + cross-entropy, HawkLM.loss and train_step against the
plain path (logits, F.cross_entropy, the same clipping and AdamW), in FP32 tightly
and under BF16 autocast against float64 (no worse than the plain BF16 path), the
Triton causal convolution against layers.Conv1D's PyTorch path, and the fused gated
GeLU against float64 and the MLP's PyTorch formula."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kernels import layers
import parity
from kernels.models import HawkConfig, HawkLM, linear_cross_entropy, train, train_step
from kernels.ops import accounting, conv, geglu
from kernels.ops.triton_utils import poisoned

B, T = 2, 7


def _model(mixer, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    m = HawkLM(HawkConfig.preset("tiny", mixer=mixer), backend="reference", device=device, dtype=dtype)
    with torch.no_grad():   # biases and norm scales start at zero; exercise them
        for n, p in m.named_parameters():
            if n.endswith("bias") or n.endswith(".b") or n.endswith("scale"):
                p.normal_(std=0.1)
    return m


def _batch(device="cpu", ignore=True):
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 256, (B, T + 1), generator=g)
    pos = torch.tensor([list(range(T)), [3, 4, 0, 1, 2, 0, 1]])
    tgt = toks[:, 1:].clone()
    if ignore:
        tgt[1, 2] = tgt[0, 6] = -100
    return toks[:, :-1].to(device), tgt.to(device), pos.to(device)


def _plain_loss(m, inp, tgt, pos):
    logits, _ = m(inp, pos)          # with a cache out: Conv1D's PyTorch path on every device
    return F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())


def _grads(m, loss_fn, autocast=None):
    m.zero_grad(set_to_none=True)
    dev = next(m.parameters()).device.type
    with torch.autocast(dev, dtype=autocast, enabled=autocast is not None):
        loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_linear_cross_entropy_equals_unfused(dtype, rtol):
    """Ragged chunks (37 rows in chunks of 8), ignored rows, a loss cotangent of 3 and
    int32 targets: the loss and both gradients equal F.cross_entropy's."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(50, 16, generator=g, dtype=dtype).requires_grad_()
    t = torch.randint(0, 50, (37,), generator=g)
    t[[0, 9, 36]] = -100
    want = F.cross_entropy(h @ w.t(), t)
    dh, dw = torch.autograd.grad(3 * want, (h, w))
    got = linear_cross_entropy(h, w, t.int(), chunk_size=8)
    gh, gw = torch.autograd.grad(3 * got, (h, w))
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    assert _rel(gh, dh) < rtol and _rel(gw, dw) < rtol
    assert torch.isnan(linear_cross_entropy(h, w, torch.full_like(t, -100)))      # as F.cross_entropy
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, t, chunk_size=0)


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_fp32_step_equals_plain_step(mixer, monkeypatch):
    """HawkLM.loss (ragged chunks of 5 rows over 14) gives the plain path's loss and
    every gradient (the tied embedding's included, output projection plus lookup);
    train_step then leaves the same parameters as the plain step with the same
    clipping and optimizer (SGD: AdamW's first step, lr * sign(g) where g is tiny,
    would turn rounding into lr-sized differences)."""
    monkeypatch.setattr(train, "LOGITS_PER_CHUNK", 5 * 256)
    inp, tgt, pos = _batch()
    m = _model(mixer)
    l_ref, g_ref = _grads(m, lambda: _plain_loss(m, inp, tgt, pos))
    l_new, g_new = _grads(m, lambda: m.loss(inp, tgt, pos))
    torch.testing.assert_close(l_new, l_ref, rtol=1e-6, atol=0)
    assert g_new.keys() == g_ref.keys() and "embed.weight" in g_new
    for n in g_ref:
        assert _rel(g_new[n], g_ref[n]) < 1e-5, n

    after = {}
    for path in ("plain", "step"):
        m = _model(mixer)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        if path == "step":
            train_step(m, opt, inp, tgt, pos, grad_clip=0.05)
        else:
            _plain_loss(m, inp, tgt, pos).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            opt.step()
        assert all(p.grad is None for p in m.parameters()) == (path == "step")
        after[path] = {n: p.detach().clone() for n, p in m.named_parameters()}
    for n in after["plain"]:
        torch.testing.assert_close(after["step"][n], after["plain"][n], rtol=1e-5, atol=1e-6, msg=n)


def _bf16_errors(mixer, device):
    """Relative errors against float64 of the loss and every gradient: plain path and
    fused path, both under BF16 autocast over FP32 parameters."""
    inp, tgt, pos = _batch(device)
    m = _model(mixer, torch.float32, device)
    m64 = copy.deepcopy(m).double()
    l64, g64 = _grads(m64, lambda: _plain_loss(m64, inp, tgt, pos))
    out = {}
    for path, fn in (("plain", lambda: _plain_loss(m, inp, tgt, pos)), ("fused", lambda: m.loss(inp, tgt, pos))):
        loss, g = _grads(m, fn, torch.bfloat16)
        out[path] = {"loss": _rel(loss, l64), **{n: _rel(g[n], g64[n]) for n in g64}}
    return out


def _check_bf16(errs):
    for n, e in errs["fused"].items():
        assert e <= 3 * errs["plain"][n] + 1e-3, (n, e, errs["plain"][n])
    assert errs["fused"]["embed.weight"] < 2e-2


@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_bf16_autocast_step_errs_like_the_plain_bf16_step(mixer, monkeypatch):
    monkeypatch.setattr(train, "LOGITS_PER_CHUNK", 5 * 256)     # chunks of 5 rows over 14
    _check_bf16(_bf16_errors(mixer, "cpu"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("starts", [True, False])
def test_conv_kernel_equals_conv1d(dtype, starts):
    """Odd shapes (several time and channel tiles, partial ones), document starts
    (one at t = 0, neighbouring ones, one in the last 3 steps) or none, NaN-poisoned
    outputs: y and the gradients of x, w and b equal Conv1D's PyTorch path."""
    torch.manual_seed(0)
    Bc, Tc, E = 2, 70, 131
    c = layers.Conv1D(E, dtype=dtype)
    with torch.no_grad():
        c.b.normal_()
    x = torch.randn(Bc, Tc, E, dtype=dtype, requires_grad=True)
    pos = torch.arange(Tc).expand(Bc, Tc).clone()
    pos[0, 5:] -= 5
    pos[1, 66:] -= 66
    pos[1, 67:] -= 1
    pos = pos if starts else None
    y, _ = c(x, pos, return_cache=False)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, (x, c.w, c.b), dy)
    with poisoned():
        y2 = conv.causal_conv1d(x, c.w, c.b, pos)
        got = torch.autograd.grad(y2, (x, c.w, c.b), dy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y2, y, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    with pytest.raises(ValueError, match="segment_pos"):
        conv.causal_conv1d(x, c.w, c.b, torch.zeros(Bc, Tc + 1, dtype=torch.long))


def _geglu64(up):
    gate, value = up.double().chunk(2, dim=-1)
    return layers.gelu(gate) * value


@pytest.mark.parametrize("form", ["geglu", "gelu_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_kernel_against_float64(dtype, form):
    """Odd shapes (rows not a multiple of anything, E over one 1024-lane block with a
    partial one), NaN-poisoned outputs, both entry points (the halves of one projection;
    two tensors): h and the gradients against float64 autograd of the formula; FP32
    tightly, BF16 no worse than the PyTorch BF16 formula plus one BF16 rounding, and
    rounded where that formula rounds (gelu(gate) and dh * value before the product):
    bitwise equal to it but where the two FP32 GeLUs round apart (rounding h once
    instead matches about 3 elements in 4)."""
    torch.manual_seed(0)
    up = (torch.randn(3, 5, 2 * 1100) * 3).to(dtype)
    dh = torch.randn(3, 5, 1100).to(dtype)
    if form == "geglu":
        ins = [up.requires_grad_()]
    else:
        ins = [t.contiguous().requires_grad_() for t in up.chunk(2, dim=-1)]
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    want = _geglu64(ins64[0]) if form == "geglu" else layers.gelu(ins64[0]) * ins64[1]
    dwant = torch.autograd.grad(want, ins64, dh.double())
    with poisoned(), accounting.counting() as c:
        h = geglu.geglu(*ins) if form == "geglu" else geglu.gelu_mul(*ins)
        got = torch.autograd.grad(h, ins, dh)
    assert h.dtype == dtype and h.shape == (3, 5, 1100)
    assert c.launches == 2 and c.by_kernel["gelu_mul"] == {"bytes_read": 2 * h.nbytes, "bytes_written": h.nbytes,
                                                           "launches": 1}
    assert all(g.dtype == dtype and g.shape == t.shape for g, t in zip(got, ins))
    if dtype == torch.float32:
        torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got, dwant):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
        return
    gate, value = ins[0].chunk(2, dim=-1) if form == "geglu" else ins
    plain = layers.gelu(gate) * value
    dplain = torch.autograd.grad(plain, ins, dh)
    for a, ref, base in ((h, want, plain), *zip(got, dwant, dplain)):
        err = ((a.double() - ref).abs() / (ref.abs() + 1e-3)).max().item()
        base_err = ((base.double() - ref).abs() / (ref.abs() + 1e-3)).max().item()
        assert torch.isfinite(a).all() and err <= base_err + 2 ** -8, (err, base_err)
        assert (a == base).double().mean().item() > 0.9


def test_geglu_rejects_bad_input():
    up = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        geglu.geglu(up.t())
    with pytest.raises(ValueError, match=r"\[\.\.\., 2E\]"):
        geglu.geglu(torch.randn(4, 5))
    with pytest.raises(ValueError, match="float64"):
        geglu.geglu(up.double())
    with pytest.raises(ValueError, match="value of gate's shape"):
        geglu.gelu_mul(up, torch.randn(4, 5))
    with pytest.raises(ValueError, match="value of gate's shape"):
        geglu.gelu_mul(up, up.bfloat16())
    with pytest.raises(ValueError, match="contiguous gate"):
        geglu.gelu_mul(up[:, :3], up[:, 3:])


@pytest.mark.cuda
def test_geglu_on_gpu_is_the_mlp_formula_within_bf16():
    """At the 1.3b MLP's size, BF16: the fused MLP block and gelu_mul against their PyTorch
    formula and float64."""
    torch.manual_seed(0)
    mlp = layers.MLPBlock(2560, 7680, device="cuda")
    x = torch.randn(2, 1024, 2560, device="cuda", requires_grad=True)
    dy = torch.randn(2, 1024, 2560, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mlp(x)
        up = mlp.ffw_up(x)
        gate, value = up.chunk(2, dim=-1)
        plain = mlp.ffw_down(layers.gelu(gate) * value)
    assert y.dtype == plain.dtype == torch.bfloat16
    got = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    want = torch.autograd.grad(plain, [x, *mlp.parameters()], dy)
    assert _rel(y, plain) < 1e-2
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-2
    up64 = up.detach().double()
    assert _rel(geglu.geglu(up.detach().contiguous()), _geglu64(up64)) <= _rel(layers.gelu(gate) * value, _geglu64(up64))
    # the recurrent block's form: two tensors
    g, v = (t.detach().contiguous().requires_grad_() for t in (gate, value))
    h, plain = layers.gelu_mul(g, v), layers.gelu(g) * v
    assert _rel(h, plain) < 1e-2 and _rel(h, _geglu64(up64)) <= _rel(plain, _geglu64(up64))
    dh = torch.randn_like(h)
    for a, b in zip(torch.autograd.grad(h, (g, v), dh), torch.autograd.grad(plain, (g, v), dh)):
        assert _rel(a, b) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_bf16_step_on_gpu(mixer):
    """On CUDA the fused path also runs the Triton convolution and the fused RMSNorm;
    the plain path (a cache out) runs Conv1D's PyTorch path."""
    _check_bf16(_bf16_errors(mixer, "cuda"))


@pytest.mark.cuda
def test_conv_kernel_and_rmsnorm_on_gpu():
    torch.manual_seed(0)
    c = layers.Conv1D(2560, device="cuda")
    x = torch.randn(4, 2048, 2560, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(2048, device="cuda").expand(4, 2048).clone()
    pos[1, 700:] -= 700
    dy = torch.randn_like(x)
    y, _ = c(x, pos, return_cache=True)
    want = torch.autograd.grad(y, (x, c.w, c.b), dy)
    y2, _ = c(x, pos, return_cache=False)
    got = torch.autograd.grad(y2, (x, c.w, c.b), dy)
    assert (y2 == y).float().mean() > 0.99 and _rel(y2, y) < 1e-2
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-2
    n = layers.RMSNorm(2048, device="cuda")
    with torch.no_grad():
        n.scale.normal_()
    h = torch.randn(8, 2048, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = n(h)
    want = h.double() / torch.sqrt((h.double() ** 2).mean(-1, keepdim=True) + 1e-6) * (1 + n.scale.double())
    assert out.dtype == torch.float32 and _rel(out, want) < 1e-6


def test_captured_step_rejects_what_it_cannot_capture():
    m = _model("rglru")
    inp, tgt, pos = _batch(ignore=False)
    plain = torch.optim.AdamW(m.parameters())
    capt = torch.optim.AdamW(m.parameters(), capturable=True)
    with pytest.raises(ValueError, match="warmup"):
        train.CapturedTrainStep(m, capt, inp, tgt, pos, warmup=0)
    with pytest.raises(ValueError, match="capturable"):
        train.CapturedTrainStep(m, plain, inp, tgt, pos)
    with pytest.raises(ValueError, match="CUDA"):
        train.CapturedTrainStep(m, capt, inp, tgt, pos)
    with pytest.raises(ValueError, match="CUDA"):
        parity.check_captured_train_step(device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_step_equals_eager_steps_on_gpu(dtype):
    """The audit's gate: the captured step's losses and the weights after three replays
    equal the same eager steps' (same kernels in the same order)."""
    rows = parity.check_captured_train_step(preset="tiny", B=2, T=40, vocab_size=256, steps=3, dtype=dtype)
    assert len(rows) == 4 and not parity.failures(rows), rows


@pytest.mark.cuda
def test_captured_step_refuses_another_batch_shape_on_gpu():
    """(Each replay reading its own batch is the gate above: every step has new tokens.)"""
    m = _model("samu", device="cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
    inp, tgt, pos = _batch("cuda", ignore=False)
    step = train.CapturedTrainStep(m, opt, inp, tgt, pos, warmup=1)
    assert torch.isfinite(step(inp, tgt, pos))
    with pytest.raises(ValueError, match="captured shape"):
        step(inp[:, :3], tgt[:, :3], pos[:, :3])
