#!/usr/bin/env bash
# Build the base image murmur's Dockerfile starts FROM, out of Debian packages alone: no image
# registry is needed (none may be reachable). debootstrap makes a minimal bookworm root file
# system from the Debian mirror this machine's apt already uses; `docker import` turns it into an
# image. Python in it is Debian's 3.11.
#
#   deploy/build-base.sh [IMAGE]        (default murmur-base:bookworm; needs root, debootstrap, docker)
#
# An image already present is kept (the build takes ~2 minutes): set MURMUR_REBUILD_BASE=1 to redo it.
set -euo pipefail

IMAGE=${1:-murmur-base:bookworm}
SUITE=bookworm

if [ -z "${MURMUR_REBUILD_BASE:-}" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE exists (MURMUR_REBUILD_BASE=1 rebuilds it)"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed: apt-get install -y debootstrap" >&2; exit 1; }
# Before debootstrap's minutes, not after them: `docker import` needs a running engine.
docker info >/dev/null 2>&1 || { echo "no Docker engine answers: start it (systemctl start docker, or dockerd &)" >&2; exit 1; }

# The mirror: the first Debian archive this machine's apt sources name (one-line or deb822 form).
mirror_of() {
    grep -rhoE '^(deb|URIs:)[[:space:]]+(\[[^]]*\][[:space:]]+)?https?://[^[:space:]]+' \
        /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
        | grep -oE 'https?://[^[:space:]]+' | grep -E '/debian/?$' | head -n1
}
MIRROR=${MURMUR_DEBIAN_MIRROR:-$(mirror_of || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

ROOTFS=$(mktemp -d /tmp/murmur-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOTFS" "$MIRROR" >/dev/null
# Package lists and caches are not needed at run time: a smaller image.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$IMAGE" >/dev/null
echo "built $IMAGE"
