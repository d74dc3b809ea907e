"""The tune stage and the three tracks at tiny shapes on the CPU: the tuning
table's round trip through backend="auto", exactness and failure handling of
candidates, and the cpu-smoke tracks end to end with resume."""

import itertools
import json
import statistics
import subprocess
import types
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from pipeline_util import REPO

from common import cases, measure, records  # noqa: E402
from common.stage import Files, Job  # noqa: E402

import kernels  # noqa: E402
import track_infer  # noqa: E402
import track_scan  # noqa: E402
import track_train  # noqa: E402
import tune  # noqa: E402
from kernels import ops  # noqa: E402
from kernels.ops import reference, tuning  # noqa: E402
import parity  # noqa: E402

CPU = yaml.safe_load((REPO / "config.yaml").read_text())["profiles"]["cpu-smoke"]
GATES = {"schema": 1, "passed": True, "checks": []}
ENV = {"copy_bandwidth_bytes_per_s": 1.0e10, "matmul_bf16_flop_per_s": 1.0e11,
       "counters": {"counters_available": False, "reason": "no GPU: hardware counters not applicable"}}


def make_job(tmp: Path, rule: str, section: str, settings: dict, outputs: dict, table: Path | None = None) -> Job:
    (tmp / "gates.json").write_text(json.dumps(GATES))
    (tmp / "environment.json").write_text(json.dumps(ENV))
    inputs = {"gates": str(tmp / "gates.json"), "environment": str(tmp / "environment.json")}
    if table is not None:
        inputs["table"] = str(table)
    script = REPO / "workflow" / "scripts" / f"{rule if rule == 'tune' else rule}.py"
    return Job(rule=rule, script=str(script), input=Files(inputs.values(), inputs),
               output=Files(outputs.values(), outputs),
               params={"profile": "cpu-smoke", "section": section, "settings": settings,
                       "records_dir": str(tmp / f"{section}.d")},
               config={"profiles": {"cpu-smoke": CPU}})


def tune_settings(**over) -> dict:
    s = json.loads(json.dumps(CPU["tune"]))
    s["decode"]["batches"] = [2]
    s.update(over)
    return s


INFER = CPU["infer"]


def test_option_grids_follow_what_launchers_accept():
    def explicit(x, a, *, chunk_size=32, num_warps=4):
        pass

    def var(x, a, **opts):
        pass

    grids = {"chunk": {"chunk_size": [16, 32], "block_d": [64]}, "*": {"num_warps": [2, 4]}}
    assert cases.option_grid(explicit, "chunk", grids) == [{"chunk_size": 16}, {"chunk_size": 32}]
    assert cases.option_grid(explicit, "serial", grids) == [{"num_warps": 2}, {"num_warps": 4}]
    assert cases.option_grid(var, "chunk", grids) == [{"block_d": 64, "chunk_size": 16},
                                                   {"block_d": 64, "chunk_size": 32}]
    assert cases.option_grid(explicit, "x", grids, fixed={"num_warps"}) == [{}]
    per_op = {**grids, "samu/chunk": {"chunk_size": [8]}}
    assert cases.option_grid(explicit, "chunk", per_op, op="samu") == [{"chunk_size": 8}]
    assert cases.option_grid(explicit, "chunk", per_op, op="rglru") == [{"chunk_size": 16}, {"chunk_size": 32}]
    union = {"serial": [{"time_warps": [4, 8], "chunk_size": [8]}, {"time_warps": [1, 4], "chunk_size": [8]},
                        {"time_warps": [1], "block_d": [16], "chunk_size": [64, 128]}]}
    assert cases.option_grid(var, "serial", union) == [
        {"chunk_size": 8, "time_warps": 4}, {"chunk_size": 8, "time_warps": 8}, {"chunk_size": 8, "time_warps": 1},
        {"block_d": 16, "chunk_size": 64, "time_warps": 1}, {"block_d": 16, "chunk_size": 128, "time_warps": 1}]
    assert cases.option_grid(explicit, "serial", union) == [{"chunk_size": 8}, {"chunk_size": 64}, {"chunk_size": 128}]
    assert cases.chunk_variants("chunk", var, [16, 32]) == [{"chunk_size": 16}, {"chunk_size": 32}]
    assert cases.chunk_variants("serial", var, [16]) == [{}]
    assert cases.chunk_variants("serial", explicit, [16]) == [{}]
    assert cases.chunk_variants("chunk", explicit, [8]) == [{"chunk_size": 8}]
    assert cases.chunk_variants("chunk", lambda x: x, [8]) == [{}]


