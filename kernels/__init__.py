"""SAMU and RG-LRU: exact fused kernels, float64 references and Hawk models.

Layering (imports run one way): ops (Triton kernels + references) -> layers
(nn.Modules) -> models (Hawk LM, presets, cache, generation).
"""

from .ops import Backend, TuningTable, backends, reference, rglru, rglru_step, samu, samu_step, scan, step_backends

__all__ = ["rglru", "samu", "scan", "rglru_step", "samu_step", "backends", "step_backends", "reference", "Backend",
           "TuningTable"]


def __getattr__(name):
    # Layers, models and converters load on first use so that `import kernels`
    # stays cheap for the ops alone.
    lazy = {
        "layers": "kernels.layers",
        "models": "kernels.models",
        "HawkLM": "kernels.models",
        "HawkConfig": "kernels.models",
        "from_recurrentgemma": "kernels.convert",
        "to_recurrentgemma": "kernels.convert",
    }
    if name in lazy:
        import importlib

        mod = importlib.import_module(lazy[name])
        return mod if lazy[name].endswith(name) else getattr(mod, name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
