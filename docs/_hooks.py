"""MkDocs hooks of the docs site (mkdocs.yml: ``hooks``). The Markdown stays readable on GitHub as it is; the site
gets two things GitHub does without:

* ``index.md`` is the README (its ``docs/x.md`` links made site-relative) and ``changelog.md`` is CHANGELOG.md,
  both generated, so neither page is a copy that can drift;
* a link from a page to a repository file outside ``docs/`` (``[dpo.py](../examples/dpo.py)``), which works on
  GitHub but is outside the site, becomes its path as code (``dpo.py (`examples/dpo.py`)``) when the file exists;
  a link to a missing file is left alone, so ``mkdocs build --strict`` fails on it like on any broken link.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")


def on_files(files: Files, config) -> Files:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = re.sub(r"\]\(docs/", "](", readme)
    files.append(File.generated(config, "index.md", content=readme))
    files.append(File.generated(config, "changelog.md", content=(ROOT / "CHANGELOG.md").read_text(encoding="utf-8")))
    return files


def _outside_docs(page_uri: str, target: str) -> str | None:
    """The repository path of a relative link target outside docs/, or None."""
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    if page_uri in ("index.md", "changelog.md"):  # generated from the repository root
        resolved = posixpath.normpath(path)
    else:
        resolved = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), path))
    if resolved.startswith("docs/") or resolved.startswith(".."):
        return None
    return resolved


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        resolved = _outside_docs(page.file.src_uri, target)
        if resolved is None or not (ROOT / resolved).exists():
            return match.group(0)
        shown = resolved.rstrip("/") + ("/" if (ROOT / resolved).is_dir() else "")
        if text.strip("`") in (shown, shown.rstrip("/"), Path(shown.rstrip("/")).name):
            return f"`{shown}`"
        return f"{text} (`{shown}`)"

    # Leave fenced code alone: split on ``` fences and only rewrite the prose between them.
    parts = re.split(r"(^```.*?^```)", markdown, flags=re.M | re.S)
    return "".join(part if part.startswith("```") else _LINK.sub(replace, part) for part in parts)
