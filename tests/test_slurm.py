"""The pipeline on a SLURM cluster, run by .ci/slurm (which starts a single-node
cluster on localhost; elsewhere this module is skipped): the cpu-smoke profile
through workflow/profiles/slurm with every stage a SLURM job, the controlling
Snakemake killed in the middle of a track (its job keeps running in SLURM),
then the same command again: the killed run's job is cancelled, finished stages
and records are kept, nothing is lost or measured twice."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from pipeline_util import copy_repo, run_and_kill, snakemake
from test_pipeline_e2e import EARLY_OUTPUTS, MEASURING

from common import records  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SAMU_SLURM_TEST") != "1" or shutil.which("sbatch") is None,
    reason="needs the SLURM cluster that .ci/slurm starts",
)

COMMAND = ["--workflow-profile", "workflow/profiles/slurm", "all", "--config", "profile=cpu-smoke",
           "--slurm-no-account", "--slurm-init-seconds-before-status-checks", "5"]
STAGES = {"probe", "audit", "tune", "track_ops", "track_scan", "track_train", "track_infer", "aggregate", "archive"}
TRACKS = MEASURING[1:]
SUBMITTED = re.compile(r"submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/")


def _mid_track(repo):
    for rdir, done in TRACKS:
        d = repo / rdir
        if d.is_dir() and any(d.glob("*.json")) and not (repo / done).exists():
            return d
    return None


def _queue():
    out = subprocess.run(["squeue", "--me", "--noheader", "--format=%i %k"], capture_output=True, text=True, check=True)
    return dict(line.split(maxsplit=1) for line in out.stdout.splitlines() if line.strip())


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("slurm"))
    t0 = time.time()
    # the controller is lost; its SLURM jobs are not
    killed_in, first = run_and_kill(repo, COMMAND, _mid_track, timeout=1500)
    print(f"first run: {time.time() - t0:.0f} s, killed in {killed_in}\n{first[-4000:]}")
    assert killed_in is not None, f"the run ended before a track wrote a record:\n{first[-4000:]}"
    orphans = _queue()
    before = {
        "early": {p: (repo / p).stat().st_mtime_ns for p in EARLY_OUTPUTS if (repo / p).exists()},
        "records": {p.name: p.read_bytes() for p in killed_in.glob("*.json")},
    }
    t1 = time.time()
    resumed = snakemake(repo, *COMMAND, timeout=1800)
    out = resumed.stdout + resumed.stderr
    print(f"resumed run: {time.time() - t1:.0f} s, SLURM jobs of the killed run {orphans}\n{out[-6000:]}")
    assert resumed.returncode == 0, out[-6000:]
    return {"repo": repo, "killed_in": killed_in, "before": before, "orphans": orphans, "first": first,
            "resumed": out}


def test_every_stage_is_a_slurm_job(cluster_run):
    submitted = SUBMITTED.findall(cluster_run["first"] + cluster_run["resumed"])
    assert {rule for _, rule in submitted} == STAGES, submitted
    assert not re.search(r"^localrule (?!all:)", cluster_run["first"] + cluster_run["resumed"], re.M)
    logs = cluster_run["repo"] / ".snakemake" / "slurm_logs"
    for job_id, rule in submitted:
        if job_id not in cluster_run["orphans"]:  # a job cancelled while pending has no log
            assert (logs / f"rule_{rule}" / f"{job_id}.log").is_file(), (rule, job_id)


def test_resume_cancels_the_killed_runs_job_and_keeps_finished_work(cluster_run):
    repo, before = cluster_run["repo"], cluster_run["before"]
    orphans = cluster_run["orphans"]
    track = cluster_run["killed_in"].parent.name
    assert any(comment == f"rule_track_{track}" for comment in orphans.values()), orphans
    assert re.search(r"cancelled SLURM jobs \[([^\]]*)\]", cluster_run["resumed"]).group(1) == ", ".join(
        repr(j) for j in orphans), cluster_run["resumed"][-3000:]
    assert _queue() == {}
    for p, mtime in before["early"].items():
        assert (repo / p).stat().st_mtime_ns == mtime, f"{p} was redone"
    for name, data in before["records"].items():
        assert (cluster_run["killed_in"] / name).read_bytes() == data, f"finished configuration {name} was redone"
    again = snakemake(repo, *COMMAND)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


def test_no_record_lost_or_duplicated(cluster_run):
    repo = cluster_run["repo"]
    for rdir, _ in MEASURING:
        ids = [r["config_id"] for r in records.read_jsonl(repo / rdir.replace("records.d", "records.jsonl"))]
        assert len(ids) == len(set(ids)) > 0, (rdir, ids)
        assert set(ids) == {p.stem for p in (repo / rdir).glob("*.json")}, rdir
    (artifact,) = (repo / "results").glob("artifact-*.tar.gz")
    verify = subprocess.run([sys.executable, str(repo / "workflow/scripts/common/artifact.py"), str(artifact)],
                            capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stdout.strip().endswith("OK"), verify.stdout
