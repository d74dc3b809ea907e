"""Public ops: one signature per recurrence, the kernel chosen by a value.

`backend` is a name or a `Backend` (kernels.ops.tuning): "reference" (PyTorch), the
Triton backends ("serial", "chunk", ...) and the PyTorch associative scans ("assoc",
"assoc_bf16": inexact by design). "auto" reads the caller's `Backend("auto", table=...)`
or $KERNELS_TUNING_TABLE, else the fastest exact default for the device (the reference
on the CPU); resolutions are cached. Every op returns (y, final_state or None).
"""

from __future__ import annotations

import functools

import torch

from . import assoc, reference, tuning
from .checks import (COMPLEX_DTYPES, FLOAT_DTYPES, MODE_CONSTS, check_chunk_size, check_same_device,
                     check_scalar, check_segment_pos, check_tensor, cu_seqlens_to_segment_pos, shape_str,
                     state_dtype)
from .tuning import Backend, TuningTable

# Backend providers: BACKENDS = {op: {name: fn}}, optionally STEPS (decode steps) and
# INEXACT (names never chosen). Imported before the ops rglru and samu are defined below,
# so those names stay the functions; without Triton the Triton packages are left out.
PROVIDERS = []
_samu_kernels = None
try:
    from . import rglru as _rglru_kernels
    from . import samu as _samu_kernels

    PROVIDERS += [_rglru_kernels, _samu_kernels]
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
PROVIDERS.append(assoc)


DEFAULT_ORDER = {"rglru": ("serial", "chunk"), "scan": ("serial", "chunk"), "samu": ("chunk", "serial")}
# Backends taking `chunk_size` (checks.CHUNK_SIZES): chunk length or serial time tile.
CHUNK_SIZE_BACKENDS = ("chunk", "serial")


@functools.cache
def _provided(table: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for mod in PROVIDERS:
        for op, fns in getattr(mod, table, {}).items():
            out.setdefault(op, {}).update(fns)
    return out


_BACKENDS = {op: {"reference": getattr(reference, op), **_provided("BACKENDS").get(op, {})}
             for op in ("rglru", "samu", "scan")}
_STEPS = {op: {"reference": getattr(reference, f"{op}_step"), **_provided("STEPS").get(op, {})}
          for op in ("rglru", "samu")}


def backends(op: str) -> dict:
    """Name -> callable for every backend of `op` ("rglru", "samu", "scan")."""
    if op not in ("rglru", "samu", "scan"):
        raise ValueError(f"expected op in ['rglru', 'samu', 'scan'], got {op!r}")
    return _BACKENDS[op]


@functools.cache
def inexact_backends() -> frozenset:
    """Backend names inexact by design: audited without gating, never selected."""
    out = set()
    for mod in PROVIDERS:
        out |= set(getattr(mod, "INEXACT", ()))
    return frozenset(out)


def step_backends(op: str) -> dict:
    """Name -> callable for every decode step backend of `op` ("rglru", "samu")."""
    if op not in ("rglru", "samu"):
        raise ValueError(f"expected op in ['rglru', 'samu'], got {op!r}")
    return _STEPS[op]


@functools.lru_cache(maxsize=None)
def _gpu_name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _gpu_name(device: torch.device) -> str | None:
    """The CUDA device's name, as the tune stage records it (cached: no query per call)."""
    return _gpu_name_of(device.index if device.index is not None else torch.cuda.current_device())


def resolve(op: str, backend, x: torch.Tensor, chunk_size=None) -> tuple[str, dict]:
    """(backend name, launcher options) for a call of `op` on x [B, T, D]; cached.

    chunk_size (checked here) overrides a Backend's or a table entry's; with another
    backend than CHUNK_SIZE_BACKENDS it raises ValueError, except under "auto", where it
    is dropped when the backend chosen does not take it (as on the CPU)."""
    if chunk_size is not None:     # before the cache: 8.0 and True hash as 8 and 1
        check_chunk_size(chunk_size)
    b = Backend.of(backend)
    B, T, D = x.shape
    env = tuning.env_table() if b.name == "auto" and b.table is None else None
    return _resolve(op, b, env, x.dtype, B, T, D, x.device, chunk_size)


@functools.lru_cache(maxsize=4096)
def _resolve(op, b: Backend, env_table, dtype, B, T, D, device, chunk_size):
    avail = backends(op)
    if b.name != "auto":
        if b.name not in avail:
            raise ValueError(f"expected backend in {['auto', *avail]} for {op}, got {b.name!r}")
        if chunk_size is not None and b.name not in CHUNK_SIZE_BACKENDS:
            raise ValueError(f"expected chunk_size only with backend in {['auto', *CHUNK_SIZE_BACKENDS]} "
                             f"(it applies to the chunk backend, and to serial as its time tile), "
                             f"got chunk_size={chunk_size!r} with backend {b.name!r}")
        return b.name, {**b.options, **_chunk_opts(b.name, chunk_size)}
    if device.type != "cuda":
        return "reference", {}
    table = b.table if b.table is not None else env_table
    entry = None
    if table is not None:
        entry = table.lookup(op, str(dtype).removeprefix("torch."), B, T, D,
                             gpu=_gpu_name(device) if table.gpu else None)
    if entry is not None and entry["backend"] in avail:
        opts = dict(entry.get("options", {}))
        if entry.get("chunk_size") is not None:
            opts["chunk_size"] = entry["chunk_size"]
        opts.update(_chunk_opts(entry["backend"], chunk_size))
        return entry["backend"], opts
    # Without a table entry: the fastest at the training shape on an H200 (re-tuned per GPU).
    for name in DEFAULT_ORDER[op]:
        if name in avail:
            return name, _chunk_opts(name, chunk_size)
    return "reference", {}


def _chunk_opts(name: str, chunk_size) -> dict:
    return {} if chunk_size is None or name not in CHUNK_SIZE_BACKENDS else {"chunk_size": chunk_size}


def _positions(x, segment_pos, cu_seqlens):
    B, T = x.shape[0], x.shape[1]
    if cu_seqlens is not None:
        if segment_pos is not None:
            raise ValueError("expected at most one of segment_pos and cu_seqlens, got both")
        return cu_seqlens_to_segment_pos(cu_seqlens, B, T, device=x.device)
    return check_segment_pos(segment_pos, B, T)


def _check_state(initial_state, B, width, dtype):
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(B, width), dtypes=(dtype,))


