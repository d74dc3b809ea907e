import datetime
import shlex
import sys
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

sys.path.insert(0, str(Path(workflow.basedir) / "workflow" / "scripts"))
from common import facts
from common.recovery import executes, recover
from common.profile import resolve_profile


configfile: "config.yaml"


if executes(sys.argv):
    _recovered = recover(Path.cwd())
    if _recovered["locks"] or _recovered["outputs"]:
        print(
            f"Resuming a killed run: released locks {_recovered['locks']}, "
            f"removed incomplete outputs {_recovered['outputs']}.",
            file=sys.stderr,
        )


validate(config, "../schemas/config.schema.yaml")

try:
    PROFILE, PROFILE_CONFIG = resolve_profile(config)
except ValueError as e:
    raise WorkflowError(str(e)) from None


def container_runtime(container):
    """The runtime the stages use: `auto` means docker when an engine answers and
    already holds the image, otherwise native."""
    runtime = container["runtime"]
    if runtime != "auto":
        return runtime
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.images.get(container["image"])
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


def container_uri(container):
    image = container["image"]
    if "://" in image or image.endswith(".sif"):
        return image
    return f"docker://{image}"


CONTAINER = container_uri(config["container"])
COMMIT = facts.commit()
ARTIFACT = "results/artifact-{date}-{commit}{dirty}.tar.gz".format(
    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d"),
    commit=COMMIT["sha"][:12],
    dirty="-dirty" if COMMIT["dirty"] else "",
)
COMMAND_LINE = shlex.join(["snakemake", *sys.argv[1:]])
# The FSDP2 training track joins the run when the profile asks for more than one GPU.
TRACKS = ("scan", "train", "infer") + (
    ("train_fsdp",) if PROFILE_CONFIG["train"].get("world_size", 1) > 1 else ()
)


def log_path(rule):
    return f"results/logs/{rule}.log"


def benchmark_path(rule):
    return f"results/benchmarks/{rule}.tsv"


def section(name):
    """The active profile's settings for one stage (they become params, so that
    changing them reruns the stage and what follows)."""
    return PROFILE_CONFIG[name]
