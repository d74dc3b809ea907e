"""Inference track (Griffin section 5) -> results/tracks/infer/records.jsonl.

The profile's preset (1.3b) with BF16 random weights, FP32 recurrent caches.
Every decode step feeds back its own output and runs the embedding, all blocks,
the final norm, the vocabulary projection and the next-token choice (argmax).
Prompt processing is excluded: the allocator's peak and the clock start after it.
The CUDA-graph generation engine (kernels.models.generation) is used when it
exists -- graphs remove Python overhead, never model work -- otherwise the
model's eager `step`.

- Latency: batch B (16), an empty prompt and a prompt of P tokens (4096), one
  trajectory to the longest length with the time read at every length (128 ..
  4096 generated tokens); SAMU -> RG-LRU and RG-LRU -> SAMU order.
- Throughput: 64-step probes over the batch sizes of the profile, extended by
  doubling B until tokens/s stops rising or memory runs out (`extend_grid`; the
  records say where and why the grid ended), then each mixer's best batch sizes
  (by probe tokens/s) through fresh trajectories of 512 .. 4096 steps in both orders.
  Only completed trajectories are reported: a failed or out-of-memory
  trajectory is a record with that status and no figures.
"""


import json
import statistics
from pathlib import Path

from common import measure, stage


def engine_module():
    try:
        from kernels.models import generation
    except ImportError:
        return None
    return generation


class Decoder:
    """Greedy decoding of one model at batch B: `prefill()` (excluded from timing)
    then `step(i)` advances every row by one token, feeding back its choice."""

    def __init__(self, model, B: int, prompt: int, vocab: int, device, use_engine: bool, seed: int = 0,
                 graphs: bool = True):
        import torch

        self.model, self.B, self.prompt, self.device = model, B, prompt, device
        self.vocab, self.seed = vocab, seed
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.prompt_tokens = torch.randint(1, vocab, (B, max(prompt, 1)), generator=g).to(device)
        self.engine = None
        gen = engine_module() if use_engine else None
        if gen is not None and hasattr(gen, "Decoder"):
            self.engine = gen.Decoder(model, B, graphs=graphs)
        self.graphs = self.engine is not None and graphs
        self.kind = ("engine+graphs" if self.graphs else "engine") if self.engine is not None else "eager"

    def describe(self) -> dict:
        if self.engine is None:
            return {"kind": "eager", "step": "HawkLM.step"}
        return {"kind": self.kind, **self.engine.engine.describe(self.B)}

    def counting_twin(self) -> "Decoder":
        """The same decoder without CUDA graphs, started on an empty prompt: a graph
        replay runs no launcher code, so the logical counts of a step come from this
        twin, which launches the same kernels eagerly."""
        twin = Decoder(self.model, self.B, 0, self.vocab, self.device, self.engine is not None, self.seed,
                       graphs=False)
        twin.prefill()
        return twin

    def prefill(self):
        """Prompt processing (or the empty-prompt start); not timed."""
        import torch

        with torch.no_grad():
            if self.engine is not None:
                toks = self.prompt_tokens if self.prompt else None
                self.engine.reset(toks)
                return
            if self.prompt:
                pos = torch.arange(self.prompt, device=self.device).expand(self.B, self.prompt)
                logits, self.cache = self.model(self.prompt_tokens, pos)
                self.tok = logits[:, -1].argmax(-1)
                del logits
            else:
                self.cache = self.model.init_cache(self.B)
                from kernels.models.generation import BOS_ID

                self.tok = torch.full((self.B,), BOS_ID, dtype=torch.int64, device=self.device)
            self.pos = torch.full((self.B,), self.prompt, dtype=torch.int64, device=self.device)

    def step(self, i: int = 0):
        import torch

        if self.engine is not None:
            return self.engine.step()
        with torch.no_grad():
            logits = self.model.step(self.tok, self.pos, self.cache)
            self.tok = logits.argmax(-1)
            self.pos.add_(1)
        return self.tok

    def state_bytes(self) -> int:
        if self.engine is not None:
            return measure.tensor_bytes(getattr(self.engine, "cache", None))
        return measure.tensor_bytes(self.cache)


def resolved_backends(model, B: int, prompt: int, device) -> dict:
    """The backends the model's mixer backends resolve to: prefill op and decode step."""
    import torch

    import kernels
    from kernels import ops

    cfg = model.config
    dtype = next(model.parameters()).dtype
    x = torch.empty(B, max(prompt, 1), cfg.lru_width, dtype=dtype, device=device)
    mixer = model.blocks[0].recurrent_block.mixer
    name, opts = ops.resolve(cfg.mixer, mixer.backend, x)
    step_fn = ops.resolve_step(cfg.mixer, mixer.step_backend, x[:, 0])
    step_fn = getattr(step_fn, "func", step_fn)
    step = next((n for n, f in kernels.step_backends(cfg.mixer).items() if f is step_fn), None)
    return {"prefill": name, "prefill_options": opts, "step": step}