def rglru(x, gate_x, gate_a, a_param, segment_pos=None, initial_state=None, output_final_state=False,
          backend="auto", chunk_size=None, cu_seqlens=None):
    """RG-LRU from gate logits. x, gate_x, gate_a: [B, T, D]; a_param: [D]; segment_pos:
    [B, T] integer (0 = document start, any other value continues) or cu_seqlens [N+1]
    with B = 1; initial_state: [B, D] FP32 (float64 for float64 x). Returns (y, h or None)."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    B, T, D = x.shape
    check_tensor("gate_x", gate_x, shape=(B, T, D), dtypes=(x.dtype,))
    check_tensor("gate_a", gate_a, shape=(B, T, D), dtypes=(x.dtype,))
    check_tensor("a_param", a_param, shape=(D,), dtypes=FLOAT_DTYPES)
    check_same_device(x=x, gate_x=gate_x, gate_a=gate_a, a_param=a_param,
                      segment_pos=segment_pos, cu_seqlens=cu_seqlens, initial_state=initial_state)
    segment_pos = _positions(x, segment_pos, cu_seqlens)
    _check_state(initial_state, B, D, state_dtype(x.dtype))
    name, opts = resolve("rglru", backend, x, chunk_size)
    return backends("rglru")[name](x, gate_x, gate_a, a_param, segment_pos, initial_state, output_final_state, **opts)


def _check_samu_params(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, **others):
    """SAMU's parameters against x [..., D]; every tensor, `others` included, on x's device."""
    D = x.shape[-1]
    M = D // 2
    check_tensor("phase_dir", phase_dir, shape=(D + 1,), dtypes=FLOAT_DTYPES)
    check_tensor("radial_dir", radial_dir, shape=(D + 1,), dtypes=FLOAT_DTYPES)
    check_scalar("phase_amp", phase_amp)
    check_scalar("radial_amp", radial_amp)
    check_tensor("nu_log", nu_log, shape=(M,), dtypes=FLOAT_DTYPES)
    check_tensor("theta_log", theta_log, shape=(M,), dtypes=FLOAT_DTYPES)
    check_same_device(x=x, phase_dir=phase_dir, radial_dir=radial_dir, phase_amp=phase_amp,
                      radial_amp=radial_amp, nu_log=nu_log, theta_log=theta_log, **others)


def samu(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, segment_pos=None,
         initial_state=None, output_final_state=False, backend="auto", chunk_size=None, cu_seqlens=None):
    """SAMU. x: [B, T, D] with D = 2M even; phase_dir, radial_dir: [D + 1]; phase_amp,
    radial_amp: floats or one-element tensors; nu_log, theta_log: [M]; segment_pos /
    cu_seqlens as for `rglru`; initial_state: [B, M] complex64 (complex128 for float64
    x). Returns (y [B, T, D], h or None)."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    B, T, D = x.shape
    if D % 2 or D == 0:
        raise ValueError(f"expected x of shape [B, T, D] with D even (and > 0) for SAMU, got {shape_str(x)}")
    M = D // 2
    _check_samu_params(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
                       segment_pos=segment_pos, cu_seqlens=cu_seqlens, initial_state=initial_state)
    segment_pos = _positions(x, segment_pos, cu_seqlens)
    _check_state(initial_state, B, M, state_dtype(x.dtype, complex_state=True))
    name, opts = resolve("samu", backend, x, chunk_size)
    return backends("samu")[name](x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log,
              segment_pos, initial_state, output_final_state, **opts)


