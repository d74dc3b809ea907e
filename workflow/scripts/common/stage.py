"""Entry point of every stage script: `stage.run(main, globals().get("snakemake"))` sends the output
to the rule's log and calls `main` with a plain `Job` (inside the image with `container.runtime:
docker`). No `from __future__` in a stage script: Snakemake puts its preamble above the first line."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from . import atomic, devices, profile
from .facts import REPO_ROOT

IN_CONTAINER = "KERNELS_PIPELINE_IN_CONTAINER"
# Set by the Snakefile: the command line of the Snakemake call, for the archive's manifest.
COMMAND_LINE = "KERNELS_PIPELINE_COMMAND_LINE"
# Given to a stage restarted on the GPUs it claimed (pin_gpu): those GPUs, so the claim is not logged twice.
CLAIMED = "KERNELS_PIPELINE_CLAIMED_GPUS"
# Kineto leaves CUPTI attached after a torch.profiler session unless TEARDOWN_CUPTI is "1"
# (pytorch/pytorch#144455), adding host time to every later CUDA call: to the eager clocks timed
# after a counted call. Safe beside CUDA graphs from CUDA 12.6 on; a caller's setting wins.
GPU_PROCESS_ENV = {"TEARDOWN_CUPTI": "1"}


class Files(list):
    """Paths in order, also by name (job.output.environment)."""

    def __init__(self, paths=(), names=None):
        super().__init__(str(p) for p in paths)
        self.names = dict(names or {})

    def __getattr__(self, name):
        try:
            return self.__dict__["names"][name]
        except KeyError:
            named = sorted(self.__dict__.get("names", {}))
            raise AttributeError(f"no file named {name!r}; named files: {named}") from None


@dataclass
class Job:
    rule: str
    script: str
    input: Files
    output: Files
    params: dict
    config: dict
    log: str | None = None
    gpus: int = 0  # the rule's `gpu` resource

    @property
    def profile(self) -> str:
        return self.params["profile"]

    def load(self, name: str):
        return json.loads(Path(getattr(self.input, name)).read_text())

    @property
    def lock_clocks(self) -> bool:
        return bool(self.config.get("profiles", {}).get(self.profile, {}).get("probe", {}).get("lock_clocks", False))

    @classmethod
    def from_snakemake(cls, smk) -> "Job":
        def files(nl):
            return Files(list(nl), {k: str(v) if isinstance(v, str) else [str(p) for p in v] for k, v in nl.items()})

        # Snakemake runs a copy named tmp<random>.<original name> from .snakemake/scripts.
        copy = Path(sys.modules["__main__"].__file__).name
        name = copy.split(".", 1)[1] if copy.startswith("tmp") and "." in copy else copy
        script = Path(smk.scriptdir or REPO_ROOT / "workflow" / "scripts") / name
        if not script.is_file():
            raise FileNotFoundError(f"cannot find the stage script {name} in {script.parent}")
        return cls(rule=smk.rule, script=str(script.resolve()), input=files(smk.input), output=files(smk.output),
                   params=dict(smk.params.items()), config=dict(smk.config),
                   log=str(smk.log[0]) if len(smk.log) else None, gpus=int(smk.resources.get("gpu", 0)))

    def to_json(self) -> dict:
        return {**asdict(self), **{k: {"paths": list(f), "names": f.names}
                                   for k, f in (("input", self.input), ("output", self.output))}}

    @classmethod
    def from_json(cls, d: dict) -> "Job":
        return cls(**{**d, **{k: Files(d[k]["paths"], d[k]["names"]) for k in ("input", "output")}})


def exec_python(args: list[str], env: dict[str, str]) -> None:
    """Replace this process (same pid and log) by `python args` with `env` added."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], {**os.environ, **env})


def start_process(env: dict[str, str]) -> None:
    """Where `env` differs from this process's environment, restart the process with it:
    CUDA and Triton read it once, at start."""
    if any(os.environ.get(k) != v for k, v in env.items()):
        exec_python(sys.argv, env)


