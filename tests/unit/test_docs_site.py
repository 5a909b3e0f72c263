"""The docs site as a reader gets it: `mkdocs build --strict` passes, and what the Markdown asks for reaches the
HTML in the form the theme draws (a mermaid diagram, not its source as a highlighted code block).

`mkdocs build --strict` alone passes with an unconfigured ```mermaid fence: the diagram's source is then a
highlighted `language-mermaid` code block, drawn as raw text.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.slow  # about 10 s on a busy 2-core machine


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _page(site: Path, md: Path) -> str:
    rel = md.relative_to(DOCS).with_suffix("")
    return (site / rel / "index.html").read_text(encoding="utf-8")


def _mermaid_pages() -> dict[Path, int]:
    pages = {}
    for md in sorted(DOCS.rglob("*.md")):
        count = len(re.findall(r"^```mermaid\s*$", md.read_text(encoding="utf-8"), flags=re.M))
        if count:
            pages[md] = count
    return pages


def test_the_docs_have_mermaid_diagrams():
    assert _mermaid_pages().get(DOCS / "architecture.md", 0) >= 2


_DIAGRAM = re.compile(r"^(flowchart|graph|sequenceDiagram|classDiagram|stateDiagram|erDiagram|gantt|pie)\b")


def test_no_raw_mermaid_reaches_the_html(site):
    """Unconfigured, a ```mermaid block is a plain highlighted code block (`language-mermaid`, or no class at all
    where Pygments has no mermaid lexer) whose text is the diagram's source."""
    for html in site.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        assert "language-mermaid" not in text, f"{html}: a ```mermaid block became a highlighted code block"
        assert "```mermaid" not in text, f"{html}: a raw ```mermaid fence reached the page"
        code = re.sub(r'<pre class="mermaid">.*?</pre>', "", text, flags=re.S)
        for block in re.findall(r"<code[^>]*>(?:<span></span>)?(.*?)</code>", code, flags=re.S):
            source = re.sub(r"<[^>]+>", "", block).lstrip()
            assert not _DIAGRAM.match(source), f"{html}: a mermaid diagram shown as code: {source[:80]!r}"


def test_every_mermaid_block_becomes_a_diagram(site):
    """Each ```mermaid block is a <pre class="mermaid"> (what Material's mermaid.js draws), its source intact."""
    for md, count in _mermaid_pages().items():
        html = _page(site, md)
        blocks = re.findall(r'<pre class="mermaid"><code>(.*?)</code></pre>', html, flags=re.S)
        assert len(blocks) == count, f"{md.name}: {count} mermaid blocks, {len(blocks)} diagrams in the HTML"
        assert all(b.lstrip().startswith(("flowchart", "graph", "sequenceDiagram")) for b in blocks), blocks


def test_no_raw_markdown_table_or_link_reaches_the_html(site):
    """A table without its blank line above, or a link the Markdown did not parse, shows as raw text."""
    for html in site.rglob("*.html"):
        if "/reference/" in html.as_posix() or html.parent == site or html.parent.name == "changelog":
            continue  # API pages (docstrings), the search page, the generated changelog
        text = re.sub(r"<(pre|code)\b.*?</\1>", "", html.read_text(encoding="utf-8"), flags=re.S)
        table = re.search(r"(?m)^(<p>)?\|[^\n<]*\|\s*$", text)
        assert table is None, f"{html}: a Markdown table drawn as text: {table.group(0)!r}"
        link = re.search(r"\]\([^)\s]+\)", text)
        assert link is None, f"{html}: an unparsed Markdown link: {link.group(0)!r}"
