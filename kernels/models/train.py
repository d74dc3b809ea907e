"""The training step of a HawkLM, applied from outside the model (torchtitan style):
`HawkLM.loss` (never holding the [B*T, V] logits), backward, clipping and the optimizer,
under autocast over FP32 master weights; on CUDA also as one CUDA graph (`CapturedTrainStep`).

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True, capturable=True)
    loss = train_step(model, opt, tokens, targets, segment_pos, autocast=torch.bfloat16)
    step = CapturedTrainStep(model, opt, tokens, targets, segment_pos, autocast=torch.bfloat16)
    loss = step(tokens, targets, segment_pos)
"""

from __future__ import annotations

import torch

# Tokens per chunk of the fused loss: FP32 logits of a chunk take about 2^28 bytes.
LOGITS_PER_CHUNK = 1 << 26


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ weight^T over the kept rows, chunk by chunk: logits in
    `dtype`, log-sum-exp in at least FP32, the gradients formed in the forward (rounded to
    `dtype` as the unfused backward rounds them), so the backward only scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk, dtype):
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(h.device.type, enabled=False):
            w, acc = weight.to(dtype), torch.promote_types(dtype, torch.float32)
            keep = targets != ignore_index
            count = keep.sum().to(acc)
            total = torch.zeros((), dtype=acc, device=h.device)
            dh = torch.empty_like(h) if grads else None
            dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if grads else None
            for s in range(0, h.shape[0], chunk):
                hc, kc = h[s:s + chunk].to(dtype), keep[s:s + chunk]
                tc = targets[s:s + chunk].masked_fill(~kc, 0)[:, None]
                logits = (hc @ w.t()).to(acc)
                lse = torch.logsumexp(logits, dim=-1)
                total += ((lse - logits.gather(1, tc)[:, 0]) * kc).sum()
                if grads:
                    g = logits.sub_(lse[:, None]).exp_()
                    g.scatter_add_(1, tc, torch.full_like(tc, -1, dtype=g.dtype))
                    g = g.mul_((kc / count)[:, None]).to(dtype)
                    dh[s:s + chunk] = g @ w
                    dw.add_(g.t() @ hc)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return dh * grad.to(dh.dtype), (dw * grad).to(ctx.weight_dtype), None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         chunk_size: int | None = None) -> torch.Tensor:
    """F.cross_entropy(h @ weight^T, targets, ignore_index=ignore_index) without the [N, V]
    logits: h [N, D], weight [V, D], targets [N]. Under autocast the matmuls run in its
    dtype, the log-sum-exp in FP32. chunk_size: rows per chunk (default: ~2^26 logits)."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"expected h [N, D] and weight [V, D], got h {list(h.shape)} and weight {list(weight.shape)}")
    if targets.shape != h.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expected targets [N] = [{h.shape[0]}] int64/int32, got {list(targets.shape)} "
                         f"{targets.dtype}")
    chunk = max(1, LOGITS_PER_CHUNK // weight.shape[0]) if chunk_size is None else chunk_size
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"expected chunk_size a positive int, got {chunk_size!r}")
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(
        h.dtype, weight.dtype)
    return _LinearCrossEntropy.apply(h, weight, targets.long(), ignore_index, chunk, dtype)


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile each residual block (one graph per block, shared by all blocks of
    a shape) in place; the embedding and the fused loss stay eager."""
    for block in model.blocks:
        block.compile()
    return model


def train_step(model, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
               segment_pos: torch.Tensor, grad_clip: float | None = 1.0,
               autocast: torch.dtype | None = None) -> torch.Tensor:
    """One step: model.loss under `autocast` (None: none), backward, gradient norm clipped to
    `grad_clip` (None: not clipped), optimizer step, gradients set to None. Returns the loss."""
    with torch.autocast(tokens.device.type, dtype=autocast, enabled=autocast is not None):
        loss = model.loss(tokens, targets, segment_pos)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class CapturedTrainStep:
    """`train_step` captured once in a CUDA graph: each call copies the batch into the
    static inputs, replays the step and returns the loss (overwritten by the next call).
    Construction runs `warmup` real eager steps on a side stream (compiling the kernels and
    creating the optimizer state), then captures one. Batches keep the first's shapes and
    dtypes; parameters and optimizer must stay the same objects."""

    def __init__(self, model, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
                 segment_pos: torch.Tensor, grad_clip: float | None = 1.0, autocast: torch.dtype | None = None,
                 warmup: int = 2):
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"expected warmup a positive int (the kernels must run once outside the capture), "
                             f"got {warmup!r}")
        if not all(g.get("capturable") for g in optimizer.param_groups):
            raise ValueError("the optimizer must be capturable (e.g. torch.optim.AdamW(..., capturable=True))")
        if not tokens.is_cuda:
            raise ValueError(f"a captured training step needs CUDA tensors, got tokens on {tokens.device}")
        self.inputs = tuple(t.clone() for t in (tokens, targets, segment_pos))
        args = (model, optimizer, *self.inputs, grad_clip, autocast)
        side = torch.cuda.Stream(tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                train_step(*args)
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = train_step(*args)

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor, segment_pos: torch.Tensor) -> torch.Tensor:
        for static, t in zip(self.inputs, (tokens, targets, segment_pos)):
            if t.shape != static.shape or t.dtype != static.dtype:
                raise ValueError(f"expected a batch of the captured shape {list(static.shape)} {static.dtype}, "
                                 f"got {list(t.shape)} {t.dtype}")
            static.copy_(t)
        self.graph.replay()
        return self.loss


__all__ = ["linear_cross_entropy", "train_step", "compile_blocks", "CapturedTrainStep"]
