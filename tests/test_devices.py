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
    assert devices.visible_env([0]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # given to the restarted process, not written here
    assert devices.claim_gpus(tmp_path, 4) == [1]
    with pytest.raises(RuntimeError, match=r"3 GPU\(s\) wanted, 2 of 4 free.*--resources gpu=N"):
        devices.claim_gpus(tmp_path, 4, 3)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and len(devices._held) == 2  # nothing kept
    assert devices.claim_gpus(tmp_path, 4, 2) == [2, 3]  # the FSDP track: two GPUs
    assert devices.visible_env([2, 3])["CUDA_VISIBLE_DEVICES"] == "2,3"
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
    assert devices.claim_gpus(tmp_path, 2) == [0]


def test_a_gpu_stage_runs_on_its_claimed_gpu_only(tmp_path, clean, monkeypatch, capsys):
    from common import profile, stage

    calls = []

    class FakeRunner:
        @staticmethod
        def run(image, command, *, repo, results, env, gpus):
            calls.append(gpus)
            envs.append(env)
            return 0

    envs = []
    monkeypatch.setattr(profile, "gpu_names", lambda: ["NVIDIA H200"] * 2)
    monkeypatch.setattr(stage, "docker_runner", lambda: FakeRunner)
    monkeypatch.setattr(stage, "REPO_ROOT", tmp_path)
    job = stage.Job(rule="track_scan", script="s.py", input=stage.Files(), output=stage.Files(),
                    params={"profile": "h200"}, config={"container": {"runtime": "docker", "image": "img:1"}}, gpus=1)
    restarts = []

    def start_process(env):  # the restart, as its new process would see the environment
        restarts.append(env)
        for k, v in env.items():
            monkeypatch.setenv(k, v)

    monkeypatch.setattr(stage, "start_process", start_process)
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    stage.pin_gpu(job)
    assert restarts == [{"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0", stage.CLAIMED: "0",
                         "TEARDOWN_CUPTI": "1"}]
    stage.pin_gpu(job)  # the restarted process: nothing claimed again, nothing logged twice
    assert len(restarts) == 1 and len(devices._held) == 1
    stage._run_in_docker(job)
    assert calls == [["0"]] and os.environ["CUDA_VISIBLE_DEVICES"] == "0" and envs[0]["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")     # a caller's own setting stands
    assert stage.gpu_env() == {}
    assert (tmp_path / "results" / ".tmp" / "gpus" / "0.lock").exists()
    assert "[stage] track_scan runs on GPU '0' (CUDA_VISIBLE_DEVICES, claimed)" in capsys.readouterr().out
    stage.pin_gpu(stage.Job(**{**job.__dict__, "gpus": 0}))  # aggregate, archive: no GPU claimed
    assert len(devices._held) == 1


def test_a_stage_restarts_with_its_environment_and_keeps_its_claim(tmp_path, clean):
    """start_process replaces the process (same pid) by one started with the variables;
    a GPU claimed before the restart stays locked after it."""
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(f"""
        import fcntl, os, sys, time
        sys.path.insert(0, {str(pipeline_util.SCRIPTS)!r})
        from common import devices, stage
        print("start", os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            stage.start_process(devices.visible_env(devices.claim_gpus({str(tmp_path)!r}, 2)))
        print("running", os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"], os.environ["CUDA_DEVICE_ORDER"], flush=True)
        time.sleep(60)
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = [proc.stdout.readline().split() for _ in range(3)]
        pid = str(proc.pid)
        assert lines == [["start", pid, "None"], ["start", pid, "0"], ["running", pid, "0", "PCI_BUS_ID"]]
        assert devices.claim_gpus(tmp_path, 2) == [1]  # GPU 0 is still held by the restarted process
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    devices._held.pop().close()


def test_a_stage_without_a_gpu_restarts_under_the_triton_interpreter(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(pipeline_util.SCRIPTS)!r})
        from common import stage
        print("start", os.environ.get("TRITON_INTERPRET"), flush=True)
        stage.prepare_process()
        print("running", os.environ["TRITON_INTERPRET"], flush=True)
    """))
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["start None", "start 1", "running 1"]
