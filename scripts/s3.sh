#!/usr/bin/env bash
# A real S3-compatible server for the object-store tests: SeaweedFS (Apache-2.0), built from Go
# modules into the project cache. (MinIO's server is AGPL-licensed; SeaweedFS's S3 gateway speaks
# SigV4, presigned URLs, multipart uploads, ranged reads and conditional writes.)
#
#   scripts/s3.sh build     build `weed` into the cache (does nothing when already built)
#   scripts/s3.sh path      print the binary's path (it may not exist yet: run `build` first)
#
# SeaweedFS publishes no tagged Go module versions, so the build pins one commit's pseudo-version.
# Its go.mod has replace directives, which `go install pkg@version` refuses: the module is
# downloaded, copied and built as the main module instead.
set -euo pipefail

WEED_VERSION="${ELASTIC_WEED_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}"
CACHE_DIR="${ELASTIC_S3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jupyter-elastic-kernels/s3/${WEED_VERSION}}"
BIN="${CACHE_DIR}/bin/weed"

log() { echo "s3.sh: $*" >&2; }

build() {
    if [[ -x "${BIN}" ]]; then
        log "already built: ${BIN}"
        return 0
    fi
    command -v go >/dev/null || { log "go is needed to build SeaweedFS"; exit 1; }
    mkdir -p "${CACHE_DIR}/bin"
    exec 9>"${CACHE_DIR}/.build.lock"
    flock 9
    if [[ -x "${BIN}" ]]; then
        log "built meanwhile by another process: ${BIN}"
        return 0
    fi
    local started=$SECONDS work
    work="$(mktemp -d)"
    trap 'chmod -R u+w "${work}"; rm -rf "${work}"' EXIT
    (cd "${work}" && go mod init fetch >/dev/null 2>&1 \
        && go mod download -json "github.com/seaweedfs/seaweedfs@${WEED_VERSION}" > download.json)
    local source
    source="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["Dir"])' "${work}/download.json")"
    cp -r "${source}" "${work}/src"
    chmod -R u+w "${work}/src"
    (cd "${work}/src" && GOFLAGS= CGO_ENABLED=0 go build -o "${BIN}.tmp" ./weed)
    mv "${BIN}.tmp" "${BIN}"
    log "built SeaweedFS ${WEED_VERSION} in $((SECONDS - started))s: ${BIN}"
}

case "${1:-}" in
    build) build ;;
    path) echo "${BIN}" ;;
    *) echo "usage: scripts/s3.sh build|path" >&2; exit 2 ;;
esac