@pytest.mark.parametrize("profile", ["h200", "h800"])
def test_decode_tune_grids_reach_the_step_launchers(profile):
    """Every option a GPU profile's decode grid names is one its step launcher takes (the
    grid keeps only those, so a misspelt option would be tried as the default), and each
    grid's combinations are distinct candidates."""
    dec = yaml.safe_load((REPO / "config.yaml").read_text())["profiles"][profile]["tune"]["decode"]
    steps = {op: ops.step_backends(op) for op in ("rglru", "samu")}
    for key, grid in dec["options"].items():
        op, name = key.split("/")
        named = {k for g in (grid if isinstance(grid, list) else [grid]) for k in g}
        got = cases.option_grid(steps[op][name], name, dec["options"], cases.STEP_FIXED[op], op)
        assert {k for o in got for k in o} == named, key
        total = sum(len(list(itertools.product(*g.values()))) for g in (grid if isinstance(grid, list) else [grid]))
        assert len(got) == total, key
    # the audit gates each of them (check_steps' options) before the tune stage times it
    sets = cases.step_option_sets(dec["options"])
    assert set(sets) == set(dec["options"])
    assert all(len(sets[k]) == len(cases.option_grid(steps[k.split("/")[0]][k.split("/")[1]], k.split("/")[1],
                                                     dec["options"], cases.STEP_FIXED[k.split("/")[0]],
                                                     k.split("/")[0])) for k in sets)
    assert cases.step_option_sets({}) == {}


def test_audit_gates_the_tuned_step_options_once():
    """The audit stage runs the decode step gates once per dtype (not per model backend)
    and with every option set of the profile's tune.decode grid."""
    import audit

    none = {k: [] for k in parity.DEFAULT_PROFILE}
    settings = {"device": "cpu", "dtypes": ["float32"], "model_backends": ["reference", "auto"],
                "gates": {**none, "steps": [{"B": 2, "D": 8, "heads": 2}]}}
    grids = {"samu/row": [{"block_d": [16]}, {"block_m": [16], "num_warps": [2]}], "rglru/fused": {"num_warps": [2]}}
    checks = audit.run_checks(settings, grids)
    assert checks and all(c["passed"] and c["model_backend"] == "reference" for c in checks)
    got = {(c["op"], c["backend"], tuple(sorted(c.get("options", {}).items()))) for c in checks}
    assert {("samu_step", "row", (("block_d", 16),)), ("samu_step", "row+table", (("block_d", 16),)),
            ("samu_step", "row", (("block_m", 16), ("num_warps", 2))), ("rglru_step", "fused", (("num_warps", 2),)),
            ("samu_step", "row", ())} <= got
    plain = audit.run_checks(settings)
    assert len(checks) - len(plain) == 2 * (2 * 2 + 1)      # per stage: samu's two sets (+table), rglru's one
    # in two spawned processes: the same checks in the same order, each passed
    pooled = audit.run_checks({**settings, "workers": 2}, grids)
    assert 2 in parity._POOLS
    assert [(c["check"], c["backend"], c.get("options"), c["passed"]) for c in pooled] == \
        [(c["check"], c["backend"], c.get("options"), c["passed"]) for c in checks]


