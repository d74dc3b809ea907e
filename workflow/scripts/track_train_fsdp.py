"""Multi-GPU training track -> results/tracks/train_fsdp/records.jsonl: track_train's step data parallel with FSDP2 over
`train.world_size` GPUs (weak scaling), each mixer on the backend track_train chose. The stage runs torchrun on this
script (`--worker`); rank 0 writes the records; a configuration during which a rank died is recorded failed."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import atomic, fsdp, measure, records, stage, training
from common.cases import opt_tag

import kernels

STAGE = "train_fsdp"
MAX_LAUNCHES = 4


def fsdp_settings(settings: dict) -> dict:
    """train.fsdp's presets, shapes, reps, warmup, budget (defaults: the track's, no budget)."""
    fs = settings.get("fsdp") or {}
    return {"presets": fs.get("presets", settings["presets"]), "shapes": fs.get("shapes", settings["shapes"]),
            "reps": fs.get("reps", settings["fresh_reps"]), "warmup": fs.get("warmup", settings["warmup"]),
            "budget_s": fs.get("budget_s")}


def plan(settings: dict, single: list[dict]) -> list[dict]:
    """Every configuration in run order, on the backend of track_train's fresh records (`single`) at
    its preset, shape and mixer."""
    world, fs, out = settings["world_size"], fsdp_settings(settings), []
    for preset in fs["presets"]:
        for T, B in ((shape["T"], shape["B"]) for shape in fs["shapes"]):
            for order, seq, mixer in measure.orders(settings["mixers"]):
                base = [r for r in single if r.get("stage") == "train" and r.get("role") == "fresh"
                        and r["status"] == "ok" and r["mixer"] == mixer and training.shape_of(r) == (preset, T, B)]
                backend, opts = (base[0]["backend"], base[0].get("options") or {}) if base else ("auto", {})
                out.append({
                    "config_id": f"train-fsdp{world}-{preset}-T{T}-B{B}-{mixer}-{backend}{opt_tag(opts)}-{order}",
                    "preset": preset, "T": T, "B": B, "mixer": mixer, "backend": backend, "options": opts,
                    "single": base, "fields": {
                        **training.identity(preset, T, B, mixer, settings), "backend": backend, "options": opts,
                        "order": order, "role": "fsdp", "exact": True, "sequence": list(seq), "world_size": world,
                        "selected_from": sorted(r["config_id"] for r in base),
                        "selected_by": "the single-GPU architecture comparison's backend" if base
                        else "tuning table (no single-GPU record at this preset and shape)"}})
    return out


def figures(per_rank: list[dict], item: dict, matmul_rate: float | None, peak_rate: float | None) -> dict:
    """Record fields from every rank's timing: a step takes as long as its slowest rank."""
    world, T, B, first, single = len(per_rank), item["T"], item["B"], per_rank[0], item["single"]
    samples = [max(step) for step in zip(*(r["timing"]["samples_ms"] for r in per_rank))]
    stats = {**first["timing"]["stats"], **measure.summarize(samples)}
    step_s, params, tokens = stats["median_ms"] * 1e-3, first["parameters"], world * B * T
    logical = first["timing"]["logical"] and {**first["timing"]["logical"], "counted_on": "rank 0 (its B documents)"}
    mfu = training.step_figures(params, tokens, step_s, logical, B * first["num_layers"] * first["lru_width"] * 4,
                                matmul_rate, peak_rate, world)
    peaks = [r["timing"]["peak_bytes"] for r in per_rank]
    one, per_gpu = sum(r["tokens_per_s"] for r in single) / len(single) if single else None, B * T / step_s
    return {"samples_ms": samples, "samples_basis": "per step, the slowest rank's time (each rank times its own steps)",
            "stats": stats, "rank_median_ms": [r["timing"]["stats"]["median_ms"] for r in per_rank],
            "peak_bytes": max(peaks) if None not in peaks else None, "peak_bytes_per_rank": peaks,
            "base_bytes_per_rank": [r["timing"]["base_bytes"] for r in per_rank], "logical": logical,
            "world_size": world, "process_group": first["process_group"], "param_dtype": first["param_dtype"],
            "reduce_dtype": "float32", "tokens_per_step": tokens, "tokens_per_step_per_gpu": B * T,
            "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": per_gpu, "step_ms": stats["median_ms"],
            "parameters": params, "non_embedding_parameters": first["non_embedding_parameters"], **mfu,
            "single_gpu_tokens_per_s": one, "single_gpu_records": sorted(r["config_id"] for r in single),
            "scaling_efficiency": per_gpu / one if one else None,
            "scaling_basis": "tokens/s per GPU over the single-GPU tokens/s of the same preset, shape and mixer "
                             "(mean of track_train's fresh records in both orders)" if one else
                             "no single-GPU record of this preset, shape and mixer"}


