"""The Hawk language model (all-recurrent Griffin) with a switchable mixer.

    tokens [B, T] -> embedding [B, T, D] -> num_layers x ResidualBlock -> RMSNorm
    -> logits [B, T, V] = x @ embedding^T (the embedding is shared with the output)

The cache is a `HawkCache`, one kernels.layers.RecurrentCache per layer: `forward`
returns a new one, `step` advances one token and updates its tensors in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import layers
from ..ops.checks import check_segment_pos, check_tensor, is_integer_dtype, shape_str
from .config import HawkConfig
from .train import linear_cross_entropy


@dataclass
class HawkCache:
    """Decode cache of a HawkLM: `layers[i]` belongs to block i."""

    layers: list[layers.RecurrentCache]

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    def clone(self) -> "HawkCache":
        return HawkCache([layers.RecurrentCache(c.conv_state.clone(), c.rnn_state.clone()) for c in self.layers])


TOKEN_DTYPES = (torch.int64, torch.int32)


class HawkLM(nn.Module):
    """Hawk LM. `backend` selects the mixer kernels: a name ("auto", "reference", a Triton
    backend) or a kernels.Backend value (e.g. Backend("auto", table=TuningTable.load(p)))."""

    def __init__(self, config: HawkConfig, backend="auto", device=None, dtype=None):
        super().__init__()
        if not isinstance(config, HawkConfig):
            raise ValueError(f"expected config to be a HawkConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.width, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(
            layers.ResidualBlock(c.width, c.mlp_expanded_width, c.gate_blocks, c.lru_width, c.mixer,
                                 c.conv1d_temporal_width, 2.0 / c.num_layers, backend, device, dtype)
            for _ in range(c.num_layers))
        self.final_norm = layers.RMSNorm(c.width, device=device, dtype=dtype)
        nn.init.normal_(self.embed.weight, std=math.sqrt(1.0 / c.width))

    def set_backend(self, backend, step_backend=None) -> "HawkLM":
        """Use `backend` (sequences) and `step_backend` (decode) in every mixer (kernels.layers.set_backend)."""
        return layers.set_backend(self, backend, step_backend)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def init_cache(self, batch: int, dtype: torch.dtype | None = None) -> HawkCache:
        """Zero cache for `batch` sequences; conv states in `dtype` (default: the
        parameter dtype), recurrent states in FP32 / complex64."""
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"expected batch a positive int, got {batch!r}")
        return HawkCache([b.recurrent_block.init_cache(batch, dtype, self.device) for b in self.blocks])

    def _check_inputs(self, tokens, segment_pos, cache, shape):
        """tokens and segment_pos of `shape` on the model's device, tokens in [0, vocab_size);
        the cache for batch size B. The id range check reads back to the host: skipped under
        torch.compile and CUDA-graph capture (no value can be read) and in a CUDA training
        pass (a stall per step; the embedding's device-side bounds check still catches it)."""
        check_tensor("tokens", tokens, shape=shape)
        check_tensor("segment_pos", segment_pos, shape=tuple(tokens.shape))
        B, T = tokens.shape[0], (tokens.shape[1] if len(shape) == 2 else 1)
        check_segment_pos(segment_pos.view(B, T), B, T)
        self._check_device(tokens=tokens, segment_pos=segment_pos)
        if tokens.dtype not in TOKEN_DTYPES:
            kind = "an integer dtype the embedding does not take" if is_integer_dtype(tokens.dtype) else "not integer"
            raise ValueError(f"expected tokens with dtype in {[str(d) for d in TOKEN_DTYPES]}, got {tokens.dtype} "
                             f"({kind})")
        if T < 1:
            raise ValueError(f"expected tokens of shape [B, T] with T >= 1, got {shape_str(tokens)}")
        skip_range = torch.compiler.is_compiling() or (
            tokens.is_cuda and (torch.cuda.is_current_stream_capturing() or torch.is_grad_enabled()))
        if not skip_range and tokens.numel():
            lo, hi = (int(v) for v in tokens.aminmax())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"expected tokens (token ids) in [0, {self.config.vocab_size}), got values in "
                                 f"[{lo}, {hi}]")
        if cache is not None or len(shape) == 1:
            self._check_cache(cache, B)

    def _check_cache(self, cache, B):
        if not isinstance(cache, HawkCache):
            raise ValueError("expected cache to be a HawkCache (from init_cache or forward), "
                             f"got {type(cache).__name__}")
        if len(cache.layers) != len(self.blocks):
            raise ValueError(f"expected cache with {len(self.blocks)} layers, got {len(cache.layers)}")
        for i, c in enumerate(cache.layers):
            if c.batch_size != B or c.conv_state.shape[0] != B:
                raise ValueError(f"expected cache.layers[{i}] for batch size {B}, got a cache for batch size "
                                 f"{c.batch_size} (conv_state {shape_str(c.conv_state)}, rnn_state "
                                 f"{shape_str(c.rnn_state)})")
            self._check_device(**{f"cache.layers[{i}].{n}": getattr(c, n) for n in ("conv_state", "rnn_state")})

    def _check_device(self, **tensors):
        for n, t in tensors.items():
            if t.device != self.device:
                raise ValueError(f"expected {n} on {self.device} (the model's device), got {t.device}")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.final_norm(x), self.embed.weight)

    def forward(self, tokens: torch.Tensor, segment_pos: torch.Tensor, cache: HawkCache | None = None,
                return_cache: bool = True) -> tuple[torch.Tensor, HawkCache | None]:
        """tokens, segment_pos: [B, T] (0 at each document start); cache: the state before
        (None: empty). Returns (logits [B, T, V], the cache after or None)."""
        x, new = self.hidden(tokens, segment_pos, cache, return_cache)
        return self.logits(x), new

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, segment_pos: torch.Tensor,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of `targets` [B, T] (ignore_index: left out): F.cross_entropy
        over forward's logits, without them (train.linear_cross_entropy)."""
        check_tensor("targets", targets, shape=tuple(tokens.shape))
        x, _ = self.hidden(tokens, segment_pos, return_cache=False)
        return linear_cross_entropy(self.final_norm(x).flatten(0, 1), self.embed.weight, targets.flatten(),
                                    ignore_index)

    def hidden(self, tokens: torch.Tensor, segment_pos: torch.Tensor, cache: HawkCache | None = None,
               return_cache: bool = True) -> tuple[torch.Tensor, HawkCache | None]:
        """forward before the final norm and output projection: (x [B, T, D], cache)."""
        self._check_inputs(tokens, segment_pos, cache, (None, None))
        x = self.embed(tokens)
        new = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, segment_pos, None if cache is None else cache.layers[i], return_cache)
            new.append(c)
        return x, (HawkCache(new) if return_cache else None)

    def step(self, tokens: torch.Tensor, segment_pos: torch.Tensor, cache: HawkCache) -> torch.Tensor:
        """One decode step: tokens, segment_pos [B]; `cache` updated in place. Returns logits
        [B, V]. The Triton step backends have no backward: decode under torch.no_grad()."""
        self._check_inputs(tokens, segment_pos, cache, (None,))
        reset = segment_pos == 0
        x = self.embed(tokens)
        for block, c in zip(self.blocks, cache.layers):
            x = block.step(x, c, reset)
        return self.logits(x)


__all__ = ["HawkLM", "HawkCache"]
