"""Fused Triton SAMU: training forward/backward with the controller and the write
fused, exact chunked scans, the prefill and the one-launch decode step.

Backends (the reference signature of kernels.ops.samu):
- "serial" (fused_recurrent.py): state-stationary, one program per (sequence, mode
  block) walking time in unrolled tiles; the adjoint walks back over the tiles.
- "chunk" (chunk.py): exact two-level chunked algorithm, chunk_size K in 8, 16, 32, 64,
  with a linear-work grouped prefix over the chunk summaries. Launcher options (exact,
  for tuning): chunk_size, block_m, num_warps (modes per thread).
Shared (common.py): the per-token controller (one pass over x: both projections,
norms, tanh, exp(eta), cos/sin(delta), resets), its backward and the deterministic
parameter reductions. Tiers: Triton kernels and launchers (fused_recurrent.py, chunk.py,
step.py), one autograd.Function and the torch.library custom ops (function.py; step.py
registers the decode step's op).
Inside the recurrence the transition, the write and relu exist only in registers;
forward keeps for backward only [B, T] controls and [B, T/K, M] complex states. The
backward's scratch: the FP32 write gradient [B, T, D] (dx itself when x is FP32; for
BF16/FP16 x the controller backward adds the control term to it and rounds once), the
per-token control-gradient partials [B*T, M/block_m, 2], the per-chunk parameter
partials, and checkpoint slots of every BWD_UNROLL-th state inside a chunk ([B, T/4, M]
complex in all for the chunk backend, [B, K/4, M] for serial), counted by the
accounting as written and read.
BF16/FP16 at the tensor boundaries, FP32 state and accumulation (float64 for float64).

Decode (step.py): STEPS["samu"] = "row" (one program per sequence), "blocked" (one
program per sequence and mode block) and "fused" (picks between them by batch size).
"""

from .function import chunk_samu, fused_recurrent_samu
from .step import samu_step, samu_step_blocked, samu_step_row

BACKENDS = {"samu": {"serial": fused_recurrent_samu, "chunk": chunk_samu}}
STEPS = {"samu": {"fused": samu_step, "row": samu_step_row, "blocked": samu_step_blocked}}

__all__ = ["BACKENDS", "STEPS", "chunk_samu", "fused_recurrent_samu", "samu_step", "samu_step_row",
           "samu_step_blocked"]
