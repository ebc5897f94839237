#!/usr/bin/env bash
# The server-level tests (-m server) against the releases pyproject.toml claims to run on.
#
#   .ci/pins.sh lowest [pytest args]   every runtime dependency at its floor (.ci/pins.py), the rest newest
#   .ci/pins.sh newest [pytest args]   the newest releases of everything (pip --upgrade, eager)
#
# Each mode has its own virtual environment (.venv-pins-lowest, .venv-pins-newest; PINS_PYTHON picks
# the interpreter, default python3), kept between runs. The package is installed editable with the
# test extra (which pulls the gateway and kubernetes extras), so the tests run against this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
case "$mode" in
    lowest | newest) shift ;;
    *) echo "usage: .ci/pins.sh lowest|newest [pytest args]" >&2; exit 2 ;;
esac

export PIP_DISABLE_PIP_VERSION_CHECK=1
venv=".venv-pins-$mode"
"${PINS_PYTHON:-python3}" -m venv "$venv"
constraints="$venv/constraints.txt"
python3 .ci/pins.py "$mode" > "$constraints"
echo "== $mode pins: $(tr '\n' ' ' < "$constraints")"
if [ "$mode" = newest ]; then
    "$venv/bin/pip" install --quiet --upgrade --upgrade-strategy eager -e ".[test]"
else
    "$venv/bin/pip" install --quiet -c "$constraints" -e ".[test]"
fi
"$venv/bin/pip" list --format=freeze > "$venv/installed.txt"
grep -iE '^(jupyter[-_]server|jupyter[-_]client|ipykernel|tornado|traitlets|kubernetes|jupyterhub)==' \
    "$venv/installed.txt" | tr '\n' ' '
echo
# The tests run `jupyter`, `jupyter-elastic`, ... from PATH: this venv's.
export PATH="$PWD/$venv/bin:$PATH" VIRTUAL_ENV="$PWD/$venv"
# torch is not a pinned dependency (.ci/run installs it for the main run only): the checkpoint
# tests that need it skip here rather than fail.
unset ELASTIC_REQUIRE_LIBRARIES
# The pure checks that depend on the versions (private names, tornado's HTTPError), then the server tests.
"$venv/bin/python" -m pytest -n 0 -q -p no:cacheprovider tests/test_compat.py tests/test_server_errors.py
"$venv/bin/python" -m pytest -n 0 -m server -p no:cacheprovider "$@"
