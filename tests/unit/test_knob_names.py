"""A misspelt knob is refused with the closest name ("did you mean") and the list of hf_gradacc's knobs, wherever a
knob name is given: a config's keyword, `gradacc_args=`, `make_exact(**knobs)`, axolotl's `gradacc:` block
(tests/integrations/test_axolotl.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from transformers import Trainer, TrainingArguments

from hf_gradacc import (
    GradAccArguments,
    GradAccConfig,
    GradAccConfigError,
    GradAccSeq2SeqConfig,
    GradAccTrainer,
    make_exact,
)
from hf_gradacc.config import GRADACC_FIELDS, gradacc_config_class
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TYPO, MEANT = "regroup_microbatches", "regroup_micro_batches"
DID_YOU_MEAN = f"`{TYPO}` (did you mean `{MEANT}`?)"


def _trainer(cls: type, **kwargs: Any) -> Trainer:
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    return cls(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(make_samples("causal_lm", 4)),
               data_collator=PaddingCollator(), **kwargs)  # fmt: skip


ENTRY_POINTS = {
    "GradAccConfig": lambda knobs: GradAccConfig(output_dir="unused", **knobs),
    "GradAccSeq2SeqConfig": lambda knobs: GradAccSeq2SeqConfig(output_dir="unused", **knobs),
    "GradAccArguments": lambda knobs: GradAccArguments(**knobs),
    "GradAccTrainingArguments": lambda knobs: gradacc_config_class(TrainingArguments)(output_dir="unused", **knobs),
    "gradacc_args": lambda knobs: _trainer(GradAccTrainer, gradacc_args=knobs),
    "make_exact(**knobs)": lambda knobs: make_exact(_trainer(Trainer), **knobs),
}


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_a_misspelt_knob_names_the_closest_one_and_lists_the_knobs(where: str) -> None:
    with pytest.raises(GradAccConfigError) as caught:
        ENTRY_POINTS[where]({TYPO: True})
    message = str(caught.value)
    assert message.startswith(f"`{where}` has an unknown field {DID_YOU_MEAN}; hf_gradacc's knobs are: "), message
    listed = message.split("hf_gradacc's knobs are: ")[1]
    assert [name for name in GRADACC_FIELDS if name not in listed] == [], message


def test_several_unknown_names_each_get_their_closest_one_or_none() -> None:
    with pytest.raises(GradAccConfigError, match=re.escape(
        f"`gradacc_args` has unknown fields `nonfinite_step` (did you mean `nonfinite_steps`?), {DID_YOU_MEAN}, "
        "`zzz`; hf_gradacc's knobs are: "
    )):  # fmt: skip
        _trainer(GradAccTrainer, gradacc_args={"zzz": 1, TYPO: True, "nonfinite_step": "skip"})


def test_a_misspelt_training_arguments_field_of_a_gradacc_config_is_named_too() -> None:
    with pytest.raises(GradAccConfigError, match=re.escape(
        "`GradAccConfig` has an unknown field `gradient_acumulation_steps` (did you mean "
        "`gradient_accumulation_steps`?)"
    )):  # fmt: skip
        GradAccConfig(output_dir="unused", gradient_acumulation_steps=4)


def test_make_exact_checks_the_names_before_it_changes_the_trainer() -> None:
    trainer = _trainer(Trainer)
    with pytest.raises(GradAccConfigError, match=re.escape(DID_YOU_MEAN)):
        make_exact(trainer, **{TYPO: True})
    assert type(trainer) is Trainer


def test_correct_names_still_work() -> None:
    assert GradAccConfig(output_dir="unused", **{MEANT: True}).regroup_micro_batches is True
    assert _trainer(GradAccTrainer, gradacc_args={MEANT: True}).gradacc.regroup_micro_batches is True
    assert make_exact(_trainer(Trainer), **{MEANT: True}).gradacc.regroup_micro_batches is True
