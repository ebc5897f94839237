#!/usr/bin/env bash
# The JupyterLab extension's toolchain (labextension/), with node_modules cached under ~/.cache.
#
#   bash scripts/labextension.sh deps    # npm ci into ~/.cache/jupyter-elastic-kernels/labext-<lock hash>,
#                                        # hard-linked into labextension/node_modules
#   bash scripts/labextension.sh build   # TypeScript + webpack -> kernelmgr/labextension (committed)
#   bash scripts/labextension.sh check   # rebuild in place; fail if the committed build differs (it is put back)
#   bash scripts/labextension.sh test    # the front-end unit tests (vitest)
#   bash scripts/labextension.sh develop # link the active environment's installed copy to kernelmgr/labextension
#                                        # (pip install -e copies shared-data once; after this, a build shows
#                                        # on the next page load)
#
# The build uses the Python jupyterlab package's staging folder as its core (pip install -e ".[lab]"),
# so the shared modules it asks for are the ones JupyterLab provides: a new JupyterLab release (a newer
# core in the environment) changes the build, and check then asks for a rebuild.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script with its own message
cd "$(dirname "$0")/../labextension"

deps() {
    local hash dir
    hash=$(sha256sum package-lock.json | cut -c1-16)
    dir="$HOME/.cache/jupyter-elastic-kernels/labext-$hash"
    if [ ! -f "$dir/.complete" ]; then
        rm -rf "$dir" && mkdir -p "$dir"
        cp package.json package-lock.json "$dir/"
        (cd "$dir" && npm ci --silent --no-audit --no-fund)
        touch "$dir/.complete"
        # An older lock's modules (420 MB each) are not used again once the lock has moved on.
        find "$(dirname "$dir")" -maxdepth 1 -name 'labext-*' ! -path "$dir" -exec rm -rf {} +
    fi
    # A real folder inside the checkout (hard links: no copy of the data where the cache shares the
    # file system), not a link to the cache: webpack names modules by their path relative to the
    # checkout, and a path into ~/.cache would differ between checkouts, and so would the build.
    if [ -L node_modules ] || [ "$(cat node_modules/.elastic-lock 2> /dev/null)" != "$hash" ]; then
        rm -rf node_modules
        cp -al "$dir/node_modules" node_modules 2> /dev/null || cp -a "$dir/node_modules" node_modules
        echo "$hash" > node_modules/.elastic-lock
    fi
}

core_path() {
    python3 -c "import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), 'staging'))"
}

# Build the extension in folder $1 (a labextension/ copy); the builder writes where package.json's
# jupyterlab.outputDir says: ../kernelmgr/labextension beside that folder.
build_in() {
    (
        cd "$1"
        rm -rf lib ../kernelmgr/labextension
        node_modules/.bin/tsc
        node node_modules/@jupyterlab/builder/lib/build-labextension.js --core-path "$(core_path)" . > /dev/null
    )
}

case "${1:-}" in
    deps) deps ;;
    build)
        deps
        build_in .
        ;;
    check)
        # Rebuilt in place and compared with the
        # committed build, which is put back whatever the result.
        deps
        tmp=$(mktemp -d)
        cp -r ../kernelmgr/labextension "$tmp/committed"
        trap 'rm -rf ../kernelmgr/labextension && cp -r "$tmp/committed" ../kernelmgr/labextension && rm -rf "$tmp"' EXIT
        build_in .
        if ! diff -r "$tmp/committed" ../kernelmgr/labextension; then
            echo "kernelmgr/labextension does not match labextension/: run 'bash scripts/labextension.sh build' and commit" >&2
            exit 1
        fi
        ;;
    develop)
        target="$(python3 -c 'import sys; print(sys.prefix)')/share/jupyter/labextensions/jupyter-elastic-kernels"
        rm -rf "$target"
        mkdir -p "$(dirname "$target")"
        ln -s "$(cd ../kernelmgr/labextension && pwd)" "$target"
        echo "$target -> kernelmgr/labextension"
        ;;
    test)
        deps
        node_modules/.bin/vitest run
        ;;
    *)
        echo "usage: $0 {deps|build|check|test|develop}" >&2
        exit 2
        ;;
esac
