"""Entry point shared by every stage script.

A stage script defines `main(job)` and ends with

    if __name__ == "__main__":
        stage.run(main, globals().get("snakemake"))

(No `from __future__` import in a stage script: Snakemake puts its own preamble
above the script's first line.) Under Snakemake's `script:` directive `snakemake` is the job; `run` sends the
script's output to the rule's log, prepares the process (repository on
sys.path, Triton's interpreter when there is no GPU) and calls `main` with a
plain `Job`. With `container: {runtime: docker}` it instead writes the job to a
JSON file and runs the same script inside the image through the docker SDK
(containers/docker_runner.py), where the script is called as
`python <script> --job <file>`. With `runtime: apptainer` Snakemake itself has
already started the script inside the image, and with `none` it runs natively.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import atomic, devices
from .facts import REPO_ROOT

IN_CONTAINER = "KERNELS_PIPELINE_IN_CONTAINER"
# Set by the Snakefile: the command line of the Snakemake call, for the archive's manifest.
COMMAND_LINE = "KERNELS_PIPELINE_COMMAND_LINE"


class Files(list):
    """Paths in order, also reachable by name (job.output.environment)."""

    def __init__(self, paths=(), names=None):
        super().__init__(str(p) for p in paths)
        self.names = dict(names or {})

    def __getattr__(self, name):
        try:
            return self.__dict__["names"][name]
        except KeyError:
            raise AttributeError(f"no file named {name!r}; named files: {sorted(self.__dict__.get('names', {}))}") from None


@dataclass
class Job:
    rule: str
    script: str
    input: Files
    output: Files
    params: dict
    config: dict
    log: str | None = None
    wildcards: dict = field(default_factory=dict)
    threads: int = 1
    gpus: int = 0  # the rule's `gpu` resource

    @property
    def profile(self) -> str:
        return self.params["profile"]

    @property
    def lock_clocks(self) -> bool:
        """Whether the timing stages try to lock the SM clock (the profile's
        probe.lock_clocks; off unless the GPU's owner allows changing its clocks)."""
        probe = self.config.get("profiles", {}).get(self.profile, {}).get("probe", {})
        return bool(probe.get("lock_clocks", False))

    @classmethod
    def from_snakemake(cls, smk, script: str) -> "Job":
        def files(nl):
            names = {k: str(v) if isinstance(v, str) else [str(p) for p in v] for k, v in nl.items()}
            return Files(list(nl), names)

        params = {k: v for k, v in smk.params.items()}
        return cls(
            rule=smk.rule,
            script=script,
            input=files(smk.input),
            output=files(smk.output),
            params=params,
            config=dict(smk.config),
            log=str(smk.log[0]) if len(smk.log) else None,
            wildcards={k: str(v) for k, v in smk.wildcards.items()},
            threads=int(smk.threads),
            gpus=int(smk.resources.get("gpu", 0)),
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["input"] = {"paths": list(self.input), "names": self.input.names}
        d["output"] = {"paths": list(self.output), "names": self.output.names}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Job":
        d = dict(d)
        d["input"] = Files(d["input"]["paths"], d["input"]["names"])
        d["output"] = Files(d["output"]["paths"], d["output"]["names"])
        return cls(**d)


def _script_path(smk) -> str:
    # Snakemake runs a copy named tmp<random>.<original name> from .snakemake/scripts.
    copy = Path(sys.modules["__main__"].__file__).name
    name = copy.split(".", 1)[1] if copy.startswith("tmp") and "." in copy else copy
    path = Path(smk.scriptdir or REPO_ROOT / "workflow" / "scripts") / name
    if not path.is_file():
        raise FileNotFoundError(f"cannot find the stage script {name} in {path.parent}")
    return str(path.resolve())


def prepare_process() -> None:
    """Pick Triton's interpreter when there is no GPU (the variable must be set
    before triton is first imported; `kernels` is importable once `common` is)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def log_to(path: str | None):
    """Send this process's stdout and stderr (file descriptors too, so that
    subprocesses and C extensions land there as well) to the rule's log."""
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
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def docker_runner():
    path = REPO_ROOT / "containers" / "docker_runner.py"
    spec = importlib.util.spec_from_file_location("kernels_docker_runner", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pin_gpu(job: Job) -> None:
    """Give a GPU stage its devices (common/devices.py) and log which."""
    if job.gpus < 1:
        return
    from .profile import gpu_names

    claimed = devices.claim_gpus(REPO_ROOT / "results" / ".tmp" / "gpus", len(gpu_names()), job.gpus)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        how = "claimed" if claimed is not None else "given by the environment"
        print(f"[stage] {job.rule} runs on GPU {visible!r} (CUDA_VISIBLE_DEVICES, {how})", flush=True)


def _run_in_docker(job: Job) -> None:
    from .profile import gpu_names

    container = job.config["container"]
    text = atomic.dumps(job.to_json())
    results = REPO_ROOT / "results"
    job_file = results / ".tmp" / "jobs" / f"{job.rule}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    atomic.write_text(job_file, text)
    print(f"[stage] running {job.rule} in docker image {container['image']}", flush=True)
    status = docker_runner().run(
        container["image"],
        ["python", job.script, "--job", str(job_file)],
        repo=REPO_ROOT,
        results=results,
        env={IN_CONTAINER: "1", **{k: os.environ[k] for k in (COMMAND_LINE,) if k in os.environ}},
        gpus=visible.split(",") if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) else bool(gpu_names()),
    )
    job_file.unlink(missing_ok=True)
    if status != 0:
        raise RuntimeError(f"stage {job.rule} exited with status {status} inside {container['image']}")


def run(main, snakemake=None) -> None:
    """Run a stage's `main(job)`; see the module docstring."""
    if snakemake is None:
        ap = argparse.ArgumentParser(description="Run one pipeline stage from a job file (written by the docker runtime).")
        ap.add_argument("--job", required=True, help="JSON job file")
        args = ap.parse_args()
        job = Job.from_json(json.loads(Path(args.job).read_text()))
        prepare_process()
        main(job)
        return
    job = Job.from_snakemake(snakemake, _script_path(snakemake))
    with log_to(job.log):
        try:
            pin_gpu(job)
            if job.config["container"]["runtime"] == "docker" and not os.environ.get(IN_CONTAINER):
                _run_in_docker(job)
            else:
                prepare_process()
                main(job)
        except SystemExit as e:
            if e.code not in (None, 0):
                print(e.code if isinstance(e.code, str) else f"stage {job.rule} exited with status {e.code}")
            failed = e.code not in (None, 0)
        except BaseException:
            traceback.print_exc()
            failed = True
        else:
            failed = False
    if failed:
        print(f"stage {job.rule} failed; see {job.log}", file=sys.stderr)
        sys.exit(1)
