"""One project URL everywhere a user or a tool reads it: the package metadata (PyPI's links), the
chart's ``home``/``sources`` (Artifact Hub), the docs site's GitHub link, and every link written
in the docs, examples and images. A placeholder or a second spelling is a dead link for a stranger."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    from pip._vendor import tomli as tomllib

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
CANONICAL = "https://github.com/jupyter-elastic-kernels/jupyter-elastic-kernels"
#: Where links to the project are written (the repository's own text, not its dependencies').
SCANNED = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "pyproject.toml")
SCANNED += ("docs", "examples", "helm", "images")
#: Any GitHub URL of a repository named like the project, whatever its owner.
PROJECT_LINK = re.compile(r"https?://github\.com/([^/\s)\"']+)/jupyter-elastic-kernels(?=[/#@\s)\"'.>]|$)")


def test_the_package_metadata_names_the_project_url() -> None:
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Source"] == CANONICAL and urls["Homepage"] == CANONICAL
    assert all(url.startswith(CANONICAL) for url in urls.values()), urls


def test_the_chart_and_the_docs_site_name_the_same_url() -> None:
    chart = yaml.safe_load((ROOT / "helm" / "jupyter-elastic-kernels" / "Chart.yaml").read_text())
    assert chart["home"] == CANONICAL and chart["sources"] == [CANONICAL]
    conf = ast.parse((ROOT / "docs" / "conf.py").read_text())
    assigned = {
        target.id: node.value
        for node in conf.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert ast.literal_eval(assigned["REPOSITORY"]) == CANONICAL
    options = assigned["html_theme_options"]
    assert isinstance(options, ast.Dict)
    keys = [ast.literal_eval(k) if k is not None else None for k in options.keys]
    github = dict(zip(keys, options.values, strict=True))["github_url"]
    assert isinstance(github, ast.Name) and github.id == "REPOSITORY"


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in candidates if "node_modules" not in p.parts and "_build" not in p.parts]
    return files


def test_every_link_to_the_project_uses_that_url() -> None:
    wrong: list[str] = []
    found = 0
    for path in scanned_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # images, archives
        for match in PROJECT_LINK.finditer(text):
            found += 1
            if match.group(1) != "jupyter-elastic-kernels":
                wrong.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not wrong, "links to the project under another owner (use " + CANONICAL + "):\n" + "\n".join(wrong)
    assert found > 5  # the scan does reach the docs that hold them


def containerfile_labels(path: Path) -> dict[str, str]:
    """The ``LABEL key="value"`` pairs of a Containerfile (its continued lines joined)."""
    text = path.read_text().replace("\\\n", " ")
    labels: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("LABEL "):
            labels.update(re.findall(r'([\w.\-]+)="([^"]*)"', line))
    return labels


@pytest.mark.parametrize("image", ["kernel", "gateway"])
def test_the_images_name_the_project_url(image: str) -> None:
    """A registry shows ``org.opencontainers.image.source`` as the image's repository link."""
    labels = containerfile_labels(ROOT / "images" / image / "Containerfile")
    assert labels["org.opencontainers.image.source"] == CANONICAL
    assert labels["org.opencontainers.image.url"] == CANONICAL
    assert labels["org.opencontainers.image.documentation"].startswith(CANONICAL)
    assert labels["org.opencontainers.image.licenses"] == "BSD-3-Clause"


@pytest.mark.parametrize("package", ["labextension/package.json", "kernelmgr/labextension/package.json"])
def test_the_labextension_names_the_project_url(package: str) -> None:
    """The source and the built copy JupyterLab's extension manager reads (it links ``homepage``)."""
    meta = json.loads((ROOT / package).read_text())
    assert meta["homepage"] == CANONICAL
    assert meta["repository"] == {"type": "git", "url": CANONICAL + ".git"}
    assert meta["bugs"] == {"url": CANONICAL + "/issues"}
