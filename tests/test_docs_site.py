"""The docs site's generated reference pages and its table of contents (pure: no Sphinx build).

CI builds the site with ``sphinx-build -W`` (.ci/run); these catch what that would not: a new
configurable class missing from the settings reference, a path of the OpenAPI file missing from
the REST page, a page left out of every table of contents, a README grown back into a manual.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import reference_pages  # noqa: E402

pytestmark = pytest.mark.pure


def classes_with_settings() -> set[str]:
    """Every class in the product whose body declares a trait with ``.tag(config=True)``."""
    found = set()
    for path in [*ROOT.joinpath("kernelmgr").rglob("*.py"), *ROOT.joinpath("gateway").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "config=True" in ast.unparse(node).replace(" ", ""):
                found.add(node.name)
    return found


def test_the_reference_lists_exactly_the_classes_with_settings() -> None:
    listed = {name for _, name, _ in reference_pages.CONFIGURABLES}
    assert classes_with_settings() == listed


def test_the_settings_reference_has_every_setting_with_its_help() -> None:
    text = reference_pages.settings_markdown()
    from kernelmgr.config import CullPolicy, ElasticKernels

    for cls in (ElasticKernels, CullPolicy):
        for name, trait in cls.class_own_traits(config=True).items():
            row = next(line for line in text.splitlines() if line.startswith(f"| `{cls.__name__}.{name}` |"))
            assert trait.help.split()[0] in row


def test_the_rest_reference_has_every_operation() -> None:
    spec = yaml.safe_load((ROOT / "docs" / "openapi.yaml").read_text())
    text = reference_pages.rest_markdown()
    for path, item in spec["paths"].items():
        for method in set(item) & reference_pages.HTTP_METHODS:
            assert f"## `{method.upper()} {path}`" in text


def test_every_page_is_in_the_table_of_contents() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(re.findall(r"^([\w/-]+)$", index, flags=re.MULTILINE))
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index", "pypi"}  # pypi: PyPI's description
    assert pages - listed == set()
    assert {"reference/settings", "reference/rest"} <= listed


def test_the_readme_is_an_introduction_not_a_manual() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
