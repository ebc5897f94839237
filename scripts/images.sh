#!/usr/bin/env bash
# The kernel and gateway images, built from this checkout with buildah (no daemon, no registry needed).
#
#   scripts/images.sh build              build both images (tags: the package version from pyproject.toml)
#                                        into this script's own containers-storage under the cache; reuses
#                                        the base image and every unchanged layer
#   scripts/images.sh export [DIR]       build, then write OCI archives DIR/{kernel,gateway}-VERSION.tar
#                                        (default DIR: the cache's archives/); prints their paths
#   scripts/images.sh push REGISTRY      build, then push both to REGISTRY (e.g. localhost:5000, plain HTTP)
#   scripts/images.sh registry-start DIR [PORT]   a local registry (Debian's docker-registry) on
#                                        127.0.0.1:PORT (default 5000) storing in DIR; prints its address
#   scripts/images.sh registry-stop DIR  stop that registry
#   scripts/images.sh prune              remove unnamed images and stray working containers from the
#                                        storage (each build does this too)
#   scripts/images.sh names              print the two image names with their tags
#   scripts/images.sh export-torch [DIR] the kernel image with PyTorch (Debian's CPU build, python3-torch)
#                                        as an OCI archive DIR/kernel-torch-VERSION.tar: the tests' PyTorch
#                                        environment (a DataLoader with workers in a real kernel pod)
#
# The base image is made from Debian packages (mmdebstrap), as no registry may be reachable; set
# ELASTIC_IMAGES_BASE to an image already in the storage (or a docker.io name, with a registry) to build
# FROM another base, e.g. a CUDA or PyTorch one (docs/images.md). Python dependencies come from the
# package index as binary wheels downloaded on this machine for the base's Python (pip download), so the
# image build itself needs no network.
#
# Needs root and: buildah, mmdebstrap, skopeo (apt-get install -y buildah mmdebstrap skopeo).
set -euo pipefail
# A failure inside `$(...)` stops the script there too, with its own message (bash does not apply
# `set -e` in command substitutions without this).
shopt -s inherit_errexit

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${ELASTIC_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jupyter-elastic-kernels/images}"
STORAGE_ROOT="${CACHE_DIR}/storage"
STORAGE_RUNROOT="${CACHE_DIR}/run"
SUITE="${ELASTIC_IMAGES_SUITE:-bookworm}"
# What the base holds: its cache key is made from this list (and the suite), so a change builds a new one.
BASE_PACKAGES="python3,python3-venv,ca-certificates,tini,passwd"
# The PyTorch base adds Debian's CPU build of PyTorch (1.13 in bookworm, with numpy and what libtorch
# links: OpenCV, FFmpeg, Qt...): a 1.4 GB tarball made in 2 to 3.5 minutes here. PyPI's Linux torch is
# the CUDA build, which imports only with its nvidia-* wheels: 3 GB to download, 6 GB installed.
TORCH_PACKAGES="${BASE_PACKAGES},python3-torch"
PYTHON="${ELASTIC_IMAGES_PYTHON:-python3}"  # runs pip on this machine
NAME_PREFIX="${ELASTIC_IMAGES_PREFIX:-localhost/}"

log() { echo "images: $*" >&2; }

version() {
    awk -F'"' '/^version = / { print $2; exit }' "${REPO_ROOT}/pyproject.toml"
}

kernel_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-kernel:$(version)"; }
torch_kernel_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-kernel-torch:$(version)"; }
gateway_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels:$(version)"; }

bud() {
    buildah --root "${STORAGE_ROOT}" --runroot "${STORAGE_RUNROOT}" --storage-driver overlay "$@"
}

