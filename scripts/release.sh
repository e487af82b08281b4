#!/usr/bin/env bash
# archway's release steps, in one place. The version X.Y.Z is written in pyproject.toml (what
# `archway --version` prints) and in charts/archway/Chart.yaml (version and appVersion); the git
# tag and the image tag are vX.Y.Z, and the chart's default image tag is "v" + appVersion, so
# an install with only image.repository set runs the image of its own release.
#
#   bash scripts/release.sh check              the versions agree; prints X.Y.Z
#   bash scripts/release.sh set X.Y.Z          writes X.Y.Z everywhere; CHANGELOG.md's
#                                              "## Unreleased" becomes "## X.Y.Z (DATE)"
#   bash scripts/release.sh tag                after check, on a clean tree whose CHANGELOG.md has
#                                              X.Y.Z: the annotated git tag vX.Y.Z
#   bash scripts/release.sh image REGISTRY/REPO [build-image.sh options, e.g. --insecure-registry]
#                                              builds and pushes REGISTRY/REPO:vX.Y.Z (linux/amd64
#                                              and linux/arm64), then checks with archway inspect
#                                              that the pushed index has both
#
# A release: set X.Y.Z, commit, tag, image (then push the commit and the tag). tests/test_release.py
# checks that the versions agree and that these steps do what they say.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

die() { echo "release.sh: $*" >&2; exit 1; }

pyproject_version() { sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml; }
chart_field() { sed -n "s/^$1: *\"\{0,1\}\([^\"]*\)\"\{0,1\}$/\1/p" charts/archway/Chart.yaml; }

check() {
  local version chart app
  version=$(pyproject_version) chart=$(chart_field version) app=$(chart_field appVersion)
  [ -n "$version" ] || die "no version in pyproject.toml"
  if [ "$chart" != "$version" ] || [ "$app" != "$version" ]; then
    die "versions disagree: pyproject.toml $version, Chart.yaml version ${chart:-none}, appVersion ${app:-none}"
  fi
  echo "$version"
}

set_version() {
  local version=$1
  [[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "'$version' is not X.Y.Z"
  sed -i "s/^version = \".*\"$/version = \"$version\"/" pyproject.toml
  sed -i "s/^version: .*/version: $version/; s/^appVersion: .*/appVersion: \"$version\"/" \
    charts/archway/Chart.yaml
  if grep -q '^## Unreleased$' CHANGELOG.md; then
    sed -i "s/^## Unreleased$/## $version ($(date -u +%Y-%m-%d))/" CHANGELOG.md
  fi
  check >/dev/null
  echo "release.sh: version $version; commit, then: bash scripts/release.sh tag" >&2
}

tag() {
  local version; version=$(check)
  grep -q "^## $version " CHANGELOG.md || die "CHANGELOG.md has no section '## $version (...)'"
  [ -z "$(git status --porcelain)" ] || die "the working tree has changes: commit them first"
  ! git rev-parse -q --verify "refs/tags/v$version" >/dev/null || die "tag v$version exists"
  git tag -a "v$version" -m "archway $version"
  echo "release.sh: tagged v$version; then: bash scripts/release.sh image REGISTRY/archway" >&2
}

image() {
  local repository=${1:?image needs REGISTRY/REPO}; shift
  local version ref insecure=false arg
  version=$(check)
  ref="$repository:v$version"
  for arg in "$@"; do [ "$arg" != --insecure-registry ] || insecure=true; done
  bash scripts/build-image.sh --push "$ref" "$@"
  # What was pushed, read back as a user would: both architectures in one index.
  . scripts/venv.sh
  local archway=archway config
  [ -x "$ARCHWAY_VENV/bin/archway" ] && archway="$ARCHWAY_VENV/bin/archway"
  config=$(mktemp)
  trap 'rm -f "$config"' RETURN
  if $insecure; then
    printf 'registry:\n  insecure_hosts: ["%s"]\n' "${repository%%/*}" >"$config"
  fi
  local found
  found=$("$archway" --config "$config" inspect "$ref" | sed -n 's/^  architectures: //p')
  [ "$found" = "amd64 arm64" ] || die "$ref has architectures '$found', not amd64 and arm64"
  echo "release.sh: $ref has amd64 and arm64; install with --set image.repository=$repository" >&2
}

case "${1:-}" in
  check) check ;;
  set) set_version "${2:?set needs X.Y.Z}" ;;
  tag) tag ;;
  image) shift; image "$@" ;;
  -h|--help) usage 0 ;;
  *) usage ;;
esac
