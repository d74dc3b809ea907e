"""Argument validation shared by every op: errors name the argument, what was
expected and what was received."""

from __future__ import annotations

import numbers

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
COMPLEX_DTYPES = (torch.complex128, torch.complex64)
# chunk_size of every backend that takes it: the chunk length K of "chunk", the time
# tile of "serial" (RG-LRU/scan: per warp; SAMU: tile and checkpoint length).
CHUNK_SIZES = (8, 16, 32, 64)
# rows of SAMU's mode table [MODE_CONSTS, M]: nu, theta, cos theta, sin theta, gamma,
# lnr, nu dgamma/dnu (kernels.ops.samu_mode_table)
MODE_CONSTS = 7


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name: str, t, shape: tuple | None = None, dtypes=None, ndim: int | None = None):
    # the passing path (every eager call) is one comparison per property
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"expected {name} with {ndim} dimensions, got shape {shape_str(t)}")
    if shape is not None and t.shape != shape:
        if t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape)):
            want = "[" + ", ".join("?" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"expected {name} of shape {want}, got {shape_str(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"expected {name} with dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def check_same_device(names: tuple, values: tuple):
    """Every tensor among `values` (names[i] names values[i]; others skipped) on one device."""
    device = None
    for t in values:
        if isinstance(t, torch.Tensor):
            if device is None:
                device = t.device
            elif t.device != device:
                desc = ", ".join(f"{n} on {v.device}" for n, v in zip(names, values) if isinstance(v, torch.Tensor))
                raise ValueError(f"expected all tensors on one device, got {desc}")


def check_segment_pos(segment_pos, B: int, T: int) -> None:
    if segment_pos is not None:
        check_tensor("segment_pos", segment_pos, shape=(B, T))
        if not is_integer_dtype(segment_pos.dtype):
            raise ValueError(f"expected segment_pos with an integer dtype, got {segment_pos.dtype}")


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_scalar(name: str, v) -> None:
    """A python real number or a one-element floating-point tensor."""
    if isinstance(v, float):
        return
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        check_tensor(name, v, dtypes=FLOAT_DTYPES)
    elif isinstance(v, (torch.Tensor, bool)) or not isinstance(v, (int, float)):
        got = f"shape {shape_str(v)}" if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"expected {name} to be a scalar (a float or a one-element tensor), got {got}")


def cu_seqlens_to_segment_pos(cu_seqlens: torch.Tensor, B: int, T: int, device=None) -> torch.Tensor:
    """Packed boundaries [N+1] (0, ..., T) -> segment_pos [1, T] int32 on `device`
    (default: cu_seqlens'), without a loop over the sequences."""
    check_tensor("cu_seqlens", cu_seqlens, ndim=1)
    if not is_integer_dtype(cu_seqlens.dtype):
        raise ValueError(f"expected cu_seqlens with an integer dtype, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"expected batch size 1 with cu_seqlens (packed sequences), got B = {B}")
    device = cu_seqlens.device if device is None else torch.device(device)
    cu = cu_seqlens.to(device, torch.int64)
    if cu.numel() < 2 or bool((cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"expected cu_seqlens increasing from 0 to T = {T}, got {cu.tolist()}")
    t = torch.arange(T, dtype=torch.int64, device=device)
    # a step's sequence: the number of boundaries cu[1:] at or before it
    seq = torch.searchsorted(cu[1:], t, right=True)
    return (t - cu[seq]).view(1, T).to(torch.int32)


def state_dtype(x_dtype: torch.dtype, complex_state: bool = False) -> torch.dtype:
    """FP32 state for every activation dtype except float64, which keeps float64."""
    if complex_state:
        return torch.complex128 if x_dtype == torch.float64 else torch.complex64
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def no_double_backward():
    """Raise inside a backward run with create_graph=True: the Triton backwards are not
    differentiable (torch's once_differentiable is pruned away by autograd.grad(..., inputs))."""
    if torch.is_grad_enabled():
        raise ValueError("expected create_graph=False with the Triton backends (their backward is not "
                         "differentiable: higher-order gradients would silently lose terms; use "
                         "backend='reference' for them), got create_graph=True")


def no_grad_inputs(step: str, names: tuple, values: tuple):
    """Raise where grad mode is on and an input requires grad (decode steps have no backward);
    names[i] names values[i]."""
    if not torch.is_grad_enabled():
        return
    for n, t in zip(names, values):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"expected no input requiring grad with the Triton decode step {step!r} (it has no "
                             f"backward: gradients would be silently dropped); run it under torch.no_grad() "
                             f"or use backend='reference', got {n} with requires_grad=True")


def check_chunk_size(chunk_size) -> int:
    """chunk_size: an int in CHUNK_SIZES (with and without gradients)."""
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
            or chunk_size not in CHUNK_SIZES):
        raise ValueError(f"expected chunk_size an int in {list(CHUNK_SIZES)}, got {chunk_size!r} "
                         f"({type(chunk_size).__name__})")
    return int(chunk_size)
