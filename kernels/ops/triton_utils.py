"""What every Triton kernel module shares: accumulation dtypes, output allocation
(NaN-filled inside `poisoned()` or with KERNELS_POISON=1), the `launcher`, and BF16
round-to-nearest-even by hand under the CPU interpreter, which truncates where the GPU
rounds (kernels take RNE=INTERPRET and store through `out`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_POISON = [os.environ.get("KERNELS_POISON", "") == "1"]


@contextlib.contextmanager
def poisoned():
    """Allocate every kernel output filled with NaN inside the block."""
    _POISON.append(True)
    try:
        yield
    finally:
        _POISON.pop()


def empty(shape, dtype, device) -> torch.Tensor:
    if _POISON[-1]:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """`empty` of a contiguous t's shape, dtype and device (half of torch.empty's host time)."""
    return torch.full_like(t, float("nan")) if _POISON[-1] else torch.empty_like(t)


def scratch(dtype, device, *shapes) -> list[torch.Tensor]:
    """Buffers of `shapes` carved from one allocation at 256-byte aligned offsets (one
    allocator call); for buffers that die together."""
    n, views = _layout(dtype.itemsize, shapes)
    buf = empty((n,), dtype, device)
    return [buf.as_strided(shape, stride, off) for shape, stride, off in views]


@functools.lru_cache(maxsize=1024)
def _layout(itemsize: int, shapes: tuple) -> tuple[int, tuple]:
    """(elements of the allocation, (shape, contiguous strides, offset) per buffer)."""
    step = max(1, 256 // itemsize)
    n, views = 0, []
    for shape in shapes:
        views.append((shape, tuple(math.prod(shape[i + 1:]) for i in range(len(shape))), n))
        n += cdiv(math.prod(shape), step) * step
    return n, tuple(views)


def tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def check_pow2(name: str, value, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"expected {name} to be a power of two in [{lo}, {hi}], got {value!r}")
    return value


def opts_key(opts: dict) -> tuple:
    """Launcher options as a cache key keeping each value's type (8.0 and True hash as 8 and 1)."""
    return tuple(sorted((k, v.__class__, v) for k, v in opts.items())) if opts else ()


def opts_items(key: tuple) -> dict:
    return {k: v for k, _, v in key}


def spec_of(cfg: dict) -> str:
    """A launch configuration as the string a custom op carries ("BD=64,backend=serial,...")."""
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))


@functools.lru_cache(maxsize=1024)
def cfg_of(spec: str) -> dict:
    """The configuration of spec_of's string."""
    items = (item.split("=", 1) for item in spec.split(","))
    return {k: v == "True" if v in ("True", "False") else int(v) if v.lstrip("-").isdigit() else v for k, v in items}


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); triton's helper costs microseconds."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _raw_stream():
    device = torch._C._cuda_getDevice()
    return device, torch._C._cuda_getCurrentRawStream(device)


class Launcher:
    """A JIT kernel launched as `k[grid](*args, **kwargs)`, runtime arguments by position.
    The first call of an argument signature goes through Triton and keeps the compiled
    kernel under a key finer than Triton's (device; per argument a tensor's dtype, device
    kind and 16-byte alignment, an int's specialisation, a constexpr's value; the
    keywords). Later calls hand the C launcher the tensors' addresses, skipping tens of
    microseconds of Triton's binding. CPU tensors, runtime arguments by keyword, launch
    hooks and unhashable arguments take Triton's path every time."""

    __slots__ = ("fn", "names", "runtime_names", "const", "defaults", "cache", "last")

    def __init__(self, fn):
        self.fn = fn
        self.names = tuple(fn.arg_names)
        self.const = tuple(i in fn.constexprs for i in range(len(self.names)))
        self.runtime_names = frozenset(n for n, c in zip(self.names, self.const) if not c)
        self.defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}
        self.cache, self.last = {}, None

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if not self.runtime_names.isdisjoint(kwargs):
            return self.fn[grid](*args, **kwargs)
        # One pass gives the C launcher's values (a tensor's address, any other value as is)
        # and the key, flat: a tensor adds its dtype, device kind and 16-byte alignment; an
        # int (not constexpr) what Triton specialises on (== 1, divisibility by 16, whether it
        # fits int32, int64 or only uint64); a float its type; any other value, and a
        # constexpr, its type and value. Each entry's first item (a dtype, a bool, a type)
        # tells its kind, so keys of different signatures never collide.
        vals, key = [], [*kwargs.items(), *map(type, kwargs.values())]
        val, add = vals.append, key.append
        try:
            for v, c in zip(args, self.const):
                if isinstance(v, torch.Tensor):
                    p = v.data_ptr()
                    val(p)
                    add(v.dtype), add(v.is_cuda), add(p & 15 == 0)
                    continue
                val(v)
                if c or (v.__class__ is not int and v.__class__ is not float):
                    add(v.__class__), add(v)
                elif v.__class__ is int:
                    add(v == 1), add(v & 15 == 0), add(-0x80000000 <= v < 0x80000000), add(v < 1 << 63)
                else:
                    add(float)
            device, stream = _raw_stream()
            add(device)
            key = tuple(key)
            hit = self.cache.get(key)
        except TypeError:                  # an unhashable argument
            return self.fn[grid](*args, **kwargs)
        if hit is None or grid.__class__ is not tuple or _hooked():
            ck = self.fn[grid](*args, **kwargs)
            if ck is not None:
                try:
                    tail = tuple(kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args):])
                except KeyError:           # a missing argument: Triton has raised or will
                    return ck
                run = ck.run
                # the C launch itself where the kernel needs no scratch the Python wrapper allocates
                direct = not run.global_scratch_size and not run.profile_scratch_size
                self.cache[key] = hit = (ck, tail, run.launch if direct else None, run, ck.function,
                                         ck.packed_metadata, run.launch_cooperative_grid, run.launch_pdl)
                self.last = (hit, grid, vals, device)
            return ck
        self.last = (hit, grid, vals, device)
        ck, tail, launch, run, function, meta, coop, pdl = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if launch is not None:
            launch(grid[0], g1, g2, stream, function, coop, pdl, None, None, meta, None, None, None, *vals, *tail)
        else:
            run(grid[0], g1, g2, stream, function, meta, None, None, None, *vals, *tail)
        return ck