def scan(a, b, segment_pos=None, initial_state=None, output_final_state=False,
         backend="auto", chunk_size=None, cu_seqlens=None):
    """h_t = a_t h_{t-1} + b_t (a_t = 0 at resets). a, b: [B, T, D], both real or both
    complex (a taken in b's dtype); initial_state: [B, D] in the state dtype.
    Returns (y in b's dtype, h or None)."""
    check_tensor("b", b, ndim=3, dtypes=FLOAT_DTYPES + COMPLEX_DTYPES)
    B, T, D = b.shape
    check_tensor("a", a, shape=(B, T, D), dtypes=COMPLEX_DTYPES if b.is_complex() else FLOAT_DTYPES)
    check_same_device(a=a, b=b, segment_pos=segment_pos, cu_seqlens=cu_seqlens, initial_state=initial_state)
    segment_pos = _positions(b, segment_pos, cu_seqlens)
    if b.is_complex():
        sd = torch.complex128 if b.dtype == torch.complex128 else torch.complex64
    else:
        sd = state_dtype(b.dtype)
    _check_state(initial_state, B, D, sd)
    name, opts = resolve("scan", backend, b, chunk_size)
    return backends("scan")[name](a, b, segment_pos, initial_state, output_final_state, **opts)


def resolve_step(op: str, backend, x: torch.Tensor):
    """The decode step callable of `op` for x [B, D]. "auto": on CUDA the tuning table's
    decode entry for x's dtype nearest in log(B) (the Backend's table, else the one at
    $KERNELS_TUNING_TABLE), else "fused"; the reference off CUDA."""
    b = Backend.of(backend)
    if b.name != "auto" or not x.is_cuda:
        return _resolve_step(op, b, x.device.type)
    table = b.table if b.table is not None else tuning.env_table()
    if table is None or not table.steps:
        return _resolve_step(op, b, "cuda")
    return _resolve_step(op, b, "cuda", table, str(x.dtype).removeprefix("torch."), x.shape[0] if x.dim() else 0,
                         _gpu_name(x.device) if table.gpu else None)


def tuned_step(op: str, table, dtype: str, B: int, gpu: str | None = None) -> dict | None:
    """The decode entry of `table` that backend "auto" runs for `op`'s step at batch B on
    CUDA (nearest in log(B) among the step kernels `op` has), or None ("fused" runs)."""
    return table.step_choice(f"{op}_step", dtype, B, gpu, tuple(n for n in step_backends(op) if n != "reference"))


@functools.lru_cache(maxsize=1024)
def _resolve_step(op, b: Backend, device_type, table=None, dtype=None, B=0, gpu=None):
    avail = step_backends(op)
    if b.name == "auto":
        if device_type != "cuda" or "fused" not in avail:
            return avail["reference"]
        e = tuned_step(op, table, dtype, B, gpu) if table is not None else None
        name, opts = (e["backend"], e.get("options") or {}) if e is not None else ("fused", {})
    elif b.name not in avail:
        raise ValueError(f"expected backend in {['auto', *avail]} for {op}_step, got {b.name!r}")
    else:
        name, opts = b.name, b.options
    return functools.partial(avail[name], **opts) if opts else avail[name]


