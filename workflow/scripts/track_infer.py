"""Inference track -> results/tracks/infer/records.jsonl: greedy decoding through the generation engine: prefill
(time to first token), latency (one trajectory read at every length), the generation command line's step time beside
it, and throughput (probes over batch sizes while tokens/s rises, the best on fresh trajectories)."""

import json
import os
import statistics
import subprocess
import sys

import torch

from common import cases, measure, stage
from common.facts import REPO_ROOT

import kernels
from kernels import ops
from kernels.generate import DTYPES
from kernels.models import HawkConfig, HawkLM
from kernels.models import decode as dk
from kernels.models.generation import Engine


def trajectory_fields(engine, B: int, prompt_tokens, checkpoints: list[int], reps: int, device, params: int,
                      reuse: dict | None = None, warmup: int = 2) -> dict:
    """Per checkpoint, the fields of `reps` trajectories, with one step's logical counts (or `reuse`'s)."""
    batch = B if prompt_tokens is None else None
    runs = [measure.time_trajectory(lambda i: engine.step(), checkpoints, device, warmup=warmup if k == 0 else 0,
                                    before=lambda: engine.start(prompt_tokens, batch_size=batch)) for k in range(reps)]
    logical = reuse or cases.step_counts(engine, B, device)
    logical.update(param_bytes=params * 2, state_bytes=measure.tensor_bytes(engine.cache))
    kind = "engine+graphs" if engine.graphs else "engine"
    out = {}
    for k, n in enumerate(runs[0]["checkpoints"]):
        samples = [r["cumulative_ms"][k] for r in runs]
        st = measure.summarize(samples)
        out[n] = {"samples_ms": samples, "stats": st,
                  "peak_bytes": max(r["peak_bytes"] or 0 for r in runs) if runs[0]["peak_bytes"] is not None else None,
                  "generated_tokens": n, "tokens_per_s": B * n / (st["median_ms"] * 1e-3),
                  "ms_per_step": st["median_ms"] / n, "logical": dict(logical), "decoder": kind,
                  "decoder_details": {"kind": kind, **engine.describe(B)}, "trajectory_clock": runs[0]["clock"],
                  "warmup_steps": warmup}
    return out


def engine_for(model, B: int, table: kernels.TuningTable, settings: dict, device) -> Engine:
    """The engine at batch size B with the table's linear tiles for B's row block."""
    return Engine(model, graphs=settings.get("cuda_graphs", True) and device.type == "cuda",
                  linear_configs=table.linear_configs(settings["dtype"], dk.rows_block(B)))


