#!/usr/bin/env bash
# The kernel and gateway images (and the JupyterHub images of the test cluster), built from this
# checkout with buildah (no daemon, no registry needed).
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
#   scripts/images.sh export-hub [DIR]   build the three images of a z2jh-style JupyterHub (the Hub with
#                                        KubeSpawner, configurable-http-proxy, the single-user server with
#                                        this package's gateway-aware managers), then write OCI archives
#                                        DIR/{hub,proxy,singleuser}-VERSION.tar; prints the three paths on
#                                        one line, in that order
#   scripts/images.sh push-hub REGISTRY  build those three, then push them to REGISTRY (plain HTTP)
#   scripts/images.sh names-hub          print those three image names with their tags
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
# The proxy's base adds Debian's Node.js (18 in bookworm) for configurable-http-proxy.
PROXY_PACKAGES="${BASE_PACKAGES},nodejs"
# The JupyterHub images' versions, pinned here and only here (the Containerfiles take them as build
# arguments). The Hub and the single-user servers run the same JupyterHub: jupyterhub-singleuser
# speaks the Hub's API and OAuth. pycurl because z2jh's jupyterhub_config.py switches tornado to its
# curl client (the Hub's many proxy API calls), jupyterhub-idle-culler for its `cull` service.
# JupyterLab as in the environment that built the committed labextension (scripts/labextension.sh).
# configurable-http-proxy stays on 4.x: 5.x needs Node.js 20, and bookworm has 18.
JUPYTERHUB_VERSION="6.1.1"
HUB_PACKAGES="jupyterhub==${JUPYTERHUB_VERSION} jupyterhub-kubespawner==7.1.0 jupyterhub-idle-culler==2.0.0 pycurl==7.49.0"
SINGLEUSER_PACKAGES="jupyterhub==${JUPYTERHUB_VERSION} jupyterlab==4.6.6"
CHP_VERSION="4.6.3"
PYTHON="${ELASTIC_IMAGES_PYTHON:-python3}"  # runs pip on this machine
NAME_PREFIX="${ELASTIC_IMAGES_PREFIX:-localhost/}"

log() { echo "images: $*" >&2; }

version() {
    awk -F'"' '/^version = / { print $2; exit }' "${REPO_ROOT}/pyproject.toml"
}

kernel_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-kernel:$(version)"; }
torch_kernel_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-kernel-torch:$(version)"; }
gateway_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels:$(version)"; }
hub_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-hub:$(version)"; }
proxy_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-proxy:$(version)"; }
singleuser_name() { echo "${NAME_PREFIX}jupyter-elastic-kernels-singleuser:$(version)"; }

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

# This checkout's wheel, alone in the cache's wheels/project (hatchling's wheels are reproducible: the
# same checkout gives the same bytes).
project_wheel() {
    local project_dir="${CACHE_DIR}/wheels/project"
    rm -rf "${project_dir}"
    mkdir -p "${project_dir}"
    "${PYTHON}" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "${project_dir}" "${REPO_ROOT}" >&2
}

# DIR: the binary wheels of REQUIREMENTS... for the base's Python VERSION (a build without network
# cannot compile), without this package's own; downloaded once (.complete marks a finished download).
download_wheels() {
    local deps_dir="$1" python_version="$2"
    shift 2
    [[ -f "${deps_dir}/.complete" ]] && return 0
    log "downloading the dependencies' wheels for Python ${python_version} into ${deps_dir}"
    rm -rf "${deps_dir}"
    mkdir -p "${deps_dir}"
    local abi="cp$(echo "${python_version}" | cut -d. -f1,2 | tr -d .)"
    "${PYTHON}" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --python-version "${python_version}" --implementation cp --abi "${abi}" --abi abi3 --abi none \
        $(platform_flags) -d "${deps_dir}" "$@" >&2
    rm -f "${deps_dir}"/jupyter_elastic_kernels-*.whl
    touch "${deps_dir}/.complete"
}

