"""Argument validation shared by every op: errors name the argument, what was
expected and what was received."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name: str, t, shape: tuple | None = None, dtypes=None, ndim: int | None = None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"expected {name} with {ndim} dimensions, got shape {shape_str(t)}")
    if shape is not None:
        if t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape)):
            want = "[" + ", ".join("?" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"expected {name} of shape {want}, got {shape_str(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"expected {name} with dtype in {[str(d) for d in dtypes]}, got {t.dtype}"
        )
    return t


def check_same_device(**tensors):
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"expected all tensors on one device, got {desc}")


def check_segment_pos(segment_pos, B: int, T: int):
    if segment_pos is None:
        return None
    check_tensor("segment_pos", segment_pos, shape=(B, T))
    if segment_pos.dtype.is_floating_point or segment_pos.dtype.is_complex or segment_pos.dtype == torch.bool:
        raise ValueError(f"expected segment_pos with an integer dtype, got {segment_pos.dtype}")
    return segment_pos


def cu_seqlens_to_segment_pos(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """FlashAttention-style packed boundaries [N+1] (0, ..., T) -> segment_pos [1, T]."""
    check_tensor("cu_seqlens", cu_seqlens, ndim=1)
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"expected cu_seqlens with an integer dtype, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"expected batch size 1 with cu_seqlens (packed sequences), got B = {B}")
    cu = cu_seqlens.to("cpu", torch.int64)
    if cu.numel() < 2 or cu[0] != 0 or cu[-1] != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"expected cu_seqlens increasing from 0 to T = {T}, got {cu.tolist()}"
        )
    pos = torch.arange(T, dtype=torch.int64)
    starts = torch.zeros(T, dtype=torch.int64)
    for s in cu[:-1].tolist():
        if s < T:
            starts[s:] = s
    return (pos - starts).view(1, T).to(cu_seqlens.device, torch.int32)


def state_dtype(x_dtype: torch.dtype, complex_state: bool = False) -> torch.dtype:
    """FP32 state for every activation dtype except float64, which keeps float64."""
    if complex_state:
        return torch.complex128 if x_dtype == torch.float64 else torch.complex64
    return torch.float64 if x_dtype == torch.float64 else torch.float32
