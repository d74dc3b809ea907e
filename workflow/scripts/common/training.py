"""The training step the train tracks time: a Hawk model, its AdamW and a batch of random
tokens (one `kernels.models.train_step`, or the official recurrentgemma model's plain step),
with the MFU and byte fields of its record."""

import torch
import torch.nn.functional as F

import kernels
from kernels.models import CapturedTrainStep, HawkConfig, HawkLM, compile_blocks, train_step


def identity(preset: str, T: int, B: int, mixer: str, settings: dict) -> dict:
    """The record fields that name a training configuration: shapes, mixer and dtype."""
    return {"shapes": {"preset": preset, "T": T, "B": B, "vocab": settings["vocab"]}, "mixer": mixer,
            "dtype": settings.get("autocast") or "float32"}


def step_figures(params: int, tokens: int, step_s: float, logical: dict | None, state_bytes: int,
                 matmul_rate: float | None, peak_rate: float | None, world: int = 1) -> dict:
    """Model FLOPs and MFU of a step of `tokens` over `world` GPUs; `logical` gains the bytes of the
    FP32 weights, gradients and AdamW moments one GPU holds."""
    flops = 6 * params * tokens
    if logical is not None:
        logical.update(param_bytes=4 * params // world, grad_bytes=4 * params // world,
                       optimizer_state_bytes=8 * params // world, state_bytes=state_bytes, model_flops_per_step=flops)
    per_s = flops / step_s
    over = " of all ranks) per second over world_size x" if world > 1 else ") per second over"
    return {"model_flops_per_step": flops, "mfu": per_s / (world * matmul_rate) if matmul_rate else None,
            "mfu_basis": f"model FLOPs (6 x parameters x tokens{over} the probe's measured BF16 matmul rate"
            if matmul_rate else None, "mfu_of_peak": per_s / (world * peak_rate) if peak_rate else None}


def shape_of(rec: dict) -> tuple:
    return rec["shapes"].get("preset"), rec["shapes"].get("T"), rec["shapes"].get("B")


class Setup:
    """A model, its optimiser and a batch of random tokens: one timed step."""

    def __init__(self, preset: str, mixer: str, T: int, B: int, settings: dict, device, backend="auto",
                 official: bool = False, seed: int = 0, graph: bool = False):
        torch.manual_seed(seed)
        self.cfg = HawkConfig.preset(preset, mixer=mixer, vocab_size=settings["vocab"])
        model = HawkLM(self.cfg, backend=backend, device=device, dtype=torch.float32)
        if official:
            model = kernels.to_recurrentgemma(model)
        self.compiled = bool(settings.get("compile")) and not official
        if self.compiled:
            compile_blocks(model)
        self.model, self.official = model, official
        if graph and (official or device.type != "cuda"):
            raise ValueError("a captured training step runs our model on CUDA only")
        self.opt = torch.optim.AdamW(model.parameters(), lr=settings.get("lr", 3e-4),
                                     fused=device.type == "cuda", capturable=graph)
        toks = torch.randint(0, settings["vocab"], (B, T + 1), generator=torch.Generator().manual_seed(seed)).to(device)
        self.inp, self.tgt = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
        self.pos = torch.arange(T, device=device).expand(B, T).contiguous()
        self.T, self.B, self.device, self.clip = T, B, device, settings.get("grad_clip", 1.0)
        self.dtype = getattr(torch, settings["autocast"]) if settings.get("autocast") else None
        self.params = sum(p.numel() for p in model.parameters())
        self.graph, self.capture_peak = None, None
        if graph:
            # a replay allocates nothing: the step's memory is the peak of its warm-up and
            # capture (the graph's pool keeps it), with the model and optimizer state alive
            torch.cuda.reset_peak_memory_stats(device)
            self.graph = CapturedTrainStep(model, self.opt, self.inp, self.tgt, self.pos, self.clip, self.dtype,
                                           settings.get("warmup", 2) or 1)
            self.capture_peak = torch.cuda.max_memory_allocated(device)

    def step(self):
        return self.eager_step() if self.graph is None else self.graph(self.inp, self.tgt, self.pos)

    def eager_step(self):
        """One step as train_step runs it (for a captured step: what its graph replays, launch by launch)."""
        if not self.official:
            return train_step(self.model, self.opt, self.inp, self.tgt, self.pos, self.clip, self.dtype)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            logits, _ = self.model(self.inp, self.pos, return_logits=True, return_cache=False)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), self.tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def figures(self, fields: dict, matmul_rate: float | None, peak_rate: float | None) -> dict:
        med_s, tokens = fields["stats"]["median_ms"] * 1e-3, self.T * self.B
        if self.capture_peak is not None:
            fields["peak_bytes"] = max(fields.get("peak_bytes") or 0, self.capture_peak)
        return {"tokens_per_step": tokens, "tokens_per_s": tokens / med_s, "step_ms": fields["stats"]["median_ms"],
                "parameters": self.params, "compiled": self.compiled,
                "step_mode": "graph" if self.graph is not None else "eager",
                "non_embedding_parameters": self.cfg.non_embedding_parameters(),
                **step_figures(self.params, tokens, med_s, fields["logical"],
                               self.B * self.cfg.num_layers * self.cfg.lru_width * 4, matmul_rate, peak_rate)}
