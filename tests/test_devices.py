"""One GPU per stage (workflow/scripts/common/devices.py): the first free GPU,
never one another stage holds, a clear error when all are held, SLURM's (or the
user's) CUDA_VISIBLE_DEVICES kept, and a claim that ends with its process."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import pipeline_util  # noqa: F401  (puts workflow/scripts on sys.path)
from common import devices


@pytest.fixture
def clean():
    """No device variables during the test, the caller's back after it, no claim left."""
    keys = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    yield
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(saved)
    while devices._held:
        devices._held.pop().close()


def test_claims_the_first_free_gpu_and_never_a_held_one(tmp_path, clean, monkeypatch):
    assert devices.claim_gpus(tmp_path, 3) == [0]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # as a second stage's process would start
    assert devices.claim_gpus(tmp_path, 4) == [1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"3 GPU\(s\) wanted, 2 of 4 free.*--resources gpu=N"):
        devices.claim_gpus(tmp_path, 4, 3)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and len(devices._held) == 2  # nothing kept
    assert devices.claim_gpus(tmp_path, 4, 2) == [2, 3]  # the FSDP track: two GPUs
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"1 GPU\(s\) wanted, 0 of 4 free"):
        devices.claim_gpus(tmp_path, 4)
    devices._held.pop(1).close()  # the stage on GPU 1 ends
    assert devices.claim_gpus(tmp_path, 4) == [1]


def test_keeps_a_given_device_and_claims_nothing_without_gpus(tmp_path, clean, monkeypatch):
    assert devices.claim_gpus(tmp_path, 0) is None and "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # SLURM's allocation
    assert devices.claim_gpus(tmp_path, 8) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert not list(tmp_path.iterdir())


def test_a_killed_stage_frees_its_gpu(tmp_path, clean):
    holder = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(pipeline_util.SCRIPTS)!r})
        from common import devices
        print(devices.claim_gpus({str(tmp_path)!r}, 2)[0], flush=True)
        time.sleep(60)
    """)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "0"
        assert devices.claim_gpus(tmp_path, 2) == [1]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    devices._held.pop().close()
    os.environ.pop("CUDA_VISIBLE_DEVICES")
    assert devices.claim_gpus(tmp_path, 2) == [0]


def test_a_gpu_stage_runs_on_its_claimed_gpu_only(tmp_path, clean, monkeypatch, capsys):
    from common import profile, stage

    calls = []

    class FakeRunner:
        @staticmethod
        def run(image, command, *, repo, results, env, gpus):
            calls.append(gpus)
            return 0

    monkeypatch.setattr(profile, "gpu_names", lambda: ["NVIDIA H200"] * 2)
    monkeypatch.setattr(stage, "docker_runner", lambda: FakeRunner)
    monkeypatch.setattr(stage, "REPO_ROOT", tmp_path)
    job = stage.Job(rule="track_scan", script="s.py", input=stage.Files(), output=stage.Files(),
                    params={"profile": "h200"}, config={"container": {"runtime": "docker", "image": "img:1"}}, gpus=1)
    stage.pin_gpu(job)
    stage._run_in_docker(job)
    assert calls == [["0"]] and os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert (tmp_path / "results" / ".tmp" / "gpus" / "0.lock").exists()
    assert "[stage] track_scan runs on GPU '0' (CUDA_VISIBLE_DEVICES, claimed)" in capsys.readouterr().out
    stage.pin_gpu(stage.Job(**{**job.__dict__, "gpus": 0}))  # aggregate, archive: no GPU claimed
    assert len(devices._held) == 1
