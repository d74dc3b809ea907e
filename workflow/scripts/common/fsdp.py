"""Fully sharded data parallelism (FSDP2) for the training track, applied from outside.

The Hawk model is single-device code; this module alone makes a training step
data parallel over documents, in the way torchtitan applies parallelism:

    rank, world, device = fsdp.init_process_group()
    setup = Setup(preset, mixer, T, world * B, ...)      # the single-GPU step's model, AdamW, batch
    fsdp.distribute(setup, rank, world, param_dtype=torch.bfloat16)
    setup.step()                                         # this rank's B documents

`shard` wraps every mixer, every residual block, then the root (the embedding,
shared with the output projection, and the final norm), with
`torch.distributed.fsdp.fully_shard`: FP32 parameters, gradients and AdamW moments
are kept as shards (1 / world of each per rank, the master weights), a block's
parameters are all-gathered in `param_dtype` (BF16 on the GPU; the mixer's in
FP32, as the single-GPU step hands them to the mixer ops) just before it runs and
freed after, and gradients are reduce-scattered in FP32. The sequence-mixer ops are unchanged: a
document never crosses ranks, so each rank scans whole sequences.
"""

from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist


def init_process_group(timeout_s: float = 900) -> tuple[int, int, torch.device]:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT): NCCL with one GPU per rank when CUDA is available, else gloo
    on the CPU. A collective that waits longer than `timeout_s` (a rank that died or
    failed alone) raises instead of hanging. Returns (rank, world size, device)."""
    if not dist.is_initialized():
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            if var not in os.environ:
                raise RuntimeError(f"expected {var} in the environment (start the worker with torchrun), got none")
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


class _Scalar(torch.nn.Module):
    """Keeps a scalar parameter as a tensor of shape [1] (fully_shard shards
    dimension 0 and refuses scalars) and hands the module its scalar."""

    def forward(self, x):
        return x.reshape(())

    def right_inverse(self, x):
        return x.reshape(1)


_STORED = ".parametrizations."


def shard(model: torch.nn.Module, param_dtype: torch.dtype | None = None,
          reduce_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Apply FSDP2 in place to a HawkLM: one unit per mixer (RG-LRU or SAMU), one per
    residual block, then the root. `param_dtype`: the dtype the blocks' parameters
    are gathered and computed in (None: the stored FP32); the mixers' parameters are
    gathered in FP32 whatever it is, so the mixer ops get the inputs they get in the
    single-GPU autocast step (FP32 parameters, activations in the autocast dtype).
    `reduce_dtype`: the dtype of the gradient reduce-scatter. Scalar parameters
    (SAMU's amplitudes) are stored with shape [1] through a parametrization; the
    module still reads a scalar."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.nn.utils import parametrize

    from kernels import layers

    if not hasattr(model, "blocks"):
        raise ValueError(f"expected a model with residual `blocks` (a HawkLM), got {type(model).__name__}")
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 0:
                parametrize.register_parametrization(module, name, _Scalar())
    stored = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    for module in list(model.modules()):
        if isinstance(module, (layers.RGLRU, layers.SAMU)):
            fully_shard(module, mp_policy=stored)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if hasattr(model, "loss"):
        # The training step calls model.loss (the fused loss), not forward: FSDP's
        # gathers and reshards run around it as around forward.
        register_fsdp_forward_method(model, "loss")
    return model


def rebuild_optimizer(opt: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    """A new optimizer of the same class and settings as `opt` over `params` (the
    sharded parameters replace the ones `opt` was built on)."""
    accepted = inspect.signature(type(opt)).parameters
    return type(opt)(params, **{k: v for k, v in opt.defaults.items() if k in accepted})


def distribute(setup, rank: int, world: int, param_dtype: torch.dtype | None = None):
    """Turn a single-GPU training step into this rank's part of a data-parallel one.

    `setup` holds `model`, `opt` and a global batch `inp`, `tgt`, `pos` of
    world x B documents ([world * B, T]); afterwards the model is sharded, the
    optimizer rebuilt over the shards and the batch is this rank's B documents
    (rows rank * B .. rank * B + B - 1). FSDP averages gradients over ranks, so with
    equal documents per rank the step's gradients are those of the global batch's
    mean loss."""
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


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and gradient as a full tensor on every rank (a collective:
    all ranks call it), keyed by the single-device model's parameter name and
    `grad.<name>`, in its shapes."""
    from torch.distributed.tensor import DTensor

    def full(t, stored):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        return (t.reshape(()) if stored else t).clone()

    out = {}
    for name, p in model.named_parameters():
        stored = _STORED in name
        if stored:
            owner, rest = name.split(_STORED)
            name = f"{owner}.{rest.removesuffix('.original')}"
        out[name] = full(p.detach(), stored)
        if p.grad is not None:
            out[f"grad.{name}"] = full(p.grad, stored)
    return out


def gather(obj) -> list:
    """`obj` of every rank, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
