"""The host path of an eager call, with every Triton launch replaced by a recording
stub: the aten ops and kernel launches one call issues are counted (a torch dispatch
mode sees every op that reaches the dispatcher), so that work added to the path a user
pays on every call (an extra allocation, fill, copy or launch) fails here, without a
time bound. The bounds are the counts of the current path."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels.ops import triton_utils
from kernels.ops.rglru import chunk as rglru_chunk
from kernels.ops.rglru import common as rglru_common
from kernels.ops.rglru import fused_recurrent as rglru_serial
from kernels.ops.rglru import step as rglru_step_mod
from kernels.ops.samu import chunk as samu_chunk
from kernels.ops.samu import common as samu_common
from kernels.ops.samu import fused_recurrent as samu_serial
from kernels.ops.samu import step as samu_step_mod

from test_launcher import FakeJit


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def stubbed(monkeypatch):
    """Every module-level Triton kernel of the op packages replaced by a stub whose
    launch records the kernel's name and does nothing."""
    launches = []
    monkeypatch.setattr(triton_utils, "_POISON", [False])   # plain allocations, as users get them

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(self.name)

    for mod in (rglru_step_mod, rglru_serial, rglru_chunk, rglru_common, samu_step_mod, samu_common, samu_chunk,
                samu_serial):
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(obj, "__getitem__"):
                monkeypatch.setattr(mod, name, Stub(name))
    return launches


def _count(fn):
    fn()        # warm the caches
    with _Count() as c:
        fn()
    return c.ops


def _step_args(B=4, D=64, H=4):
    g = torch.Generator().manual_seed(0)
    W = D // H
    x = torch.randn(B, D, generator=g)
    w = torch.randn(H, W, W, generator=g)
    b = torch.randn(H, W, generator=g)
    return x, w, b, torch.randn(D, generator=g)


@torch.no_grad()
def test_rglru_step_host_path(stubbed):
    x, w, b, ap = _step_args()
    state = torch.zeros(x.shape)
    ops = _count(lambda: kernels.rglru_step(x, w, b, w, b, ap, state, backend="fused"))
    assert stubbed[-1] == "rglru_step_kernel" and stubbed.count("rglru_step_kernel") == 2
    assert ops == ["empty_like"], ops       # y; no copy of contiguous inputs, no fill


@torch.no_grad()
def test_samu_step_host_path(stubbed):
    x, _, _, _ = _step_args()
    D, M = x.shape[1], x.shape[1] // 2
    g = torch.Generator().manual_seed(1)
    pd, rd = torch.randn(D + 1, generator=g), torch.randn(D + 1, generator=g)
    nu, th = torch.randn(M, generator=g), torch.randn(M, generator=g)
    state = torch.zeros(x.shape[0], M, dtype=torch.complex64)
    ops = _count(lambda: kernels.samu_step(x, pd, rd, 0.5, -0.25, nu, th, state, backend="fused"))
    assert stubbed == ["_step_kernel"] * 2
    # y and the real view of the state; python-float amplitudes are cached constants
    assert sorted(ops) == ["empty_like", "view_as_real"], ops


def _seq(B=2, T=16, D=64, grad=False):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(B, T, D, generator=g).requires_grad_(grad) for _ in range(3)]


@pytest.mark.parametrize("backend", ["serial", "chunk"])
def test_rglru_scan_inference_host_path(stubbed, backend):
    x, gx, ga = _seq()
    ap = torch.randn(x.shape[-1])
    a = ga.sigmoid()
    # the output alone (serial); chunk: plus the summaries (one allocation, carved) and the
    # chunk states; no autograd node, no copy of contiguous inputs
    bound = 1 if backend == "serial" else 3
    with torch.no_grad():
        ops = _count(lambda: kernels.rglru(x, gx, ga, ap, backend=backend))
    assert set(ops) <= {"empty", "empty_like", "as_strided"} and _allocations(ops) <= bound, ops
    ops = _count(lambda: kernels.scan(a, x, backend=backend))
    assert set(ops) <= {"empty", "empty_like", "as_strided"} and _allocations(ops) <= bound, ops


def _allocations(ops):
    return ops.count("empty") + ops.count("empty_like")


