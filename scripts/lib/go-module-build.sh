# Sourced by kwok-build.sh and karpenter-build.sh: one command built from a module on the Go module
# proxy into a cache folder, one build at a time (a second caller waits, then finds it built).
# The caller defines NAME (for messages), CACHE, out (the folder that holds the result) and
# built() (true when $out is complete), then:
#   gomodule_begin MODULE@VERSION   exits printing $out when built; else locks, downloads the
#                                   module and sets $module_dir, $go (new enough for its go.mod),
#                                   $work (removed on exit) and $log
#   gomodule_install PACKAGE@VERSION   go install into $work/bin, exits with the log's tail on failure
say() { echo "$NAME-build: $*" >&2; }

download() {   # download GO: sets module_dir (empty when refused) and gomod
  local json
  json=$(cd "$work" && GOPATH="$work/gopath" "$1" mod download -json "$module" 2>>"$log") || true
  echo "$json" >>"$log"
  module_dir=$(echo "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  gomod=$(echo "$json" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
}

gomodule_begin() {
  module=$1
  local here any_go
  if built; then echo "$out"; exit 0; fi
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.build.lock"
  flock 9
  if built; then echo "$out"; exit 0; fi
  export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
  work=$(mktemp -d "$CACHE/.build-XXXXXX")
  trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
  log="$CACHE/build-${module##*@}.log"
  : >"$log"
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  any_go=$(command -v go || echo /usr/local/go/bin/go)
  [ -x "$any_go" ] || any_go=$(bash "$here/go-toolchain.sh" 1.21)
  say "downloading $module (log: $log)"
  download "$any_go"
  # A go.mod newer than the Go at hand refuses the download but names the go.mod it read:
  # go-toolchain.sh fetches a toolchain new enough from the module proxy (what GOTOOLCHAIN
  # switching would do, but cached and said out loud), which then downloads the module.
  [ -n "$gomod" ] && [ -f "$gomod" ] || { say "the module proxy does not serve $module"; tail -n 5 "$log" >&2; exit 1; }
  go=$(bash "$here/go-toolchain.sh" "$(sed -n 's/^go //p' "$gomod")")
  [ -n "$module_dir" ] || download "$go"
  [ -d "$module_dir" ] || { say "could not download $module"; tail -n 5 "$log" >&2; exit 1; }
}

gomodule_install() {
  say "building $1 with $("$go" version | cut -d' ' -f3) (log: $log)"
  if ! (cd "$work" && GOPATH="$work/gopath" GOBIN="$work/bin" \
        "$go" install -trimpath -ldflags "-s -w" "$1") >>"$log" 2>&1; then
    say "FAILED — last lines of $log:"; tail -n 25 "$log" >&2; exit 1
  fi
}