# CONTEXT/wheels made to hold exactly the wheels of DEPS_DIR and this checkout's: a file is copied only
# when its content changed, its time kept, so buildah reuses the layers made from the others.
sync_wheels() {
    local context="$1" deps_dir="$2" project_dir="${CACHE_DIR}/wheels/project"
    mkdir -p "${context}/wheels"
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

# The context of the kernel and gateway builds: the wheels (this checkout's, plus its dependencies'),
# the dependencies resolved for the base's own Python and cached, keyed by the dependency list and that
# version.
stage_context() {
    local context="$1" python_version="$2"
    local deps_key deps_dir
    deps_key="$({
        sed -n '/^dependencies = \[/,/^\]/p' "${REPO_ROOT}/pyproject.toml"
        sed -n '/^kubernetes = \[/p; /^gateway = \[/p' "${REPO_ROOT}/pyproject.toml"  # the gateway image's extras
        echo "${python_version} $(uname -m)"
    } | sha256sum | cut -c1-16)"
    deps_dir="${CACHE_DIR}/wheels/deps-${deps_key}"
    project_wheel
    download_wheels "${deps_dir}" "${python_version}" \
        "jupyter-elastic-kernels[gateway,kubernetes] @ file://$(ls "${CACHE_DIR}/wheels/project"/*.whl)"
    sync_wheels "${context}" "${deps_dir}"
}

# The context of the hub and single-user builds: one set of wheels resolved for both at once (the
# pinned JupyterHub packages, JupyterLab, this package with every extra either image installs), so
# the two agree on every shared dependency. Its own folder: the kernel and gateway images' wheels and
# layers stay as they are.
stage_hub_context() {
    local context="$1" python_version="$2"
    local deps_key deps_dir
    deps_key="$({
        sed -n '/^dependencies = \[/,/^\]/p' "${REPO_ROOT}/pyproject.toml"
        sed -n '/^kubernetes = \[/p; /^gateway = \[/p; /^lab = \[/p' "${REPO_ROOT}/pyproject.toml"
        echo "${HUB_PACKAGES} ${SINGLEUSER_PACKAGES}"
        echo "${python_version} $(uname -m)"
    } | sha256sum | cut -c1-16)"
    deps_dir="${CACHE_DIR}/wheels/hub-deps-${deps_key}"
    project_wheel
    # (word splitting of the two lists is wanted: one requirement a word)
    # shellcheck disable=SC2086
    download_wheels "${deps_dir}" "${python_version}" ${HUB_PACKAGES} ${SINGLEUSER_PACKAGES} \
        "jupyter-elastic-kernels[gateway,kubernetes,lab] @ file://$(ls "${CACHE_DIR}/wheels/project"/*.whl)"
    sync_wheels "${context}" "${deps_dir}"
}

# The proxy's context: configurable-http-proxy from npm (pure JavaScript: installed here, run by the
# base's Node.js), in CONTEXT/chp; installed again only when CHP_VERSION changes, so its files keep
# their times and buildah reuses its layer.
stage_proxy_context() {
    local context="$1" staging
    if [[ "$(cat "${context}/chp.version" 2>/dev/null)" == "${CHP_VERSION}" && -d "${context}/chp" ]]; then
        return 0
    fi
    need npm
    log "installing configurable-http-proxy ${CHP_VERSION} from npm into ${context}/chp"
    rm -rf "${context}/chp" "${context}/chp.version" "${context}/partial-chp"
    staging="${context}/partial-chp"
    mkdir -p "${staging}"
    # --ignore-scripts: no install script runs on this machine (it has none to run).
    npm install --silent --no-audit --no-fund --omit=dev --ignore-scripts --prefix "${staging}" \
        "configurable-http-proxy@${CHP_VERSION}" >&2
    mv "${staging}" "${context}/chp"
    echo "${CHP_VERSION}" >"${context}/chp.version"
}

