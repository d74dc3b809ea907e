"""The official recurrentgemma==1.0.1 PyTorch code (the oracle), loaded without JAX."""

from __future__ import annotations

import importlib.util
import sys


def load_official():
    """The official `recurrentgemma.torch` module, loaded from the unmodified files with
    an empty package module standing in for the top-level __init__ (which imports JAX)."""
    if "recurrentgemma" not in sys.modules:
        spec = importlib.util.find_spec("recurrentgemma")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("recurrentgemma is not installed (pip install recurrentgemma==1.0.1)")
        sys.modules["recurrentgemma"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("recurrentgemma.torch")


__all__ = ["load_official"]
