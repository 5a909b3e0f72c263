"""`import hf_gradacc` never imports a framework integration: only the framework imports its module
(hf_gradacc/integrations/), so the package works without axolotl installed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_gradacc"
FRAMEWORKS = ("axolotl", "llamafactory", "unsloth")


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level and node.module:
            names.add(f".{node.module}")
    return names


def test_only_integrations_import_the_frameworks() -> None:
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if "integrations" in path.relative_to(PACKAGE).parts:
            continue
        bad = sorted(n for n in _imported(path) if n.split(".")[0] in FRAMEWORKS or "integrations" in n)
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = bad
    assert not offenders, offenders


def test_the_integrations_package_imports_no_framework() -> None:
    assert not _imported(PACKAGE / "integrations" / "__init__.py")


def test_the_axolotl_plugins_pure_parts_import_no_framework() -> None:
    """The plugin's configuration checks, collator wrapper and class swap (integrations/axolotl_core.py) are tested
    where axolotl is not installed (tests/integrations/test_axolotl.py): only integrations/axolotl.py imports it."""
    imported = _imported(PACKAGE / "integrations" / "axolotl_core.py")
    assert not sorted(n for n in imported if n.split(".")[0] in FRAMEWORKS), imported
    assert "axolotl" in {n.split(".")[0] for n in _imported(PACKAGE / "integrations" / "axolotl.py")}
