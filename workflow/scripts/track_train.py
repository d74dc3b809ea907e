"""Training-step track -> results/tracks/train/records.jsonl.

Identical Hawk models with the mixer switched (kernels.HawkLM, presets of the
profile, 32K vocabulary), random tokens (no quality claims), (T, B) with 8192
tokens per step. One timed step = kernels.models.train_step: forward with the
chunked fused output projection + cross-entropy, backward, gradient clipping and
fused AdamW, with BF16 autocast over FP32 master weights, gradients and AdamW
moments (`compile: true` compiles each residual block).

Two parts:
- implementation diagnostics: every gated backend of each mixer (chunked ones
  once per chunk size of the profile; the PyTorch per-step reference only up to
  the profile's limits since it is slow) and the official recurrentgemma model as
  a peer with few repetitions;
- architecture comparison: per preset and shape each mixer's fastest exact
  backend -- the fastest diagnostics record at that preset and shape, else the
  tuning table's choice (`auto`) -- re-measured on fresh runs in SAMU -> RG-LRU and
  RG-LRU -> SAMU order.
Order of work: Triton diagnostics, the architecture comparison, then the slow
reference diagnostics and the official peer, so a time budget that runs out cuts
the slow per-step loops first (their records say so), never the comparison.
Records carry tokens/s, step time, peak memory, model FLOPs utilisation (model
FLOPs = 6 x parameters x tokens, the shared embedding counted once as the output
projection, over the probe's measured BF16 matmul rate) and logical figures.
"""


import json
from pathlib import Path

from common import cases, measure, stage
from common.cases import chunk_variants, opt_tag


def backend_variants(mixer: str, settings: dict, gates: dict | None, device) -> list[tuple[str, dict]]:
    """(backend, options) diagnostics of one mixer; chunked backends once per chunk
    size on a GPU (one option set each on the CPU, where the interpreter is slow)."""
    import kernels

    fns = kernels.backends(mixer)
    out = []
    # Backends inexact by design (the BF16 associative scan) are diagnostics too; their
    # records say exact=False and the architecture comparison never takes them.
    for name in cases.diagnostic_backend_names(mixer, fns, gates)[0]:
        if settings.get("backends") and name not in settings["backends"]:
            continue
        variants = chunk_variants(name, fns[name], settings["chunk_sizes"]) if device.type == "cuda" else [{}]
        out += [(name, opts) for opts in variants]
    return out


class Setup:
    """A model, its optimiser and a batch of random tokens: one timed step."""

    def __init__(self, preset: str, mixer: str, T: int, B: int, settings: dict, device, backend="auto",
                 official: bool = False, seed: int = 0):
        import torch

        import kernels
        from kernels.models import HawkConfig, HawkLM, compile_blocks

        torch.manual_seed(seed)
        self.cfg = HawkConfig.preset(preset, mixer=mixer, vocab_size=settings["vocab"])
        model = HawkLM(self.cfg, backend=backend, device=device, dtype=torch.float32)
        if official:
            model = kernels.to_recurrentgemma(model)
        self.compiled = bool(settings.get("compile")) and not official
        if self.compiled:
            compile_blocks(model)
        self.model, self.official = model, official
        self.opt = torch.optim.AdamW(model.parameters(), lr=settings.get("lr", 3e-4),
                                     fused=device.type == "cuda")
        g = torch.Generator(device="cpu").manual_seed(seed)
        toks = torch.randint(0, settings["vocab"], (B, T + 1), generator=g).to(device)
        self.inp, self.tgt = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
        self.pos = torch.arange(T, device=device).expand(B, T).contiguous()
        self.T, self.B, self.device = T, B, device
        self.clip = settings.get("grad_clip", 1.0)
        self.autocast = settings.get("autocast")
        self.params = sum(p.numel() for p in model.parameters())

    def step(self):
        import torch
        import torch.nn.functional as F

        from kernels.models import train_step

        dtype = getattr(torch, self.autocast) if self.autocast else None
        if not self.official:
            return train_step(self.model, self.opt, self.inp, self.tgt, self.pos, self.clip, dtype)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            logits, _ = self.model(self.inp, self.pos, return_logits=True, return_cache=False)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), self.tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def figures(self, fields: dict, matmul_rate: float | None, peak_rate: float | None) -> dict:
        med_s = fields["stats"]["median_ms"] * 1e-3
        tokens = self.T * self.B
        flops = 6 * self.params * tokens
        lg = fields["logical"]
        if lg is not None:
            lg["param_bytes"] = 4 * self.params
            lg["grad_bytes"] = 4 * self.params
            lg["optimizer_state_bytes"] = 8 * self.params
            lg["state_bytes"] = self.B * self.cfg.num_layers * self.cfg.lru_width * 4
            lg["model_flops_per_step"] = flops
        return {
            "tokens_per_step": tokens,
            "tokens_per_s": tokens / med_s,
            "step_ms": fields["stats"]["median_ms"],
            "parameters": self.params,
            "compiled": self.compiled,
            "non_embedding_parameters": self.cfg.non_embedding_parameters(),
            "model_flops_per_step": flops,
            "mfu": flops / med_s / matmul_rate if matmul_rate else None,
            "mfu_basis": "model FLOPs (6 x parameters x tokens) per second over the probe's measured BF16 "
                         "matmul rate" if matmul_rate else None,
            "mfu_of_peak": flops / med_s / peak_rate if peak_rate else None,
        }