def step_has_backward(op: str, backend, device) -> bool:
    """Whether the decode step `backend` of `op` on `device` is differentiable (the reference only)."""
    fn = _resolve_step(op, Backend.of(backend), torch.device(device).type)
    return getattr(fn, "func", fn) is step_backends(op)["reference"]


def rglru_step(x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, reset=None, backend="auto"):
    """One RG-LRU decode step with both block-diagonal gate matvecs. x: [B, D]; gate_*_w:
    [H, D/H, D/H]; gate_*_b: [H, D/H]; a_param: [D]; state: [B, D] FP32, updated in
    place; reset: [B] bool. Returns y [B, D]. The Triton step has no backward: an input
    requiring grad under grad mode raises ValueError."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    check_tensor("state", state, shape=(B, D), dtypes=(state_dtype(x.dtype),))
    check_tensor("gate_x_w", gate_x_w, ndim=3, dtypes=FLOAT_DTYPES)
    H, W = gate_x_w.shape[:2]
    if H * W != D or gate_x_w.shape[2] != W:
        raise ValueError(f"expected gate_x_w of shape [H, D/H, D/H] with D = {D}, got {shape_str(gate_x_w)}")
    check_tensor("gate_a_w", gate_a_w, shape=(H, W, W), dtypes=FLOAT_DTYPES)
    check_tensor("gate_x_b", gate_x_b, shape=(H, W), dtypes=FLOAT_DTYPES)
    check_tensor("gate_a_b", gate_a_b, shape=(H, W), dtypes=FLOAT_DTYPES)
    check_tensor("a_param", a_param, shape=(D,), dtypes=FLOAT_DTYPES)
    if reset is not None:
        check_tensor("reset", reset, shape=(B,), dtypes=(torch.bool,))
    check_same_device(x=x, state=state, gate_x_w=gate_x_w, gate_x_b=gate_x_b, gate_a_w=gate_a_w,
                      gate_a_b=gate_a_b, a_param=a_param, reset=reset)
    return resolve_step("rglru", backend, x)(x, gate_x_w, gate_x_b, gate_a_w, gate_a_b, a_param, state, reset)


def samu_step(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state, reset=None, backend="auto",
              modes=None):
    """One SAMU decode step. x: [B, D]; parameters as for `samu`; state: [B, M] complex64,
    updated in place; reset: [B] bool; modes: `samu_mode_table(nu_log, theta_log, x.dtype)`
    of these very parameters (recompute it after they change), which the Triton steps read
    instead of recomputing the per-mode constants in float64 (the reference ignores it).
    Returns y [B, D]. No backward in the Triton steps."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    if D % 2 or D == 0:
        raise ValueError(f"expected x of shape [B, D] with D even (and > 0) for SAMU, got {shape_str(x)}")
    check_tensor("state", state, shape=(B, D // 2), dtypes=(state_dtype(x.dtype, complex_state=True),))
    if reset is not None:
        check_tensor("reset", reset, shape=(B,), dtypes=(torch.bool,))
    _check_samu_params(x, phase_dir, radial_dir, phase_amp, radial_amp, nu_log, theta_log, state=state, reset=reset,
                       modes=modes)
    if modes is not None:
        check_tensor("modes", modes, shape=(MODE_CONSTS, D // 2), dtypes=(state_dtype(x.dtype),))
    return resolve_step("samu", backend, x)(x, phase_dir, radial_dir, phase_amp, radial_amp,
                                             nu_log, theta_log, state, reset, modes=modes)


def samu_mode_table(nu_log, theta_log, dtype):
    """[7, M] per-mode constants of SAMU's decode step for inputs of `dtype` (FP32, float64
    for float64 inputs), one row per constant: what `samu_step(..., modes=...)` reads
    instead of recomputing."""
    check_tensor("nu_log", nu_log, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("theta_log", theta_log, shape=nu_log.shape, dtypes=FLOAT_DTYPES)
    check_same_device(nu_log=nu_log, theta_log=theta_log)
    if _samu_kernels is None:
        raise RuntimeError("samu_mode_table needs Triton (the table is read by the Triton decode steps only)")
    return _samu_kernels.mode_table(nu_log.contiguous(), theta_log.contiguous(), state_dtype(dtype))


__all__ = ["rglru", "samu", "scan", "rglru_step", "samu_step", "samu_mode_table", "backends", "step_backends",
           "inexact_backends", "resolve", "resolve_step", "tuned_step", "step_has_backward", "reference", "tuning",
           "Backend", "TuningTable"]
