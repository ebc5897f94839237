"""Write pip constraints that pin every runtime dependency of pyproject.toml to its floor.

``python .ci/pins.py lowest`` prints ``name==floor`` for each ``name>=floor`` in
``[project] dependencies`` (and the ``gateway`` and ``kubernetes`` extras): pip has no
lowest-version resolution, so the floors are pinned as constraints and everything else
resolves to its newest release (what uv calls ``lowest-direct``). ``newest`` prints nothing:
the newest releases are what pip picks anyway. A floor that is not a released version (``>=12.535``
when only 12.535.77 exists) makes pip fail: write the floor as a real release.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

#: The extras whose floors are part of what the package claims to run on.
RUNTIME_EXTRAS = ("gateway", "kubernetes")  # those missing are skipped

FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in RUNTIME_EXTRAS:
        requirements += project.get("optional-dependencies", {}).get(extra, [])
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"pins.py: {requirement!r} has no '>=' floor; give it one in pyproject.toml")
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        pins[name] = match.group(2)
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("lowest", "newest"):
        raise SystemExit("usage: python .ci/pins.py lowest|newest")
    if mode == "lowest":
        print("\n".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml")))


if __name__ == "__main__":
    main()