def timed(setup_fn, reps: int, warmup: int, settings: dict, device, matmul_rate, peak_rate,
          reuse: dict | None = None) -> dict:
    """Build, warm up, count (unless `reuse`, the same configuration's record in the
    other order, already holds the counts) and time the training step."""
    s = setup_fn()
    try:
        logical = measure.reuse_logical(reuse)
        m = measure.measure(s.step, reps, warmup, device, count=logical is None,
                            budget_s=settings.get("budget_s_per_config"))
        fields = measure.timing_fields(m)
        fields["logical"] = fields["logical"] or logical
        fields.update(s.figures(fields, matmul_rate, peak_rate))
        return fields
    finally:
        del s
        measure.release(device)


def main(job):
    import torch

    settings = job.params["settings"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gates = json.loads(Path(job.input.gates).read_text())
    env = json.loads(Path(job.input.environment).read_text())
    import kernels

    tuned = kernels.Backend("auto", table=kernels.TuningTable.load(job.input.table))
    matmul_rate, peak_rate = measure.matmul_rate(env), settings.get("peak_flop_per_s")
    runner = measure.Runner("train", job.profile, job.params["records_dir"], settings.get("budget_s"), device,
                            restart=lambda: measure.reexec(job), lock_clocks=job.lock_clocks)
    mixers = settings["mixers"]
    shapes = [(p, s["T"], s["B"]) for p in settings["presets"] for s in settings["shapes"]]
    diag = settings.get("diagnostics", "all")
    diag_shapes = shapes if diag == "all" else [(d["preset"], d["T"], d["B"]) for d in diag]
    ref_lim, off = settings.get("reference", {}), settings.get("official", {})

    def base(preset, T, B, mixer):
        return {"shapes": {"preset": preset, "T": T, "B": B, "vocab": settings["vocab"]}, "mixer": mixer,
                "dtype": settings.get("autocast") or "float32"}

    def setup(preset, T, B, mixer, name, opts):
        """The model with backend `name` and its launcher options ("auto": the tuning table)."""
        backend = tuned if name == "auto" else kernels.Backend(name, **opts)
        return Setup(preset, mixer, T, B, settings, device, backend=backend)

    # On a GPU the PyTorch per-step reference is the slow one; on the CPU it is what
    # the architecture comparison measures, so it runs first there.
    slow_names = {"reference"} if device.type == "cuda" else set()

    def diagnostics(slow: bool):
        """Diagnostics at every diagnostics shape; `slow` selects the PyTorch per-step
        reference and the official peer (run after the architecture comparison, so a
        spent time budget cuts them first), otherwise the Triton backends."""
        for preset, T, B in diag_shapes:
            items = [(mx, name, opts) for mx in mixers for name, opts in backend_variants(mx, settings, gates, device)
                     if (name in slow_names) == slow]
            for order, seq in measure.orders(items):
                if order not in settings.get("diagnostic_orders", ["AB", "BA"]):
                    continue
                for mixer, name, opts in seq:
                    diagnostic(preset, T, B, order, seq, mixer, name, opts)
            if slow and "rglru" in mixers and preset in off.get("presets", []) and T <= off.get("max_T", 0):
                official_peer(preset, T, B)

    def diagnostic(preset, T, B, order, seq, mixer, name, opts):
        reps, warmup = settings["reps"], settings["warmup"]
        if name == "reference":
            if T > ref_lim.get("max_T", 0) or preset not in ref_lim.get("presets", []):
                return
            reps, warmup = ref_lim.get("reps", 1), ref_lim.get("warmup", 1)
        cid = f"train-diag-{preset}-T{T}-B{B}-{mixer}-{name}{opt_tag(opts)}-{order}"

        def make(mixer=mixer, name=name, opts=opts):
            return setup(preset, T, B, mixer, name, opts)

        reuse = runner.ok(cid[:-2] + "AB") if order == "BA" else None

        def body(make=make, reps=reps, warmup=warmup, reuse=reuse):
            return timed(make, reps, warmup, settings, device, matmul_rate, peak_rate, reuse)

        runner.run(cid, body, **base(preset, T, B, mixer), backend=name, options=opts, order=order,
                   role="diagnostic", exact=name in cases.exact_backend_names(
                       mixer, [name], gates, settings.get("inexact", [])),
                   sequence=[f"{m}/{n}{opt_tag(o)}" for m, n, o in seq])

    def official_peer(preset, T, B):
        cid = f"train-peer-{preset}-T{T}-B{B}-rglru-official"

        def peer_body():
            try:
                from kernels import parity

                parity.load_official()
            except ImportError as e:
                raise measure.Skip(f"recurrentgemma not installed ({e})") from None
            return timed(lambda: Setup(preset, "rglru", T, B, settings, device, official=True),
                         off.get("reps", 2), off.get("warmup", 1), settings, device, matmul_rate, peak_rate)

        runner.run(cid, peer_body, **base(preset, T, B, "rglru"), backend="peer:recurrentgemma", options={},
                   role="peer", exact=True)

    diagnostics(slow=False)

    inexact = settings.get("inexact", [])
    for preset, T, B in shapes:
        chosen = {}
        for mixer in mixers:
            cands = []
            for rid in list(runner.done):
                rec = runner.ok(rid)
                if (rec and rec.get("role") == "diagnostic" and rec["mixer"] == mixer and rec.get("exact")
                        and rec["shapes"].get("preset") == preset and rec["shapes"].get("T") == T
                        and rec["shapes"].get("B") == B
                        and cases.exact_backend_names(mixer, [rec["backend"]], gates, inexact)):
                    cands.append(rec)
            if cands:
                best = min(cands, key=lambda r: r["stats"]["median_ms"])
                chosen[mixer] = (best["backend"], best.get("options") or {},
                                 sorted(r["config_id"] for r in cands), "fastest diagnostics record")
            else:
                chosen[mixer] = ("auto", {}, [], "tuning table (no diagnostics at this preset and shape)")
        for order, seq in measure.orders(mixers):
            for mixer in seq:
                name, opts, sel, why = chosen[mixer]
                cid = f"train-arch-{preset}-T{T}-B{B}-{mixer}-{name}{opt_tag(opts)}-{order}"

                def make(mixer=mixer, name=name, opts=opts):
                    return setup(preset, T, B, mixer, name, opts)

                reuse = runner.ok(cid[:-2] + "AB") if order == "BA" else None

                def body(make=make, reuse=reuse):
                    return timed(make, settings["fresh_reps"], settings["warmup"], settings, device,
                                 matmul_rate, peak_rate, reuse)

                runner.run(cid, body, **base(preset, T, B, mixer), backend=name, options=opts, order=order,
                           role="fresh", exact=True, selected_from=sel, selected_by=why, sequence=list(seq))
    diagnostics(slow=True)
    recs = runner.finish(job.output.records)
    print(f"track_train: {len(recs)} records", flush=True)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
