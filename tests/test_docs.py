"""README is the front page and docs/ holds one page per topic: every link and every `docs/<page>.md "Section"`
pointer in code, Makefile, compose.yaml and .env.example lands on a file and heading that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md")),
         *(ROOT / d / "README.md" for d in ("envs", "bench", "prompts"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
POINTER = re.compile(r"(README|docs/[\w-]+\.md) \\?[\"']([^\"'\\\n]+)\\?[\"']")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#+ (.+)", line)):
            found.append(m.group(1).strip())
    return found


def test_every_link_between_the_pages_lands_on_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL, not ours to check offline
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_section_pointers_in_code_and_config_name_a_heading_of_that_page():
    sources = [p for d in ("tools", "trainer", "contract", "envs", "bench", "tests", "services") for p in (ROOT / d).rglob("*")
               if p.suffix in (".py", ".md", ".sh") or p.name.startswith("Dockerfile")]
    sources += [ROOT / "Makefile", ROOT / "compose.yaml", ROOT / ".env.example", *PAGES]
    stale = []
    for path in sources:
        for page, section in POINTER.findall(path.read_text()):
            target = ROOT / ("README.md" if page == "README" else page)
            if not target.exists() or not any(h.startswith(section) for h in headings(target)):
                stale.append(f"{path.relative_to(ROOT)}: {page} \"{section}\"")
    assert not stale, stale


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md is the front page: move a section to its docs/ page"
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages README does not link: {unlinked}"


def test_architecture_names_every_module_and_nothing_that_is_gone():
    """ARCHITECTURE.md names each module of tools/, trainer/, contract/ and bench/ a newcomer meets (a command by its
    name), and every file or folder path it names exists."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    modules = [Path(f) for f in tracked if f.endswith(".py") and Path(f).name != "__init__.py"
               and (f.split("/")[0] in ("tools", "trainer") or f.count("/") == 1 and f.split("/")[0] in ("contract", "bench"))]
    unnamed = [str(m) for m in modules
               if not any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text) for n in {m.stem, m.stem.replace("_", "-")})]
    assert not unnamed, f"ARCHITECTURE.md does not name: {unnamed}"
    names = {Path(f).name for f in tracked} | {d for f in tracked for d in Path(f).parent.parts}
    tops = {f.split("/")[0] for f in tracked if "/" in f}
    paths = re.findall(r"`((?:\.?[\w.-]+/)+[\w.<>*-]*)`", text) + re.findall(r"`([\w-]+\.py)`", text)
    paths = [p for p in paths if "<" not in p and "*" not in p and ("/" not in p or p.split("/")[0] in tops)]
    stale = [p for p in paths if not ((ROOT / p).exists() or Path(p.rstrip("/")).name in names
                                      or (ROOT / (p.partition(".")[0] + ".py")).exists())]  # `tools/x.function`
    assert not stale, f"ARCHITECTURE.md names what is not in the repository: {stale}"
