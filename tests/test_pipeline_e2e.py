"""The cpu-smoke profile end to end in a throw-away copy of the repository:
a run killed in the middle of a measurement stage, resumed with the same
command, then checked (outputs, records, report, archive); the archive verifies
and a tampered copy does not; and a deliberately failing gate stops the
pipeline before any timing stage."""

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline_util import copy_repo, run_and_kill, snakemake

from common import records  # noqa: E402

COMMAND = ["--cores", "1", "all", "--config", "profile=cpu-smoke"]
# (records.d of a measuring stage, the output that marks the stage finished)
MEASURING = [("results/tune/records.d", "results/tune/tuning.json")] + [
    (f"results/tracks/{t}/records.d", f"results/tracks/{t}/records.jsonl") for t in ("ops", "scan", "train", "infer")
]
EARLY_OUTPUTS = ["results/probe/environment.json", "results/audit/gates.json", "results/audit/audit.md"]


def _mid_stage(repo: Path):
    """(records.d, finished-marker) of a measuring stage that has written a record
    but not finished, or None."""
    for rdir, done in MEASURING:
        d = repo / rdir
        if d.is_dir() and any(d.glob("*.json")) and not (repo / done).exists():
            return d
    return None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("smoke"))
    killed_in, first_out = run_and_kill(repo, COMMAND, _mid_stage, timeout=600)
    assert killed_in is not None, f"the run ended before any measuring stage wrote a record:\n{first_out[-3000:]}"
    before = {
        "early": {p: (repo / p).stat().st_mtime_ns for p in EARLY_OUTPUTS if (repo / p).exists()},
        "records": {p.name: p.read_bytes() for p in killed_in.glob("*.json")},
    }
    resumed = snakemake(repo, *COMMAND, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    return {"repo": repo, "killed_in": killed_in, "before": before, "resumed": resumed.stdout + resumed.stderr}


def test_resume_redoes_only_unfinished_work(smoke):
    repo, before = smoke["repo"], smoke["before"]
    assert set(before["early"]) == set(EARLY_OUTPUTS), "probe and audit finish before any measuring stage"
    for p, mtime in before["early"].items():
        assert (repo / p).stat().st_mtime_ns == mtime, f"{p} was redone"
    assert not re.search(r"^localrule (probe|audit):", smoke["resumed"], re.M)
    for name, data in before["records"].items():
        assert (smoke["killed_in"] / name).read_bytes() == data, f"finished configuration {name} was redone"
    again = snakemake(repo, *COMMAND)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    # another command line (more cores, a dry run) finds the finished run up to date,
    # the archive included
    other = snakemake(repo, "-n", "--cores", "2", "all", "--config", "profile=cpu-smoke")
    assert other.returncode == 0 and "Nothing to be done" in other.stdout + other.stderr, other.stdout[-3000:]


def test_outputs_records_and_report(smoke):
    repo = smoke["repo"]
    env_ = json.loads((repo / "results/probe/environment.json").read_text())
    assert env_["profile"] == "cpu-smoke" and env_["has_gpu"] is False
    assert env_["counters_available"] is False and "no GPU" in env_["counters"]["reason"]
    assert env_["measured"]["copy_bandwidth_bytes_per_s"] > 0
    gates = json.loads((repo / "results/audit/gates.json").read_text())
    assert gates["passed"] and gates["checks"] and all(c["passed"] for c in gates["checks"])
    assert {c["check"].split("/")[0] for c in gates["checks"]} >= {
        "backends", "rglru_official", "residual_block_official", "samu_reference"}
    n = 0
    for t in ("ops", "scan", "train", "infer"):
        recs = records.read_jsonl(repo / f"results/tracks/{t}/records.jsonl")
        assert all(r["profile"] == "cpu-smoke" and r["counters"] is None for r in recs)
        n += len(recs)
    report = (repo / "results/report/report.md").read_text()
    assert "cpu-smoke" in report and "results/probe/environment.json" in report and "results/audit/audit.md" in report
    assert report.startswith("# SAMU and RG-LRU: study report (cpu-smoke profile, measured on the CPU)")
    assert f"{n} records" in report
    plots = {p.name for p in (repo / "results/report/plots").glob("*.png")}
    # The study's headline figures exist beside the per-stage ones, and the report shows them.
    assert {"train_comparison.png", "infer_throughput.png", "infer_latency.png", "scan.png", "ops.png"} <= plots
    assert all(f"plots/{p}" in report for p in plots)
    summary = report.split("## Summary", 1)[1].split("## Environment", 1)[0]
    for part in ("**Training step**", "**Inference latency**", "**Inference throughput**", "**Scan track**",
                 "**Decode step tuning**", "`rglru_step`:", "`samu_step`:"):
        assert part in summary
    # the generation command's step time beside the track's, in the infer table
    assert "vs_track" in (repo / "results/report/tables.md").read_text().split("### infer", 1)[1]
    # each op's table names the tuning table's choice at every tuned batch size
    assert summary.split("**Decode step tuning**", 1)[1].split("## Run orders", 1)[0].count("**") == 2 * 2
    for text in (report, (repo / "results/report/tables.md").read_text()):
        assert not re.search(r"\bnan\b", text, re.I), [line for line in text.splitlines() if "nan" in line.lower()][:5]
    assert "64-step" not in report
    csv = (repo / "results/report/records.csv").read_text()
    assert n == 0 or ("median_ms" in csv and "logical.launches" in csv)
    for rule in ("probe", "audit", "tune", "track_ops", "track_scan", "track_train", "track_infer", "aggregate",
                 "archive"):
        assert (repo / f"results/logs/{rule}.log").exists() and (repo / f"results/benchmarks/{rule}.tsv").exists()


def test_archive_verifies_and_tampering_is_caught(smoke, tmp_path):
    repo = smoke["repo"]
    (artifact,) = (repo / "results").glob("artifact-*.tar.gz")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert artifact.name == f"artifact-{sha[:12]}-cpu-smoke.tar.gz"
    verify = [sys.executable, str(repo / "workflow/scripts/common/artifact.py")]
    ok = subprocess.run([*verify, str(artifact)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("OK"), ok.stdout
    with tarfile.open(artifact) as tar:
        names = tar.getnames()
        prefix = artifact.name.removesuffix(".tar.gz")
        manifest = json.loads(tar.extractfile(f"{prefix}/MANIFEST.json").read())
        tar.extractall(tmp_path, filter="data")
    assert names == sorted(names)
    assert manifest["profile"] == "cpu-smoke" and manifest["commit"]["dirty"] is False
    assert manifest["command_line"].startswith("snakemake") and "profile=cpu-smoke" in manifest["command_line"]
    assert manifest["config"]["profile"] == "cpu-smoke" and manifest["probe"]["has_gpu"] is False
    assert manifest["gpu"] is None
    assert manifest["container"]["runtime"] in ("none", "docker")
    assert {"results/probe/environment.json", "results/audit/gates.json", "results/report/report.md",
            "config/config.yaml"} <= set(manifest["files"])
    folder = tmp_path / prefix
    assert subprocess.run([*verify, str(folder)], capture_output=True).returncode == 0
    target = folder / "results/audit/gates.json"
    target.write_text(target.read_text().replace('"passed": true', '"passed": false', 1))
    bad = subprocess.run([*verify, str(folder)], capture_output=True, text=True)
    assert bad.returncode == 1 and "content differs from the manifest: results/audit/gates.json" in bad.stdout
    tampered = tmp_path / "tampered.tar.gz"
    with tarfile.open(tampered, "w:gz") as tar:
        tar.add(folder, arcname=prefix)
    bad = subprocess.run([*verify, str(tampered)], capture_output=True, text=True)
    assert bad.returncode == 1 and "results/audit/gates.json" in bad.stdout


def test_report_against_a_baseline_archive(smoke):
    """`--config baseline=<artifact>` reruns the aggregation alone; the run set beside its own
    archive pairs every successful record at ratio 1, none of ours slower."""
    repo = smoke["repo"]
    (artifact,) = (repo / "results").glob("artifact-*.tar.gz")
    ran = snakemake(repo, "--cores", "1", "aggregate", "--config", "profile=cpu-smoke", f"baseline={artifact}")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert not re.search(r"^localrule (probe|audit|tune|track_\w+):", ran.stdout + ran.stderr, re.M)
    report = (repo / "results/report/report.md").read_text()
    section = report.split("## Against the baseline run", 1)[1].split("\n## ", 1)[0]
    ok = sum(r["status"] == "ok" for t in ("ops", "scan", "train", "infer")
             for r in records.read_jsonl(repo / f"results/tracks/{t}/records.jsonl"))
    assert f"{ok} configurations share their config_id" in section
    assert "on the same GPU, 0 of ours are slower by over 5 %" in section
    pairs = (repo / "results/report/baseline.csv").read_text().splitlines()
    assert len(pairs) == ok + 1 and all(row.split(",")[-1] == "1.0" for row in pairs[1:]), pairs[:3]


FAST_AUDIT = """
profiles:
  cpu-smoke:
    audit:
      gates:
        backends: []
        conv1d_official: []
        residual_block_official: []
        griffin_official: []
        samu_reference: []
"""

BROKEN_RGLRU = """

_exact_rglru = rglru


def rglru(*args, **kwargs):  # deliberately wrong: the audit must catch it
    y, h = _exact_rglru(*args, **kwargs)
    return y * 1.001, h
"""


def test_failing_gate_stops_before_any_timing_stage(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    with open(repo / "kernels/ops/reference.py", "a") as f:
        f.write(BROKEN_RGLRU)
    (tmp_path / "fast.yaml").write_text(FAST_AUDIT)
    out = snakemake(repo, *COMMAND, "--configfile", str(tmp_path / "fast.yaml"))
    assert out.returncode != 0
    log = (repo / "results/logs/audit.log").read_text()
    assert "gate(s) failed" in log and "rglru_official" in log, log[-3000:]
    assert not (repo / "results/audit/gates.json").exists() and not (repo / "results/audit/audit.md").exists()
    assert not (repo / "results/tune").exists() and not (repo / "results/tracks").exists()
    assert not list((repo / "results").glob("artifact-*"))
