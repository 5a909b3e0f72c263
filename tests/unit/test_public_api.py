"""The public API is frozen: `__all__` changes only on purpose, and public classes document an example."""

from __future__ import annotations

import pytest

import hf_gradacc

EXPECTED_ALL = [
    "IGNORE_INDEX",
    "GradAccArguments",
    "GradAccCompatibilityError",
    "GradAccConfig",
    "GradAccConfigError",
    "GradAccDataError",
    "GradAccError",
    "GradAccLossError",
    "GradAccMixin",
    "GradAccSeq2SeqConfig",
    "GradAccSeq2SeqTrainer",
    "GradAccTrainer",
    "GradAccUsageError",
    "GradientsNotReadyError",
    "LossTerm",
    "UnsupportedBackendError",
    "__version__",
    "gradacc_config_class",
    "make_exact",
]
PUBLIC_CLASSES = [n for n in EXPECTED_ALL if n[0].isupper() and not n.endswith("Error") and n != "IGNORE_INDEX"]


def test_all_is_frozen() -> None:
    assert sorted(hf_gradacc.__all__) == sorted(EXPECTED_ALL)
    assert len(hf_gradacc.__all__) == len(set(hf_gradacc.__all__))
    for name in hf_gradacc.__all__:
        assert hasattr(hf_gradacc, name), name


@pytest.mark.parametrize("name", [*PUBLIC_CLASSES, "gradacc_config_class", "make_exact"])
def test_public_class_docstring_has_example(name: str) -> None:
    doc = getattr(hf_gradacc, name).__doc__
    assert doc and "Example" in doc, f"{name} docstring lacks an `Example:` section"


def test_errors_share_one_base() -> None:
    for name in [n for n in EXPECTED_ALL if n.endswith("Error")]:
        assert issubclass(getattr(hf_gradacc, name), hf_gradacc.GradAccError)
    assert hf_gradacc.IGNORE_INDEX == -100


def test_every_knob_is_in_the_api_table() -> None:
    """Each GradAccArguments field has its row in docs/api.md's knob table (a field added without docs fails)."""
    from pathlib import Path

    from hf_gradacc.config import GRADACC_FIELDS

    table = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    missing = [name for name in GRADACC_FIELDS if f"| `{name}` |" not in table]
    assert not missing, f"add rows for {missing} to docs/api.md"
