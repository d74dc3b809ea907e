"""torch.compile(fullgraph=True) of a HawkLM training step and of a decode step with
the mixers on Triton backends: no graph break (fullgraph raises on one), the mixers as
the custom ops kernels::rglru_fwd / samu_fwd in the forward graph, their backward ops
in the backward graph, the decode steps' kernels::rglru_step / samu_step with the state
updated in place, and the same loss, gradients, logits and caches as the eager model.
On the CPU: Triton interpreter, AOT autograd without a code generator (no C++ compiler
needed), a two-layer tiny model (each layer's custom ops see their own parameters and
saved tensors)."""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from kernels.models import HawkConfig, HawkLM

B, T = 2, 6


def recording_backend():
    """An AOT-autograd backend that keeps every graph it is given and runs it as is."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep), graphs


def ops_in(gm) -> set[str]:
    """The kernels:: ops a graph calls (an op that mutates an input appears wrapped in
    auto_functionalized, the op its first argument)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            target = n.args[0] if "auto_functionalized" in str(n.target) else n.target
            if str(target).startswith("kernels."):
                out.add(str(target).split(".")[1])
    return out


def model(mixer, backend, step_backend):
    torch.manual_seed(0)
    m = HawkLM(HawkConfig.preset("tiny", mixer=mixer, num_layers=2), backend=backend)
    return m.set_backend(backend, step_backend)


def loss_of(m, tokens, pos):
    logits, _ = m(tokens, pos, return_cache=False)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("mixer,backend,step", [("rglru", "serial", "fused"), ("samu", "chunk", "blocked")])
def test_compiled_training_and_decode_steps(mixer, backend, step):
    torch._dynamo.reset()
    tokens = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T).expand(B, T).clone()
    pos[1, 3] = 0                                                   # a document start inside row 1
    m = model(mixer, backend, step)
    loss = loss_of(m, tokens, pos)
    loss.backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()

    be, graphs = recording_backend()
    got = torch.compile(loss_of, fullgraph=True, backend=be)(m, tokens, pos)
    got.backward()
    torch.testing.assert_close(got, loss, rtol=1e-6, atol=0)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)
    assert f"{mixer}_fwd" in ops_in(graphs[0]) and f"{mixer}_bwd" in ops_in(graphs[1])

    # decode: two steps from a prefill, the cache updated in place by the compiled step
    with torch.no_grad():
        _, cache = m(tokens[:, :4], pos[:, :4])
        eager = cache.clone()
        be, graphs = recording_backend()
        compiled = torch.compile(m.step, fullgraph=True, backend=be)
        for t in (4, 5):
            want_logits = m.step(tokens[:, t], pos[:, t], eager)
            got_logits = compiled(tokens[:, t], pos[:, t], cache)
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    for a, b in zip(cache.layers, eager.layers):
        torch.testing.assert_close(a.rnn_state, b.rnn_state, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.conv_state, b.conv_state, rtol=1e-5, atol=1e-6)
    assert f"{mixer}_step" in ops_in(graphs[0])


@pytest.mark.cuda
@pytest.mark.parametrize("mixer", ["rglru", "samu"])
def test_compiled_training_step_on_gpu(mixer):
    """The 400m width at a short sequence, default inductor backend, BF16 autocast:
    fullgraph compile; the loss and every gradient are judged against the FP32 step,
    the compiled error at most 3x the eager BF16 step's own (BF16 rule)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = HawkLM(HawkConfig.preset("400m", mixer=mixer, num_layers=2), backend="auto", device="cuda")
    tokens = torch.randint(0, 32000, (2, 256), device="cuda")
    pos = torch.arange(256, device="cuda").expand(2, 256)

    def grads_of(fn):
        m.zero_grad()
        loss = fn(tokens, pos)
        loss.backward()
        return loss.detach().float(), {n: p.grad.clone() for n, p in m.named_parameters()}

    def step(tokens, pos):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_of(m, tokens, pos)

    ref_loss, ref = grads_of(lambda t, p: loss_of(m, t, p))
    eager_loss, eager = grads_of(step)
    got_loss, got = grads_of(torch.compile(step, fullgraph=True))
    assert abs(got_loss - ref_loss) <= 3 * abs(eager_loss - ref_loss) + 1e-3 * abs(ref_loss)
    for n in ref:
        assert torch.isfinite(got[n]).all(), n
        scale = ref[n].norm().clamp_min(1e-12)
        err_got, err_eager = (got[n] - ref[n]).norm() / scale, (eager[n] - ref[n]).norm() / scale
        assert err_got <= 3 * err_eager + 1e-3, (n, float(err_got), float(err_eager))