def test_tuning_table_round_trips_through_auto(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = {"table": str(tmp_path / "tuning.json"), "records": str(tmp_path / "tune.jsonl")}
    s = tune_settings(backends=["reference", "chunk"])
    tune.main(make_job(tmp_path, "tune", "tune", s, out))
    table = tuning.validate_table(json.loads(Path(out["table"]).read_text()))
    assert {e["op"] for e in table["entries"]} == {"rglru", "samu", "scan"}
    assert {e["op"] for e in table["decode"]} == {"rglru_step", "samu_step"}
    recs = records.read_jsonl(out["records"])
    for e in table["entries"]:
        probes = [r for r in recs if r["role"] == "probe" and r["op"] == e["op"] and r["status"] == "ok"]
        best = min(probes, key=lambda r: r["stats"]["median_ms"])
        assert (e["backend"], e["chunk_size"]) == (best["backend"], best["options"].get("chunk_size"))
        fresh = next(r for r in recs if r["config_id"] == e["fresh_config_id"])
        # The table's figures come from the fresh runs, not from the probes that chose.
        assert fresh["role"] == "fresh" and e["fresh"]["median_ms"] == fresh["stats"]["median_ms"]
        assert fresh["samples_ms"] != best["samples_ms"]
        assert tuning.TuningTable(table).lookup(e["op"], "float32", e["B"], e["T"], e["D"]) == e

    # backend="auto" on a GPU reads the table it is given, or the one $KERNELS_TUNING_TABLE
    # names: dispatch with a CUDA-looking input.
    chunk_entry = {"op": "rglru", "dtype": "bfloat16", "B": 4, "T": 2048, "D": 2560, "backend": "chunk",
                   "chunk_size": 16, "options": {"block_d": 32}}
    path = tmp_path / "gpu-table.json"
    path.write_text(json.dumps({"schema": 1, "entries": [chunk_entry], "decode": []}))
    fake = types.SimpleNamespace(device=torch.device("cuda"), shape=(2, 4096, 2048), dtype=torch.bfloat16)
    want = ("chunk", {"block_d": 32, "chunk_size": 16})
    assert ops.resolve("rglru", kernels.Backend("auto", table=tuning.TuningTable.load(path)), fake) == want
    monkeypatch.setenv("KERNELS_TUNING_TABLE", str(path))
    tuning.env_table.cache_clear()
    assert ops.resolve("rglru", "auto", fake) == want
    monkeypatch.delenv("KERNELS_TUNING_TABLE")
    tuning.env_table.cache_clear()
    assert ops.resolve("rglru", "auto", fake) == ("serial", {})
    assert ops.resolve("rglru", "auto", torch.zeros(1, 2, 8)) == ("reference", {})   # CPU: by design
    # A table tuned on another GPU is not used, with a warning naming both GPUs.
    path.write_text(json.dumps({"schema": 1, "gpu": "GPU A", "entries": [chunk_entry], "decode": []}))
    monkeypatch.setattr(ops, "_gpu_name", lambda device: "GPU A")
    assert ops.resolve("rglru", kernels.Backend("auto", table=tuning.TuningTable.load(path)), fake) == want
    monkeypatch.setattr(ops, "_gpu_name", lambda device: "GPU B")
    with pytest.warns(RuntimeWarning, match="tuned on 'GPU A', not on this 'GPU B'"):
        assert ops.resolve("rglru", kernels.Backend("auto", table=tuning.TuningTable.load(path)), fake) == \
            ("serial", {})


def test_tuning_lookup_tells_equal_token_counts_apart_by_batch():
    """Entries of equal B x T and D (the training shapes B4 T2048 and B1 T8192, whose
    serial kernels run 4x apart in programs): each call takes its own batch's entry; a
    call between them the nearest in log(B x T), log(D) and log(B); another op or dtype
    none."""
    def entry(B, T, D, backend):
        return {"op": "rglru", "dtype": "bfloat16", "B": B, "T": T, "D": D, "backend": backend}
    wide, long_ = entry(4, 2048, 2560, "serial"), entry(1, 8192, 2560, "chunk")
    for entries in ([wide, long_], [long_, wide]):
        t = tuning.TuningTable.from_dict({"schema": 1, "entries": entries})
        assert t.lookup("rglru", "bfloat16", 4, 2048, 2560) is wide
        assert t.lookup("rglru", "bfloat16", 1, 8192, 2560) is long_
        assert t.lookup("rglru", "bfloat16", 1, 8192, 2048) is long_        # the 400m width
        assert t.lookup("rglru", "bfloat16", 16, 4096, 2560) is wide        # the prefill
        assert t.lookup("rglru", "bfloat16", 1, 16384, 2560) is long_
        assert t.lookup("samu", "bfloat16", 1, 8192, 2560) is None
        assert t.lookup("rglru", "float32", 1, 8192, 2560) is None


def test_inexact_and_failing_candidates_are_recorded_and_left_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def wrong(*args, **opts):
        y, h = reference.scan(*args)
        return y * 1.01, h

    def oom(*args, **opts):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    def crash(*args, **opts):
        raise RuntimeError("triton: out of resources: shared memory")

    real = kernels.backends

    def fake(op):
        got = dict(real(op))
        if op == "scan":
            got.update(wrong=wrong, oom=oom, crash=crash)
        return got

    monkeypatch.setattr(kernels, "backends", fake)
    out = {"table": str(tmp_path / "tuning.json"), "records": str(tmp_path / "tune.jsonl")}
    s = tune_settings(backends=["reference", "wrong", "oom", "crash"], decode={})
    s["shapes"] = {"scan": [{"B": 1, "T": 9, "D": 4}]}
    tune.main(make_job(tmp_path, "tune", "tune", s, out))
    by = {r["backend"]: r for r in records.read_jsonl(out["records"]) if r.get("op") == "scan"
          and r["role"] == "probe"}
    assert by["wrong"]["status"] == "failed" and "inexact" in by["wrong"]["error"]
    assert by["oom"]["status"] == "oom" and by["crash"]["status"] == "failed"
    assert by["reference"]["status"] == "ok"
    table = json.loads(Path(out["table"]).read_text())
    assert [e["backend"] for e in table["entries"]] == ["reference"]


def test_samu_tune_check_zeroes_the_cotangent_at_relu_kinks_like_the_audit(tmp_path, monkeypatch):
    """A candidate whose gradient differs from the reference only through the output
    cotangent at positions the kink mask names is exact for the tune (as for the audit);
    the same candidate with an empty mask is rejected, so the mask is what decides."""
    import parity

    monkeypatch.chdir(tmp_path)
    real = kernels.backends

    def kinky(*args, **opts):
        y, h = reference.samu(*args)
        z = 100.0 * y[:, -1:]
        return y + torch.nn.functional.pad(z - z.detach(), (0, 0, y.shape[1] - 1, 0)), h

    monkeypatch.setattr(kernels, "backends", lambda op: {**real(op), "kinky": kinky} if op == "samu" else real(op))

    def last_step(args64, h0, pos):
        m = torch.zeros(args64[0].shape, dtype=torch.bool)
        m[:, -1] = True
        return m

    def run(mask_fn, name):
        monkeypatch.setattr(parity, "samu_relu_kinks", mask_fn)
        out = {"table": str(tmp_path / f"{name}.json"), "records": str(tmp_path / f"{name}.jsonl")}
        s = tune_settings(backends=["reference", "kinky"], decode={}, modes={"samu": "fwd_bwd"})
        s["shapes"] = {"samu": [{"B": 1, "T": 5, "D": 4}]}
        job = make_job(tmp_path, "tune", "tune", s, out)
        job.params["records_dir"] = str(tmp_path / f"{name}.d")
        tune.main(job)
        return {r["backend"]: r for r in records.read_jsonl(out["records"]) if r["role"] == "probe"}

    masked = run(last_step, "masked")
    assert masked["kinky"]["status"] == "ok" and masked["kinky"]["relu_kinks_masked"] == 4
    bare = run(lambda a, h, p: torch.zeros(a[0].shape, dtype=torch.bool), "bare")
    assert bare["kinky"]["status"] == "failed" and "inexact: gradient" in bare["kinky"]["error"]
    assert bare["reference"]["status"] == "ok" and bare["reference"]["relu_kinks_masked"] == 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """tune then the three tracks with the cpu-smoke settings (reference backends
    for speed; test_tuning_table_round_trips_through_auto covers the interpreter)."""
    tmp = tmp_path_factory.mktemp("smoke")
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    table = tmp / "tuning.json"
    dec = {**CPU["tune"]["decode"], "backends": ["reference"]}
    tune.main(make_job(tmp, "tune", "tune", tune_settings(backends=["reference"], decode=dec),
                       {"table": str(table), "records": str(tmp / "tune.jsonl")}))
    scan = {**CPU["scan"], "backends": ["reference", "serial"], "T": [12]}
    runs = {}
    for mod, rule, section, settings in ((track_scan, "track_scan", "scan", scan),
                                         (track_train, "track_train", "train", CPU["train"]),
                                         (track_infer, "track_infer", "infer", INFER)):
        job = make_job(tmp, rule, section, settings, {"records": str(tmp / f"{section}.jsonl")}, table)
        mod.main(job)
        runs[section] = (mod, job)
    yield tmp, runs
    mp.undo()


def _recs(tmp, section):
    return records.read_jsonl(tmp / f"{section}.jsonl")


def test_scan_track_runs_every_item_in_both_orders(smoke):
    tmp, _ = smoke
    recs = _recs(tmp, "scan")
    assert recs and all(r["status"] == "ok" and r["profile"] == "cpu-smoke" for r in recs)
    keys = {(r["op"], r["backend"], r["order"]) for r in recs}
    for op in ("rglru", "samu", "scan"):
        assert (op, "reference", "AB") in keys and (op, "reference", "BA") in keys
    ab = next(r for r in recs if r["order"] == "AB")
    assert ab["sequence"] == list(reversed(next(r for r in recs if r["order"] == "BA")["sequence"]))
    r = next(r for r in recs if r["op"] == "scan" and r["backend"] == "serial")
    B, T, D = 1, 12, 8
    assert r["floor_bytes"] == 3 * B * T * D * 4                      # a, b read; y written (fp32)
    assert r["floor_ms"] == pytest.approx(r["floor_bytes"] / 1e10 * 1e3)
    assert r["logical"]["bytes_read"] > 0 and r["logical"]["launches"] >= 1    # the launcher's accounting
    assert r["counters"] is None and "not applicable" in r["counters_reason"]
    ba = next(x for x in recs if x["config_id"] == r["config_id"][:-2] + "BA")
    # The BA run times afresh but reuses the counts of the AB run (the same kernels).
    assert ba["logical"]["counted_in"] == r["config_id"] and ba["samples_ms"] != r["samples_ms"]


def test_train_track_diagnostics_peer_and_fresh_comparison(smoke):
    tmp, _ = smoke
    recs = _recs(tmp, "train")
    roles = {r["role"] for r in recs}
    assert {"diagnostic", "fresh"} <= roles
    fresh = [r for r in recs if r["role"] == "fresh"]
    assert {(r["mixer"], r["order"]) for r in fresh} == {(m, o) for m in ("samu", "rglru") for o in ("AB", "BA")}
    ab = [r for r in fresh if r["order"] == "AB"]
    assert ab[0]["sequence"] == ["samu", "rglru"]
    for r in fresh:
        assert r["selected_from"] and r["config_id"] not in r["selected_from"]
        assert r["tokens_per_s"] > 0 and r["tokens_per_step"] == 8
        assert r["logical"]["param_bytes"] == 4 * r["parameters"]
        assert r["model_flops_per_step"] == 6 * r["parameters"] * 8
        assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / (r["stats"]["median_ms"] * 1e-3) / 1.0e11)
    peer = [r for r in recs if r["role"] == "peer"]
    assert peer and peer[0]["backend"] == "peer:recurrentgemma" and peer[0]["status"] == "ok"


