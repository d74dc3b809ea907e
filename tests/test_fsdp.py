"""The FSDP2 training mode on the CPU: two gloo ranks against one process.

The data-parallel step (common/fsdp.py around common/training.py's Setup.step) over two
ranks of one document each must give the single-process step over both
documents: the same loss, the same gradients after clipping (a clip small enough
to be active, so the global gradient norm across shards is tested) and the same
parameters after AdamW, all in FP32. The CPU runs FP32 throughout: FSDP's
BF16 parameter policy is what the GPU profiles use, and a BF16 step would not
match an FP32 reference at FP32 tolerance; the GPU run exercises BF16.
"""

import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

from pipeline_util import REPO, copy_repo, snakemake

from common import fsdp, records, training  # noqa: E402
from common.stage import Files, Job  # noqa: E402

import track_train_fsdp  # noqa: E402

WORLD, B, T = 2, 1, 7
MIXERS = ("samu", "rglru")
SETTINGS = {"vocab": 256, "lr": 1e-2, "grad_clip": 0.05, "autocast": None}
BF16 = {**SETTINGS, "autocast": "bfloat16"}
STORED = ".parametrizations."   # where parametrize keeps a scalar stored with shape [1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and `grad.<name>` as a full tensor in the single-device names and
    shapes, on every rank (a collective)."""
    from torch.distributed.tensor import DTensor

    def full(t, stored):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        return (t.reshape(()) if stored else t).clone()

    out = {}
    for name, p in model.named_parameters():
        stored = STORED in name
        if stored:
            owner, rest = name.split(STORED)
            name = f"{owner}.{rest.removesuffix('.original')}"
        out[name] = full(p.detach(), stored)
        if p.grad is not None:
            out[f"grad.{name}"] = full(p.grad, stored)
    return out


def reference_step(setup_fn) -> dict:
    """Loss, parameters before the step, clipped gradients (at the optimizer step)
    and parameters after the step of `setup_fn()`, all as full tensors."""
    s = setup_fn()
    seen = {}
    s.opt.register_step_pre_hook(lambda *_: seen.update(full_state(s.model)))
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        seen["norm"] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        return norm

    torch.nn.utils.clip_grad_norm_ = recording_clip
    try:
        loss = s.step()
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    after = {k: v for k, v in full_state(s.model).items() if not k.startswith("grad.")}
    return {"loss": loss.detach(), "norm": seen.pop("norm"),
            "grads": {k: v for k, v in seen.items() if k.startswith("grad.")},
            "before": {k: v for k, v in seen.items() if not k.startswith("grad.")}, "params": after, "opt": s.opt}


def optimizer_step(opt, before: dict, grads: dict) -> dict:
    """`before` after one step of a fresh optimizer like `opt` with gradients `grads`."""
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in before.items()}
    for k, p in ps.items():
        p.grad = grads[f"grad.{k}"].clone()
    fresh = fsdp.rebuild_optimizer(opt, list(ps.values()))
    fresh.step()
    return {k: p.detach() for k, p in ps.items()}


def rank_main(rank: int, world: int, port: int, out: str, variants: dict) -> None:
    """One rank: the data-parallel step of each mixer in each variant (name:
    (settings, backend, param_dtype name or None)); rank 0 saves what it saw,
    with the dtypes block 0 computed with."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rank, world, device = fsdp.init_process_group(timeout_s=60)
    result = {}
    for variant, (settings, backend, param_dtype) in variants.items():
        for mixer in MIXERS:
            seen = {}

            def setup():
                s = training.Setup("tiny", mixer, T, world * B, settings, device, backend=backend)
                fsdp.distribute(s, rank, world, param_dtype and getattr(torch, param_dtype))
                block = s.model.blocks[0].recurrent_block
                block.register_forward_pre_hook(lambda m, a: seen.update(linear=m.linear_x.weight.dtype))
                block.mixer.register_forward_pre_hook(
                    lambda m, a: seen.update(mixer={p.dtype for p in m.parameters()}))
                return s

            r = reference_step(setup)
            losses = [None] * world
            torch.distributed.all_gather_object(losses, r["loss"].item())
            r["loss"] = torch.tensor(losses)
            r["dtypes"] = seen
            del r["opt"]
            result[variant, mixer] = r
    if rank == 0:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    # Both modes on the CPU in one process group: FP32 parameters and compute, and
    # the GPU profiles' BF16 parameters under BF16 autocast (gloo reduces BF16 too).
    out = tmp_path_factory.mktemp("fsdp") / "rank0.pt"
    variants = {"fp32": (SETTINGS, "reference", None), "bf16": (BF16, "reference", "bfloat16")}
    mp.spawn(rank_main, args=(WORLD, free_port(), str(out), variants), nprocs=WORLD, join=True)
    return torch.load(out, map_location="cpu")


