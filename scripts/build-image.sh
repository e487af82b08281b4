#!/usr/bin/env bash
# Builds archway's image for several platforms as ONE image index and pushes it, with no container
# engine and no pullable base image (as root, or with sudo, on Debian 12):
#
#   bash scripts/build-image.sh --push REF [--platforms linux/amd64,linux/arm64] [--insecure-registry]
#                               [--refresh-base]
#   bash scripts/build-image.sh --oci-archive FILE:NAME [--platforms ...]   (no registry: an OCI
#        archive whose image is named NAME, e.g. for `ctr images import`)
#
# It builds the repository's Dockerfile, the very file `docker buildx build --platform ...` builds,
# with buildah (vfs storage, chroot isolation). The Dockerfile's bases are made here instead of
# pulled: mmdebstrap makes a Debian rootfs of the Debian release the Dockerfile's default base
# comes from (bookworm), one with python3 per target architecture (foreign ones under qemu-user,
# binfmt_misc) and one with python3-pip for this machine's architecture, passed in as BASE and
# BUILD_BASE. The rootfs tarballs are cached in ~/.cache/archway/image (ARCHWAY_CACHE_DIR) and
# made again after 7 days, or at once with --refresh-base, so they carry Debian's security fixes.
# Everything it needs is installed first (apt packages; skipped when present).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

ref="" archive="" platforms="linux/amd64,linux/arm64" tls_verify=true refresh=false
while (($#)); do
  case "$1" in
    --push) ref="${2:?--push needs an image reference}"; shift 2 ;;
    --oci-archive) archive="${2:?--oci-archive needs FILE:NAME}"; shift 2 ;;
    --platforms) platforms="${2:?--platforms needs a list}"; shift 2 ;;
    --insecure-registry) tls_verify=false; shift ;;
    --refresh-base) refresh=true; shift ;;
    -h|--help) usage 0 ;;
    *) echo "build-image.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$ref$archive" ] || { echo "build-image.sh: --push REF or --oci-archive FILE:NAME is required" >&2; usage; }

# The Debian release: the last word of the Dockerfile's default base (python:3.11-slim-bookworm).
suite=$(sed -n 's/^ARG BASE=.*-\([a-z]*\)$/\1/p' Dockerfile)
[ -n "$suite" ] || { echo "build-image.sh: no Debian release in the Dockerfile's ARG BASE" >&2; exit 1; }
host_arch=$(dpkg --print-architecture)
arches=()
IFS=, read -ra wanted <<<"$platforms"
for p in "${wanted[@]}"; do
  case "$p" in
    linux/amd64|linux/arm64) arches+=("${p#linux/}") ;;
    *) echo "build-image.sh: unsupported platform '$p' (linux/amd64, linux/arm64)" >&2; exit 2 ;;
  esac
done

sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
bash scripts/apt-install.sh buildah mmdebstrap qemu-user-static binfmt-support arch-test >&2

# Foreign architectures run their package scripts (mmdebstrap) under qemu through binfmt_misc.
for arch in "${arches[@]}"; do
  [ "$arch" != "$host_arch" ] || continue
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    $sudo mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  fi
  $sudo update-binfmts --enable >/dev/null 2>&1 || true
  arch-test "$arch" >/dev/null || {
    echo "build-image.sh: this machine cannot run $arch binaries (qemu-user-static, binfmt_misc)" >&2
    exit 1
  }
done

cache="${ARCHWAY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/archway}/image"
mkdir -p "$cache"
# archway's own buildah storage: vfs works everywhere (no overlay inside overlay), and it keeps
# the imported bases between runs without touching anyone's /var/lib/containers.
buildah=($sudo buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver vfs)
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

seconds() { date +%s; }