def decode_choice(table: dict, mixer: str, B: int) -> dict | None:
    """The tuning table's decode entry for this mixer nearest in log(B), if any."""
    import math

    import kernels

    cands = [e for e in table.get("decode", []) if e.get("op") == f"{mixer}_step"
             and e.get("backend") in kernels.step_backends(mixer)]
    if not cands:
        return None
    return min(cands, key=lambda e: abs(math.log(max(e["B"], 1) / max(B, 1))))


def build_model(preset: str, mixer: str, settings: dict, device, backend="auto"):
    import torch

    from kernels.models import HawkConfig, HawkLM

    torch.manual_seed(0)
    cfg = HawkConfig.preset(preset, mixer=mixer, vocab_size=settings["vocab"])
    model = HawkLM(cfg, backend=backend, device=device, dtype=getattr(torch, settings["dtype"])).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def trajectory_fields(dec: Decoder, checkpoints: list[int], reps: int, device, params: int,
                      reuse: dict | None = None, warmup: int = 2) -> dict:
    """Run `reps` trajectories to max(checkpoints); per checkpoint, the cumulative
    milliseconds of every trajectory plus tokens/s, peak memory and logical counts
    (of one step; taken from `reuse`, the other order's record, when it has them).
    Before the first timed trajectory, `warmup` untimed steps from a fresh prefill
    take the one-time work (kernel compilation, CUDA-graph capture) out of it."""
    runs = [measure.time_trajectory(dec.step, checkpoints, device, before=dec.prefill,
                                   warmup=warmup if k == 0 else 0) for k in range(reps)]
    logical = measure.reuse_logical(reuse)
    if logical is None:
        counted = dec.counting_twin() if dec.graphs else dec
        counted.step()
        logical = measure.logical_counts(counted.step, device)
        if counted is not dec:
            logical["launches_method"] += " (eager twin of the graph-captured step)"
            del counted
    logical["param_bytes"] = params * 2
    logical["state_bytes"] = dec.state_bytes()
    out = {}
    for k, n in enumerate(runs[0]["checkpoints"]):
        samples = [r["cumulative_ms"][k] for r in runs]
        st = measure.summarize(samples)
        out[n] = {
            "samples_ms": samples,
            "stats": st,
            "peak_bytes": max((r["peak_bytes"] or 0) for r in runs) if runs[0]["peak_bytes"] is not None else None,
            "generated_tokens": n,
            "tokens_per_s": dec.B * n / (st["median_ms"] * 1e-3),
            "ms_per_step": st["median_ms"] / n,
            "logical": dict(logical),
            "decoder": dec.kind,
            "decoder_details": dec.describe(),
            "trajectory_clock": runs[0]["clock"],
            "warmup_steps": warmup,
        }
    return out


def extend_grid(probe_at, thr: dict) -> dict:
    """Probe the profile's batch sizes in rising order, then keep doubling B while
    tokens/s still rises by more than `plateau_rise` (default 2 %) up to `max_batch`;
    stop at the first failure (out of memory). {"records": the completed probes,
    "plateau": why the grid ends, with the batch sizes that decide it}."""
    batches, rise, cap = sorted(thr["batches"]), thr.get("plateau_rise", 0.02), thr.get("max_batch", 8192)
    done, i, why = [], 0, None
    while i < len(batches):
        B, rec = batches[i], probe_at(batches[i])
        if rec is None:
            why = f"not probed from B={B} on (the stage's time budget)"
            break
        if rec["status"] != "ok":
            why = f"{'out of memory' if rec['status'] == 'oom' else 'failed'} at B={B}"
            break
        done.append(rec)
        if i == len(batches) - 1:
            prev = done[-2]["tokens_per_s"] if len(done) > 1 else 0.0
            if rec["tokens_per_s"] <= prev * (1 + rise):
                why = (f"tokens/s stopped rising: {prev:.0f} at B={done[-2]['shapes']['B']}, "
                       f"{rec['tokens_per_s']:.0f} at B={B} (under +{rise:.0%})")
            elif 2 * B > cap:
                why = f"max_batch {cap} reached, tokens/s still rising at B={B}"
            else:
                batches.append(2 * B)
        i += 1
    return {"records": done, "plateau": why, "batches": [r["shapes"]["B"] for r in done]}


