"""Hawk model configurations: the presets of SPEC 2 (Griffin paper, Table 2) by name.

The study's models: a 32,000-token vocabulary, no embedding scaling or logit soft-cap, MLP
expansion 3, 16 RG-LRU gate blocks. Size labels count non-embedding parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layers import MIXERS

# name: (width D, layers, D_RNN, attention heads of the Griffin table; unused by Hawk)
_TABLE = {
    "100m": (768, 12, 1024, 6),
    "200m": (1024, 12, 1536, 8),
    "400m": (1536, 12, 2048, 12),
    "1.3b": (2048, 24, 2560, 16),
    "3b": (3072, 24, 4096, 24),
    "7b": (4096, 32, 5632, 32),
    "tiny": (64, 2, 96, 2),
}
TINY_VOCAB = 256


@dataclass(frozen=True)
class HawkConfig:
    """An all-recurrent (Hawk) model. num_heads: the preset table's attention heads (kept
    for the record); gate_blocks: diagonal blocks of the RG-LRU gates; mixer: "rglru" or "samu"."""

    width: int
    num_layers: int
    lru_width: int
    mlp_expanded_width: int
    num_heads: int = 1
    gate_blocks: int = 16
    vocab_size: int = 32_000
    mixer: str = "rglru"
    conv1d_temporal_width: int = 4
    name: str = "custom"

    def __post_init__(self):
        for f in ("width", "num_layers", "lru_width", "mlp_expanded_width", "num_heads", "gate_blocks",
                  "vocab_size", "conv1d_temporal_width"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"expected {f} a positive int, got {v!r}")
        if self.mixer not in MIXERS:
            raise ValueError(f"expected mixer in {list(MIXERS)}, got {self.mixer!r}")
        if self.mixer == "rglru" and self.lru_width % self.gate_blocks:
            raise ValueError(f"expected gate_blocks dividing lru_width = {self.lru_width}, got {self.gate_blocks}")
        if self.mixer == "samu" and self.lru_width % 2:
            raise ValueError(f"expected an even lru_width for SAMU (M = lru_width / 2 modes), got {self.lru_width}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "HawkConfig":
        """A preset by name ("100m", "200m", "400m", "1.3b", "3b", "7b", "tiny"); keyword
        arguments override fields, e.g. HawkConfig.preset("1.3b", mixer="samu")."""
        if name not in _TABLE:
            raise ValueError(f"expected preset in {list(_TABLE)}, got {name!r}")
        width, layers, lru, heads = _TABLE[name]
        base = dict(width=width, num_layers=layers, lru_width=lru, mlp_expanded_width=3 * width,
                    num_heads=heads, vocab_size=TINY_VOCAB if name == "tiny" else 32_000, name=name)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"expected HawkConfig fields as overrides, got unknown {sorted(unknown)}")
        return cls(**{**base, **overrides})

    def non_embedding_parameters(self) -> int:
        """Parameter count without the (shared) embedding, as the size labels count."""
        D, E, F, L = self.width, self.lru_width, self.mlp_expanded_width, self.num_layers
        W = self.conv1d_temporal_width
        if self.mixer == "rglru":
            mixer = E + 2 * (E * E // self.gate_blocks + E)
        else:
            mixer = 2 * (E // 2) + 2 * (E + 1) + 2
        block = (2 * (D * E + E) + (E * D + D) + (W * E + E) + mixer   # recurrent block
                 + (D * 2 * F + 2 * F) + (F * D + D) + 2 * D)           # MLP and two norms
        return L * block + D                                             # + final norm


PRESETS = tuple(_TABLE)

__all__ = ["HawkConfig", "PRESETS", "MIXERS"]
