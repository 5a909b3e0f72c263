"""CI runs the README's test command word for word: the ``python -m pytest`` line of the README's set-up block is a
line of .ci/run's newest-stack stage, and the packages that command needs (pytest-xdist for ``-n``) are in the
``test`` extra."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    [line] = [ln for ln in text.splitlines() if ln.startswith("python3 -m venv") and "pytest" in ln]
    return line[line.index("python -m pytest") :].strip()


def test_ci_runs_the_readme_test_command_as_printed() -> None:
    command = _readme_test_command()
    ci_lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, (command, [ln for ln in ci_lines if "pytest" in ln])


def test_the_plugins_the_command_uses_are_in_the_test_extra() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI's)
    command = _readme_test_command()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    test_extra = {re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower() for req in extras["test"]}
    if re.search(r"(^| )-n ", command):
        assert "pytest-xdist" in test_extra, extras["test"]
    assert "ray" in test_extra, "tests/distributed/test_ray_train.py needs Ray Train: a skip must not hide it"
