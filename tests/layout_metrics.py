"""Measures of the package's structure, read from the code (AST and text), one function per measure.

``tests/unit/test_layout.py`` holds the package to them; run this file to print them (before / after a redesign):

    python tests/layout_metrics.py            # a table
    python tests/layout_metrics.py --details  # and what each count is made of

Measures:

- private trainer accesses: ``trainer._x`` (or ``self.trainer._x``, ``getattr(trainer, "_x")``) in a package module
  other than the step's owner and the mixin (``OWNERS``);
- functions taking a trainer: functions whose parameters include ``trainer`` (or a parameter annotated with a Trainer
  / mixin class) outside the owners and the declared edges (``TRAINER_EDGES``: public API that takes a user's trainer);
- modules in import circles: every module in a strongly connected part of the import graph, imports under
  ``if TYPE_CHECKING:`` and inside functions included;
- command modules in testing/: modules of ``hf_gradacc/testing`` that ``hf_gradacc/commands`` imports other than
  fixtures and references;
- ``# fmt: skip`` lines and lines over 119 characters in the package;
- denominator dispatches: functions that pick a count by comparing a value with two or more of the denominator names,
  and tables keyed by three or more of them;
- "which ranks" answers: definitions that size a group of ranks (names in ``RANK_ANSWER_NAMES``);
- package modules missing from docs/architecture.md.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_gradacc"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

# The step's owner and the Trainer adapter: the only modules that may read or write a trainer's private state.
OWNERS = ("hf_gradacc/mixin.py", "hf_gradacc/step/engine.py", "hf_gradacc/step/host.py")
# Public API and framework adapters whose job is to take someone's trainer (a user's, a framework's).
TRAINER_EDGES = (
    "hf_gradacc/exact.py",
    "hf_gradacc/integrations/",
    "hf_gradacc/trl/",
    "hf_gradacc/callbacks/",
    "hf_gradacc/log.py",
    "hf_gradacc/testing/",
    "hf_gradacc/commands/",
)
LINE_LIMIT = 119
DENOMINATORS = {"tokens", "samples", "input_tokens", "weights"}
# Names of definitions that answer "how many ranks / which ranks" (count, average, hold copies).
RANK_ANSWER_NAMES = re.compile(
    r"^(dp_world_size|data_parallel_size|count_group_size|count_rule|loss_scale|num_data_ranks|num_count_ranks|"
    r"num_loss_ranks|data_ranks|count_ranks|world_size_of|samples_per_micro_batch)$"
)
FIXTURE_MODULES = ("tiny", "tiny_vlm", "reference", "moe_reference", "grpo_reference", "one_step", "steps",
                   "trl_steps", "trl_more_steps", "grpo_steps", "trl_gather", "noise_problems", "__init__")


def modules() -> dict[str, Path]:
    """Every package module by its path relative to the repository (``hf_gradacc/x/y.py``)."""
    return {p.relative_to(ROOT).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}


def _trees() -> Iterator[tuple[str, ast.Module]]:
    for rel, path in modules().items():
        yield rel, ast.parse(path.read_text())


def _is_trainer_expr(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("trainer", "tr")
    if isinstance(node, ast.Attribute):
        return node.attr in ("trainer", "_trainer", "host", "_host")
    return False


def private_trainer_accesses() -> dict[str, list[str]]:
    """``{module: ["line: trainer._x", ...]}`` outside :data:`OWNERS`."""
    found: dict[str, list[str]] = {}
    for rel, tree in _trees():
        if rel in OWNERS:
            continue
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and _is_trainer_expr(node.value):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr")
                  and len(node.args) >= 2 and _is_trainer_expr(node.args[0]) and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                name = node.args[1].value
            if name and name.startswith("_") and not name.startswith("__"):
                found.setdefault(rel, []).append(f"{node.lineno}: {name}")
    return found


def _takes_trainer(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    for arg in params:
        if arg.arg in ("trainer", "tr"):
            return True
        text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        if re.search(r"\b(GradAccMixin|Trainer|TrainerHost)\b", text):
            return True
    return False


def functions_taking_a_trainer(include_edges: bool = False) -> dict[str, list[str]]:
    """``{module: ["line: name", ...]}``: functions with a trainer parameter, outside the owners (and the edges)."""
    found: dict[str, list[str]] = {}
    for rel, tree in _trees():
        if rel in OWNERS or (not include_edges and rel.startswith(TRAINER_EDGES)):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_trainer(node):
                found.setdefault(rel, []).append(f"{node.lineno}: {node.name}")
    return found


def _module_name(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, package: str, *, type_checking: bool, into: set[str]) -> None:
    """Add to ``into`` the absolute names ``node`` (and what it holds) imports."""
    if isinstance(node, ast.If) and not type_checking and "TYPE_CHECKING" in ast.unparse(node.test):
        for child in node.orelse:
            _imported(child, package, type_checking=type_checking, into=into)
        return
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        if node.module:
            into.add(target)
        into.update(f"{target}.{alias.name}" for alias in node.names)
    elif isinstance(node, ast.Import):
        into.update(alias.name for alias in node.names)
    for child in ast.iter_child_nodes(node):
        _imported(child, package, type_checking=type_checking, into=into)


def import_graph(*, type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere (functions too; ``if TYPE_CHECKING:`` with ``type_checking``)."""
    names = {_module_name(rel): rel for rel in modules()}
    graph: dict[str, set[str]] = {}
    for rel, tree in _trees():
        name = _module_name(rel)
        package = name if rel.endswith("__init__.py") else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        _imported(tree, package, type_checking=type_checking, into=targets)
        graph[name] = {t for t in targets if t in names and t != name and not t.startswith(name + ".")}
    return graph


