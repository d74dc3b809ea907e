"""Weight-exact conversion between the official `recurrentgemma.torch` modules (RGLRU,
Conv1D, RecurrentBlock, recurrent ResidualBlock, all-recurrent Griffin) and ours (the
RG-LRU mixer; Griffin <-> HawkLM). Parameter names agree except for the MLP's up
projection (official Einsum w [2, D, F], b [2, 1, 1, F]; ours one Linear(D, 2F), gate
half first) and the embedding (official `embedder.input_embedding`, ours `embed.weight`).
Official modules are recognised by class name, however the caller loaded the package.
"""

from __future__ import annotations

import torch
from torch import nn

from . import layers

_OFFICIAL_KINDS = ("RGLRU", "Conv1D", "RecurrentBlock", "ResidualBlock", "Griffin")


def _factory(module) -> dict:
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


def _official_to_ours(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if k.endswith("mlp_block.ffw_up.w"):                # [2, D, F] -> [2F, D]
            k, v = k[:-1] + "weight", torch.cat([v[0].T, v[1].T], dim=0)
        elif k.endswith("mlp_block.ffw_up.b"):              # [2, 1, 1, F] -> [2F]
            k, v = k[:-1] + "bias", v.reshape(-1)
        out["embed.weight" if k == "embedder.input_embedding" else k] = v.detach().clone()
    return out


def _ours_to_official(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if k.endswith("mlp_block.ffw_up.weight"):           # [2F, D] -> [2, D, F]
            k, v = k[: -len("weight")] + "w", torch.stack([half.T for half in v.chunk(2)], dim=0)
        elif k.endswith("mlp_block.ffw_up.bias"):           # [2F] -> [2, 1, 1, F]
            k, v = k[: -len("bias")] + "b", v.reshape(2, 1, 1, -1)
        out["embedder.input_embedding" if k == "embed.weight" else k] = v.detach().clone().contiguous()
    return out


def _recurrent_type(block, where: str) -> None:
    name = getattr(block.temporal_block_type, "name", str(block.temporal_block_type))
    if name != "RECURRENT":
        raise ValueError(f"expected {where} with temporal_block_type RECURRENT (Hawk), got {name}")


def from_recurrentgemma(module: nn.Module, backend="auto") -> nn.Module:
    """Our equivalent of an official recurrentgemma torch module, with the same weights.
    `backend` is the mixer backend of the result (a name or a kernels.Backend)."""
    cls = type(module)
    kind = cls.__name__ if cls.__module__.startswith("recurrentgemma.") else None
    if kind not in _OFFICIAL_KINDS:
        raise ValueError(f"expected an official recurrentgemma.torch module of type {list(_OFFICIAL_KINDS)}, "
                         f"got {cls.__module__}.{cls.__name__}")
    f = _factory(module)
    if kind == "RGLRU":
        ours = layers.RGLRU(module.width, module.num_heads, module.w_init_variance_scale, backend=backend, **f)
    elif kind == "Conv1D":
        ours = layers.Conv1D(module.width, module.temporal_width, module.w_init_variance_scale, **f)
    elif kind == "RecurrentBlock":
        ours = layers.RecurrentBlock(module.width, module.num_heads, module.lru_width, "rglru",
                                     module.conv1d_temporal_width, module.final_w_init_variance_scale,
                                     backend=backend, **f)
    elif kind == "ResidualBlock":
        _recurrent_type(module, "a residual block")
        ours = layers.ResidualBlock(module.width, module.mlp_expanded_width, module.num_heads,
                                    module.lru_width, "rglru", module.conv1d_temporal_width,
                                    module.final_w_init_variance_scale, backend=backend, **f)
    else:
        from .models import HawkConfig, HawkLM

        c = module.config
        for i, block in enumerate(module.blocks):
            _recurrent_type(block, f"blocks.{i}")
        if c.embeddings_scale_by_sqrt_dim:
            raise ValueError("expected config.embeddings_scale_by_sqrt_dim False (Hawk has no embedding "
                             "scaling), got True")
        if c.logits_soft_cap:
            raise ValueError(f"expected config.logits_soft_cap 0 (no soft-cap), got {c.logits_soft_cap}")
        cfg = HawkConfig(width=c.width, num_layers=c.num_layers, lru_width=c.lru_width or c.width,
                         mlp_expanded_width=c.mlp_expanded_width, num_heads=c.num_heads,
                         gate_blocks=c.num_heads, vocab_size=c.vocab_size, mixer="rglru")
        ours = HawkLM(cfg, backend=backend, **f)
    ours.load_state_dict(_official_to_ours(module.state_dict()), strict=True)
    return ours


def to_recurrentgemma(module: nn.Module) -> nn.Module:
    """The official recurrentgemma torch module equal to ours (RG-LRU mixer only)."""
    from .models import HawkLM
    from .official import load_official

    if any(isinstance(m, layers.SAMU) for m in module.modules()):
        raise ValueError("expected a module with the RG-LRU mixer (the official code has no SAMU), "
                         "got mixer 'samu'")
    rg = load_official()
    f = _factory(module)
    if isinstance(module, layers.RGLRU):
        theirs = rg.RGLRU(module.width, module.num_heads, module.w_init_variance_scale, **f)
    elif isinstance(module, layers.Conv1D):
        theirs = rg.Conv1D(module.width, module.temporal_width, module.w_init_variance_scale, **f)
    elif isinstance(module, layers.RecurrentBlock):
        theirs = rg.RecurrentBlock(module.width, module.num_heads, module.lru_width,
                                   module.conv_1d.temporal_width, module.final_w_init_variance_scale, **f)
    elif isinstance(module, layers.ResidualBlock):
        rb = module.recurrent_block
        theirs = rg.ResidualBlock(module.width, module.mlp_block.expanded_width, rb.num_heads, 2048,
                                  rg.TemporalBlockType.RECURRENT, rb.lru_width, rb.conv_1d.temporal_width,
                                  rb.final_w_init_variance_scale, **f)
    elif isinstance(module, HawkLM):
        c = module.config
        if c.conv1d_temporal_width != 4:
            raise ValueError(f"expected conv1d_temporal_width 4 (fixed in the official Griffin), "
                             f"got {c.conv1d_temporal_width}")
        gc = rg.GriffinConfig(vocab_size=c.vocab_size, width=c.width, mlp_expanded_width=c.mlp_expanded_width,
                              num_heads=c.gate_blocks, block_types=(rg.TemporalBlockType.RECURRENT,) * c.num_layers,
                              embeddings_scale_by_sqrt_dim=False, attention_window_size=2048,
                              logits_soft_cap=0.0, lru_width=c.lru_width)
        theirs = rg.Griffin(gc, gradient_checkpointing=False, **f)
    else:
        raise ValueError(f"expected a kernels RGLRU, Conv1D, RecurrentBlock, ResidualBlock or HawkLM, "
                         f"got {type(module).__name__}")
    theirs.load_state_dict(_ours_to_official(module.state_dict()), strict=True)
    return theirs


__all__ = ["from_recurrentgemma", "to_recurrentgemma"]
