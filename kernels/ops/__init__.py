"""Public ops: one signature per recurrence, the kernel chosen by a value.

`backend` is a name (README.md lists them) or a `Backend` (kernels.ops.tuning). "auto"
reads the caller's `Backend("auto", table=...)` or $KERNELS_TUNING_TABLE, else the
fastest exact default for the device (the reference on the CPU); resolutions are cached.
Every sequence op returns (y, final_state or None).
"""

from __future__ import annotations

import functools

import torch

from . import assoc, reference, tuning
from .checks import (COMPLEX_DTYPES, FLOAT_DTYPES, MODE_CONSTS, check_chunk_size, check_same_device,
                     check_scalar, check_segment_pos, check_tensor, cu_seqlens_to_segment_pos, shape_str,
                     state_dtype)
from .tuning import Backend, TuningTable

# Backend providers: BACKENDS = {op: {name: fn}}, optionally STEPS and INEXACT (never
# chosen). Renamed: the ops rglru and samu are defined below. Left out without Triton.
try:
    from . import rglru as rglru_kernels, samu as samu_kernels

    PROVIDERS = (rglru_kernels, samu_kernels, assoc)
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    samu_kernels = None
    PROVIDERS = (assoc,)

# Without a table entry: the fastest at the training shape on an H200 (re-tuned per GPU).
DEFAULT_ORDER = {"rglru": ("serial", "chunk"), "scan": ("serial", "chunk"), "samu": ("chunk", "serial"),
                 "rglru_step": ("fused",), "samu_step": ("fused",)}
# Backends taking `chunk_size` (checks.CHUNK_SIZES): chunk length or serial time tile.
CHUNK_SIZE_BACKENDS = ("chunk", "serial")


def _collect(attr: str, ops: tuple, suffix: str = "") -> dict:
    out = {op: {"reference": getattr(reference, op + suffix)} for op in ops}
    for mod in PROVIDERS:
        for op, fns in getattr(mod, attr, {}).items():
            out[op].update(fns)
    return out


_BACKENDS = _collect("BACKENDS", ("rglru", "samu", "scan"))
_STEPS = _collect("STEPS", ("rglru", "samu"), "_step")
# every op resolve() takes: the sequence ops and the decode steps ("rglru_step", "samu_step")
_CHOICES = {**_BACKENDS, **{f"{op}_step": fns for op, fns in _STEPS.items()}}


def _of(table: dict, op: str) -> dict:
    if op not in table:
        raise ValueError(f"expected op in {list(table)}, got {op!r}")
    return table[op]


def backends(op: str) -> dict:
    """Name -> callable for every backend of `op` ("rglru", "samu", "scan")."""
    return _of(_BACKENDS, op)


def step_backends(op: str) -> dict:
    """Name -> callable for every decode step backend of `op` ("rglru", "samu")."""
    return _of(_STEPS, op)


def inexact_backends() -> frozenset:
    """Backend names inexact by design: audited without gating, never selected."""
    return frozenset().union(*(getattr(mod, "INEXACT", ()) for mod in PROVIDERS))


# the CUDA device's name, as the tune stage records it
_gpu_name = torch.cuda.get_device_name


def _choose(op: str, backend, x, chunk_size=None) -> tuple[str, dict, object]:
    if chunk_size is not None:     # before the cache: 8.0 and True hash as 8 and 1
        check_chunk_size(chunk_size)
    b = Backend.of(backend)
    if b.name != "auto":        # a name's choice depends on nothing of x
        return _resolve_named(op, b, chunk_size)
    return _resolve(op, b, tuning.env_table() if b.table is None else None, x.dtype, x.shape, x.device, chunk_size)


def resolve(op: str, backend, x: torch.Tensor, chunk_size=None) -> tuple[str, dict]:
    """(backend name, launcher options) for `op` on x [B, T, D] or a decode step
    ("rglru_step", "samu_step") on x [B, D]; cached. chunk_size overrides a Backend's or a
    table's; a named backend outside CHUNK_SIZE_BACKENDS refuses it, "auto" drops it."""
    return _choose(op, backend, x, chunk_size)[:2]


def resolve_step(op: str, backend, x: torch.Tensor):
    """The decode step callable of `op` ("rglru", "samu") for x [B, D], options bound."""
    return _choose(f"{op}_step", backend, x)[2]