# What a context holds, for a build's key: its wheels, and the proxy's node_modules.
context_digest() {
    if [[ -d "$1/wheels" ]]; then (cd "$1" && sha256sum wheels/*.whl); fi
    if [[ -d "$1/chp" ]]; then (cd "$1" && find chp -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum); fi
}

# WHICH (images/WHICH/Containerfile) as NAME from BASE; STAMP names its key file (default: WHICH),
# CONTEXT the build's context (default: the kernel and gateway images'); further arguments go to the
# build as they are (--build-arg NAME=VALUE).
build_one() {
    local which="$1" name="$2" base="$3" started=$SECONDS key stamp context
    stamp="${CACHE_DIR}/built-${4:-${which}}.key"
    context="${5:-${CACHE_DIR}/context}"
    local extra=("${@:6}")
    # What is in the image: its recipe, the context, the base, the build arguments. Unchanged and still
    # there: nothing to do (buildah would reuse every layer too, but hashing the venv for its cache
    # takes a while).
    key="$({
        cat "${REPO_ROOT}/images/${which}/Containerfile"
        context_digest "${context}"
        bud inspect --type image --format '{{.FromImageID}}' "${base}"
        if ((${#extra[@]})); then printf '%s\n' "${extra[@]}"; fi
    } | sha256sum | cut -c1-32)"
    if [[ "$(cat "${stamp}" 2>/dev/null)" == "${key}" ]] && bud inspect --type image "${name}" >/dev/null 2>&1; then
        log "${name} is up to date"
        return 0
    fi
    bud bud --quiet --layers --pull-never --network none \
        --build-arg "BASE_IMAGE=${base}" --build-arg "VERSION=$(version)" \
        --build-arg "PIP_OPTIONS=--no-index --find-links /tmp/wheels" "${extra[@]}" \
        -t "${name}" -f "${REPO_ROOT}/images/${which}/Containerfile" "${context}" >/dev/null
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

# The three images of a z2jh-style JupyterHub. The hub and the single-user image are built on the
# kernel and gateway images' base (its layer is shared, on a node too), never on ELASTIC_IMAGES_BASE
# (a CUDA base is no use to them); the proxy on a base with Node.js.
build_hub() {
    need buildah
    mkdir -p "${CACHE_DIR}"
    exec 8>"${CACHE_DIR}/.build.lock"
    flock 8
    local started=$SECONDS base proxy_base python_version
    base="$(ensure_base "${BASE_PACKAGES}")"
    python_version="$(image_python "${base}")"
    stage_hub_context "${CACHE_DIR}/hub-context" "${python_version}"
    build_one hub "$(hub_name)" "${base}" hub "${CACHE_DIR}/hub-context" \
        --build-arg "PACKAGES=${HUB_PACKAGES}"
    build_one singleuser "$(singleuser_name)" "${base}" singleuser "${CACHE_DIR}/hub-context" \
        --build-arg "PACKAGES=${SINGLEUSER_PACKAGES}"
    proxy_base="$(ensure_base "${PROXY_PACKAGES}")"
    stage_proxy_context "${CACHE_DIR}/proxy-context"
    build_one proxy "$(proxy_name)" "${proxy_base}" proxy "${CACHE_DIR}/proxy-context"
    prune_storage
    log "the JupyterHub images ready in $((SECONDS - started)) s: $(hub_name) $(proxy_name) $(singleuser_name)"
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
    export-hub)
        build_hub
        dir="${2:-${CACHE_DIR}/archives}"
        mkdir -p "${dir}"
        hub="$(export_one "$(hub_name)" "${dir}/hub-$(version).tar")"
        proxy="$(export_one "$(proxy_name)" "${dir}/proxy-$(version).tar")"
        singleuser="$(export_one "$(singleuser_name)" "${dir}/singleuser-$(version).tar")"
        echo "${hub} ${proxy} ${singleuser}"
        ;;
    push-hub)
        [[ -n "${2:-}" ]] || { log "usage: scripts/images.sh push-hub REGISTRY"; exit 2; }
        build_hub
        for image in "$(hub_name)" "$(proxy_name)" "$(singleuser_name)"; do
            bud push --quiet --tls-verify=false "${image}" "docker://${2}/${image#"${NAME_PREFIX}"}" >/dev/null
            echo "${2}/${image#"${NAME_PREFIX}"}"
        done
        ;;
    names-hub)
        hub_name
        proxy_name
        singleuser_name
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
        sed -n '2,32p' "$0" >&2
        exit 2
        ;;
esac
