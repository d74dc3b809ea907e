"""Fused Triton SAMU: training forward/backward with the controller and the write fused,
exact chunked scans, the prefill and the one-launch decode step.

Backends: "serial" (fused_recurrent.py): one program per (sequence, mode block) walking
time in unrolled tiles; "chunk" (chunk.py): exact two-level chunked scan with a
linear-work grouped prefix. common.py: the per-token controller, its backward and the
deterministic parameter reductions. Transition, write and relu exist only in registers;
the backward keeps [B, T] controls and [B, T/K, M] states, and its scratch is the FP32
write gradient [B, T, D], per-token and per-chunk partials and the checkpoints of every
BWD_UNROLL-th state inside a chunk. Decode (step.py): "row", "blocked", "fused".
"""

from .common import mode_table
from .function import chunk_samu, fused_recurrent_samu
from .step import samu_step, samu_step_blocked, samu_step_row

BACKENDS = {"samu": {"serial": fused_recurrent_samu, "chunk": chunk_samu}}
STEPS = {"samu": {"fused": samu_step, "row": samu_step_row, "blocked": samu_step_blocked}}

__all__ = ["BACKENDS", "STEPS", "mode_table", "chunk_samu", "fused_recurrent_samu", "samu_step", "samu_step_row",
           "samu_step_blocked"]