def worker(job_file: str) -> None:
    stage.prepare_process()
    job = stage.Job.from_json(json.loads(Path(job_file).read_text()))
    rank, world, device = fsdp.init_process_group()
    settings = job.params["settings"]
    if world != settings["world_size"]:
        raise RuntimeError(f"expected {settings['world_size']} ranks (train.world_size), torchrun started {world}")
    fs = fsdp_settings(settings)
    tuned = kernels.Backend("auto", table=kernels.TuningTable.load(job.input.table))
    matmul_rate, peak_rate = measure.matmul_rate(job.load("environment")), settings.get("peak_flop_per_s")
    autocast = settings.get("autocast")
    param_dtype = getattr(torch, autocast) if autocast else None
    items = plan(settings, records.read_jsonl(job.input.single))
    runner = measure.Runner(STAGE, job.profile, job.params["records_dir"], None, device,
                            lock_clocks=job.lock_clocks) if rank == 0 else None
    exhausted = measure.deadline(fs["budget_s"])

    def timed_rank(item, count: bool) -> dict:
        backend = tuned if item["backend"] == "auto" else kernels.Backend(item["backend"], **item["options"])
        s = fsdp.distribute(training.Setup(item["preset"], item["mixer"], item["T"], world * item["B"], settings,
                                           device, backend=backend), rank, world, param_dtype)
        try:
            # No time budget or timed warm-up inside a configuration: every rank must take the same steps.
            return {"timing": measure.measure(s.step, fs["reps"], fs["warmup"], device, count=count, warm_ms=0),
                    "parameters": s.params, "non_embedding_parameters": s.cfg.non_embedding_parameters(),
                    "num_layers": s.cfg.num_layers, "lru_width": s.cfg.lru_width,
                    "process_group": torch.distributed.get_backend(), "param_dtype": autocast or "float32"}
        finally:
            del s
            measure.release(device)

    def body(item) -> dict:
        local = measure.capture(lambda: timed_rank(item, count=rank == 0), device)
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, local)
        if failed := [f"rank {r}: {o.error['type']}: {o.error['message'][:800]}"
                      for r, o in enumerate(everyone) if not o.ok]:
            raise RuntimeError("; ".join(failed))
        return figures([o.value for o in everyone], item, matmul_rate, peak_rate)

    skipped, marker = [], Path(job_file).with_name("current.json")
    for item in items:
        cid = item["config_id"]
        go = [cid not in runner.done and not exhausted() if rank == 0 else None]
        torch.distributed.broadcast_object_list(go, src=0)  # rank 0 decides for every rank
        if rank == 0 and not go[0] and cid not in runner.done:
            skipped.append(cid)
        if not go[0]:
            continue
        if rank == 0:
            atomic.write_json(marker, {"config_id": cid, "fields": item["fields"]})
            runner.run(cid, lambda: body(item), **item["fields"])
            marker.unlink()
        else:
            measure.capture(lambda: body(item), device)
            if not measure.context_usable(device):
                sys.exit(measure.POISONED_EXIT)
    if skipped:
        runner.say(f"time budget spent: {len(skipped)} configurations not run: {skipped}")
    # Every rank reaches teardown together: a rank that tears its group down while rank 0
    # still writes records can abort at exit ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(job):
    settings = job.params["settings"]
    world = settings.get("world_size", 1)
    if not isinstance(world, int) or world < 2:
        raise ValueError(f"expected train.world_size an int >= 2 for the FSDP track, got {world!r}")
    records_dir, items = Path(job.params["records_dir"]), plan(settings, records.read_jsonl(job.input.single))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(Path(__file__).resolve()), "--worker"]
    with tempfile.TemporaryDirectory(prefix="train-fsdp-") as work:
        job_file, marker = Path(work) / "job.json", Path(work) / "current.json"
        atomic.write_json(job_file, job.to_json())
        for launch in range(MAX_LAUNCHES):
            if all(i["config_id"] in records.done_ids(records_dir, job.profile) for i in items):
                break
            print(f"[{STAGE}] launch {launch + 1}: {' '.join(cmd)} {job_file}", flush=True)
            if (rc := subprocess.run([*cmd, str(job_file)]).returncode) == 0:
                break
            if not marker.is_file():
                raise RuntimeError(f"torchrun exited with status {rc} outside a configuration; see the log above")
            cur = json.loads(marker.read_text())
            marker.unlink()
            if cur["config_id"] not in records.done_ids(records_dir, job.profile):
                records.write_record(records_dir, records.new_record(STAGE, job.profile, cur["config_id"], **{
                    **cur["fields"], "status": measure.STATUS_FAILED, "samples_ms": [], "stats": None,
                    "error": f"torchrun exited with status {rc} while this configuration ran (a rank died or a "
                             "collective timed out); see the stage log"}))
        else:
            raise RuntimeError(f"torchrun failed {MAX_LAUNCHES} times; see the log above")
    done = records.done_ids(records_dir, job.profile)
    recs = records.collect(records_dir, job.output.records, profile=job.profile,
                           ids=[i["config_id"] for i in items if i["config_id"] in done])
    print(f"{STAGE}: {len(recs)} records", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        stage.run(main, globals().get("snakemake"))
