#!/usr/bin/env bash
# The real `helm` binary for the chart tests, built from Go modules into the project cache.
#
#   scripts/helm.sh build     build helm into the cache (does nothing when already built)
#   scripts/helm.sh path      print the binary's path (it may not exist yet: run `build` first)
#
# The version is pinned so the cache folder name says what is in it; ELASTIC_HELM_VERSION overrides it.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script with its own message

HELM_VERSION="${ELASTIC_HELM_VERSION:-v3.22.0}"
CACHE_DIR="${ELASTIC_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jupyter-elastic-kernels/helm/${HELM_VERSION}}"
BIN="${CACHE_DIR}/bin/helm"

log() { echo "helm.sh: $*" >&2; }

# The cached binary is there and runs (one that does not is built again).
built() { [[ -x "${BIN}" ]] && "${BIN}" version --short >/dev/null 2>&1; }

build() {
    if built; then
        log "already built: ${BIN}"
        return 0
    fi
    command -v go >/dev/null || { log "go is needed to build helm"; exit 1; }
    mkdir -p "${CACHE_DIR}/bin"
    # Several checkouts share the cache: one build at a time, the others wait and reuse it.
    exec 9>"${CACHE_DIR}/.build.lock"
    flock 9
    if built; then
        log "built meanwhile by another process: ${BIN}"
        return 0
    fi
    local started=$SECONDS
    # `go install pkg@version` builds with helm's own go.mod (its pinned k8s.io/* versions), outside any module.
    (cd "${CACHE_DIR}" && GOFLAGS= CGO_ENABLED=0 GOBIN="${CACHE_DIR}/bin.tmp" \
        go install "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}")
    "${CACHE_DIR}/bin.tmp/helm" version --short >/dev/null  # it runs, or the build stops here
    mv "${CACHE_DIR}/bin.tmp/helm" "${BIN}"
    rmdir "${CACHE_DIR}/bin.tmp"
    log "built helm ${HELM_VERSION} in $((SECONDS - started))s: ${BIN}"
}

case "${1:-}" in
    build) build ;;
    path) echo "${BIN}" ;;
    *) echo "usage: scripts/helm.sh build|path" >&2; exit 2 ;;
esac
