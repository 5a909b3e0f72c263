"""The package layout is the architecture: the core never reaches into the tooling (commands/, testing/), only
backends/ names DDP / DeepSpeed / FSDP2, and the imports of the whole package (commands/ and testing/ included)
form no cycle, neither at import time nor counting the imports inside functions that run at command time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_gradacc"
TOOLING = ("commands", "testing")


def _module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module, *, at_import_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: at import time (outside function bodies: the module, its classes, its
    module-level ``try`` / ``if``) or, with ``at_import_only=False``, also those in function bodies, which run when
    the function is called (a command's lazy imports). Imports under ``if TYPE_CHECKING:`` never run: left out."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                walk(child)
            return
        if at_import_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return found


def _imports(path: Path, *, top_level_only: bool, root: Path = PACKAGE.parent) -> set[str]:
    """Absolute names of the hf_gradacc modules ``path`` imports (``top_level_only``: those run at import time)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _import_nodes(tree, at_import_only=top_level_only):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("hf_gradacc"):
                if node.module:  # `from . import x` names submodules, not the package itself
                    found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        else:
            found.update(a.name for a in node.names if a.name.startswith("hf_gradacc"))
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _part(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _part(n) not in (*TOOLING, "__main__")))
def test_the_core_does_not_import_the_tooling(name: str) -> None:
    bad = sorted(i for i in _imports(MODULES[name], top_level_only=False) if _part(i) in TOOLING)
    assert not bad, f"{name} imports {bad}"


def test_only_backends_name_the_distributed_libraries() -> None:
    offenders = []
    for name, path in MODULES.items():
        if _part(name) in ("backends", "patches", *TOOLING):
            continue
        text = path.read_text()
        for word in ("import deepspeed", "from deepspeed", "fully_shard", "DistributedDataParallel("):
            if word in text:
                offenders.append((name, word))
    assert not offenders, offenders


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if not state.get(nxt):
                cycle = visit(nxt, [*path, nxt])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    return {
        n: {i for i in _imports(p, top_level_only=top_level_only) if i in MODULES and i != n}
        for n, p in MODULES.items()
    }


def test_the_layout_test_sees_the_whole_package() -> None:
    assert {"hf_gradacc.commands.check", "hf_gradacc.testing.tiny", "hf_gradacc.backends"} <= set(MODULES)


def test_no_import_cycle_at_module_level() -> None:
    cycle = _find_cycle(_graph(top_level_only=True))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_at_run_time() -> None:
    """Imports inside functions run when a command or a hook calls them: with them, still no cycle (a module
    reached lazily must not import its caller back). Only ``if TYPE_CHECKING:`` imports are left out."""
    cycle = _find_cycle(_graph(top_level_only=False))
    assert cycle is None, f"import cycle (counting the imports inside functions): {' -> '.join(cycle)}"


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "hf_gradacc").mkdir()
    first = tmp_path / "hf_gradacc" / "first.py"
    first.write_text("def run():\n    from . import second\n")
    second = tmp_path / "hf_gradacc" / "second.py"
    second.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import third\ntry:\n    import hf_gradacc.first\nexcept ImportError:\n    pass\n"
    )
    assert _imports(first, top_level_only=True, root=tmp_path) == set()
    assert _imports(first, top_level_only=False, root=tmp_path) == {"hf_gradacc.second"}
    assert _imports(second, top_level_only=True, root=tmp_path) == {"hf_gradacc.first"}
    graph = {"hf_gradacc.first": {"hf_gradacc.second"}, "hf_gradacc.second": {"hf_gradacc.first"}}
    assert _find_cycle(graph) == ["hf_gradacc.first", "hf_gradacc.second", "hf_gradacc.first"]


def test_the_trl_trainers_import_only_what_they_share() -> None:
    """hf_gradacc.trl is one module per trainer plus ``_common``: a trainer module never imports another trainer's
    module, and no submodule imports the package itself (its ``__init__`` imports them, after the TRL check, so an
    import back would read a package still being initialised; the cycle check above skips package -> submodule
    edges and would not see it)."""
    trl_modules = {n for n in MODULES if n.startswith("hf_gradacc.trl.")}
    assert {"hf_gradacc.trl._common", "hf_gradacc.trl.sft", "hf_gradacc.trl.grpo"} <= trl_modules
    trainers = trl_modules - {"hf_gradacc.trl._common"}
    for name in trl_modules:
        imported = {i for i in _imports(MODULES[name], top_level_only=False) if i in MODULES}
        assert "hf_gradacc.trl" not in imported, f"{name} imports its own package hf_gradacc.trl"
        assert not (imported & (trainers - {name})), f"{name} imports {sorted(imported & (trainers - {name}))}"
