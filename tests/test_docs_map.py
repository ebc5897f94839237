"""The docs point at real code: every "`path:line` `Symbol`" of docs/architecture.md, every link
into a docs page's heading.

The architecture map walks a start, a hibernation, a resume and a loss through the code by line
number. Line numbers drift with every change, so this test says, for each stale reference, where
the symbol is now: after a merge the fix is one glance at the failure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: "`lifecycle/service.py:134` `Hibernator.hibernate`": a path (relative to kernelmgr/, or to the
#: repository for gateway/ and tests/), a line, then the symbol found there.
REFERENCE = re.compile(r"`([\w/.-]+\.py):(\d+)`\s*`([\w.]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def source_file(path: str, root: Path = ROOT) -> Path:
    inside = root / "kernelmgr" / path
    return inside if inside.exists() else root / path


def definitions(lines: list[str], symbol: str) -> list[int]:
    """1-based lines where ``symbol`` (``Class.method`` or ``name``) is defined; for a dotted name
    the definition after its class's."""
    *owners, name = symbol.split(".")
    defined = re.compile(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]")
    start = 0
    if owners:
        owner = re.compile(rf"^\s*class\s+{re.escape(owners[-1])}\b")
        start = next((i for i, line in enumerate(lines) if owner.match(line)), 0)
    return [i + 1 for i, line in enumerate(lines) if i >= start and defined.match(line)]


def stale_references(doc: Path, root: Path = ROOT) -> list[str]:
    """One line per reference of ``doc`` whose file is missing or whose line (±1) does not name
    its symbol, saying where the symbol is now."""
    stale = []
    for number, text in enumerate(doc.read_text().splitlines(), start=1):
        for path, line, symbol in REFERENCE.findall(text):
            where = f"{doc.name}:{number}: `{path}:{line}` `{symbol}`"
            file = source_file(path, root)
            if not file.is_file():
                stale.append(f"{where}: no file {path}")
                continue
            lines = file.read_text().splitlines()
            name = symbol.split(".")[-1]
            at = int(line)
            window = lines[max(at - 2, 0) : at + 1]
            if any(re.search(rf"\b{re.escape(name)}\b", candidate) for candidate in window):
                continue
            found = definitions(lines, symbol)
            now = ", ".join(f"`{path}:{n}`" for n in found) if found else "not defined in that file"
            stale.append(f"{where}: now {now}")
    return stale


def references(doc: Path) -> list[tuple[str, str, str]]:
    return REFERENCE.findall(doc.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(pages: list[Path]) -> list[str]:
    """Each link from ``pages`` to a missing .md file, or to an anchor that is no heading of a docs page."""
    broken = []
    for page in pages:
        for number, text in enumerate(page.read_text().splitlines(), start=1):
            for target in LINK.findall(text):
                if "://" in target or target.startswith("mailto:"):
                    continue
                file, _, anchor = target.partition("#")
                if file and not file.endswith(".md"):
                    continue
                goal = (page.parent / file).resolve() if file else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not goal.is_file():
                    broken.append(f"{where}: no such file")
                elif anchor and goal.parent == ROOT / "docs" and anchor not in anchors(goal):
                    broken.append(f"{where}: no heading with that anchor in {goal.name}")
    return broken


def test_the_architecture_map_points_at_the_code() -> None:
    assert len(references(ARCHITECTURE)) >= 30, "the map walks its paths by `path:line` `Symbol`"
    stale = stale_references(ARCHITECTURE)
    assert not stale, "stale references in docs/architecture.md:\n" + "\n".join(stale)


def test_a_wrong_line_is_reported_with_where_the_symbol_is_now(tmp_path: Path) -> None:
    (tmp_path / "kernelmgr" / "lifecycle").mkdir(parents=True)
    (tmp_path / "kernelmgr" / "lifecycle" / "service.py").write_text(
        "class Other:\n    def hibernate(self):\n        pass\n\n\nclass Hibernator:\n"
        "    async def hibernate(self):\n        pass\n"
    )
    doc = tmp_path / "map.md"
    doc.write_text(
        "1. `lifecycle/service.py:7` `Hibernator.hibernate`\n"
        "2. `lifecycle/service.py:4` `Hibernator.hibernate`\n"
        "3. `lifecycle/gone.py:1` `gone`\n"
    )
    assert stale_references(doc, tmp_path) == [
        "map.md:2: `lifecycle/service.py:4` `Hibernator.hibernate`: now `lifecycle/service.py:7`",
        "map.md:3: `lifecycle/gone.py:1` `gone`: no file lifecycle/gone.py",
    ]


def test_links_into_the_docs_reach_a_heading() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert broken_links(pages) == []


def test_anchors_are_githubs() -> None:
    assert slug("Kubernetes: RBAC, namespaces, pod security") == "kubernetes-rbac-namespaces-pod-security"
    assert slug("The cluster's GPU inventory") == "the-clusters-gpu-inventory"
    assert slug("Kernels as pods: hibernate, resume, loss, restart") == (
        "kernels-as-pods-hibernate-resume-loss-restart"
    )
    assert slug("Warm kernels — `kernelmgr/warm/`") == "warm-kernels--kernelmgrwarm"
