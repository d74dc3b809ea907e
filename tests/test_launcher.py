"""kernels.ops.triton_utils.Launcher: the first call of an argument signature goes through
the wrapped JIT function, later ones launch its compiled kernel directly with every
argument in signature order; any change Triton would specialise on takes Triton's path
again. Triton and CUDA are replaced by recording fakes (no GPU here)."""

import inspect
import types

import pytest
import torch
import triton.language as tl

from kernels.ops import triton_utils as tu


def kern(x, y, n, eps, B, FLAG=False, MODE=1):     # the wrapped kernel's signature
    pass


class FakeRun:
    """Triton's launcher object: __call__ allocates any scratch, then calls the C `launch`.
    With a `log`, a C launch also adds ("launch", its runtime values) to it."""
    launch_cooperative_grid, launch_pdl, profile_scratch_size = "coop", "pdl", 0

    def __init__(self, scratch, runs, log=None):
        self.global_scratch_size, self.runs, self.log = scratch, runs, log

    def __call__(self, *a):
        self.runs.append(("run", *a))

    def launch(self, *a):
        self.runs.append(("launch", *a))
        if self.log is not None:
            self.log.append(("launch", a[13:]))      # after grid, stream, function and metadata


class FakeCompiled:
    function, packed_metadata = "fn", "meta"
    scratch = 0

    def __init__(self, log=None):
        self.runs = []
        self.run = FakeRun(self.scratch, self.runs, log)


class FakeJit:
    """A JIT function of kern's signature, or of the Python kernel `fn`'s; with a `log`, a
    call (a compilation) adds ("triton", its positional arguments) to it."""
    arg_names = ["x", "y", "n", "eps", "B", "FLAG", "MODE"]
    constexprs = [4, 5, 6]
    fn = staticmethod(kern)

    def __init__(self, fn=None, log=None):
        if fn is not None:
            params = inspect.signature(fn).parameters.values()
            self.fn, self.arg_names = fn, [p.name for p in params]
            self.constexprs = [i for i, p in enumerate(params) if p.annotation in (tl.constexpr, "tl.constexpr")]
        self.calls, self.compiled, self.log = [], [], log

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            if self.log is not None:
                self.log.append(("triton", args))
            self.compiled.append(FakeCompiled(self.log))
            return self.compiled[-1]
        return run


@pytest.fixture
def launch(monkeypatch):
    monkeypatch.setattr(tu, "_raw_stream", lambda: (0, 1234))
    hooks = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]),
                                  launch_exit_hook=types.SimpleNamespace(calls=[]))
    monkeypatch.setattr(tu.triton, "knobs", types.SimpleNamespace(runtime=hooks))
    fake = FakeJit()
    return fake, tu.Launcher(fake), hooks


def test_second_call_launches_the_compiled_kernel_with_every_argument_in_order(launch):
    fake, k, _ = launch
    x, y = torch.zeros(8), torch.zeros(8)
    k[(3, 2)](x, y, 40, 0.5, B=16, num_warps=4)
    assert len(fake.calls) == 1 and fake.calls[0] == ((3, 2), (x, y, 40, 0.5), {"B": 16, "num_warps": 4})
    k[(5,)](x, y, 40, 0.25, B=16, num_warps=4)           # same signature: no Triton call
    assert len(fake.calls) == 1
    (run,) = fake.compiled[0].runs
    # the C launch: grid, stream, function, its launch flags, no scratch, metadata, no hooks
    assert run[:14] == ("launch", 5, 1, 1, 1234, "fn", "coop", "pdl", None, None, "meta", None, None, None)
    # tensors as their addresses, defaults applied, constexprs included
    assert run[14:] == (x.data_ptr(), y.data_ptr(), 40, 0.25, 16, False, 1)


def test_a_kernel_with_scratch_launches_through_tritons_launcher_object(launch, monkeypatch):
    monkeypatch.setattr(FakeCompiled, "scratch", 256)
    fake, k, _ = launch
    x = torch.zeros(8)
    k[(2,)](x, x, 40, 0.5, B=16)
    k[(2,)](x, x, 40, 0.5, B=16)
    (run,) = fake.compiled[0].runs
    assert run == ("run", 2, 1, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), x.data_ptr(), 40, 0.5, 16,
                   False, 1)