def test_infer_track_latency_and_throughput(smoke):
    tmp, _ = smoke
    recs = _recs(tmp, "infer")
    lat = [r for r in recs if r["role"] == "latency"]
    assert {(r["shapes"]["prompt"], r["mixer"], r["order"], r["generated_tokens"]) for r in lat} == {
        (p, m, o, n) for p in (0, 5) for m in ("samu", "rglru") for o in ("AB", "BA") for n in (2, 4)}
    for r in lat:
        n2 = next(x for x in lat if x["config_id"] == r["config_id"][:-len(f"N{r['generated_tokens']}")] + "N2")
        assert r["stats"]["median_ms"] >= n2["stats"]["median_ms"]     # one trajectory, cumulative
        assert r["tokens_per_s"] == pytest.approx(2 * r["generated_tokens"] / (r["stats"]["median_ms"] * 1e-3))
        assert r["logical"]["state_bytes"] > 0 and r["decoder"] == "engine"      # no graphs on the CPU
        assert r["resolved"]["step"] == "reference" and r["decoder_details"]["mixer_step_backend"] == "reference"
        if r["order"] == "BA":
            assert r["logical"]["counted_in"].endswith("-AB-N2")
    pre = [r for r in recs if r["role"] == "prefill"]
    assert {(r["mixer"], r["order"]) for r in pre} == {(m, o) for m in ("samu", "rglru") for o in ("AB", "BA")}
    for r in pre:
        assert r["status"] == "ok" and r["prompt_tokens"] == 2 * 5 and r["ttft_ms"] == r["stats"]["median_ms"] > 0
        f = r["floor"]
        assert f["model_flops"] > 0 and f["weight_bytes"] > 0
        assert f["ms"] == max(v for v in (f["flops_ms"], f["bytes_ms"]) if v is not None) < r["ttft_ms"]
    probes = [r for r in recs if r["role"] == "probe"]
    assert {1, 2} <= {r["shapes"]["B"] for r in probes} <= {1, 2, 4}     # extended to max_batch at most
    thr = [r for r in recs if r["role"] == "fresh"]
    assert thr and all(r["selected_from"] for r in thr)
    for r in thr:   # where and why the grid ended, per probe order
        assert set(r["throughput_grid"]) == {"AB", "BA"}
        assert all(("stopped rising" in w) or ("max_batch 4" in w) for w in r["throughput_grid"].values())
    assert {r["generated_tokens"] for r in thr} == {2, 3}
    cli = [r for r in recs if r["role"] == "cli"]
    assert {r["mixer"] for r in cli} == {"samu", "rglru"}
    for r in cli:   # the command line in its own process, beside both orders' latency trajectories of its length
        got = r["cli"]
        assert r["status"] == "ok" and (got["mixer"], got["batch"], got["new_tokens"], got["prompt_len"]) == (
            r["mixer"], 2, 4, 0) and got["mixer_step_backend"] == "reference"
        lat4 = [x["ms_per_step"] for x in lat if x["mixer"] == r["mixer"] and x["shapes"]["prompt"] == 0
                and x["generated_tokens"] == 4]
        assert sorted(r["track_ms_per_step"]) == sorted(lat4) and len(lat4) == 2
        assert r["ms_per_step"] == got["ms_per_step"] > 0
        assert r["vs_track"] == pytest.approx(got["ms_per_step"] / statistics.median(lat4))