def test_samu_train_host_path(stubbed):
    x = _seq(grad=True)[0]
    D, M = x.shape[-1], x.shape[-1] // 2
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=g).requires_grad_() for n in (D + 1, D + 1, M, M)]
    pd, rd, nu, th = params
    dy = torch.ones_like(x)

    def step():
        y, _ = kernels.samu(x, pd, rd, 0.5, 0.5, nu, th, backend="chunk")
        y.backward(dy)

    stubbed.clear()
    ops = _count(step)
    # forward: controls with the mode table, summary, 2 prefix kernels, replay; backward:
    # summary, 2 prefix kernels, the backward, controls_bwd, finalize
    assert len(stubbed) // 2 == 11, stubbed
    # allocations (scratch carved from shared ones: as_strided views), the gradients'
    # slices and their accumulation into .grad (the warm-up call left them set); no
    # fill (an unused final state's gradient stays None), no copy
    assert _allocations(ops) <= 16, ops
    assert set(ops) <= {"empty", "empty_like", "as_strided", "slice", "select", "add_"}, ops


def test_serial_launch_plans_are_kept_per_shape_and_configuration(stubbed, monkeypatch):
    """The serial launchers' grid and keywords are worked out once per kernel, shape,
    dtype, device and configuration; a new configuration object (an id reused after the
    old one died included) gets its own."""
    made = []
    plan = rglru_serial._plan
    monkeypatch.setattr(rglru_serial, "_plan", lambda *a: made.append(a[0].shape) or plan(*a))
    monkeypatch.setattr(rglru_serial, "_PLANS", {})
    x, _, ga = _seq()
    cfg = rglru_serial.config(*x.shape, True, grad=False)
    with torch.no_grad():
        for T in (16, 16, 8, 16):
            rglru_serial.forward(x[:, :T].contiguous(), x, ga[:, :T].contiguous(), None, None, None, False, False,
                                 True, cfg)
        assert made == [(2, 16, 64), (2, 8, 64)]
        rglru_serial.forward(x, x, ga, None, None, None, False, False, True, dict(cfg))
        assert len(made) == 3
        key = next(iter(rglru_serial._PLANS))
        rglru_serial._PLANS[key] = ({}, *rglru_serial._PLANS[key][1:])    # another object under cfg's id
        rglru_serial.forward(x, x, ga, None, None, None, False, False, True, cfg)
        assert len(made) == 4