@pytest.mark.parametrize("positional", [True, False])
@pytest.mark.parametrize("change", ["dtype", "misaligned", "one", "div16", "wide", "constexpr", "default",
                                    "bool_for_int", "warps"])
def test_whatever_triton_specialises_on_takes_its_path_again(launch, change, positional):
    """Runtime arguments by position (the launchers' calls): cached, and a new entry for
    any change; by keyword: Triton's path every time."""
    fake, k, _ = launch
    base = torch.zeros(64)
    args = dict(x=base[:8], y=base[8:16], n=40, eps=0.5, B=16)
    opts = {"num_warps": 4}

    def call(a, o):
        if positional:
            k[(1,)](a["x"], a["y"], a["n"], a["eps"], **{n: v for n, v in a.items() if n not in "x y n eps"}, **o)
        else:
            k[(1,)](**a, **o)
    call(args, opts)
    call(args, opts)
    assert len(fake.calls) == (1 if positional else 2) and len(fake.compiled[0].runs) == (1 if positional else 0)
    if not positional:
        return
    new = dict(args)
    if change == "dtype":
        new["x"] = base[:8].double()
    elif change == "misaligned":
        new["x"] = base[1:9]                     # 4 bytes off a 16-byte boundary
    elif change == "one":
        new["n"] = 1
    elif change == "div16":
        new["n"] = 48
    elif change == "wide":
        new["n"] = 1 << 33
    elif change == "constexpr":
        new["B"] = 32
    elif change == "default":
        new["FLAG"] = True
    elif change == "bool_for_int":
        new["MODE"] = True                       # equal to the default 1, not the same constexpr
    else:
        opts = {"num_warps": 8}
    call(new, opts)
    assert len(fake.calls) == 2 and len(fake.compiled[0].runs) == 1


def test_hooks_tuple_free_grids_and_missing_arguments_go_through_triton(launch):
    fake, k, hooks = launch
    x = torch.zeros(8)
    k[(1,)](x, x, 40, 0.5, B=16)
    hooks.launch_enter_hook.calls.append(print)           # a profiler's hook
    k[(1,)](x, x, 40, 0.5, B=16)
    hooks.launch_enter_hook.calls.clear()
    k[[1]](x, x, 40, 0.5, B=16)                            # a list grid
    k[(1,)](x, x, 40, 0.5)                                 # B missing: Triton raises its own error
    assert len(fake.calls) == 4 and not any(c.runs for c in fake.compiled)
    k[(1,)](x, x, 40, 0.5, B=16)
    assert len(fake.calls) == 4 and len(fake.compiled[-1].runs) + len(fake.compiled[2].runs) >= 1


def test_interpreter_keeps_the_jit_function():
    fake = FakeJit()
    assert (tu.launcher(fake) is fake) == tu.INTERPRET


@pytest.mark.cuda
def test_on_the_gpu_the_second_call_skips_triton_and_writes_the_same_result(monkeypatch):
    """A real kernel: the first call compiles through Triton and fills the cache, the
    second launches the cached binary (Triton's run is not entered) with new inputs and
    writes what Triton's own launch writes."""
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x, y, out, n, a, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(out + o, a * tl.load(x + o, mask=m) + tl.load(y + o, mask=m), mask=m)

    k = tu.Launcher(axpy)
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out = torch.full_like(x, float("nan"))
    k[(8,)](x, y, out, 1000, 2.0, BLOCK=128)
    assert len(k.cache) == 1
    torch.testing.assert_close(out, 2.0 * x + y)
    entered = []
    original = axpy.run
    monkeypatch.setattr(axpy, "run", lambda *a, **kw: entered.append(1) or original(*a, **kw))
    x2, out2 = torch.randn(1000, device="cuda"), torch.full_like(x, float("nan"))
    k[(8,)](x2, y, out2, 1000, -0.5, BLOCK=128)
    torch.cuda.synchronize()
    assert not entered and len(k.cache) == 1
    want = torch.full_like(x, float("nan"))
    axpy[(8,)](x2, y, want, 1000, -0.5, BLOCK=128)
    assert torch.equal(out2, want)
    # a CPU tensor keys apart from the cached entry: Triton's own pointer check rejects it
    with pytest.raises(ValueError, match="cpu tensor"):
        k[(8,)](x2.cpu(), y, out2, 1000, -0.5, BLOCK=128)
