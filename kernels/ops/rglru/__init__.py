"""Fused Triton RG-LRU: training forward/backward from the gate logits, the bare affine
scan, and the one-launch decode step.

Backends: "serial" (fused_recurrent.py): one program per (sequence, channel
block) walking time in tiles, one launch per pass (+ the a_param reduction); "chunk"
(chunk.py): exact two-level chunked scan, parallel over chunks too. Gate activations,
a and the write exist only in registers; the backward keeps the inputs and FP32 states
at tile or chunk boundaries only. Complex scans go to the PyTorch reference. function.py
holds the autograd.Function and the torch.compile custom ops; step.py the decode step.
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
