"""Weight-exact conversion between the official `recurrentgemma.torch` modules and ours
(RG-LRU mixer; Griffin <-> HawkLM). Parameter names agree except for the MLP's up projection
(official w [2, D, F], b [2, 1, 1, F]; ours one Linear(D, 2F), gate half first) and the
embedding. Official modules are recognised by class name, however the package was loaded.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from . import layers

_OFFICIAL_KINDS = ("RGLRU", "Conv1D", "RecurrentBlock", "ResidualBlock", "Griffin")


def _build(cls, src: nn.Module, **kw) -> nn.Module:
    """cls on src's device and dtype, other constructor arguments from kw, else from src's
    attribute of that name (ours and the official modules name them alike)."""
    p = next(src.parameters())
    kw.update(device=p.device, dtype=p.dtype)
    return cls(**{n: kw[n] if n in kw else getattr(src, n) for n in inspect.signature(cls).parameters})


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
    if kind != "Griffin":
        if kind == "ResidualBlock":
            _recurrent_type(module, "a residual block")
        ours = _build(getattr(layers, kind), module, backend=backend, mixer="rglru")
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
        ours = _build(HawkLM, module, config=cfg, backend=backend)
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
    if isinstance(module, (layers.RGLRU, layers.Conv1D, layers.RecurrentBlock)):
        theirs = _build(getattr(rg, type(module).__name__), module)
    elif isinstance(module, layers.ResidualBlock):
        # the window only sizes attention blocks, which Hawk has none of
        theirs = _build(rg.ResidualBlock, module.recurrent_block, mlp_expanded_width=module.mlp_block.expanded_width,
                        attention_window_size=2048, temporal_block_type=rg.TemporalBlockType.RECURRENT)
    elif isinstance(module, HawkLM):
        c = module.config
        if c.conv1d_temporal_width != 4:
            raise ValueError(f"expected conv1d_temporal_width 4 (fixed in the official Griffin), "
                             f"got {c.conv1d_temporal_width}")
        gc = rg.GriffinConfig(vocab_size=c.vocab_size, width=c.width, mlp_expanded_width=c.mlp_expanded_width,
                              num_heads=c.gate_blocks, block_types=(rg.TemporalBlockType.RECURRENT,) * c.num_layers,
                              embeddings_scale_by_sqrt_dim=False, attention_window_size=2048,
                              logits_soft_cap=0.0, lru_width=c.lru_width)
        theirs = _build(rg.Griffin, module, config=gc, gradient_checkpointing=False)
    else:
        raise ValueError(f"expected a kernels RGLRU, Conv1D, RecurrentBlock, ResidualBlock or HawkLM, "
                         f"got {type(module).__name__}")
    theirs.load_state_dict(_ours_to_official(module.state_dict()), strict=True)
    return theirs


__all__ = ["from_recurrentgemma", "to_recurrentgemma"]
