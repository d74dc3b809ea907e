"""The official recurrentgemma==1.0.1 PyTorch code (the oracle), loaded without JAX."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def load_official():
    """The official `recurrentgemma.torch` module, without importing its JAX side.

    The package's top-level __init__ imports JAX. When it is not imported yet, a bare
    package module whose __path__ is the installed directory stands in for it, so that
    `recurrentgemma.torch` and `recurrentgemma.common` load from the unmodified files.
    """
    if "recurrentgemma.torch" in sys.modules:
        return sys.modules["recurrentgemma.torch"]
    if "recurrentgemma" not in sys.modules:
        spec = importlib.util.find_spec("recurrentgemma")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("recurrentgemma is not installed (pip install recurrentgemma==1.0.1)")
        pkg = types.ModuleType("recurrentgemma")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__ = spec.origin
        pkg.__spec__ = spec
        pkg.__package__ = "recurrentgemma"
        sys.modules["recurrentgemma"] = pkg
    return importlib.import_module("recurrentgemma.torch")


__all__ = ["load_official"]
