"""The package layout is the architecture: the core never reaches into the tooling (commands/, testing/), only
backends/ names DDP / DeepSpeed / FSDP2, and module-level imports form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_gradacc"
TOOLING = ("commands", "testing")
DEPRECATED = {"tiny", "reference", "check", "plot", "bench", "regroup", "cli"}  # 0.1 paths, kept for one release


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Absolute names of the hf_gradacc modules ``path`` imports."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
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
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hf_gradacc"))
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py") if not (p.parent == PACKAGE and p.stem in DEPRECATED)}


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


def test_no_import_cycle_at_module_level() -> None:
    graph = {n: {i for i in _imports(p, top_level_only=True) if i in MODULES and i != n} for n, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if not state.get(nxt):
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [node])
