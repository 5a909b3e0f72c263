"""The torch range pyproject.toml declares is the range CI runs: its floor is the oldest torch a stage of .ci/run
installs (the LLaMA-Factory stage), and a declared upper bound, if any, admits the newest torch a stage installs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, ...]:
    """``"2.9"`` and ``"2.9.0"`` are the same release: trailing zero parts dropped."""
    parts = [int(part) for part in text.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def declared_torch() -> tuple[str, str | None]:
    """pyproject.toml's ``torch>=X`` (and ``<Y`` where present), read from the ``dependencies`` list."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert deps, "pyproject.toml has no `dependencies = [...]` list"
    spec = re.search(r'"torch\s*([^"]*)"', deps.group(1))
    assert spec, "pyproject.toml's dependencies do not name torch"
    floor = re.search(r">=\s*([0-9][0-9.]*)", spec.group(1))
    assert floor, f"pyproject.toml's torch requirement {spec.group(0)} has no `>=` floor"
    cap = re.search(r"<\s*([0-9][0-9.]*)", spec.group(1))
    return floor.group(1), cap.group(1) if cap else None


def ci_torch_versions() -> list[str]:
    """Every torch .ci/run installs: ``fresh_venv``'s default and each stage's ``torch==`` pin."""
    text = (ROOT / ".ci" / "run").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())  # comments may name other versions
    versions = re.findall(r"torch==\$\{2:-([0-9][0-9.]*)\}", code) + re.findall(r"torch==([0-9][0-9.]*)", code)
    assert versions, ".ci/run installs no pinned torch"
    return versions


def test_pyproject_torch_floor_is_the_oldest_torch_ci_runs():
    floor, _ = declared_torch()
    oldest = min(ci_torch_versions(), key=_version)
    assert _version(floor) == _version(oldest), (
        f"pyproject.toml declares torch>={floor} but the oldest torch .ci/run tests is {oldest}: "
        "make them equal (raise the floor, or add a stage at it)"
    )


def test_pyproject_torch_cap_admits_the_newest_torch_ci_runs():
    _, cap = declared_torch()
    newest = max(ci_torch_versions(), key=_version)
    if cap is not None:
        assert _version(newest) < _version(cap), f"pyproject.toml caps torch<{cap} but .ci/run tests {newest}"