@functools.lru_cache(maxsize=1024)
def _resolve_named(op, b: Backend, chunk_size):
    avail = _CHOICES[op]
    if b.name not in avail:
        raise ValueError(f"expected backend in {['auto', *avail]} for {op}, got {b.name!r}")
    if chunk_size is not None and b.name not in CHUNK_SIZE_BACKENDS:
        raise ValueError(f"expected chunk_size only with backend in {['auto', *CHUNK_SIZE_BACKENDS]} "
                         f"(it applies to the chunk backend, and to serial as its time tile), "
                         f"got chunk_size={chunk_size!r} with backend {b.name!r}")
    return _bound(avail, b.name, {**b.options, **_chunk_opts(b.name, chunk_size)})


@functools.lru_cache(maxsize=4096)
def _resolve(op, b: Backend, env_table, dtype, shape, device, chunk_size):
    """Backend "auto": the table's entry for the call, else DEFAULT_ORDER (CUDA) or the reference."""
    avail = _CHOICES[op]
    table = b.table if b.table is not None else env_table
    entry = None
    if device.type == "cuda" and table is not None:
        gpu, dt = _gpu_name(device) if table.gpu else None, str(dtype).removeprefix("torch.")
        entry = (tuned_step(op.removesuffix("_step"), table, dt, shape[0], gpu) if op.endswith("_step")
                 else table.lookup(op, dt, *shape, gpu=gpu))
    if entry is not None and entry["backend"] in avail:
        opts = dict(entry.get("options", {}))
        if entry.get("chunk_size") is not None:
            opts["chunk_size"] = entry["chunk_size"]
        return _bound(avail, entry["backend"], {**opts, **_chunk_opts(entry["backend"], chunk_size)})
    for name in DEFAULT_ORDER[op] if device.type == "cuda" else ():
        if name in avail:
            return _bound(avail, name, _chunk_opts(name, chunk_size))
    return _bound(avail, "reference", {})


def _bound(avail: dict, name: str, opts: dict) -> tuple[str, dict, object]:
    return name, opts, functools.partial(avail[name], **opts) if opts else avail[name]


def _chunk_opts(name: str, chunk_size) -> dict:
    return {} if chunk_size is None or name not in CHUNK_SIZE_BACKENDS else {"chunk_size": chunk_size}


def tuned_step(op: str, table, dtype: str, B: int, gpu: str | None = None) -> dict | None:
    """The decode entry "auto" runs for `op`'s step at batch B on CUDA (nearest in log(B)
    among `op`'s step kernels), or None ("fused" runs)."""
    return table.step_choice(f"{op}_step", dtype, B, gpu, tuple(n for n in step_backends(op) if n != "reference"))


def step_has_backward(op: str, backend, device) -> bool:
    """Whether the decode step `backend` of `op` on `device` is differentiable (the reference only)."""
    b = Backend.of(backend)
    if b.name == "auto":
        return torch.device(device).type != "cuda" or "fused" not in step_backends(op)
    return b.name == "reference"


# Checked call signatures -> the backend callable. An op's checks and its backend choice read
# only the backend (and the table "auto" reads), the chunk size, and per argument a tensor's
# shape, dtype and device or another value's type, so a call repeating a signature skips them.
# The key holds the strides too: a decode step's replayed launch (kept per signature) takes
# contiguous tensors only.
_CHECKED: dict = {}


