"""SAMU and RG-LRU: exact fused kernels, float64 references and Hawk models.

Layering (imports run one way): ops (Triton kernels + references) -> layers
(nn.Modules) -> models (Hawk LM, presets, cache, generation).
"""

import importlib

from .ops import Backend, TuningTable, backends, reference, rglru, rglru_step, samu, samu_step, scan, step_backends

__all__ = ["rglru", "samu", "scan", "rglru_step", "samu_step", "backends", "step_backends", "reference", "Backend",
           "TuningTable"]


def __getattr__(name):
    # layers, models and the converters load on first use: `import kernels` stays cheap for the ops alone
    if name in ("layers", "models"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("from_recurrentgemma", "to_recurrentgemma"):
        return getattr(importlib.import_module(f"{__name__}.convert"), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
