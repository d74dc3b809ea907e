"""FSDP2 for the training track, applied from outside the single-device model (as torchtitan
does): every mixer, residual block and the root sharded with `fully_shard` (FP32 master weights,
gradients and AdamW moments; gathers in `param_dtype`, the mixers' in FP32); B documents a rank."""

from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist


def init_process_group(timeout_s: float = 900) -> tuple[int, int, torch.device]:
    """Join torchrun's group (NCCL, one GPU per rank; gloo on the CPU); a collective waiting over
    `timeout_s` raises instead of hanging. Returns (rank, world size, device)."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if missing := [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]:
            raise RuntimeError(f"expected {missing[0]} in the environment (start the worker with torchrun), got none")
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else None)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


class _Scalar(torch.nn.Module):
    """Stores a scalar parameter with shape [1] (fully_shard refuses scalars)."""

    def forward(self, x):
        return x.reshape(())

    def right_inverse(self, x):
        return x.reshape(1)


def shard(model: torch.nn.Module, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 in place, one unit per mixer, per residual block, then the root; mixers gather in FP32,
    as the single-GPU autocast step hands them their parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.nn.utils import parametrize

    from kernels import layers

    if not hasattr(model, "blocks"):
        raise ValueError(f"expected a model with residual `blocks` (a HawkLM), got {type(model).__name__}")
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 0:
                parametrize.register_parametrization(module, name, _Scalar())
    stored = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for module in list(model.modules()):
        if isinstance(module, (layers.RGLRU, layers.SAMU)):
            fully_shard(module, mp_policy=stored)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if hasattr(model, "loss"):
        # The training step calls model.loss (the fused loss), not forward: FSDP's
        # gathers and reshards run around it as around forward.
        register_fsdp_forward_method(model, "loss")
    return model


def rebuild_optimizer(opt: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    """A new optimizer like `opt` over `params`."""
    accepted = inspect.signature(type(opt)).parameters
    return type(opt)(params, **{k: v for k, v in opt.defaults.items() if k in accepted})


def distribute(setup, rank: int, world: int, param_dtype: torch.dtype | None = None):
    """`setup` (world x B documents) made this rank's part: model sharded, optimizer rebuilt, B rows kept."""
    rows = setup.inp.shape[0]
    if rows % world:
        raise ValueError(f"expected a global batch divisible by the world size {world}, got {rows} documents")
    b = rows // world
    shard(setup.model, param_dtype)
    setup.opt = rebuild_optimizer(setup.opt, setup.model.parameters())
    for name in ("inp", "tgt", "pos"):
        setattr(setup, name, getattr(setup, name)[rank * b:(rank + 1) * b].contiguous())
    setup.B = b
    return setup
