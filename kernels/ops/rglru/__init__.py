"""Fused Triton RG-LRU: training forward/backward from the gate logits, the bare affine
scan (complex: the PyTorch reference), and the one-launch decode step (step.py).
Backends: "serial" (fused_recurrent.py), one program per (sequence, channel block)
walking time; "chunk" (chunk.py), the exact two-level chunked scan. function.py holds
the autograd.Function and the torch.compile custom ops.
"""

from .function import chunk_rglru, chunk_scan, fused_recurrent_rglru, fused_recurrent_scan
from .step import rglru_step

BACKENDS = {
    "rglru": {"serial": fused_recurrent_rglru, "chunk": chunk_rglru},
    "scan": {"serial": fused_recurrent_scan, "chunk": chunk_scan},
}
STEPS = {"rglru": {"fused": rglru_step}}

__all__ = ["BACKENDS", "STEPS", "chunk_rglru", "chunk_scan", "fused_recurrent_rglru", "fused_recurrent_scan",
           "rglru_step"]
