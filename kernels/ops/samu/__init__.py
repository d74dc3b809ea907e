"""Fused Triton SAMU: the "serial" (fused_recurrent.py) and "chunk" (chunk.py) training backends over the shared
controller, its backward and the parameter reductions (common.py), and the decode steps (step.py).
"""

from .common import mode_table
from .function import chunk_samu, fused_recurrent_samu
from .step import samu_step, samu_step_blocked, samu_step_row

BACKENDS = {"samu": {"serial": fused_recurrent_samu, "chunk": chunk_samu}}
STEPS = {"samu": {"fused": samu_step, "row": samu_step_row, "blocked": samu_step_blocked}}

__all__ = ["BACKENDS", "STEPS", "mode_table", "chunk_samu", "fused_recurrent_samu", "samu_step", "samu_step_row",
           "samu_step_blocked"]
