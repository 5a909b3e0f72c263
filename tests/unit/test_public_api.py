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
    "GradAccDistributedError",
    "GradAccError",
    "GradAccLossError",
    "GradAccMixin",
    "GradAccSeq2SeqConfig",
    "GradAccSeq2SeqTrainer",
    "GradAccTrainer",
    "GradAccUsageError",
    "GradientsNotReadyError",
    "LossTerm",
    "NonFiniteStepError",
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


@pytest.mark.parametrize(
    ("name", "base"), [("GradAccTrainer", "Trainer"), ("GradAccSeq2SeqTrainer", "Seq2SeqTrainer")]
)
def test_trainer_signature_is_the_stock_one_plus_gradacc_args(name: str, base: str) -> None:
    """IDEs and `inspect` see the stock constructor's parameters, in its order (so positional calls still work),
    plus the keyword-only ``gradacc_args``; a parameter transformers adds or renames fails here."""
    import inspect

    import transformers

    ours = inspect.signature(getattr(hf_gradacc, name).__init__).parameters
    stock = inspect.signature(getattr(transformers, base).__init__).parameters
    assert list(ours)[:-1] == list(stock)
    assert [p.default for n, p in ours.items() if n != "gradacc_args"] == [p.default for p in stock.values()]
    assert ours["gradacc_args"].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["gradacc_args"].default is None


def test_trainer_takes_its_arguments_positionally_and_by_keyword(tmp_path) -> None:
    from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

    model = build_tiny_model("causal_lm")
    args = hf_gradacc.GradAccConfig(output_dir=str(tmp_path), report_to="none")
    data = ListDataset(make_samples("causal_lm", 4))
    trainer = hf_gradacc.GradAccTrainer(model, args, PaddingCollator(), data, gradacc_args=None)
    assert trainer.model is model and trainer.train_dataset is data
    plain = transformers_args(tmp_path)
    trainer = hf_gradacc.GradAccTrainer(model=model, args=plain, train_dataset=data, data_collator=PaddingCollator(),
                                        gradacc_args={"regroup_micro_batches": True})  # fmt: skip
    assert trainer.gradacc.regroup_micro_batches is True


def transformers_args(tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to="none")


TRL_EXPECTED_ALL = [
    "GradAccDPOConfig",
    "GradAccDPOTrainer",
    "GradAccDistillationConfig",
    "GradAccDistillationTrainer",
    "GradAccGRPOConfig",
    "GradAccGRPOTrainer",
    "GradAccKTOConfig",
    "GradAccKTOTrainer",
    "GradAccRLOOConfig",
    "GradAccRLOOTrainer",
    "GradAccRewardConfig",
    "GradAccRewardTrainer",
    "GradAccSFTConfig",
    "GradAccSFTTrainer",
    "TRLDependencyError",
]


def test_trl_all_is_frozen_and_its_classes_document_an_example() -> None:
    """hf_gradacc.trl's names (KTO, RLOO and Distillation from TRL 1.16 on); asking an older TRL for one of those
    names the version instead of an AttributeError."""
    pytest.importorskip("trl")
    import hf_gradacc.trl as gradacc_trl
    from hf_gradacc.compat import trl_at_least

    newer = trl_at_least(gradacc_trl.TRL_MORE_TRAINERS)
    assert gradacc_trl.__all__ == [n for n in TRL_EXPECTED_ALL if newer or n not in gradacc_trl._MORE_TRAINERS]
    for name in gradacc_trl.__all__:
        if name != "TRLDependencyError":
            assert "Example:" in (getattr(gradacc_trl, name).__doc__ or ""), name
    with pytest.raises(gradacc_trl.TRLDependencyError, match=r"GradAccKTOTrainer needs trl>=1\.16"):
        gradacc_trl.__getattr__("GradAccKTOTrainer")