def prepare_process() -> None:
    """Restart under Triton's interpreter without a GPU (unless the caller chose), with GPU_PROCESS_ENV on one."""
    import torch

    if torch.cuda.is_available():
        start_process(gpu_env())
    elif "TRITON_INTERPRET" not in os.environ:
        start_process({"TRITON_INTERPRET": "1"})


def gpu_env() -> dict[str, str]:
    return {k: v for k, v in GPU_PROCESS_ENV.items() if k not in os.environ}


@contextlib.contextmanager
def log_to(path: str | None):
    """Send stdout and stderr (the file descriptors, so subprocesses too) to the rule's log."""
    if path is None:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a", buffering=1) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, target in zip(saved, (1, 2)):
                os.dup2(fd, target)
                os.close(fd)


def docker_runner():
    spec = importlib.util.spec_from_file_location("kernels_docker_runner", REPO_ROOT / "containers/docker_runner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pin_gpu(job: Job) -> None:
    """Give a GPU stage its devices (common/devices.py), log which, and restart with them visible."""
    if job.gpus < 1:
        return
    claimed = devices.claim_gpus(REPO_ROOT / "results" / ".tmp" / "gpus", len(profile.gpu_names()), job.gpus)
    if claimed is not None:
        env = devices.visible_env(claimed)
        print(f"[stage] {job.rule} runs on GPU {env['CUDA_VISIBLE_DEVICES']!r} (CUDA_VISIBLE_DEVICES, claimed)",
              flush=True)
        start_process({**env, CLAIMED: env["CUDA_VISIBLE_DEVICES"], **gpu_env()})
    elif (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None and os.environ.get(CLAIMED) != visible:
        print(f"[stage] {job.rule} runs on GPU {visible!r} (CUDA_VISIBLE_DEVICES, given by the environment)",
              flush=True)


def _run_in_docker(job: Job) -> None:
    container, text, results = job.config["container"], atomic.dumps(job.to_json()), REPO_ROOT / "results"
    job_file = results / ".tmp" / "jobs" / f"{job.rule}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    atomic.write_text(job_file, text)
    print(f"[stage] running {job.rule} in docker image {container['image']}", flush=True)
    env = {IN_CONTAINER: "1", **{k: os.environ[k] for k in (COMMAND_LINE,) if k in os.environ},
           **{k: os.environ.get(k, v) for k, v in GPU_PROCESS_ENV.items()}}
    status = docker_runner().run(container["image"], ["python", job.script, "--job", str(job_file)], repo=REPO_ROOT,
                                 results=results, env=env,
                                 gpus=visible.split(",") if (visible := os.environ.get("CUDA_VISIBLE_DEVICES"))
                                 else bool(profile.gpu_names()))
    job_file.unlink(missing_ok=True)
    if status != 0:
        raise RuntimeError(f"stage {job.rule} exited with status {status} inside {container['image']}")


def run(main, snakemake=None) -> None:
    if snakemake is None:
        ap = argparse.ArgumentParser(description="Run one stage from a job file (written by the docker runtime).")
        ap.add_argument("--job", required=True, help="JSON job file")
        job = Job.from_json(json.loads(Path(ap.parse_args().job).read_text()))
        prepare_process()
        return main(job)
    job, failed = Job.from_snakemake(snakemake), False
    with log_to(job.log):
        try:
            pin_gpu(job)
            if job.config["container"]["runtime"] == "docker" and not os.environ.get(IN_CONTAINER):
                _run_in_docker(job)
            else:
                prepare_process()
                main(job)
        except SystemExit as e:
            if failed := e.code not in (None, 0):
                print(e.code if isinstance(e.code, str) else f"stage {job.rule} exited with status {e.code}")
        except BaseException:
            traceback.print_exc()
            failed = True
    if failed:
        print(f"stage {job.rule} failed; see {job.log}", file=sys.stderr)
        sys.exit(1)
