"""Run one command inside the pipeline's image through the docker SDK.

The stage helper (workflow/scripts/common/stage.py) calls `run` for every stage
when `container.runtime` is docker. The repository is mounted read-only at its
own path and `results/` read-write on top of it, the command runs as the host
user (so results stay owned by whoever ran the pipeline), every GPU of the host
(or the listed ones) is requested when there is one, and no network is attached (a stage fetches
nothing). Works with any engine that speaks the
Docker API (DOCKER_HOST=unix:///run/podman/podman.sock for podman).

    python containers/docker_runner.py --image samu-kernels:0.1.0 -- python -c "import torch"
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run(image: str, command: list[str], *, repo: str | os.PathLike = REPO_ROOT, results: str | os.PathLike | None = None,
        env: dict | None = None, gpus: bool | list[str] = False, stream=None) -> int:
    """Run `command` in a fresh container of `image`, stream its output to
    `stream` (default stdout) and return its exit status. `gpus`: True for every
    GPU of the host, a list for those device indices (or UUIDs) only."""
    import docker
    from docker.types import DeviceRequest

    stream = stream or sys.stdout
    repo = Path(repo).resolve()
    results = Path(results).resolve() if results is not None else repo / "results"
    results.mkdir(parents=True, exist_ok=True)
    # No client timeout: creating a container from a large image can take minutes on
    # a slow storage driver, and a stage may print nothing for hours.
    client = docker.from_env(timeout=None)
    container = client.containers.run(
        image,
        command,
        detach=True,
        user=f"{os.getuid()}:{os.getgid()}",
        working_dir=str(repo),
        volumes={str(repo): {"bind": str(repo), "mode": "ro"}, str(results): {"bind": str(results), "mode": "rw"}},
        environment={"HOME": "/tmp", "PYTHONUNBUFFERED": "1", **(env or {})},
        device_requests=[DeviceRequest(device_ids=list(gpus), capabilities=[["gpu"]]) if isinstance(gpus, list)
                         else DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpus else None,
        ipc_mode="host" if gpus else None,
        network_mode="none",
    )
    try:
        for chunk in container.logs(stream=True, follow=True):
            stream.write(chunk.decode(errors="replace"))
            stream.flush()
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run a command in the pipeline image (docker SDK).")
    ap.add_argument("--image", required=True)
    ap.add_argument("--gpus", action="store_true", help="request every GPU of the host")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="command after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("expected a command after --")
    return run(args.image, cmd, gpus=args.gpus)


if __name__ == "__main__":
    sys.exit(main())