# base KIND ARCH PACKAGES: prints the local image name of a cached Debian base, making it if needed.
base() {
  local kind=$1 arch=$2 packages=$3
  local name="localhost/archway-base:$kind-$suite-$arch"
  local tarball="$cache/$kind-$suite-$arch.tar" part="$cache/$kind-$suite-$arch.part.tar"
  local stamp="$cache/$kind-$suite-$arch.imported"
  if $refresh || [ -z "$(find "$tarball" -mtime -7 2>/dev/null)" ]; then
    local start; start=$(seconds)
    echo "build-image.sh: making the $suite $kind base for $arch (mmdebstrap)" >&2
    # The same trimming as Debian's own slim images: no manuals, translations or docs but the
    # licenses; merged /usr from the start (no usrmerge package, which drags perl in).
    if ! $sudo mmdebstrap --variant=minbase --format=tar --arch="$arch" --include="$packages" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --aptopt='Acquire::Retries "3"' \
        "$suite" "$part" \
        "deb $mirror $suite main" "deb $mirror $suite-updates main" \
        "deb $security $suite-security main" >"$cache/mmdebstrap-$kind-$arch.log" 2>&1; then
      tail -n 30 "$cache/mmdebstrap-$kind-$arch.log" >&2
      rm -f "$part"
      exit 1
    fi
    mv "$part" "$tarball"
    echo "build-image.sh: $kind base for $arch made in $(($(seconds) - start)) s" >&2
  fi
  local want; want=$(stat -c '%Y %s' "$tarball")
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
      || ! "${buildah[@]}" inspect --type image "$name" >/dev/null 2>&1; then
    local c; c=$("${buildah[@]}" from --arch "$arch" scratch)
    # commit --rm removes the working container; a step that fails removes it here.
    if ! { "${buildah[@]}" add --quiet "$c" "$tarball" / >/dev/null &&
           "${buildah[@]}" config --os linux --arch "$arch" \
             --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
             --cmd /bin/bash "$c" &&
           "${buildah[@]}" commit --quiet --rm "$c" "$name" >/dev/null; }; then
      "${buildah[@]}" rm "$c" >/dev/null 2>&1 || true
      echo "build-image.sh: importing the $kind base for $arch into buildah failed" >&2
      exit 1
    fi
    echo "$want" >"$stamp"
  fi
  echo "$name"
}

# A CA bundle of this machine (a TLS-inspecting proxy in front of PyPI, a private mirror) is
# mounted into the RUN steps only: it is never part of the image.
mounts=()
for ca in /etc/ssl/certs/ca-certificates.crt; do
  [ -r "$ca" ] && mounts+=(--volume "$ca:$ca:ro")
done

build_base=$(base build "$host_arch" python3,python3-pip)
list="localhost/archway-build-$$"
cleanup() {
  # Keep the bases (the next build starts from them), drop this build's images.
  "${buildah[@]}" manifest rm "$list" >/dev/null 2>&1 || true
  "${buildah[@]}" rmi --prune >/dev/null 2>&1 || true
}
trap cleanup EXIT
"${buildah[@]}" manifest create "$list" >/dev/null
for arch in "${arches[@]}"; do
  run_base=$(base run "$arch" python3,ca-certificates)
  start=$(seconds)
  # buildah 1.28 does not set BUILDPLATFORM itself (BuildKit does); --pull=never: the bases are
  # the local images made above, never anything of the same name on a registry.
  "${buildah[@]}" build --quiet --isolation chroot --platform "linux/$arch" "${mounts[@]}" \
    --pull=never --build-arg "BUILDPLATFORM=linux/$host_arch" \
    --build-arg "BASE=$run_base" --build-arg "BUILD_BASE=$build_base" \
    --manifest "$list" -f Dockerfile . >/dev/null
  echo "build-image.sh: linux/$arch image built in $(($(seconds) - start)) s" >&2
done

if [ -n "$archive" ]; then
  rm -f "${archive%%:*}"
  "${buildah[@]}" manifest push --quiet --all "$list" "oci-archive:$archive"
  echo "build-image.sh: wrote ${archive%%:*} (${platforms})" >&2
  exit 0
fi
digestfile="$cache/pushed-digest-$$"
"${buildah[@]}" manifest push --quiet --all --tls-verify="$tls_verify" --digestfile "$digestfile" \
  "$list" "docker://$ref"
echo "build-image.sh: pushed $ref@$(cat "$digestfile") (${platforms})" >&2
rm -f "$digestfile"