def modules_in_circles(*, type_checking: bool = True) -> list[list[str]]:
    """The strongly connected parts (more than one module) of :func:`import_graph` (Tarjan)."""
    graph = import_graph(type_checking=type_checking)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []
    counter = [0]

    def strong(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return parts


def command_modules_in_testing() -> list[str]:
    """Modules of hf_gradacc/testing that hf_gradacc/commands reaches (directly or through other testing modules),
    other than fixtures and references."""
    graph = import_graph()
    seen: set[str] = set()
    todo = [name for name in graph if name.startswith("hf_gradacc.commands")]
    while todo:  # what the commands reach through testing/ (a command's engine imports more of it)
        for target in graph[todo.pop()]:
            if target.startswith("hf_gradacc.testing.") and target not in seen:
                seen.add(target)
                todo.append(target)
    return sorted(t for t in seen if t.rsplit(".", 1)[1] not in FIXTURE_MODULES)


def fmt_skip_lines() -> list[str]:
    return [f"{rel}:{i}" for rel, path in modules().items()
            for i, line in enumerate(path.read_text().splitlines(), 1) if "fmt: skip" in line or "fmt: off" in line]


def long_lines() -> list[str]:
    return [f"{rel}:{i}" for rel, path in modules().items()
            for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > LINE_LIMIT]


def denominator_dispatches() -> list[str]:
    """Functions that choose a count by comparing one value with two or more denominator names."""
    found = []
    for rel, tree in _trees():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            compared: set[str] = set()
            for node in ast.walk(fn):
                if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
                    for side in (node.left, *node.comparators):
                        if isinstance(side, ast.Constant) and side.value in DENOMINATORS:
                            compared.add(side.value)
            if len(compared) >= 2:
                found.append(f"{rel}:{fn.lineno} {fn.name} {sorted(compared)}")
        for node in ast.walk(tree):  # a table from denominator names to what each counts
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in DENOMINATORS}
                if len(keys) >= 3:
                    found.append(f"{rel}:{node.lineno} table {sorted(keys)}")
    return found


def rank_answers() -> list[str]:
    """Definitions (functions, properties) that size a group of ranks: count, average, data ranks."""
    found = []
    for rel, tree in _trees():
        if rel.startswith(("hf_gradacc/testing/", "hf_gradacc/commands/")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and RANK_ANSWER_NAMES.match(node.name):
                found.append(f"{rel}:{node.lineno} {node.name}")
    return found


def modules_missing_from_architecture_doc() -> list[str]:
    text = ARCHITECTURE_DOC.read_text() if ARCHITECTURE_DOC.exists() else ""
    missing = []
    for rel in modules():
        if rel.endswith("__init__.py") or rel.endswith("__main__.py"):
            continue
        short = rel.removeprefix("hf_gradacc/")
        if short not in text and rel not in text:
            missing.append(rel)
    return missing


def measures() -> dict[str, tuple[int, list[str]]]:
    private = private_trainer_accesses()
    taking = functions_taking_a_trainer()
    circles = modules_in_circles()
    return {
        "private trainer accesses outside the owner": (sum(map(len, private.values())),
                                                       [f"{m}: {len(v)}" for m, v in private.items()]),
        "modules making them": (len(private), sorted(private)),
        "functions taking a trainer (outside owner and edges)": (
            sum(map(len, taking.values())), [f"{m} {', '.join(v)}" for m, v in taking.items()]),
        "modules in import circles (type-only imports included)": (sum(map(len, circles)),
                                                                   [" <-> ".join(c) for c in circles]),
        "command modules in testing/": (len(command_modules_in_testing()), command_modules_in_testing()),
        "`# fmt: skip` lines": (len(fmt_skip_lines()), fmt_skip_lines()),
        f"lines over {LINE_LIMIT} characters": (len(long_lines()), long_lines()),
        "denominator dispatches": (len(denominator_dispatches()), denominator_dispatches()),
        "'which ranks' answers": (len(rank_answers()), rank_answers()),
        "package modules missing from docs/architecture.md": (len(modules_missing_from_architecture_doc()),
                                                               modules_missing_from_architecture_doc()),
        "package modules / lines": (len(modules()), [str(sum(len(p.read_text().splitlines()) for p in modules().values()))]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--details", action="store_true", help="list what each count is made of")
    args = parser.parse_args()
    for name, (count, details) in measures().items():
        print(f"{count:6d}  {name}")
        if args.details:
            for line in details:
                print(f"          {line}")


if __name__ == "__main__":
    main()