@torch.no_grad()
def test_checks_run_once_per_signature_and_every_changed_argument_is_checked_again(monkeypatch):
    """kernels.ops keeps each checked call signature: a repeat skips the checks, while a
    call differing in any argument's shape, dtype, device or type, the backend or the
    chunk size is checked afresh (and a bad one raises after good ones)."""
    calls = []
    real = kernels.ops.check_tensor
    monkeypatch.setattr(kernels.ops, "check_tensor", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    x, w, b, ap = _step_args()
    state = torch.zeros(x.shape)
    step = lambda **kw: kernels.rglru_step(*{"x": x, "w": w, "b": b, "wa": w, "ba": b, "ap": ap, "state": state,
                                            **kw}.values(), backend="reference")
    step()
    n = len(calls)
    assert n >= 7
    step()
    assert len(calls) == n                      # the repeat: no check
    bad = {"state": torch.zeros(x.shape, dtype=torch.float64), "ap": torch.zeros(x.shape[1] + 1),
           "b": torch.zeros(b.shape, dtype=torch.int32), "x": torch.zeros(x.shape[0], x.shape[1] + 1),
           "wa": w.to("meta")}
    for name, value in bad.items():
        with pytest.raises(ValueError):
            step(**{name: value})
        with pytest.raises(ValueError):         # not remembered as checked
            step(**{name: value})
    seq = _seq()
    kernels.scan(seq[0].sigmoid(), seq[1], backend="reference")
    for chunk_size in (8.0, True, 12):
        with pytest.raises(ValueError, match="chunk_size"):
            kernels.scan(seq[0].sigmoid(), seq[1], backend="serial", chunk_size=chunk_size)
    kernels.scan(seq[0].sigmoid(), seq[1], backend="reference", initial_state=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="initial_state"):
        kernels.scan(seq[0].sigmoid(), seq[1], backend="reference", initial_state=torch.zeros(2, 65))
    M = x.shape[1] // 2
    args = (x, torch.zeros(x.shape[1] + 1), torch.zeros(x.shape[1] + 1), 0.5, 0.5, torch.zeros(M), torch.zeros(M))
    sstate = torch.zeros(x.shape[0], M, dtype=torch.complex64)
    kernels.samu_step(*args, sstate, backend="reference")
    with pytest.raises(ValueError, match="phase_amp"):
        kernels.samu_step(x, *args[1:3], True, *args[4:], sstate, backend="reference")
    with pytest.raises(ValueError, match="backend"):
        kernels.samu_step(*args, sstate, backend="nonesuch")


def _fake(monkeypatch, mod, name, log):
    """mod.<name> as a Launcher over test_launcher's FakeJit of the kernel's Python function,
    on a fake CUDA stream; its compilations and launches go to `log`."""
    monkeypatch.setattr(triton_utils, "_raw_stream", lambda: (0, 1234))
    real = getattr(mod, name)
    while hasattr(real, "fn"):                 # Launcher, interpreted and JIT function: the Python one
        real = real.fn
    monkeypatch.setattr(mod, name, triton_utils.Launcher(FakeJit(real, log)))


def _keyed(monkeypatch) -> list:
    """A list that grows by one per launch through the Launcher's own path (its key built)."""
    keyed, launch = [], triton_utils.Launcher._launch
    monkeypatch.setattr(triton_utils.Launcher, "_launch", lambda self, *a, **k: keyed.append(1) or launch(self, *a, **k))
    return keyed


@pytest.fixture
def replayed(monkeypatch):
    """The decode steps' kernels as Launchers over test_launcher's FakeJit, outside the interpreter."""
    log = []
    for mod, name in ((rglru_step_mod, "rglru_step_kernel"), (samu_step_mod, "_step_kernel")):
        _fake(monkeypatch, mod, name, log)
        monkeypatch.setattr(mod, "INTERPRET", False)
    return log


def _ptrs(*tensors):
    return tuple(t.data_ptr() for t in tensors)


def _hit(log, fn, *args, y_at):
    """The launch values of fn(*args) through the Launcher's own cache, its output's address
    at position y_at set to None."""
    fn(*args)
    kind, vals = log[-1]
    assert kind == "launch"
    return (*vals[:y_at], None, *vals[y_at + 1:])


def _replay(log, y_at, y):
    """The last launch's values with y's address (checked at y_at) set to None."""
    kind, vals = log[-1]
    assert kind == "launch" and vals[y_at] == y.data_ptr()
    return (*vals[:y_at], None, *vals[y_at + 1:])


@torch.no_grad()
def test_a_repeated_step_signature_replays_its_launch_with_the_new_tensors(replayed, monkeypatch):
    """From the second call of a signature the step launches the kept compiled kernel with
    the call's own tensors in the first call's places and the values the Launcher would
    pass, in grad mode too; a strided or misaligned input, an input requiring grad or another
    signature takes the checked path again."""
    log = replayed
    x, w, b, ap = _step_args()
    wa, ba = w + 1, b + 1
    state, reset = torch.zeros(x.shape), torch.tensor([True, False, True, False])
    kernels.rglru_step(x, w, b, wa, ba, ap, state, backend="fused")
    assert [k for k, _ in log] == ["triton"]
    for r in (None, reset, None):
        x2, state2 = x.clone(), torch.zeros(x.shape)
        kernels.rglru_step(x2, w, b, wa, ba, ap, state2, r, backend="fused")     # a new signature's first call
        y = kernels.rglru_step(x2, w, b, wa, ba, ap, state2, r, backend="fused")
        got = _replay(log, 8, y)
        assert got == _hit(log, rglru_step_mod.rglru_step, x2, w, b, wa, ba, ap, state2, r, y_at=8)
        assert got[:8] == _ptrs(x2, w, b, wa, ba, ap, state2, state2 if r is None else r)
    n = len(log)
    strided = torch.randn(x.shape[1], x.shape[0]).t()
    for _ in range(2):                         # copied, then launched: never replayed on the strided x
        kernels.rglru_step(strided, w, b, wa, ba, ap, state, backend="fused")
        assert log[-1][0] == "launch" and log[-1][1][0] != strided.data_ptr()
    assert len(log) == n + 2
    off = torch.randn(x.numel() + 1)[1:].view(x.shape)                         # 4 bytes past alignment
    kernels.rglru_step(off, w, b, wa, ba, ap, state, backend="fused")
    assert log[-1][0] == "triton" and log[-1][1][0] is off                    # Triton's path: a new key

    def launcher_calls(*args):                 # the checked path's launcher, counted
        full.append(1)
        return launch(*args)
    full, launch = [], rglru_step_mod._launch
    monkeypatch.setattr(rglru_step_mod, "_launch", launcher_calls)
    with torch.enable_grad():                  # grad mode, no input requiring grad: replayed
        y = kernels.rglru_step(x, w, b, wa, ba, ap, state, backend="fused")
    assert _replay(log, 8, y)[:8] == _ptrs(x, w, b, wa, ba, ap, state, state) and not full
    with torch.enable_grad(), pytest.raises(ValueError, match="requires_grad"):
        kernels.rglru_step(x, w, b, wa, ba, ap.requires_grad_(), state, backend="fused")
    kernels.rglru_step(x, w, b, wa, ba, ap, state, backend="fused")   # outside grad mode: replayed
    assert not full


@torch.no_grad()
@pytest.mark.parametrize("table", [False, True])
def test_a_repeated_samu_step_signature_replays_its_launch(replayed, table):
    x, _, _, _ = _step_args()
    D, M = x.shape[1], x.shape[1] // 2
    g = torch.Generator().manual_seed(4)
    pd, rd = torch.randn(D + 1, generator=g), torch.randn(D + 1, generator=g)
    nu, th = torch.randn(M, generator=g), torch.randn(M, generator=g)
    modes = kernels.ops.samu_mode_table(nu, th, torch.float32) if table else None
    state, reset = torch.zeros(x.shape[0], M, dtype=torch.complex64), torch.tensor([False, True, False, False])
    amp = torch.tensor(-0.25)
    kernels.samu_step(x, pd, rd, 0.5, amp, nu, th, state, reset, modes=modes, backend="fused")
    assert [k for k, _ in replayed] == ["triton"]
    x2 = x + 1
    y = kernels.samu_step(x2, pd, rd, 0.75, amp, nu, th, state, reset, modes=modes, backend="fused")
    got = _replay(replayed, 10, y)
    pa = samu_step_mod._amp(0.75, x2)                                 # the new amplitude's constant
    assert got[:10] == _ptrs(x2, pd, rd, pa, amp, nu, th, state if modes is None else modes, state, reset)
    assert got == _hit(replayed, samu_step_mod.samu_step, x2, pd, rd, 0.75, amp, nu, th, state, reset, modes, y_at=10)


@torch.no_grad()
@pytest.mark.parametrize("op", ["rglru", "scan"])
def test_serial_launches_replay_a_repeated_plan(monkeypatch, op):
    """The serial kernels' launcher replays the first launch of a plan (shape, each tensor's
    dtype and device or None, configuration) with the call's own tensors: the values equal
    those the Launcher's cache would pass, outputs aside."""
    log = []
    monkeypatch.setattr(rglru_serial, "_PLANS", {})
    _fake(monkeypatch, rglru_serial, "serial_fwd_kernel", log)
    x, gx, ga = _seq()
    fn = kernels.backends(op)["serial"]
    args = (x, gx, ga, torch.randn(x.shape[-1])) if op == "rglru" else (ga.sigmoid(), x)
    fn(*args)
    assert [k for k, _ in log] == ["triton"]
    y, _ = fn(*args)
    kind, got = log[-1]
    assert kind == "launch" and got[6] == y.data_ptr()
    assert (got[0], got[2]) == (x.data_ptr(), ga.data_ptr() if op == "rglru" else args[0].data_ptr())
    for plan in rglru_serial._PLANS.values():          # no replay: the Launcher's own cached launch
        plan[3].clear()
    y2, _ = fn(*args)
    assert log[-1][0] == "launch" and log[-1][1][6] == y2.data_ptr()
    mask = lambda vals: tuple(None if i in (6, 7, 8) else v for i, v in enumerate(vals))
    assert mask(got) == mask(log[-1][1]) and len(log) == 3
    fn(*args)
    assert log[-1][0] == "launch"                       # the plan's replay is back
    # an input 4 bytes past 16-byte alignment: the same plan, but Triton's path (a new key)
    off = torch.randn(x.numel() + 1)[1:].view(x.shape)
    fn(*((off, *args[1:]) if op == "rglru" else (args[0], off)))
    assert log[-1][0] == "triton" and log[-1][1][0] is off
    monkeypatch.setattr(triton_utils, "_hooked", lambda: True)   # a launch hook: never replayed
    n = len(log)
    fn(*args)
    assert log[n:] and all(kind == "triton" for kind, _ in log[n:])


def test_chunk_samu_launches_replay_a_repeated_plan(monkeypatch):
    """The chunk SAMU's launches (forward: summary, 2 prefix kernels, replay; backward: the
    same) replay a plan's first launch from its second call with the call's own tensors: the
    values the Launcher's cache passes, without building its key; a misaligned input takes
    the Launcher's path where it is read."""
    logs = {}
    for name in ("_fwd_kernel", "_group_kernel", "_bwd_summary_kernel", "_bwd_kernel"):
        _fake(monkeypatch, samu_chunk, name, logs.setdefault(name, []))
    keyed = _keyed(monkeypatch)
    samu_chunk._Plan.cache_clear()          # no replay kept by another test's kernels
    B, T, D = 2, 40, 64
    g = torch.Generator().manual_seed(5)
    pd, rd, nu, th = (torch.randn(n, generator=g).requires_grad_() for n in (D + 1, D + 1, D // 2, D // 2))

    def call(x):
        y, _ = kernels.samu(x, pd, rd, 0.5, 0.5, nu, th, backend="chunk", chunk_size=8)
        y.backward(torch.ones_like(y))
        return {name: log[-n:] for name, log, n in zip(logs, logs.values(), (2, 4, 1, 1))}

    try:
        xs = [torch.randn(B, T, D).requires_grad_() for _ in range(4)]
        first = call(xs[0])
        assert all(kind == "triton" for entries in first.values() for kind, _ in entries) and len(keyed) == 8
        replays = call(xs[1])
        assert len(keyed) == 8                                  # no Launcher key built
        for backward in (False, True):                          # the plans' replays dropped
            samu_chunk._Plan(B, T, D // 2, 8, torch.float32, backward).kept.clear()
        cached = call(xs[2])
        assert len(keyed) == 16
        for name in logs:
            for (_, args), (k1, v1), (k2, v2) in zip(first[name], replays[name], cached[name]):
                n = sum(isinstance(v, torch.Tensor) for v in args)
                assert (k1, k2) == ("launch", "launch") and v1[n:] == v2[n:] and v1[n:len(args)] == args[n:]
                if name != "_group_kernel":                     # x leads
                    assert (v1[0], v2[0]) == (xs[1].data_ptr(), xs[2].data_ptr())
        call(xs[3])
        assert len(keyed) == 16 and logs["_bwd_kernel"][-1][1][0] == xs[3].data_ptr()
        call(torch.randn(B * T * D + 1)[1:].view(B, T, D).requires_grad_())     # 4 bytes past alignment
        # the 4 launches reading x through the Launcher (a new key: Triton's path), the prefix replayed
        assert len(keyed) == 20 and logs["_fwd_kernel"][-1][0] == "triton"
    finally:
        samu_chunk._Plan.cache_clear()


def test_reduce_dap_replays_a_repeated_launch(monkeypatch):
    """The RG-LRU's a_param reduction replays its launch for repeated sizes and dtypes: the
    new call's addresses, the first call's sizes; other sizes take the Launcher's path."""
    log = []
    monkeypatch.setattr(rglru_common, "_KEPT", {})
    _fake(monkeypatch, rglru_common, "reduce_dap_kernel", log)
    keyed = _keyed(monkeypatch)
    part, ap = torch.randn(6, 40), torch.randn(40)
    rglru_common.reduce_dap(part, ap)
    assert [k for k, _ in log] == ["triton"] and len(keyed) == 1
    part2, ap2 = part + 1, ap + 1
    dap = rglru_common.reduce_dap(part2, ap2)
    assert log[-1][0] == "launch" and log[-1][1][:5] == (part2.data_ptr(), ap2.data_ptr(), dap.data_ptr(), 6, 40)
    assert len(keyed) == 1
    rglru_common.reduce_dap(torch.randn(7, 40), ap)              # the Launcher's cached kernel, with R = 7
    assert len(keyed) == 2 and log[-1][0] == "launch" and log[-1][1][3] == 7
