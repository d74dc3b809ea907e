"""Hawk language models: presets (config), the model and its decode cache (hawk)."""

from .config import PRESETS, HawkConfig, preset
from .hawk import HawkCache, HawkLM

__all__ = ["HawkConfig", "HawkLM", "HawkCache", "PRESETS", "preset"]
