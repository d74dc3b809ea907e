"""Fused Triton RG-LRU: training forward/backward from the gate logits, the bare affine
scan (complex: the PyTorch reference), and the one-launch decode step (step.py).
Backends: "serial" (fused_recurrent.py), one program per (sequence, channel block)
walking time; "chunk" (chunk.py), the exact two-level chunked scan. function.py holds
the autograd.Function and the torch.compile custom ops.
"""

from functools import partial

from .function import rglru, scan
from .step import rglru_step

# {op: {backend: the function with the reference signature}}
BACKENDS = {op.__name__: {name: partial(op, name) for name in ("serial", "chunk")} for op in (rglru, scan)}
STEPS = {"rglru": {"fused": rglru_step}}