def replay(kernel, tensors: tuple):
    """The last launch of `kernel` (a Launcher) again, with other tensors in the places of
    `tensors` (its leading arguments, which that launch took) and its grid and later values:
    `fn(*tensors)` launches and returns True, or returns False where it may not (a tensor not
    16-byte aligned, another current device, launch hooks); None where that launch took
    Triton's path. For a caller that knows the new tensors keep the old ones' dtypes and
    devices (one checked call signature)."""
    last, n = getattr(kernel, "last", None), len(tensors)
    if (last is None or last[0][2] is None or last[1].__class__ is not tuple
            or last[2][:n] != [t.data_ptr() for t in tensors]):
        return None
    (_, tail, launch, _, function, meta, coop, pdl), grid, vals, device = last
    if functools.reduce(operator.or_, vals[:n]) & 15:
        return None
    g0, g1, g2 = (*grid, 1, 1)[:3]
    rest = (*vals[n:], *tail)

    def fn(*ts):
        ptrs = [t.data_ptr() for t in ts]
        dev, stream = _raw_stream()
        if dev != device or functools.reduce(operator.or_, ptrs) & 15 or _hooked():
            return False
        launch(g0, g1, g2, stream, function, coop, pdl, None, None, meta, None, None, None, *ptrs, *rest)
        return True
    return fn


def replayed(kept: dict, key, kernel, grid, args: tuple, n: int, **kwargs):
    """kernel[grid](*args, **kwargs), from the second call under `key` through `replay` of the leading n
    tensors: the caller's promise that the key fixes the grid, args[n:], kwargs and those tensors' dtypes."""
    fn = kept.get(key)
    if fn is not None and fn(*args[:n]):
        return
    kernel.last = None
    kernel[grid](*args, **kwargs)
    if fn is None:
        if len(kept) >= 4096:
            kept.clear()
        kept[key] = replay(kernel, args[:n])


def _hooked() -> bool:
    rt = triton.knobs.runtime
    return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)


def launcher(fn):
    """`@launcher` above `@triton.jit` on a kernel launched from the host (not traced by
    torch.compile): a Launcher, or the JIT function itself under the CPU interpreter."""
    return fn if INTERPRET else Launcher(fn)


@triton.jit
def gelu_tanh(x):
    """GeLU (tanh approximation) of FP32 x without libdevice, so the interpreter runs it as
    the GPU does."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))


@triton.jit
def rne_bf16(v):
    """FP32 v rounded to the nearest BF16 (ties to even), returned as FP32."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def out(v, ptr, RNE: tl.constexpr):
    """v cast to ptr's element type for a store; RNE: BF16 rounded to nearest even first."""
    ty = ptr.dtype.element_ty
    if RNE and ty == tl.bfloat16:
        v = rne_bf16(v.to(tl.float32))
    return v.to(ty)


def multiprocessors(device: torch.device):
    """The CUDA device's multiprocessor count (None elsewhere)."""
    return _props(device, "multi_processor_count")


def smem_limit(device: torch.device):
    """Shared memory one program may use on a CUDA device (None elsewhere: no limit)."""
    return _props(device, "shared_memory_per_block_optin")


def _props(device: torch.device, name: str):
    if device.type != "cuda":
        return None
    return getattr(_props_of(device.index if device.index is not None else torch.cuda.current_device()), name)


# queried once per device: the launchers run on the host's critical path
_props_of = functools.lru_cache(maxsize=None)(torch.cuda.get_device_properties)
