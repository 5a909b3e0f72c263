"""Every row of the catalogue (catalogue.py) ends as it says: a clear error of the project's hierarchy naming the
value and the fix, a warning and a correct step, or an exact step. The page docs/reliability.md shows the same table."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import hf_gradacc
from hf_gradacc import errors

from .catalogue import CASES, render_table, run_case

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def test_the_catalogue_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case, caplog) -> None:
    caplog.set_level(logging.WARNING)
    if case.outcome == "error":
        expected = getattr(errors, case.error, None) or getattr(__builtins__, case.error, None) or eval(case.error)
        with pytest.raises(expected) as info:
            run_case(case)
        if expected is not RuntimeError:
            assert isinstance(info.value, hf_gradacc.GradAccError), type(info.value)  # one hierarchy
        for word in case.words:
            assert word in str(info.value), (word, str(info.value))
        return
    run_case(case)  # "exact" and "check" rows assert inside
    if case.outcome == "warning":
        messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        for word in case.words:
            assert any(word in m for m in messages), (word, messages)


def test_the_documentation_shows_this_catalogue() -> None:
    assert render_table() in DOC.read_text(), "regenerate with: python -m tests.reliability.catalogue"
