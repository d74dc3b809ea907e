#!/usr/bin/env bash
# Build the pipeline's GPU image with podman from pinned parts, no container registry:
#   1. a Debian root filesystem by debootstrap (containers/base.lock pins the release
#      by the sha256 of its package index), imported as localhost/samu-base:<release>;
#   2. every wheel of containers/requirements.lock (PyTorch's CUDA build with its
#      CUDA libraries as pip packages, Triton 3.6.0, the rest of envs/) downloaded
#      here with --require-hashes into WHEEL_CACHE;
#   3. `podman build` of containers/Dockerfile, which installs the lock with
#      --require-hashes --no-index from the mounted wheel folder (the build itself
#      has no network).
# Writes containers/image.json (image id, base image id, the pins) and
# containers/base-packages.txt (the Debian packages in the image).
#
#   sudo containers/build.sh                 # IMAGE=samu-kernels:0.1.0
#
# Needs root, podman, debootstrap, Debian's archive keyring and python3 with venv.
# Environment: IMAGE (tag), DEBIAN_MIRROR, WHEEL_CACHE (default /var/cache/samu-wheels),
# PIP_CERT (CA bundle of a TLS-inspecting proxy for the wheel download).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=containers/base.lock
. containers/base.lock
IMAGE=${IMAGE:-samu-kernels:0.1.0}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEEL_CACHE=${WHEEL_CACHE:-/var/cache/samu-wheels}
BASE=localhost/samu-base:${DEBIAN_SUITE}-${DEBIAN_VERSION}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
for tool in podman debootstrap python3; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool not found (apt-get install podman debootstrap python3-venv)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "build.sh: debootstrap and podman import need root" >&2; exit 1; }
started=$(date +%s)

if ! podman image exists "$BASE"; then
    root=$(mktemp -d /var/tmp/samu-base.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --keyring="$KEYRING" --include="$DEBIAN_INCLUDE" \
        "$DEBIAN_SUITE" "$root" "$DEBIAN_MIRROR"
    release=$(find "$root/var/lib/apt/lists" -maxdepth 1 -name "*_dists_${DEBIAN_SUITE}_*Release" ! -name "*.gpg" | head -n 1)
    version=$(sed -n 's/^Version: //p' "$release")
    index=$(awk '/^SHA256:/{f=1;next} /^[^ ]/{f=0} f && $3=="main/binary-amd64/Packages.xz"{print $1}' "$release")
    if [ "$version" != "$DEBIAN_VERSION" ] || [ "$index" != "$DEBIAN_PACKAGES_XZ_SHA256" ]; then
        echo "build.sh: $DEBIAN_MIRROR serves $DEBIAN_SUITE $version with package index sha256 $index;" \
             "containers/base.lock pins $DEBIAN_VERSION, $DEBIAN_PACKAGES_XZ_SHA256 (use a snapshot mirror, see base.lock)" >&2
        exit 1
    fi
    chroot "$root" dpkg-query -W -f '${Package}=${Version}\n' | sort > containers/base-packages.txt
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/var/log/*
    tar --numeric-owner -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE"
    rm -rf "$root"
    trap - EXIT
fi

mkdir -p "$WHEEL_CACHE"
venv=$(mktemp -d)
python3 -m venv "$venv"
"$venv/bin/pip" download --isolated ${PIP_CERT:+--cert "$PIP_CERT"} --index-url https://pypi.org/simple \
    --no-deps --require-hashes --prefer-binary -r containers/requirements.lock -d "$WHEEL_CACHE"
rm -rf "$venv"

podman build --format docker --network none --volume "$WHEEL_CACHE:/wheels:ro" \
    --build-arg BASE_IMAGE="$BASE" -f containers/Dockerfile -t "$IMAGE" containers
image_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
base_id=$(podman image inspect --format '{{.Id}}' "$BASE")
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
cat > containers/image.json <<JSON
{
  "image": "$IMAGE",
  "image_id": "sha256:$image_id",
  "size_bytes": $size,
  "base_image": "$BASE",
  "base_image_id": "sha256:$base_id",
  "debian": {"suite": "$DEBIAN_SUITE", "version": "$DEBIAN_VERSION", "packages_xz_sha256": "$DEBIAN_PACKAGES_XZ_SHA256"},
  "requirements_lock_sha256": "$(sha256sum containers/requirements.lock | cut -d' ' -f1)",
  "podman": "$(podman version --format '{{.Client.Version}}')",
  "built_utc": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
  "build_seconds": $(( $(date +%s) - started ))
}
JSON
echo "built $IMAGE (sha256:$image_id); recorded in containers/image.json"
