"""Where the command line's code lives: each `hf-gradacc` command's engine beside its command in
``hf_gradacc/commands/``, ``hf_gradacc/testing/`` fixtures and references only, and no module name used twice.

* every module of ``testing/`` is a fixture: something outside the package's tooling (the tests, examples,
  benchmarks or docs) imports it; a module only a command imports belongs beside that command;
* ``testing/`` never imports ``commands/`` (the fixtures sit below the commands that use them);
* no two modules of the package share a file name (``__init__.py`` aside), so a traceback, a grep or a docs page
  names one module.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_gradacc"
TESTING = PACKAGE / "testing"
# Where a fixture is used from, outside the package's tooling.
USERS = ("tests", "examples", "benchmarks", "docs")


def _module_names(root: Path = PACKAGE) -> Counter[str]:
    return Counter(p.name for p in root.rglob("*.py") if p.name != "__init__.py")


def _fixtures(testing: Path = TESTING) -> list[str]:
    return sorted(p.stem for p in testing.glob("*.py") if p.name != "__init__.py")


def _used_outside(names: list[str], roots: list[Path]) -> dict[str, bool]:
    """Whether some file under ``roots`` names ``hf_gradacc.testing.<name>`` (an import or a docs page's path)."""
    texts = [p.read_text(errors="replace") for root in roots for p in root.rglob("*") if p.suffix in (".py", ".md")]
    found = {}
    for name in names:
        dotted = re.compile(rf"hf_gradacc\.testing\.{name}\b|from hf_gradacc\.testing import [^\n]*\b{name}\b")
        found[name] = any(dotted.search(text) for text in texts)
    return found


def _imported_modules(path: Path) -> set[str]:
    """The hf_gradacc modules ``path`` (a module of hf_gradacc/testing) imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative to hf_gradacc.testing
                base = ["hf_gradacc", "testing"][: 2 - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("hf_gradacc")}


def test_every_testing_module_is_a_fixture_something_outside_the_tooling_uses() -> None:
    names = _fixtures()
    assert {"tiny", "reference", "one_step"} <= set(names)  # the scan sees the real fixtures
    used = _used_outside(names, [ROOT / d for d in USERS])
    only_commands = [name for name, is_used in used.items() if not is_used]
    assert not only_commands, (
        f"hf_gradacc/testing/ modules no test, example, benchmark or docs page uses: {only_commands}; a command's "
        "engine lives beside its command in hf_gradacc/commands/"
    )


def test_the_fixture_scan_finds_a_module_only_a_command_uses(tmp_path: Path) -> None:
    (tmp_path / "testing").mkdir()
    for name in ("tiny", "engine_of_a_command"):
        (tmp_path / "testing" / f"{name}.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from hf_gradacc.testing.tiny import build_tiny_model\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("`hf_gradacc.testing.engine_of_a_commandx` is another name\n")
    used = _used_outside(_fixtures(tmp_path / "testing"), [tmp_path / "tests", tmp_path / "docs"])
    assert used == {"engine_of_a_command": False, "tiny": True}


def test_testing_never_imports_the_commands() -> None:
    offenders = {
        p.name: sorted(m for m in _imported_modules(p) if m.startswith("hf_gradacc.commands"))
        for p in TESTING.glob("*.py")
    }
    offenders = {name: modules for name, modules in offenders.items() if modules}
    assert not offenders, f"hf_gradacc/testing/ imports the command line: {offenders}"


def test_no_two_modules_share_a_file_name() -> None:
    names = _module_names()
    assert names["hf_gradacc_cli.py"] == 1 and sum(names.values()) > 50  # the count sees the whole package
    shared = {name for name, count in names.items() if count > 1}
    assert not shared, f"module file names used twice: {sorted(shared)}"
