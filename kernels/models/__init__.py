"""Hawk language models: presets (config), the model and its decode cache (hawk), the
training step applied from outside the model (train)."""

from .config import PRESETS, HawkConfig
from .hawk import HawkCache, HawkLM
from .train import CapturedTrainStep, compile_blocks, linear_cross_entropy, train_step

__all__ = ["HawkConfig", "HawkLM", "HawkCache", "PRESETS", "linear_cross_entropy", "train_step", "compile_blocks",
           "CapturedTrainStep"]
