"""Fused Triton RG-LRU: training forward/backward from the gate logits, the bare affine
scan, and the one-launch decode step.

Backends (the reference signatures of kernels.ops):
- "serial" (fused_recurrent.py, split.py): state-stationary, one program per (sequence,
  channel block) walking time in tiles; one launch forward, one (+ the a_param
  reduction) backward; reads every input once per pass. By default each tile's time
  axis is split across the program's warps (split.py); time_warps=1 (and, by default,
  an RG-LRU forward without gradient) runs the tile kernels.
- "chunk" (chunk.py): exact two-level chunked algorithm, chunk_size K in 8, 16, 32, 64;
  parallel over chunks as well as channels.
Inside both, the gate activations, log a, a, the clipped-sqrt multiplier and the write
exist only in registers; forward keeps for backward nothing of shape [B, T, D] besides
the inputs (FP32 states at tile or chunk boundaries only). BF16/FP16 tensors at the
boundary, FP32 accumulation (float64 for float64 inputs). The bare scan takes real
inputs; complex inputs are passed to the PyTorch reference.
Decode: STEPS["rglru"]["fused"] (step.py).
Tiers: Triton kernels and their launchers (fused_recurrent.py, split.py, chunk.py,
step.py), one autograd.Function and the torch.library custom ops that torch.compile
traces (function.py; step.py registers the decode step's op).
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