def test_generate_cli_failure_is_an_error(tmp_path, capfd):
    """A generation command that exits non-zero raises (a failed record), its error text in the stage's log."""
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero exit status 2"):
        track_infer.cli_fields(["--preset", "none"], str(tmp_path / "tuning.json"), [])
    assert "argument --preset: invalid choice: 'none'" in capfd.readouterr().err


def test_tracks_resume_without_measuring_again(smoke):
    tmp, runs = smoke
    before = {p.name: p.stat().st_mtime_ns for p in (tmp / "scan.d").glob("*.json")}
    (tmp / "scan.d" / sorted(before)[0]).write_text("{")            # one torn record
    mod, job = runs["scan"]
    mod.main(job)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp / "scan.d").glob("*.json")}
    changed = [n for n in before if after[n] != before[n]]
    assert changed == [sorted(before)[0]]
    assert len(_recs(tmp, "scan")) == len(before)


def test_a_failing_backend_does_not_stop_the_track(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real = kernels.backends

    def fake(op):
        got = dict(real(op))

        def boom(*args, **opts):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        got["boom"] = boom
        return got

    monkeypatch.setattr(kernels, "backends", fake)
    restarts = []
    monkeypatch.setattr(track_scan.measure, "reexec", lambda job: restarts.append(job.rule))
    settings = {**CPU["scan"], "backends": ["reference", "boom"], "ops": ["scan"], "orders": ["AB"], "T": [6]}
    (tmp_path / "tuning.json").write_text(json.dumps({"schema": 1, "entries": []}))
    job = make_job(tmp_path, "track_scan", "scan", settings, {"records": str(tmp_path / "scan.jsonl")},
                   tmp_path / "tuning.json")
    track_scan.main(job)
    by = {r["backend"]: r for r in _recs(tmp_path, "scan")}
    assert by["boom"]["status"] == "failed" and "illegal memory access" in by["boom"]["error"]
    assert by["boom"]["samples_ms"] == [] and by["reference"]["status"] == "ok"
    assert restarts == ["track_scan"]            # a poisoning error restarts the process, which resumes


@pytest.mark.parametrize("curve, cap, plateau, probed", [
    ({1: 10, 4: 35, 8: 60, 16: 100, 32: 101}, 8192, "stopped rising: 100 at B=16, 101 at B=32", [1, 4, 8, 16, 32]),
    ({1: 10, 4: 35, 8: 60, 16: "oom"}, 8192, "out of memory at B=16", [1, 4, 8]),
    ({1: 10, 4: 35, 8: 60, 16: 100}, 16, "max_batch 16 reached", [1, 4, 8, 16]),
])
def test_throughput_grid_extends_until_tokens_per_s_stops_rising_or_memory_runs_out(curve, cap, plateau, probed):
    asked = []

    def probe_at(B):
        asked.append(B)
        v = curve[B]
        return {"status": v, "shapes": {"B": B}} if v == "oom" else {"status": "ok", "shapes": {"B": B},
                                                                     "tokens_per_s": float(v)}

    got = track_infer.extend_grid(probe_at, {"batches": [4, 1, 8], "max_batch": cap})
    assert plateau in got["plateau"] and got["batches"] == probed and asked == sorted(curve)[:len(asked)]


@pytest.mark.parametrize("order", [1, -1])
def test_decode_step_choice_takes_the_entry_nearest_in_log_batch(order, monkeypatch):
    """The step kernel per batch size (TuningTable.step_choice, what backend="auto" and the
    infer track run): the tuned entry nearest in log(B), the larger batch's on a tie
    whatever the table's order; other ops, dtypes and unknown backends never chosen; a
    table tuned on another GPU gives none."""
    entries = [{"op": "samu_step", "dtype": "bfloat16", "B": 16, "backend": "blocked"},
               {"op": "samu_step", "dtype": "bfloat16", "B": 64, "backend": "row"},
               {"op": "samu_step", "dtype": "bfloat16", "B": 256, "backend": "row", "options": {"block_m": 512}},
               {"op": "samu_step", "dtype": "float32", "B": 128, "backend": "fused"},
               {"op": "rglru_step", "dtype": "bfloat16", "B": 32, "backend": "fused"},
               {"op": "samu_step", "dtype": "bfloat16", "B": 32, "backend": "gone"}]
    table = kernels.TuningTable.from_dict({"schema": 1, "gpu": "G", "decode": entries[::order]})
    known = tuple(kernels.step_backends("samu"))
    got = {B: (e["B"], e["backend"]) for B in (1, 16, 24, 32, 48, 128, 4096)
           if (e := table.step_choice("samu_step", "bfloat16", B, backends=known))}
    assert got == {1: (16, "blocked"), 16: (16, "blocked"), 24: (16, "blocked"), 32: (64, "row"), 48: (64, "row"),
                   128: (256, "row"), 4096: (256, "row")}
    assert table.step_choice("rglru_step", "bfloat16", 1)["B"] == 32
    assert table.step_choice("samu_step", "float16", 16) is None
    with warnings.catch_warnings():     # the warning comes once per pair of GPU names
        warnings.simplefilter("ignore")
        assert table.step_choice("samu_step", "bfloat16", 16, gpu="other") is None
    # what auto resolves to on CUDA (the resolution itself; no kernel runs here)
    ops = kernels.ops
    b = kernels.Backend("auto", table=table)
    steps = kernels.step_backends("samu")
    monkeypatch.setattr(ops, "_gpu_name", lambda device: "G")

    def x(B, dtype=torch.bfloat16, device="cuda"):
        return types.SimpleNamespace(device=torch.device(device), shape=(B, 8), dtype=dtype)

    assert ops.resolve_step("samu", b, x(16)) is steps["blocked"]
    big = ops.resolve_step("samu", b, x(1024))
    assert big.func is steps["row"] and big.keywords == {"block_m": 512}
    assert ops.resolve_step("samu", b, x(16, torch.float16)) is steps["fused"]
    assert ops.resolve_step("samu", b, x(16, device="cpu")) is steps["reference"]
    # a model given a tuned backend takes the table for its steps too
    m = kernels.layers.set_backend(kernels.layers.SAMU(8), b)
    assert m.step_backend.name == "auto" and m.step_backend.table is table
    with pytest.raises(ValueError, match="decode entry"):
        kernels.TuningTable.from_dict({"schema": 1, "decode": [{"op": "samu_step", "B": 16, "backend": "row"}]})


def test_per_step_loop_counts_extrapolate_linearly_in_T(monkeypatch):
    """The training track counts a per-step loop at two short lengths and extrapolates:
    launches (and bytes) of such a loop are a fixed part plus the same work per step."""
    import track_train

    class S:
        def __init__(self, t):
            self.t = t

        def step(self):
            return None

    def fake_counts(fn, device=None):
        t = fn.__self__.t
        return {"launches": 7 + 5 * t, "bytes_read": 100 * t, "bytes_written": 40, "accounted_launches": 0,
                "memcpy": 1, "memset": None, "launches_method": "torch.profiler", "top_kernels": {"k": 5 * t}}

    monkeypatch.setattr(track_train.measure, "logical_counts", fake_counts)
    got = track_train.loop_counts(S, [128, 256], 2048, torch.device("cpu"))
    assert (got["launches"], got["bytes_read"], got["bytes_written"], got["memcpy"]) == (7 + 5 * 2048, 204800, 40, 1)
    assert got["memset"] is None and "top_kernels" not in got
    assert "at T = 128 and 256, extrapolated linearly to T = 2048" in got["launches_method"]
    assert got["counted_at_T"]["128"]["launches"] == 7 + 5 * 128


def _spy_fused_step(monkeypatch, op, record):
    """kernels.step_backends with `op`'s "fused" step calling record(args, kwargs) first."""
    real = kernels.step_backends

    def spy_backends(name):
        fns = dict(real(name))
        if name == op:
            inner = fns["fused"]

            def spy(*args, **kw):
                record(args, kw)
                return inner(*args, **kw)
            fns["fused"] = spy
        return fns

    monkeypatch.setattr(kernels, "step_backends", spy_backends)


def test_tune_times_samu_steps_with_the_engines_mode_table(tmp_path, monkeypatch):
    """The generation engine passes each SAMU layer's mode table to its step, so the tune
    stage times (and checks) the Triton steps with it and the reference without."""
    seen = []
    _spy_fused_step(monkeypatch, "samu", lambda args, kw: seen.append(kw.get("modes")))
    dec = {**CPU["tune"]["decode"], "backends": ["fused"]}
    runner = measure.Runner.for_job(make_job(tmp_path, "tune", "tune", tune_settings(decode=dec), {}), "tune",
                                    tune_settings(decode=dec), torch.device("cpu"))
    entries = tune.tune_decode(runner, tune_settings(decode=dec), torch.device("cpu"))
    assert {e["op"] for e in entries} == {"rglru_step", "samu_step"}
    assert seen and all(t is not None for t in seen)
    assert torch.equal(seen[0], ops.samu_mode_table(*cases.step_inputs("samu", 2, 8, 2, torch.float32,
                                                                       torch.device("cpu"))[0][5:7], torch.float32))


@pytest.mark.parametrize("walks", [1, 2])
def test_tune_decode_steps_walk_distinct_layers(tmp_path, monkeypatch, walks):
    """A timed decode step walks `layers` layers, each with its own weights and state, as
    the model's step does; successive steps take their layers from a pool of at least twice
    the L2 cache (here made one RG-LRU walk's size, so two walks), so no visit finds them cached.
    The entry says how many layers a step walks and how many the pool holds."""
    seen = []
    # (the state, the first weight) of every call: args are (x, *weights, state, reset)
    _spy_fused_step(monkeypatch, "rglru", lambda args, kw: seen.append((args[-2].data_ptr(), args[1].data_ptr())))
    dec = {**CPU["tune"]["decode"], "backends": ["fused"], "layers": 3}
    walk = 3 * measure.tensor_bytes(cases.step_inputs("rglru", dec["batches"][0], dec["D"], dec["heads"],
                                                      torch.float32, torch.device("cpu")))
    monkeypatch.setattr(tune, "l2_bytes", lambda device: 0 if walks == 1 else walk)
    s = tune_settings(decode=dec)
    runner = measure.Runner.for_job(make_job(tmp_path, "tune", "tune", s, {}), "tune", s, torch.device("cpu"))
    entries = tune.tune_decode(runner, s, torch.device("cpu"))
    assert {e["layers"] for e in entries} == {3}
    assert [e["layer_pool"] for e in entries if e["op"] == "rglru_step"] == [3 * walks]
    assert len({w for _, w in seen}) == 3 * walks and len({st for st, _ in seen}) > 3 * walks


def test_tune_picks_decode_linear_tiles_role_by_role_behind_a_gate(tmp_path, monkeypatch):
    """Each role's grid beside the default tiles, gated on the first step from BOS: a tile
    choice that writes wrong results is recorded as failed and never chosen; the table
    hands the chosen tiles back by row block, and the inference track passes them on."""
    from kernels.models import decode as dk

    monkeypatch.setattr(tune, "LINEAR_ROLES", ("out", "logits"))
    real = dk.linear

    def wrong_at_split_2(*args, config=None, **kw):
        got = real(*args, config=config, **kw)
        if (config or {}).get("SPLIT") == 2 and kw.get("epilogue", dk.EPI_BIAS) == dk.EPI_BIAS:
            return -got                             # the logits negated: another argmax
        return got
    monkeypatch.setattr(dk, "linear", wrong_at_split_2)
    lin = {"preset": "tiny", "batch": 2, "dtype": "float32", "steps": 2, "trajectories": 2, "warmup": 0,
           "options": {"SPLIT": [2]}, "refine": {"num_stages": [2]}}
    # no stage budget: the candidate counts below must not depend on the host's load
    settings = tune_settings(linears=lin, budget_s=None)
    runner = measure.Runner.for_job(make_job(tmp_path, "tune", "tune", settings, {}), "tune", settings,
                                    torch.device("cpu"))
    entries = tune.tune_linears(runner, settings, torch.device("cpu"))
    assert [e["role"] for e in entries] == ["out", "logits"]
    assert all(e["rows"] == 16 and e["dtype"] == "float32" for e in entries)
    by_role = {e["role"]: e for e in entries}
    # stage one: the default and SPLIT 2; the refine stage: the winner and the winner at 2 stages
    assert by_role["out"]["candidates"] == 4 and by_role["logits"]["candidates"] == 3
    assert by_role["logits"]["config"] in ({}, {"num_stages": 2})   # SPLIT 2 failed its gate
    refined = [c for c in runner.planned if "-refine-" in c and c.endswith("-probe")]
    assert len(refined) == 4 and "tune-linear-logits-tiny-float32-B2-refine-gemm-s2-probe" in refined
    failed = [c for c in runner.planned if (runner.get(c) or {}).get("status") != "ok"]
    assert failed == ["tune-linear-logits-tiny-float32-B2-gemm-SPLIT2-probe"]
    assert "first-step tokens differ" in runner.get(failed[0])["error"]
    doc = {"schema": 1, "entries": [], "decode_linears": entries}
    table = kernels.TuningTable.from_dict(tuning.validate_table(doc))
    assert table.linear_configs("float32", 16) == {e["role"]: e["config"] for e in entries}
    assert table.linear_configs("float32", 64) == {} and table.linear_configs("bfloat16", 16) == {}
    with pytest.raises(ValueError, match="decode_linears"):
        tuning.validate_table({"schema": 1, "decode_linears": [{"role": "out", "rows": 16}]})


def test_a_failing_linear_tune_leaves_the_table_and_names_the_error(tmp_path, monkeypatch):
    """The op and step entries are written; the table and the report say why the decode
    linears kept their built-in tiles."""
    import aggregate

    def broken(*a, **k):
        raise RuntimeError("no model here")
    monkeypatch.setattr(tune, "tune_ops", lambda *a, **k: [])
    monkeypatch.setattr(tune, "tune_decode", lambda *a, **k: [])
    monkeypatch.setattr(tune, "HawkLM", broken)
    settings = tune_settings(linears={"preset": "tiny", "batch": 2, "steps": 1, "trajectories": 1})
    job = make_job(tmp_path, "tune", "tune", settings, {"table": str(tmp_path / "tuning.json"),
                                                        "records": str(tmp_path / "records.jsonl")})
    tune.main(job)
    table = json.loads((tmp_path / "tuning.json").read_text())
    assert table["decode_linears"] == [] and "RuntimeError: no model here" in table["decode_linears_error"]
    assert "Decode linears not tuned" in aggregate.linear_tiles(table)