need() {
    local tool missing=()
    for tool in "$@"; do
        command -v "${tool}" >/dev/null || missing+=("${tool}")
    done
    if ((${#missing[@]})); then
        log "missing: ${missing[*]} (apt-get install -y ${missing[*]})"
        exit 1
    fi
}

base_key() {
    printf '%s\n' "${SUITE}" "$1" "minbase" | sha256sum | cut -c1-16
}

# A half-made base from an interrupted or failed mmdebstrap: a file, or a directory with the mounts a
# directory build leaves inside it (/proc, /sys, /dev), unmounted before it is removed.
discard_partial() {
    local partial="$1" mount
    if [[ -d "${partial}" ]]; then
        while read -r mount; do
            umount -l "${mount}" || { log "could not unmount ${mount} (left by mmdebstrap): unmount it by hand"; exit 1; }
        done < <(awk -v top="${partial}/" 'index($2, top) == 1 { print $2 }' /proc/self/mounts | sort -r)
    fi
    rm -rf "${partial}"
}

# The base image from Debian packages: the tarball is cached (about 2 minutes to make), and imported into
# the storage once. PACKAGES (default: BASE_PACKAGES) makes another base, named and cached by its key.
ensure_base() {
    local packages="${1:-${BASE_PACKAGES}}"
    if [[ -z "${1:-}" && -n "${ELASTIC_IMAGES_BASE:-}" ]]; then
        echo "${ELASTIC_IMAGES_BASE}"
        return 0
    fi
    local key image tarball partial
    key="$(base_key "${packages}")"
    image="localhost/jupyter-elastic-kernels-base:${key}"
    tarball="${CACHE_DIR}/base-${key}.tar"
    if bud inspect --type image "${image}" >/dev/null 2>&1; then
        if [[ -n "$(probe_python "${image}")" ]]; then
            echo "${image}"
            return 0
        fi
        log "the cached base ${image} has no working python3: removing it and making it again"
        bud rmi --force "${image}" >/dev/null
        rm -f "${tarball}"
    fi
    if [[ ! -s "${tarball}" ]]; then
        need mmdebstrap
        log "making the base (${SUITE}: ${packages}) with mmdebstrap"
        local started=$SECONDS
        # The name must end in .tar: mmdebstrap picks its output format from the name, and any other
        # ending makes a directory (with /proc mounted inside while it works).
        partial="${CACHE_DIR}/partial-base-${key}.tar"
        discard_partial "${partial}"
        mmdebstrap --quiet --variant=minbase --include="${packages}" \
            --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
            "${SUITE}" "${partial}" >&2
        if ! tar -tf "${partial}" ./usr/bin/python3 >/dev/null 2>&1; then
            log "mmdebstrap made ${partial}, but it is not a tarball holding ./usr/bin/python3 (removed)"
            discard_partial "${partial}"
            exit 1
        fi
        mv "${partial}" "${tarball}"
        log "base made in $((SECONDS - started)) s: ${tarball}"
    fi
    # Imported under a working name and tagged only once python3 runs in it, so a broken import is
    # never found as the cached base by the next run.
    local container candidate="localhost/jupyter-elastic-kernels-base-unchecked:${key}"
    container="$(bud from --quiet scratch)"
    bud add --quiet "${container}" "${tarball}" / >/dev/null
    bud config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /bin/bash "${container}"
    bud commit --quiet --rm "${container}" "${candidate}" >/dev/null
    if [[ -z "$(probe_python "${candidate}")" ]]; then
        bud rmi --force "${candidate}" >/dev/null
        rm -f "${tarball}"
        log "the base imported from ${tarball} does not run python3 (tarball removed; run again to remake it)"
        exit 1
    fi
    bud tag "${candidate}" "${image}"
    bud rmi "${candidate}" >/dev/null
    log "base imported as ${image}"
    echo "${image}"
}

# The Python version (x.y.z) IMAGE runs, or nothing when python3 does not run in it.
probe_python() {
    local container version=""
    container="$(bud from --quiet --pull-never "$1")"
    version="$(bud run --network none "${container}" -- python3 -c 'import platform; print(platform.python_version())' 2>/dev/null)" || version=""
    bud rm "${container}" >/dev/null
    echo "${version}"
}

# The Python version (x.y.z) of IMAGE, from running it (the dependencies' wheels must suit that one).
image_python() {
    local version
    version="$(probe_python "$1")"
    if [[ ! "${version}" =~ ^3\.[0-9]+\.[0-9]+$ ]]; then
        log "python3 does not run in $1 (it printed '${version}'): cannot choose wheels for it"
        exit 1
    fi
    echo "${version}"
}

# pip takes the platforms a download may match one by one: every glibc from 2.17 (manylinux2014) to 2.36
# (bookworm's).
platform_flags() {
    local arch minor
    arch="$(uname -m)"
    for minor in $(seq 17 36); do
        printf -- '--platform manylinux_2_%s_%s ' "${minor}" "${arch}"
    done
    printf -- '--platform manylinux2014_%s --platform manylinux2010_%s --platform manylinux1_%s' \
        "${arch}" "${arch}" "${arch}"
}

# The context of both builds: the wheels (this checkout's, plus its dependencies'), kept between builds
# with their times unchanged when their content is, so buildah reuses the layers made from them. The
# dependencies are resolved for the base's own Python (binary wheels only: a build without network
# cannot compile), and cached, keyed by the dependency list and that version.
stage_context() {
    local context="$1" python_version="$2"
    local deps_key deps_dir
    deps_key="$({
        sed -n '/^dependencies = \[/,/^\]/p' "${REPO_ROOT}/pyproject.toml"
        sed -n '/^kubernetes = \[/p; /^gateway = \[/p' "${REPO_ROOT}/pyproject.toml"  # the gateway image's extras
        echo "${python_version} $(uname -m)"
    } | sha256sum | cut -c1-16)"
    deps_dir="${CACHE_DIR}/wheels/deps-${deps_key}"
    local project_dir="${CACHE_DIR}/wheels/project"
    rm -rf "${project_dir}"
    mkdir -p "${project_dir}" "${context}/wheels"
    # (hatchling's wheels are reproducible: the same checkout gives the same bytes)
    "${PYTHON}" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "${project_dir}" "${REPO_ROOT}" >&2
    if [[ ! -f "${deps_dir}/.complete" ]]; then
        log "downloading the dependencies' wheels for Python ${python_version} into ${deps_dir}"
        rm -rf "${deps_dir}"
        mkdir -p "${deps_dir}"
        local abi="cp$(echo "${python_version}" | cut -d. -f1,2 | tr -d .)"
        "${PYTHON}" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
            --python-version "${python_version}" --implementation cp --abi "${abi}" --abi abi3 --abi none \
            $(platform_flags) -d "${deps_dir}" \
            "jupyter-elastic-kernels[gateway,kubernetes] @ file://$(ls "${project_dir}"/*.whl)" >&2
        rm -f "${deps_dir}"/jupyter_elastic_kernels-*.whl
        touch "${deps_dir}/.complete"
    fi
    local wanted=("${deps_dir}"/*.whl "${project_dir}"/*.whl) source target name
    for target in "${context}/wheels"/*.whl; do
        [[ -e "${target}" ]] || continue
        name="$(basename "${target}")"
        [[ -f "${deps_dir}/${name}" || -f "${project_dir}/${name}" ]] || rm -f "${target}"
    done
    for source in "${wanted[@]}"; do
        target="${context}/wheels/$(basename "${source}")"
        cmp -s "${source}" "${target}" || cp -p "${source}" "${target}"
    done
}

# WHICH (images/WHICH/Containerfile) as NAME from BASE; STAMP names its key file (default: WHICH).
build_one() {
    local which="$1" name="$2" base="$3" started=$SECONDS key stamp
    stamp="${CACHE_DIR}/built-${4:-${which}}.key"
    # What is in the image: its recipe, the wheels, the base. Unchanged and still there: nothing to do
    # (buildah would reuse every layer too, but hashing the venv for its cache takes a while).
    key="$({
        cat "${REPO_ROOT}/images/${which}/Containerfile"
        (cd "${CACHE_DIR}/context" && sha256sum wheels/*.whl)
        bud inspect --type image --format '{{.FromImageID}}' "${base}"
    } | sha256sum | cut -c1-32)"
    if [[ "$(cat "${stamp}" 2>/dev/null)" == "${key}" ]] && bud inspect --type image "${name}" >/dev/null 2>&1; then
        log "${name} is up to date"
        return 0
    fi
    bud bud --quiet --layers --pull-never --network none \
        --build-arg "BASE_IMAGE=${base}" --build-arg "VERSION=$(version)" \
        --build-arg "PIP_OPTIONS=--no-index --find-links /tmp/wheels" \
        -t "${name}" -f "${REPO_ROOT}/images/${which}/Containerfile" "${CACHE_DIR}/context" >/dev/null
    echo "${key}" >"${stamp}"
    log "built ${name} in $((SECONDS - started)) s"
}

# Every rebuild leaves the previous images' layers behind, unnamed (their first step copies the wheels,
# which change with the checkout, so no later build can reuse them), and an interrupted build leaves its
# working container: about 2.5 GB a code change, 46 GB after a day here, which filled the disk CI shares.
# Called with the build lock held, after each build, so the storage holds only the named images.
# A failed prune only costs disk, never the build it follows: it is logged, not fatal.
prune_storage() {
    bud rm --all >/dev/null || log "could not remove the working containers (left in ${STORAGE_ROOT})"
    bud rmi --prune >/dev/null || log "could not remove the unnamed images (left in ${STORAGE_ROOT})"
}

build() {
    need buildah
    mkdir -p "${CACHE_DIR}"
    # Several checkouts on one machine share the cache: one build at a time.
    exec 8>"${CACHE_DIR}/.build.lock"
    flock 8
    local started=$SECONDS base python_version
    base="$(ensure_base)"
    python_version="$(image_python "${base}")"
    stage_context "${CACHE_DIR}/context" "${python_version}"
    build_one kernel "$(kernel_name)" "${base}"
    build_one gateway "$(gateway_name)" "${base}"
    prune_storage
    log "both images ready in $((SECONDS - started)) s: $(kernel_name) $(gateway_name)"
}

# The kernel image built from the PyTorch base (same recipe; its venv sees the system's torch).
build_torch() {
    need buildah
    mkdir -p "${CACHE_DIR}"
    exec 8>"${CACHE_DIR}/.build.lock"
    flock 8
    local started=$SECONDS base python_version
    base="$(ensure_base "${TORCH_PACKAGES}")"
    python_version="$(image_python "${base}")"
    stage_context "${CACHE_DIR}/context" "${python_version}"
    build_one kernel "$(torch_kernel_name)" "${base}" kernel-torch
    prune_storage
    log "the PyTorch kernel image ready in $((SECONDS - started)) s: $(torch_kernel_name)"
}

# An OCI archive of IMAGE at PATH, rewritten only when the image changed (its id is kept beside it).
export_one() {
    local image="$1" path="$2" id
    id="$(bud inspect --type image --format '{{.FromImageID}}' "${image}")"
    if [[ -f "${path}" && "$(cat "${path}.id" 2>/dev/null)" == "${id}" ]]; then
        echo "${path}"
        return 0
    fi
    rm -f "${path}"
    # The archive names the image in full (localhost/...): the name a pod's `image:` gives, as the CRI
    # would otherwise read a bare name as docker.io/library/...
    bud push --quiet "${image}" "oci-archive:${path}:${image}" >/dev/null
    echo "${id}" >"${path}.id"
    echo "${path}"
}

registry_start() {
    local dir="$1" port="${2:-5000}"
    need docker-registry
    mkdir -p "${dir}/data"
    cat >"${dir}/config.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: ${dir}/data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:${port}
EOF
    docker-registry serve "${dir}/config.yml" >"${dir}/registry.log" 2>&1 &
    echo $! >"${dir}/registry.pid"
    local i
    for i in $(seq 1 100); do
        if curl -fsS "http://127.0.0.1:${port}/v2/" >/dev/null 2>&1; then
            echo "127.0.0.1:${port}"
            return 0
        fi
        kill -0 "$(cat "${dir}/registry.pid")" 2>/dev/null || break
        sleep 0.2
    done
    log "the registry did not start: $(tail -5 "${dir}/registry.log")"
    exit 1
}

registry_stop() {
    local dir="$1" pid
    pid="$(cat "${dir}/registry.pid" 2>/dev/null || true)"
    [[ -n "${pid}" ]] && kill "${pid}" 2>/dev/null || true
    rm -f "${dir}/registry.pid"
}

cmd="${1:-}"
case "${cmd}" in
    build)
        build
        ;;
    prune)
        [[ -d "${STORAGE_ROOT}" ]] || exit 0
        need buildah
        exec 8>"${CACHE_DIR}/.build.lock"
        flock 8
        prune_storage
        ;;
    export)
        build
        dir="${2:-${CACHE_DIR}/archives}"
        mkdir -p "${dir}"
        export_one "$(kernel_name)" "${dir}/kernel-$(version).tar"
        export_one "$(gateway_name)" "${dir}/gateway-$(version).tar"
        ;;
    push)
        [[ -n "${2:-}" ]] || { log "usage: scripts/images.sh push REGISTRY"; exit 2; }
        build
        for image in "$(kernel_name)" "$(gateway_name)"; do
            bud push --quiet --tls-verify=false "${image}" "docker://${2}/${image#"${NAME_PREFIX}"}" >/dev/null
            echo "${2}/${image#"${NAME_PREFIX}"}"
        done
        ;;
    export-torch)
        build_torch
        dir="${2:-${CACHE_DIR}/archives}"
        mkdir -p "${dir}"
        export_one "$(torch_kernel_name)" "${dir}/kernel-torch-$(version).tar"
        ;;
    registry-start)
        [[ -n "${2:-}" ]] || { log "usage: scripts/images.sh registry-start DIR [PORT]"; exit 2; }
        registry_start "$2" "${3:-5000}"
        ;;
    registry-stop)
        [[ -n "${2:-}" ]] || { log "usage: scripts/images.sh registry-stop DIR"; exit 2; }
        registry_stop "$2"
        ;;
    names)
        kernel_name
        gateway_name
        ;;
    *)
        sed -n '2,24p' "$0" >&2
        exit 2
        ;;
esac
