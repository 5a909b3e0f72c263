"""The package layout is the architecture, checked on the code's own imports and names (AST), not on strings:

- the core never reaches into the tooling (commands/, testing/);
- only backends/ (and the opt-in patches/) knows the distributed libraries: it alone imports DeepSpeed, torch's FSDP
  and DTensor, names their wrapper classes, or calls torch.distributed's collectives;
- the imports of the whole package (commands/ and testing/ included) form no cycle, neither at import time, nor
  counting the imports inside functions that run at command time, nor counting type-only imports;
- one optimizer step has one owner: no module outside it (hf_gradacc/step/engine.py, step/host.py) and the Trainer
  adapter (mixin.py) reads or writes a trainer's private attribute, and no function outside them and the public edges
  that take a user's trainer (``tests/layout_metrics.py``: ``TRAINER_EDGES``) takes a trainer;
- one formatter owns the layout (``ruff format``): hand-aligned ``# fmt: skip`` lines and lines over 119 characters
  are counted and capped.

Files are sized by concern: there is no line cap. ``python tests/layout_metrics.py`` prints every measure."""

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


# What only backends/ may know: the distributed libraries' modules, their wrapper classes, torch's collectives.
DISTRIBUTED_MODULES = ("deepspeed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.nn.parallel")
DISTRIBUTED_NAMES = {"DistributedDataParallel", "DeepSpeedEngine", "FSDPModule", "FullyShardedDataParallel",
                     "DTensor", "fully_shard", "_get_ddp_logging_data", "reducer"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "reduce_scatter", "new_group", "all_to_all", "gather_object"}
BACKEND_PARTS = ("backends", "patches", *TOOLING)


def _is_torch_distributed(node: ast.expr) -> bool:
    """``dist`` / ``torch.distributed`` (how the package names torch's collectives module), not a backend object."""
    text = ast.unparse(node)
    return text in ("dist", "torch.distributed") or text.endswith(".distributed")


def _backend_knowledge(path: Path) -> list[str]:
    """What ``path`` knows of the distributed libraries: imports, wrapper-class names (code or strings), collectives."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(DISTRIBUTED_MODULES):
            found.append(f"{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.startswith(DISTRIBUTED_MODULES) for a in node.names):
            found.append(f"{node.lineno}: import {node.names[0].name}")
        elif isinstance(node, ast.Name) and node.id in DISTRIBUTED_NAMES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in DISTRIBUTED_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _is_torch_distributed(node.value):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in DISTRIBUTED_NAMES:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_only_backends_know_the_distributed_libraries() -> None:
    offenders = {
        name: found
        for name, path in MODULES.items()
        if _part(name) not in BACKEND_PARTS and (found := _backend_knowledge(path))
    }
    assert not offenders, offenders


def test_the_backend_knowledge_scan_sees_each_kind(tmp_path: Path) -> None:
    path = tmp_path / "module.py"
    path.write_text(
        "import deepspeed\nfrom torch.distributed.tensor import DTensor\nimport torch.distributed as dist\n"
        "def f(m, backend):\n    dist.all_reduce(m)\n    backend.all_gather(m)\n"
        "    return type(m).__name__ in {'DeepSpeedEngine'}\n"
    )
    found = " ".join(_backend_knowledge(path))
    assert "backend.all_gather" not in found  # the backend's own collective is the way through
    for word in ("deepspeed", "torch.distributed.tensor", "dist.all_reduce", "'DeepSpeedEngine'"):
        assert word in found, (word, found)


def test_one_owner_of_the_step() -> None:
    """No private trainer attribute outside the step's owner and the mixin; no trainer parameter outside them and the
    public edges."""
    from tests.layout_metrics import functions_taking_a_trainer, private_trainer_accesses

    assert private_trainer_accesses() == {}
    assert functions_taking_a_trainer() == {}


def test_one_formatter_owns_the_layout() -> None:
    from tests.layout_metrics import fmt_skip_lines, long_lines

    assert len(fmt_skip_lines()) <= MAX_FMT_SKIP, fmt_skip_lines()
    assert len(long_lines()) <= MAX_LONG_LINES, long_lines()


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md names every package module (its path under hf_gradacc/), with what it owns."""
    from tests.layout_metrics import modules_missing_from_architecture_doc

    assert modules_missing_from_architecture_doc() == []


MAX_FMT_SKIP = 20
MAX_LONG_LINES = 10


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


def test_no_import_cycle_counting_type_only_imports() -> None:
    """``if TYPE_CHECKING:`` imports run under a type checker and in the reader's head: with them, still no cycle."""
    from tests.layout_metrics import modules_in_circles

    assert modules_in_circles(type_checking=True) == []


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