def _checked(op: str, backend, chunk_size, values: tuple, check):
    """check() (the op's checks, returning the backend callable) once per signature of `values`."""
    b = Backend.of(backend)
    try:
        key = (op, b, tuning.env_table() if b.name == "auto" and b.table is None else None, chunk_size,
               chunk_size.__class__,
               *[(v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v.__class__
                 for v in values])
        fn = _CHECKED.get(key)
    except TypeError:              # an unhashable value: check() names it
        return check()
    if fn is None:
        fn = check()
        if len(_CHECKED) >= 4096:
            _CHECKED.clear()
        _CHECKED[key] = fn
    return fn


def _sequence(op, x, args: tuple, check, segment_pos, initial_state, output_final_state, backend, chunk_size,
              cu_seqlens):
    """Call a sequence op: check() validates `args` (x among them); then the positions, the
    initial state and the devices are checked, once per signature (every call with cu_seqlens,
    whose values are checked)."""

    def checks():
        check()
        B, T = x.shape[:2]
        check_same_device(_NAMES[op], (*args, segment_pos, cu_seqlens, initial_state))
        if cu_seqlens is not None and segment_pos is not None:
            raise ValueError("expected at most one of segment_pos and cu_seqlens, got both")
        check_segment_pos(segment_pos, B, T)
        if initial_state is not None:
            width, dt = _STATE[op](x)
            check_tensor("initial_state", initial_state, shape=(B, width), dtypes=(dt,))
        return _choose(op, backend, x, chunk_size)[2]

    if cu_seqlens is None:
        fn = _checked(op, backend, chunk_size, (*args, segment_pos, initial_state), checks)
    else:
        fn = checks()
        segment_pos = cu_seqlens_to_segment_pos(cu_seqlens, *x.shape[:2], device=x.device)
    return fn(*args, segment_pos, initial_state, output_final_state)


# the arguments check_same_device names: each op's, then those _sequence / _step add
_POSITIONS = ("segment_pos", "cu_seqlens", "initial_state")
_SAMU_ARGS = ("x", "phase_dir", "radial_dir", "phase_amp", "radial_amp", "nu_log", "theta_log")
_NAMES = {"rglru": ("x", "gate_x", "gate_a", "a_param", *_POSITIONS), "samu": (*_SAMU_ARGS, *_POSITIONS),
          "scan": ("a", "b", *_POSITIONS),
          "rglru_step": ("x", "gate_x_w", "gate_x_b", "gate_a_w", "gate_a_b", "a_param", "state", "reset"),
          "samu_step": (*_SAMU_ARGS, "state", "reset", "modes")}
# each op's state: (width, dtype) for its x (b for the scan)
_STATE = {"rglru": lambda x: (x.shape[-1], state_dtype(x.dtype)),
          "samu": lambda x: (x.shape[-1] // 2, state_dtype(x.dtype, complex_state=True)),
          "scan": lambda b: (b.shape[-1], b.dtype if b.is_complex() else state_dtype(b.dtype))}
_STATE.update(rglru_step=_STATE["rglru"], samu_step=_STATE["samu"])


def rglru(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False,
          backend="auto", chunk_size=None, cu_seqlens=None):
    """RG-LRU from gate logits. x, gate_x, gate_a: [B, T, D]; a_param: [D]; segment_pos:
    [B, T] integer (0 = document start) or cu_seqlens [N+1] with B = 1; initial_state:
    [B, D] FP32 (float64 for float64 x). Returns (y, h or None)."""

    def check():
        check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
        B, T, D = x.shape
        check_tensor("gate_x", gate_x, shape=(B, T, D), dtypes=(x.dtype,))
        check_tensor("gate_a", gate_a, shape=(B, T, D), dtypes=(x.dtype,))
        check_tensor("a_param", a_param, shape=(D,), dtypes=FLOAT_DTYPES)

    return _sequence("rglru", x, (x, gate_x, gate_a, a_param), check, segment_pos, initial_state, output_final_state,
                     backend, chunk_size, cu_seqlens)


def _samu_args(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log) -> None:
    """SAMU's input and parameters checked against x [..., D] with D = 2M even."""
    D = x.shape[-1]
    if D % 2 or D == 0:
        raise ValueError(f"expected x of shape [{'B, T' if x.dim() == 3 else 'B'}, D] with D even (and > 0) for "
                         f"SAMU, got {shape_str(x)}")
    check_tensor("phase_dir", phase_dir, shape=(D + 1,), dtypes=FLOAT_DTYPES)
    check_tensor("radial_dir", radial_dir, shape=(D + 1,), dtypes=FLOAT_DTYPES)
    check_scalar("phase_amp", phase_amp)
    check_scalar("radial_amp", radial_amp)
    check_tensor("nu_log", nu_log, shape=(D // 2,), dtypes=FLOAT_DTYPES)
    check_tensor("theta_log", theta_log, shape=(D // 2,), dtypes=FLOAT_DTYPES)


def samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
         initial_state=None, output_final_state=False, backend="auto", chunk_size=None, cu_seqlens=None):
    """SAMU. x: [B, T, D] with D = 2M even; phase_dir, radial_dir: [D + 1]; phase_amp,
    radial_amp: floats or one-element tensors; nu_log, theta_log: [M]; segment_pos /
    cu_seqlens as for `rglru`; initial_state: [B, M] complex64 (complex128 for float64
    x). Returns (y [B, T, D], h or None)."""
    args = (x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log)

    def check():
        check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
        _samu_args(*args)

    return _sequence("samu", x, args, check, segment_pos, initial_state, output_final_state, backend, chunk_size,
                     cu_seqlens)


def scan(a, b, segment_pos=None, initial_state=None, output_final_state=False,
         backend="auto", chunk_size=None, cu_seqlens=None):
    """h_t = a_t h_{t-1} + b_t (a_t = 0 at resets). a, b: [B, T, D], both real or both
    complex (a taken in b's dtype); initial_state: [B, D] in the state dtype.
    Returns (y in b's dtype, h or None)."""

    def check():
        check_tensor("b", b, ndim=3, dtypes=FLOAT_DTYPES + COMPLEX_DTYPES)
        check_tensor("a", a, shape=b.shape, dtypes=COMPLEX_DTYPES if b.is_complex() else FLOAT_DTYPES)

    return _sequence("scan", b, (a, b), check, segment_pos, initial_state, output_final_state, backend, chunk_size,
                     cu_seqlens)


def _step(op, args: tuple, check, state, reset, backend, **kw):
    """Call a decode step: check() validates `args` (x first), then the state, reset and
    devices are checked, once per signature."""

    def checks():
        check()
        x = args[0]
        width, dt = _STATE[op](x)
        check_tensor("state", state, shape=(x.shape[0], width), dtypes=(dt,))
        if reset is not None:
            check_tensor("reset", reset, shape=(x.shape[0],), dtypes=(torch.bool,))
        check_same_device(_NAMES[op], (*args, state, reset, *kw.values()))
        name, _, fn = _choose(op, backend, x)
        # a Triton step keeps this signature's launch in its own plan (see rglru.step.rglru_step)
        return fn if name == "reference" else functools.partial(fn, plan=[None])

    return _checked(op, backend, None, (*args, state, reset, *kw.values()), checks)(*args, state, reset, **kw)


def rglru_step(x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, reset=None, backend="auto"):
    """One RG-LRU decode step with both gate matvecs. x: [B, D]; gate_*_w: [H, D/H, D/H];
    gate_*_b: [H, D/H]; a_param: [D]; state: [B, D] FP32, updated in place; reset: [B] bool.
    Returns y [B, D]. The Triton step has no backward (inputs requiring grad: ValueError)."""

    def check():
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        D = x.shape[1]
        check_tensor("gate_x_w", gate_x_w, ndim=3, dtypes=FLOAT_DTYPES)
        H, W = gate_x_w.shape[:2]
        if H * W != D or gate_x_w.shape[2] != W:
            raise ValueError(f"expected gate_x_w of shape [H, D/H, D/H] with D = {D}, got {shape_str(gate_x_w)}")
        check_tensor("gate_a_w", gate_a_w, shape=(H, W, W), dtypes=FLOAT_DTYPES)
        check_tensor("gate_x_b", gate_x_b, shape=(H, W), dtypes=FLOAT_DTYPES)
        check_tensor("gate_a_b", gate_a_b, shape=(H, W), dtypes=FLOAT_DTYPES)
        check_tensor("a_param", a_param, shape=(D,), dtypes=FLOAT_DTYPES)

    return _step("rglru_step", (x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param), check, state, reset, backend)


def samu_step(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset=None, backend="auto",
              modes=None):
    """One SAMU decode step. x: [B, D]; parameters as for `samu`; state: [B, M] complex64,
    updated in place; reset: [B] bool; modes: `samu_mode_table` of these very parameters,
    which the Triton steps read instead of recomputing it. No backward in the Triton steps."""
    args = (x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log)

    def check():
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        _samu_args(*args)
        if modes is not None:
            check_tensor("modes", modes, shape=(MODE_CONSTS, x.shape[1] // 2), dtypes=(state_dtype(x.dtype),))

    return _step("samu_step", args, check, state, reset, backend, modes=modes)


def samu_mode_table(nu_log, theta_log, dtype):
    """[7, M] per-mode constants that `samu_step(..., modes=...)` reads, for inputs of `dtype`."""
    check_tensor("nu_log", nu_log, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("theta_log", theta_log, shape=nu_log.shape, dtypes=FLOAT_DTYPES)
    check_same_device(("nu_log", "theta_log"), (nu_log, theta_log))
    if samu_kernels is None:
        raise RuntimeError("samu_mode_table needs Triton (the table is read by the Triton decode steps only)")
    return samu_kernels.mode_table(nu_log.contiguous(), theta_log.contiguous(), state_dtype(dtype))


__all__ = ["rglru", "samu", "scan", "rglru_step", "samu_step", "samu_mode_table", "backends", "step_backends",
           "inexact_backends", "resolve", "resolve_step", "tuned_step", "step_has_backward", "reference", "tuning",
           "Backend", "TuningTable"]
