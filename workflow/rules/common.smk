import os
import shlex
import sys
from pathlib import Path

from snakemake.utils import min_version, update_config

min_version("9.0")

sys.path.insert(0, str(Path(workflow.basedir) / "workflow" / "scripts"))
from common import config_check, facts
from common.recovery import executes, recover
from common.profile import choice, gpu_names, resolve_profile
from common.stage import COMMAND_LINE


configfile: "config.yaml"


# Scalars inside a nested --config value arrive as strings; type them as YAML would.
_OVERRIDES = dict(workflow.config_settings.config or {})
update_config(config, config_check.typed_overrides(_OVERRIDES))
_GPUS = gpu_names()
try:
    config_check.validate(
        config, Path(workflow.basedir) / "workflow/schemas/config.schema.yaml"
    )
    PROFILE, PROFILE_CONFIG = resolve_profile(config, gpus=_GPUS)
except ValueError as e:
    raise WorkflowError(str(e)) from None
# A stage's settings go in its rule's params: a change reruns the stage.
print(choice(config["profile"], PROFILE, _GPUS), file=sys.stderr)
# A CUDA profile on a machine without a GPU stops here, not after the probe; a dry
# run only warns, so that the plan can be read anywhere.
try:
    config_check.require_device(PROFILE, PROFILE_CONFIG, _GPUS)
except ValueError as e:
    # The controller of a cluster run (--jobs for an executor that sends every job
    # elsewhere: resource_settings.nodes) needs no GPU: its jobs run on GPU nodes.
    if executes(sys.argv) and workflow.resource_settings.nodes is None:
        raise WorkflowError(str(e)) from None
    print(f"warning: {e}", file=sys.stderr)


if executes(sys.argv):
    recover(Path.cwd())


def container_runtime(container):
    """`auto`: docker when an engine answers and holds the image, else none."""
    if container["runtime"] != "auto":
        return container["runtime"]
    try:
        import docker

        docker.from_env(timeout=5).images.get(container["image"])
    except Exception:
        return "none"
    return "docker"


config["container"]["runtime"] = container_runtime(config["container"])
if config["container"]["runtime"] == "apptainer":
    _methods = {str(m).lower() for m in workflow.deployment_settings.deployment_method}
    if not any("apptainer" in m or "singularity" in m for m in _methods):
        raise WorkflowError(
            "container.runtime is apptainer: run snakemake with --sdm apptainer "
            "(and --apptainer-args '--nv' on a GPU node)"
        )


_IMAGE = config["container"]["image"]
CONTAINER = (
    _IMAGE if "://" in _IMAGE or _IMAGE.endswith(".sif") else f"docker://{_IMAGE}"
)
_COMMIT = facts.commit()
# Named by what it holds (commit, tree state, profile), never by the date, so that
# a resumed run finishes the same artifact.
_SOURCE = _COMMIT["sha"][:12] + ("-dirty" if _COMMIT["dirty"] else "")
ARTIFACT = f"results/artifact-{_SOURCE}-{PROFILE}.tar.gz"
# The archive's manifest records the command line; an environment variable rather
# than a rule param, so that `-n` or `--cores 2` does not make the archive stale.
os.environ[COMMAND_LINE] = shlex.join(["snakemake", *sys.argv[1:]])
# The FSDP2 training track joins the run when the profile asks for more than one GPU.
_WORLD = PROFILE_CONFIG["train"].get("world_size", 1)
TRACKS = ("ops", "scan", "train", "infer") + (("train_fsdp",) if _WORLD > 1 else ())


# Each stage's job: whole GPUs (`gpu`), host memory (`mem_mb`), wall minutes (`runtime`);
# a SLURM job asks for them (workflow/profiles/slurm). On one node `gpu` counts against
# `--resources gpu=N`, N = 1 unless given, so one GPU stage runs at a time. The CPU
# profile's jobs are small and take no GPU.
if "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", 1)
STAGE_RESOURCES = {
    "probe": {"gpu": 1, "mem_mb": 16000, "runtime": 30},
    "audit": {"gpu": 1, "mem_mb": 32000, "runtime": 60},
    "tune": {"gpu": 1, "mem_mb": 32000, "runtime": 240},
    "track": {"gpu": 1, "mem_mb": 64000, "runtime": 480},
    "track_fsdp": {"gpu": _WORLD, "mem_mb": 128000, "runtime": 480},
    "aggregate": {"gpu": 0, "mem_mb": 8000, "runtime": 30},
    "archive": {"gpu": 0, "mem_mb": 8000, "runtime": 30},
}
_CPU_JOB = {"gpu": 0, "mem_mb": 2000, "runtime": 30}
if PROFILE_CONFIG["audit"]["device"] == "cpu":
    STAGE_RESOURCES = dict.fromkeys(STAGE_RESOURCES, _CPU_JOB)


def reported(path, caption, category, **kwargs):
    """An output shown in the Snakemake report, captioned by workflow/report/<caption>.rst."""
    return report(path, caption=f"../report/{caption}.rst", category=category, **kwargs)
