#!/usr/bin/env bash
# Tests of the pipeline image that need no GPU (root, podman):
#   1. containers/check_image.py inside the image, without network: PyTorch's CUDA
#      build, its libraries resolved by ldd inside the image, Triton compiling a
#      kernel for sm_90 to a cubin, pip check;
#   2. the cpu-smoke profile end to end through the docker runtime: podman's
#      Docker-API service, the docker SDK (containers/docker_runner.py), every
#      stage inside the image, in a throw-away copy of the repository.
#
#   containers/test_image.sh 2>&1 | tee containers/test-image.log
# Environment: IMAGE (default samu-kernels:0.1.0), PYTHON (the host's venv python).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-samu-kernels:0.1.0}
PYTHON=${PYTHON:-.venv/bin/python}
repo=$PWD
podman image inspect --format "image $IMAGE: sha256:{{.Id}}, {{.Size}} bytes" "$IMAGE"

t=$(date +%s)
podman run --rm --network none -v "$repo/containers/check_image.py:/opt/check_image.py:ro" \
    "$IMAGE" python /opt/check_image.py
echo "== in-image checks: $(( $(date +%s) - t )) s"

work=$(mktemp -d /var/tmp/samu-image-test.XXXXXX)
sock=$work.sock
podman system service --time=0 "unix://$sock" &
service=$!
trap 'kill "$service"; rm -rf "$work" "$sock"' EXIT
"$PYTHON" -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); \
from pipeline_util import copy_repo; copy_repo(Path('$work'))"
cd "$work"
t=$(date +%s)
DOCKER_HOST=unix://$sock CUDA_VISIBLE_DEVICES="" "$PYTHON" -m snakemake --cores 1 all \
    --config profile=cpu-smoke "container={runtime: docker, image: $IMAGE}"
echo "== cpu-smoke through the docker runtime: $(( $(date +%s) - t )) s"
for rule in probe audit tune track_ops track_scan track_train track_infer aggregate archive; do
    grep -q "^\[stage\] running $rule in docker image $IMAGE" "results/logs/$rule.log" \
        || { echo "FAIL $rule did not run in the image (results/logs/$rule.log)" >&2; exit 1; }
done
echo "ok   every stage ran in $IMAGE"
"$PYTHON" workflow/scripts/common/artifact.py results/artifact-*.tar.gz
"$PYTHON" - <<'PY'
import glob, json, tarfile
(path,) = glob.glob("results/artifact-*.tar.gz")
with tarfile.open(path) as tar:
    name = next(n for n in tar.getnames() if n.endswith("/MANIFEST.json"))
    manifest = json.load(tar.extractfile(name))
print("ok   archive manifest: container", manifest["container"], "profile", manifest["profile"])
assert manifest["container"]["runtime"] == "docker"
PY
echo "image tests passed"
