#!/usr/bin/env bash
# Local base images for the compose stack when no image registry is reachable:
# a Debian bookworm root file system made with debootstrap from Debian's own
# packages, imported into the engine. Built once; later runs reuse the image.
#
#   scripts/docker_base.sh            # makes compacting-chat/debian-python:bookworm
#   BASE_IMAGE=... docker compose build
set -euo pipefail
IMAGE=${BASE_IMAGE:-compacting-chat/debian-python:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE: cached"
  exit 0
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# python3-venv: the build stage makes a virtual environment; wget: the NATS
# image's healthcheck; ca-certificates: pip over HTTPS in the build stage.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,wget \
  bookworm "$root" "$MIRROR" >/dev/null
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "base image $IMAGE: built"