@pytest.mark.parametrize("mixer", MIXERS)
def test_two_gloo_ranks_match_one_process(sharded, mixer):
    cpu = torch.device("cpu")
    ref = reference_step(lambda: training.Setup("tiny", mixer, T, WORLD * B, SETTINGS, cpu,
                                                   backend="reference"))
    got = sharded["fp32", mixer]
    assert got["dtypes"] == {"linear": torch.float32, "mixer": {torch.float32}}
    # Each rank's loss is the mean over its document; their mean is the global loss.
    assert got["loss"].shape == (WORLD,) and not torch.allclose(got["loss"][0], got["loss"][1])
    torch.testing.assert_close(got["loss"].mean(), ref["loss"], rtol=1e-6, atol=0)
    assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) == len(ref["params"])
    # The gradient norm before clipping (the ranks' gradients averaged, not summed),
    # large enough for the clip to act.
    assert ref["norm"] > 2 * SETTINGS["grad_clip"]
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-5, atol=1e-7 * SETTINGS["grad_clip"], msg=k)
    # AdamW's first step is g / (|g| + eps): gradients of the order of eps (embedding
    # rows of absent tokens) amplify FP32 rounding, so the sharded update is checked
    # against the same optimizer applied to the same start and the sharded gradients.
    for k, p in ref["before"].items():
        torch.testing.assert_close(got["before"][k], p, rtol=0, atol=0, msg=k)
    want = optimizer_step(ref["opt"], ref["before"], got["grads"])
    assert not torch.equal(want["embed.weight"], ref["before"]["embed.weight"])
    for k, p in want.items():
        torch.testing.assert_close(got["params"][k], p, rtol=1e-6, atol=1e-7, msg=k)


def relative_errors(got: dict, ref: dict) -> tuple[float, float]:
    """Relative error of the mean loss and of all clipped gradients together."""
    def flat(r):
        return torch.cat([r["grads"][k].double().flatten().cpu() for k in sorted(ref["grads"])])

    loss = abs(got["loss"].double().mean().item() - ref["loss"].double().mean().item()) / abs(ref["loss"].item())
    g, g_ref = flat(got), flat(ref)
    return loss, (torch.linalg.vector_norm(g - g_ref) / torch.linalg.vector_norm(g_ref)).item()


def check_bf16(got: dict, mixer: str, device, backend: str) -> None:
    """The BF16 mode (BF16 parameters gathered for the blocks, FP32 for the mixers,
    FP32 reduce and master weights) against the single-device FP32 step: its loss
    and gradient errors are at most 3x those of the single-GPU track's own step
    under BF16 autocast."""
    assert got["dtypes"] == {"linear": torch.bfloat16, "mixer": {torch.float32}}
    assert {g.dtype for g in got["grads"].values()} == {torch.float32}

    def single(settings):
        r = reference_step(lambda: training.Setup("tiny", mixer, T, WORLD * B, settings, device, backend=backend))
        r["loss"] = r["loss"].reshape(1)
        return r

    ref32, ref16 = single(SETTINGS), single(BF16)
    e_single, e_fsdp = relative_errors(ref16, ref32), relative_errors(got, ref32)
    assert e_single[1] > 0, "the BF16 step must differ from the FP32 one"
    assert e_fsdp[0] <= 3 * e_single[0] + 1e-3, (e_fsdp, e_single)
    assert e_fsdp[1] <= 3 * e_single[1], (e_fsdp, e_single)
    e_norm = [abs(r["norm"] - ref32["norm"]) / ref32["norm"] for r in (got, ref16)]
    assert e_norm[0] <= 3 * e_norm[1] + 1e-3, e_norm


@pytest.mark.parametrize("mixer", MIXERS)
def test_two_gloo_ranks_in_bf16_err_like_the_single_process_bf16_step(sharded, mixer):
    check_bf16(sharded["bf16", mixer], mixer, torch.device("cpu"), "reference")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_nccl_ranks_in_bf16_err_like_the_single_gpu_bf16_step(tmp_path):
    """The GPU mode with NCCL and the Triton kernels (`auto`)."""
    out = tmp_path / "rank0.pt"
    mp.spawn(rank_main, args=(WORLD, free_port(), str(out), {"bf16": (BF16, "auto", "bfloat16")}), nprocs=WORLD,
             join=True)
    got = torch.load(out, map_location="cpu")
    for mixer in MIXERS:
        check_bf16(got["bf16", mixer], mixer, torch.device("cuda", 0), "auto")