def main(job):
    import torch

    settings = job.params["settings"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import kernels

    table = json.loads(Path(job.input.table).read_text())
    auto = kernels.Backend("auto", table=kernels.TuningTable.from_dict(table))
    runner = measure.Runner("infer", job.profile, job.params["records_dir"], settings.get("budget_s"), device,
                            restart=lambda: measure.reexec(job), lock_clocks=job.lock_clocks)
    preset, mixers = settings["preset"], settings["mixers"]
    use_engine = settings.get("engine", True)
    models: dict = {}

    def model(mixer):
        # One model resident at a time, so that a configuration's peak memory is its own model's.
        if mixer not in models:
            models.clear()
            measure.release(device)
            models[mixer] = build_model(preset, mixer, settings, device, auto)
        return models[mixer]

    def base(mixer, B, prompt):
        return {"shapes": {"preset": preset, "B": B, "prompt": prompt, "vocab": settings["vocab"]},
                "mixer": mixer, "backend": "auto", "dtype": settings["dtype"]}

    def group(prefix, mixer, B, prompt, lengths, reps, order, extra):
        ids = [f"{prefix}-N{n}" for n in lengths]
        reuse = runner.ok(f"{prefix[:-2]}AB-N{lengths[0]}") if order == "BA" else None

        def body():
            m = model(mixer)
            choice = decode_choice(table, mixer, B)
            # The decode table picks the step kernel and its launcher options by batch size.
            step = kernels.Backend(choice["backend"], **choice.get("options", {})) if choice else "auto"
            m.set_backend(auto, step_backend=step)
            dec = Decoder(m, B, prompt, settings["vocab"], device, use_engine,
                          graphs=settings.get("cuda_graphs", True) and device.type == "cuda")
            try:
                per = trajectory_fields(dec, lengths, reps, device, sum(p.numel() for p in m.parameters()), reuse,
                                        warmup=settings.get("warmup_steps", 2))
                for v in per.values():
                    v["resolved"] = resolved_backends(m, B, prompt, device)
                    v["decode_table_entry"] = choice
            finally:
                del dec
                measure.release(device)
            return {f"{prefix}-N{n}": per[n] for n in lengths}

        fields = {f"{prefix}-N{n}": {**base(mixer, B, prompt), "order": order, "generated_tokens": n, **extra}
                  for n in lengths}
        return runner.run_group(ids, body, fields)

    lat = settings["latency"]
    for prompt in lat["prompts"]:
        for order, seq in measure.orders(mixers):
            for mixer in seq:
                group(f"infer-latency-{preset}-P{prompt}-B{lat['batch']}-{mixer}-{order}", mixer, lat["batch"],
                      prompt, sorted(lat["lengths"]), lat.get("reps", 1), order,
                      {"role": "latency", "sequence": list(seq)})

    thr = settings.get("throughput") or {}
    if thr:
        probe, grid = {}, {}
        for order, seq in measure.orders(mixers):
            for mixer in seq:
                def probe_at(B, mixer=mixer, order=order, seq=seq):
                    got = group(f"infer-probe-{preset}-B{B}-{mixer}-{order}", mixer, B, 0, [thr["probe_steps"]], 1,
                                order, {"role": "probe", "sequence": list(seq)})
                    return next(iter(got.values()), None)

                grid[(mixer, order)] = extend_grid(probe_at, thr)
                for rec in grid[(mixer, order)]["records"]:
                    probe.setdefault(mixer, {}).setdefault(rec["shapes"]["B"], []).append(rec)
                measure.log_line(None, f"infer: {mixer} {order}: {grid[(mixer, order)]['plateau']}")
        best = {}
        for mixer in mixers:
            scores = {B: statistics.median(r["tokens_per_s"] for r in rs) for B, rs in probe.get(mixer, {}).items()}
            best[mixer] = sorted(scores, key=lambda b: -scores[b])[: thr.get("top", 1)]
            measure.log_line(None, f"infer: {mixer} best batch sizes by probe tokens/s: {best[mixer]}")
        for order, seq in measure.orders(mixers):
            for mixer in seq:
                plateau = {o: grid[(mixer, o)]["plateau"] for m, o in grid if m == mixer}
                for B in best.get(mixer, []):
                    sel = sorted(r["config_id"] for r in probe[mixer][B])
                    group(f"infer-throughput-{preset}-B{B}-{mixer}-{order}", mixer, B, 0, sorted(thr["lengths"]),
                          thr.get("reps", 1), order,
                          {"role": "fresh", "sequence": list(seq), "selected_from": sel,
                           "selected_by": "highest probe tokens/s", "throughput_grid": plateau})
    recs = runner.finish(job.output.records)
    print(f"track_infer: {len(recs)} records", flush=True)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
