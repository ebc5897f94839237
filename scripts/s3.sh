#!/usr/bin/env bash
# A real S3-compatible server for the object-store tests, built from Go modules into the project
# cache. Two, both Apache-2.0 (MinIO's server is AGPL-licensed):
#
#   versitygw  Versity's S3 gateway with its posix backend (the default): a 45 MB binary,
#              about 3 minutes cold (modules downloaded and built) on two cores
#   seaweedfs  SeaweedFS (`weed server -s3`): a 233 MB binary, about an hour cold on two loaded cores
#
# Both speak SigV4, presigned URLs, multipart uploads, ranged reads and conditional writes.
#
#   scripts/s3.sh build [versitygw|seaweedfs]   build into the cache (nothing when already built)
#   scripts/s3.sh path  [versitygw|seaweedfs]   print the binary's path (it may not exist yet)
#
# SeaweedFS publishes no tagged Go module versions, so its build pins one commit's pseudo-version;
# its go.mod has replace directives, which `go install pkg@version` refuses: the module is
# downloaded, copied and built as the main module instead.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script with its own message

VGW_VERSION="${ELASTIC_VERSITYGW_VERSION:-v1.8.0}"
WEED_VERSION="${ELASTIC_WEED_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}"
CACHE_ROOT="${ELASTIC_S3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jupyter-elastic-kernels/s3}"

log() { echo "s3.sh: $*" >&2; }

server="${2:-versitygw}"
case "${server}" in
    versitygw) CACHE_DIR="${CACHE_ROOT}/versitygw-${VGW_VERSION}"; BIN="${CACHE_DIR}/bin/versitygw" ;;
    seaweedfs) CACHE_DIR="${CACHE_ROOT}/${WEED_VERSION}"; BIN="${CACHE_DIR}/bin/weed" ;;
    *) echo "unknown S3 server ${server}: versitygw or seaweedfs" >&2; exit 2 ;;
esac

build_versitygw() {
    (cd "${CACHE_DIR}" && GOFLAGS=-modcacherw CGO_ENABLED=0 GOBIN="${CACHE_DIR}/bin.tmp" \
        go install -trimpath -ldflags="-s -w" "github.com/versity/versitygw/cmd/versitygw@${VGW_VERSION}")
    mv "${CACHE_DIR}/bin.tmp/versitygw" "${BIN}"
    rmdir "${CACHE_DIR}/bin.tmp"
}

build_seaweedfs() {
    local work
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
}

# The cached binary is there and runs (one that does not is built again).
built() { [[ -x "${BIN}" ]] && "${BIN}" --version >/dev/null 2>&1; }

build() {
    if built; then
        log "already built: ${BIN}"
        return 0
    fi
    command -v go >/dev/null || { log "go is needed to build ${server}"; exit 1; }
    mkdir -p "${CACHE_DIR}/bin"
    exec 9>"${CACHE_DIR}/.build.lock"
    flock 9
    if built; then
        log "built meanwhile by another process: ${BIN}"
        return 0
    fi
    local started=$SECONDS
    "build_${server}"
    log "built ${server} in $((SECONDS - started))s: ${BIN}"
}

case "${1:-}" in
    build) build ;;
    path) echo "${BIN}" ;;
    *) echo "usage: scripts/s3.sh build|path [versitygw|seaweedfs]" >&2; exit 2 ;;
esac