def test_stage_runs_both_orders_under_torchrun(tmp_path):
    """The stage launches torchrun with two gloo ranks at the tiny preset and
    writes one record per mixer and order with the multi-GPU fields; a second run
    resumes without measuring again."""
    settings = {"presets": ["tiny"], "vocab": 256, "shapes": [{"T": 5, "B": 1}], "mixers": list(MIXERS),
                "autocast": None, "reps": 1, "warmup": 0, "fresh_reps": 1, "lr": 3e-4, "grad_clip": 1.0,
                "world_size": WORLD, "fsdp": {"reps": 2, "warmup": 1}}
    single = [records.new_record("train", "cpu-smoke", f"train-arch-tiny-T5-B1-samu-reference-{o}", role="fresh",
                                 shapes={"preset": "tiny", "T": 5, "B": 1, "vocab": 256}, mixer="samu",
                                 backend="reference", order=o, samples_ms=[1.0], stats={"p10_ms": 1.0, "median_ms": 1.0, "p95_ms": 1.0},
                                 tokens_per_s=tps) for o, tps in (("AB", 4000.0), ("BA", 6000.0))]
    paths = {"environment": tmp_path / "environment.json", "table": tmp_path / "tuning.json",
             "single": tmp_path / "single.jsonl"}
    paths["environment"].write_text(json.dumps({"matmul_bf16_flop_per_s": 1.0e11}))
    paths["table"].write_text(json.dumps({"schema": 1, "entries": []}))
    paths["single"].write_text("".join(json.dumps(r) + "\n" for r in single))
    out = tmp_path / "records.jsonl"
    job = Job(rule="track_train_fsdp", script=str(REPO / "workflow" / "scripts" / "track_train_fsdp.py"),
              input=Files([str(p) for p in paths.values()], {k: str(p) for k, p in paths.items()}),
              output=Files([str(out)], {"records": str(out)}),
              params={"profile": "cpu-smoke", "section": "train", "settings": settings,
                      "records_dir": str(tmp_path / "records.d")}, config={})
    track_train_fsdp.main(job)
    recs = {r["config_id"]: r for r in records.read_jsonl(out)}
    assert sorted(recs) == sorted(f"train-fsdp2-tiny-T5-B1-{m}-{b}-{o}" for o in ("AB", "BA")
                                  for m, b in (("samu", "reference"), ("rglru", "auto")))
    for r in recs.values():
        assert r["status"] == "ok", r["error"]
        assert r["world_size"] == 2 and r["process_group"] == "gloo" and r["stage"] == "train_fsdp"
        assert r["tokens_per_step"] == 2 * r["tokens_per_step_per_gpu"] == 10
        assert r["tokens_per_s"] == pytest.approx(2 * r["tokens_per_s_per_gpu"])
        assert len(r["samples_ms"]) == 2 and len(r["rank_median_ms"]) == 2 and len(r["peak_bytes_per_rank"]) == 2
        assert r["samples_ms"][0] >= 0 and r["mfu"] > 0
        if r["mixer"] == "samu":
            assert r["single_gpu_tokens_per_s"] == 5000.0
            assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_s_per_gpu"] / 5000.0)
        else:
            assert r["scaling_efficiency"] is None and r["selected_from"] == []
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "records.d").iterdir()}
    track_train_fsdp.main(job)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "records.d").iterdir()} == before


def test_world_size_one_is_refused(tmp_path):
    job = Job(rule="track_train_fsdp", script="", input=Files([]), output=Files([]),
              params={"profile": "cpu-smoke", "settings": {"world_size": 1}, "records_dir": str(tmp_path)}, config={})
    with pytest.raises(ValueError, match="world_size"):
        track_train_fsdp.main(job)


def test_two_gpu_overlay_adds_the_fsdp_track_after_the_single_gpu_one(tmp_path):
    repo = copy_repo(tmp_path)
    dag = snakemake(repo, "--dag", "--cores", "1", "all", "--config", "profile=h200", "--configfile", "two-gpus.yaml")
    assert dag.returncode == 0, dag.stderr
    name = {m.group(1): m.group(2) for m in re.finditer(r'^\s*(\d+)\[label = "([a-z_]+)"', dag.stdout, re.M)}
    named = {(name[a], name[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dag.stdout, re.M)}
    assert {("track_train", "track_train_fsdp"), ("track_train_fsdp", "aggregate")} <= named, named
    plain = snakemake(repo, "-n", "--cores", "1", "all", "--config", "profile=h200")
    assert plain.returncode == 0 and "track_train_fsdp" not in plain.stdout, plain.stderr
