#!/usr/bin/env bash
# A real Kubernetes node for the tests: kubelet + containerd + runc + CNI (bridge, host-local) on this
# machine, registered with the control plane of scripts/envtest.sh beside its kwok nodes.
#
#   scripts/node.sh build               build the kubelet (the control plane's pinned Kubernetes version,
#                                       from the same Go modules) and the pause image into the cache's
#                                       bin/; does nothing when built
#   scripts/node.sh start DIR [REGISTRY]  start a node with its state in DIR for the cluster of $KUBECONFIG
#                                       (an admin kubeconfig: scripts/envtest.sh env); REGISTRY, e.g.
#                                       127.0.0.1:5000, is pulled from over plain HTTP. Runs until Ctrl-C
#   scripts/node.sh paths               print kubelet=..., pause=..., cni=... (what the tests use)
#
# containerd, runc and the CNI plugins are Debian's (apt-get install -y containerd runc
# containernetworking-plugins buildah); docs/envtest.md says which versions work together and why.
# The node is implemented in tests/support/node.py, so tests and this script share one implementation.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script with its own message

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K8S_VERSION="${ELASTIC_K8S_VERSION:-v1.36.3}"
CACHE_DIR="${ELASTIC_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jupyter-elastic-kernels/node/${K8S_VERSION}}"
BIN_DIR="${CACHE_DIR}/bin"
CNI_DIR="${ELASTIC_CNI_BIN_DIR:-/usr/lib/cni}"
PAUSE_IMAGE="localhost/jupyter-elastic-kernels-pause:1"

log() { echo "node: $*" >&2; }

python_bin() {
    if [[ -x "${REPO_ROOT}/.venv/bin/python" ]]; then
        echo "${REPO_ROOT}/.venv/bin/python"
    else
        echo python3
    fi
}

build_kubelet() {
    # Built and running (a half-written or broken one is built again).
    [[ -x "${BIN_DIR}/kubelet" ]] && "${BIN_DIR}/kubelet" --version >/dev/null 2>&1 && return 0
    # The control plane's build writes the Go module that pins k8s.io/kubernetes and its staging modules;
    # the kubelet builds from a copy of it, so both share the compiled packages in Go's build cache.
    ELASTIC_K8S_VERSION="${K8S_VERSION}" bash "${REPO_ROOT}/scripts/envtest.sh" build
    local envtest_module
    envtest_module="$(dirname "$(ELASTIC_K8S_VERSION="${K8S_VERSION}" bash "${REPO_ROOT}/scripts/envtest.sh" bindir)")/build-module"
    local mod_dir="${CACHE_DIR}/build-module" started=$SECONDS
    mkdir -p "${mod_dir}" "${BIN_DIR}"
    sed 's/^module .*/module elastic-node-build/' "${envtest_module}/go.mod" >"${mod_dir}/go.mod"
    cp "${envtest_module}/go.sum" "${mod_dir}/go.sum"
    local major="${K8S_VERSION#v}" minor="${K8S_VERSION#v*.}" ldflags="-s -w" pkg
    major="${major%%.*}"
    minor="${minor%%.*}"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION} -X ${pkg}.gitMajor=${major} -X ${pkg}.gitMinor=${minor}"
        ldflags+=" -X ${pkg}.gitTreeState=clean"
    done
    log "building kubelet ${K8S_VERSION} in ${mod_dir}"
    (cd "${mod_dir}" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags="${ldflags}" \
        -o "${mod_dir}/kubelet" k8s.io/kubernetes/cmd/kubelet)
    "${mod_dir}/kubelet" --version >/dev/null  # it runs, or the build stops here
    mv "${mod_dir}/kubelet" "${BIN_DIR}/kubelet"
    log "kubelet built in $((SECONDS - started)) s"
}

# The pod sandbox's image: a static program that waits for a signal and reaps orphans (no registry
# serves registry.k8s.io/pause here), packed with buildah into an OCI archive that containerd imports.
build_pause() {
    [[ -f "${BIN_DIR}/pause.tar" ]] && return 0
    local work="${CACHE_DIR}/pause"
    rm -rf "${work}"
    mkdir -p "${work}/src"
    cat >"${work}/src/main.go" <<'EOF'
// The pod sandbox's process: holds the pod's namespaces until the kubelet stops it.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
EOF
    printf 'module pause\n\ngo 1.22\n' >"${work}/src/go.mod"
    (cd "${work}/src" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "${work}/pause" .)
    local storage=(--root "${work}/storage" --runroot "${work}/run" --storage-driver vfs)
    local container
    container="$(buildah "${storage[@]}" from --quiet scratch)"
    buildah "${storage[@]}" copy --quiet "${container}" "${work}/pause" /pause >/dev/null
    buildah "${storage[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "${container}"
    buildah "${storage[@]}" commit --quiet --rm "${container}" "${PAUSE_IMAGE}" >/dev/null
    buildah "${storage[@]}" push --quiet "${PAUSE_IMAGE}" "oci-archive:${BIN_DIR}/pause.tar.partial:${PAUSE_IMAGE}"
    mv "${BIN_DIR}/pause.tar.partial" "${BIN_DIR}/pause.tar"
    buildah "${storage[@]}" rmi --all >/dev/null 2>&1 || true
    rm -rf "${work}"
    log "pause image: ${BIN_DIR}/pause.tar"
}

cmd="${1:-}"
case "${cmd}" in
    build)
        command -v go >/dev/null || { log "go is needed to build the kubelet"; exit 1; }
        command -v buildah >/dev/null || { log "buildah is needed (apt-get install -y buildah)"; exit 1; }
        mkdir -p "${BIN_DIR}"
        exec 9>"${CACHE_DIR}/.build.lock"
        flock 9
        build_kubelet
        build_pause
        ;;
    paths)
        echo "kubelet=${BIN_DIR}/kubelet"
        echo "pause=${BIN_DIR}/pause.tar"
        echo "cni=${CNI_DIR}"
        ;;
    start)
        [[ -n "${2:-}" && -n "${KUBECONFIG:-}" ]] || { log "usage: KUBECONFIG=... scripts/node.sh start DIR [REGISTRY]"; exit 2; }
        PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}" \
            exec "$(python_bin)" -m tests.support.node start "$2" "${KUBECONFIG}" ${3:+"$3"}
        ;;
    *)
        sed -n '2,16p' "$0" >&2
        exit 2
        ;;
esac