def prefill_fields(model, pre: dict, settings: dict, env: dict, table: kernels.TuningTable, device) -> dict:
    """Time to first token (prefill of a [B, P] prompt and one decode step, eager) and its floor."""
    B, P = pre["batch"], pre["prompt"]
    engine = engine_for(model, B, table, settings, device)
    tokens = torch.randint(1, settings["vocab"], (B, P), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        fields = measure.measure(lambda: (engine.start(tokens), engine.step()), pre.get("reps", 3), 1, device)
    finally:
        del engine
        measure.release(device)
    flops = 2 * model.config.non_embedding_parameters() * B * P
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rate, bw = measure.matmul_rate(env), measure.copy_bandwidth(env)
    floors = {"flops_ms": flops / rate * 1e3 if rate else None, "bytes_ms": weight_bytes / bw * 1e3 if bw else None}
    floor_ms = max((v for v in floors.values() if v is not None), default=None)
    return {**fields, "prompt_tokens": B * P, "ttft_ms": fields["stats"]["median_ms"], "floor_ms": floor_ms,
            "floor": {"model_flops": flops, "weight_bytes": weight_bytes, **floors, "ms": floor_ms, "basis":
                      "max(2 x non-embedding parameters x B x P / probe BF16 rate, weights / probe copy bandwidth)"}}


def cli_fields(argv: list[str], table: str, track: list) -> dict:
    """The generation command in its own process (table via $KERNELS_TUNING_TABLE, errors to the log) beside `track`."""
    out = subprocess.run([sys.executable, "-m", "kernels.generate", *argv, "--json"], stdout=subprocess.PIPE, text=True,
                         cwd=REPO_ROOT, env={**os.environ, ops.tuning.ENV: os.path.abspath(table)}, check=True).stdout
    got, ms = json.loads(out.splitlines()[-1]), [r["ms_per_step"] for r in track if r]
    total = got["runs_ms"]      # the command's timed runs, whose median it prints
    return {"samples_ms": total, "stats": measure.summarize(total), "cli": got, "argv": argv, "track_ms_per_step": ms,
            "ms_per_step": got["ms_per_step"], "vs_track": got["ms_per_step"] / statistics.median(ms) if ms else None}


def extend_grid(probe_at, thr: dict) -> dict:
    """Probe the batch sizes, doubling B while tokens/s rises over `plateau_rise` (to `max_batch`);
    stop at the first failure; say why it ended."""
    batches, rise, cap = sorted(thr["batches"]), thr.get("plateau_rise", 0.02), thr.get("max_batch", 8192)
    done, why = [], None
    for i, B in enumerate(batches):     # batches grows while tokens/s rises
        rec = probe_at(B)
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
    return {"records": done, "plateau": why, "batches": [r["shapes"]["B"] for r in done]}


def main(job):
    settings, device = job.params["settings"], measure.device_of()
    auto = kernels.Backend("auto", table=kernels.TuningTable.from_dict(job.load("table")))
    runner = measure.Runner.for_job(job, "infer", settings, device)
    preset, mixers = settings["preset"], settings["mixers"]
    if settings.get("cli_tokens") and settings["vocab"] != (v := HawkConfig.preset(preset).vocab_size):
        raise ValueError(f"infer.cli_tokens: the generation command builds vocab {v}, not {settings['vocab']}")
    models: dict = {}

    def model(mixer):
        # One model resident at a time, so that a configuration's peak memory is its own model's.
        if mixer not in models:
            models.clear()
            measure.release(device)
            torch.manual_seed(0)
            cfg = HawkConfig.preset(preset, mixer=mixer, vocab_size=settings["vocab"])
            models[mixer] = HawkLM(cfg, backend=auto, device=device, dtype=getattr(torch, settings["dtype"])
                                   ).eval().requires_grad_(False)
        return models[mixer]

    def base(mixer, B, prompt):
        return {"shapes": {"preset": preset, "B": B, "prompt": prompt, "vocab": settings["vocab"]},
                "mixer": mixer, "backend": "auto", "dtype": settings["dtype"]}

    def group(prefix, mixer, B, prompt, lengths, reps, order, seq, role, **extra):
        ids = [f"{prefix}-N{n}" for n in lengths]

        def body():
            m = model(mixer)
            # the table's decode entries pick the step kernel and its options by batch size
            m.set_backend(auto)
            choice = kernels.ops.tuned_step(mixer, auto.table, settings["dtype"], B)
            engine = engine_for(m, B, auto.table, settings, device)
            g = torch.Generator(device="cpu").manual_seed(0)
            tokens = torch.randint(1, settings["vocab"], (B, prompt), generator=g).to(device) if prompt else None
            try:
                per = trajectory_fields(engine, B, tokens, lengths, reps, device,
                                        sum(p.numel() for p in m.parameters()), runner.twin(ids[0]),
                                        warmup=settings.get("warmup_steps", 2))
                # what the mixer backends resolve to: the prefill op (with options) and the decode step
                x = torch.empty((), dtype=engine.dtype, device=device).expand(B, max(prompt, 1), m.config.lru_width)
                name, opts = ops.resolve(mixer, m.blocks[0].recurrent_block.mixer.backend, x)
                for v in per.values():
                    v.update(resolved={"prefill": name, "prefill_options": opts, "step": v["decoder_details"][
                        "mixer_step_backend"]}, decode_table_entry=choice)
            finally:
                del engine
                measure.release(device)
            return {c: per[n] for c, n in zip(ids, lengths)}

        fields = {**base(mixer, B, prompt), "order": order, "role": role, "sequence": list(seq), **extra}
        return runner.run_group(ids, body, {c: {**fields, "generated_tokens": n} for c, n in zip(ids, lengths)})

    lat = settings["latency"]
    for prompt in lat["prompts"]:
        for order, seq, mixer in measure.orders(mixers):
            group(f"infer-latency-{preset}-P{prompt}-B{lat['batch']}-{mixer}-{order}", mixer, lat["batch"],
                  prompt, sorted(lat["lengths"]), lat.get("reps", 1), order, seq, "latency")

    if pre := settings.get("prefill"):
        env = job.load("environment")
        for order, seq, mixer in measure.orders(mixers):
            cid = f"infer-prefill-{preset}-P{pre['prompt']}-B{pre['batch']}-{mixer}-{order}"
            runner.run(cid, lambda mixer=mixer: prefill_fields(model(mixer), pre, settings, env, auto.table, device),
                       **base(mixer, pre["batch"], pre["prompt"]), order=order, role="prefill", sequence=list(seq))

    if n := settings.get("cli_tokens"):
        measure.release(device)
        B, dtype = lat["batch"], next(k for k, v in DTYPES.items() if v == getattr(torch, settings["dtype"]))
        for mixer in mixers:
            argv = ["--preset", preset, "--mixer", mixer, "--batch", str(B), "--new-tokens", str(n), "--dtype", dtype]
            track = [runner.ok(f"infer-latency-{preset}-P0-B{B}-{mixer}-{o}-N{n}") for o in ("AB", "BA")]
            runner.run(f"infer-cli-{preset}-B{B}-N{n}-{mixer}", lambda a=argv, t=track: cli_fields(
                a, job.input.table, t), **base(mixer, B, 0), role="cli", generated_tokens=n)

    if thr := settings.get("throughput"):
        probe, grid = {}, {}
        for order, seq, mixer in measure.orders(mixers):
            def probe_at(B, mixer=mixer, order=order, seq=seq):
                got = group(f"infer-probe-{preset}-B{B}-{mixer}-{order}", mixer, B, 0, [thr["probe_steps"]],
                            thr.get("probe_reps", 1), order, seq, "probe")
                return next(iter(got.values()), None)

            grid[(mixer, order)] = extend_grid(probe_at, thr)
            for rec in grid[(mixer, order)]["records"]:
                probe.setdefault(mixer, {}).setdefault(rec["shapes"]["B"], []).append(rec)
            runner.say(f"{mixer} {order}: {grid[(mixer, order)]['plateau']}")
        best = {}
        for mixer in mixers:
            scores = {B: statistics.median(r["tokens_per_s"] for r in rs) for B, rs in probe.get(mixer, {}).items()}
            best[mixer] = sorted(scores, key=lambda b: -scores[b])[: thr.get("top", 1)]
            runner.say(f"{mixer} best batch sizes by probe tokens/s: {best[mixer]}")
        for order, seq, mixer in measure.orders(mixers):
            plateau = {o: grid[(mixer, o)]["plateau"] for m, o in grid if m == mixer}
            for B in best.get(mixer, []):
                sel = sorted(r["config_id"] for r in probe[mixer][B])
                group(f"infer-throughput-{preset}-B{B}-{mixer}-{order}", mixer, B, 0, sorted(thr["lengths"]),
                      thr.get("reps", 1), order, seq, "fresh", selected_from=sel,
                      selected_by="highest probe tokens/s", throughput_grid=plateau)
    runner.finish(job.output.records)


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
