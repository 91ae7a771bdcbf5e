#!/usr/bin/env bash
# build.sh — the container image deploy/k8s/tandem.yaml runs, with podman:
#   deploy/container/build.sh [TAG]          (default tandem:0.1.0 -> localhost/tandem:0.1.0)
# The base is Debian 12: localhost/debian:12 if it exists, else pulled from a
# registry (docker.io/library/debian:12), else made here with debootstrap
# (needs root and a Debian mirror) and imported. The default model is baked
# into /models from models/ (deploy/install-deps.sh puts it there); TARGET=runtime
# builds the image without it (mount the model at /models). Prints the tag last.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
tag=${1:-tandem:0.1.0}
base=localhost/debian:12
say() { echo "container: $*" >&2; }
command -v podman >/dev/null || { echo "container: podman is missing (apt install podman; runc too where crun refuses the host's cgroups)" >&2; exit 1; }
. "$root/deploy/container/podman-opts.sh"
if ! podman image exists "$base"; then
  if podman pull -q docker.io/library/debian:12 >/dev/null 2>&1; then
    podman tag docker.io/library/debian:12 "$base"
    say "base: docker.io/library/debian:12"
  else
    say "base: no registry answered; debootstrap bookworm (minbase) into a temporary folder"
    command -v debootstrap >/dev/null || { say "debootstrap is missing (apt install debootstrap), and no registry answered"; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    debootstrap --variant=minbase bookworm "$tmp/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$tmp/log" 2>&1 ||
      { tail -20 "$tmp/log" >&2; exit 1; }
    printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://security.debian.org/debian-security bookworm-security main\n' \
      "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
      > "$tmp/rootfs/etc/apt/sources.list"
    rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/lib/apt/lists/"*
    tar -C "$tmp/rootfs" -c . | podman import -q - "$base" >/dev/null
  fi
fi
target=${TARGET:-image}
ctx=()
[ "$target" = image ] && ctx=(--build-context "models=$root/models")
podman "${podman_global[@]}" build "${podman_opts[@]}" -f deploy/container/Containerfile --ignorefile deploy/container/containerignore \
  --build-arg BASE="$base" --target "$target" "${ctx[@]}" -t "$tag" . >&2
echo "localhost/${tag#localhost/}"
