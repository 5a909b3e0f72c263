"""`make_exact(trainer)`: a Trainer subclass built by "a framework" (not by the user), made exact in place.

One SGD(lr=1) step, per-device batch 2 x GA 4, mixed lengths, heavy padding and ignored targets: the parameter update
is the accumulated gradient, compared with the float64 full-batch gradient (relative error <= 1e-5). The same class
without make_exact is measured too, so that each exactness assertion can fail.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback

from hf_gradacc import (
    GradAccError,
    GradAccMixin,
    GradAccSeq2SeqTrainer,
    GradAccTrainer,
    LossTerm,
    make_exact,
)
from hf_gradacc.errors import GradAccTypeError, GradAccUsageError
from hf_gradacc.exact import exact_class
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import float64_copy, full_batch_loss
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4


class MarkLogs(TrainerCallback):
    """A framework's callback: it must still see every log line."""

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs or {}))


class FrameworkClassifierTrainer(Trainer):
    """A framework's sequence-classification trainer: the stock loss, its own `log` override."""

    def log(self, logs, start_time=None):
        logs["framework_marker"] = 1.0
        super().log(logs, start_time)


class FrameworkMeanTrainer(Trainer):
    """A framework's compute_loss: the model's own loss, the mean over the micro-batch (what frameworks return)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class FrameworkSuperTrainer(Trainer):
    """A framework's compute_loss that calls the stock one through super() and adds nothing."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


class FrameworkTermTrainer(Trainer):
    """A framework that already returns an hf_gradacc LossTerm (the token SUM)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits.float()
        total = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
        )
        return LossTerm(total=total, normalize_by="tokens")


class FrameworkStepTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


def _made_exact(trainer_class: type[Trainer], **gradacc_args):
    """A factory with the trainer-class signature: the framework builds its trainer, then make_exact."""

    def build(**kwargs):
        trainer = trainer_class(**kwargs)
        assert make_exact(trainer, **gradacc_args) is trainer
        return trainer

    return build


def _args(**overrides):
    return one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, **overrides)


def _step(trainer_class, task: str, **kwargs):
    model, samples = build_tiny_model(task), make_samples(task, BATCH_SIZE * GA, seed=1)
    update, trainer = one_step_update(trainer_class, model, samples, _args(), **kwargs)
    return compare_with_reference(update, model, samples, task), trainer


def test_sequence_classification_subclass_is_exact_and_keeps_its_overrides() -> None:
    marks = MarkLogs()
    comparison, trainer = _step(
        _made_exact(FrameworkClassifierTrainer), "sequence_classification", trainer_kwargs={"callbacks": [marks]}
    )
    assert comparison.relative_error <= TOLERANCE, comparison
    assert isinstance(trainer, FrameworkClassifierTrainer) and isinstance(trainer, GradAccMixin)
    assert type(trainer).__name__ == "GradAccFrameworkClassifierTrainer"
    assert not trainer.step_engine.source.custom_compute_loss  # the stock compute_loss is replaced by the built-in sum, not re-weighted
    train_logs = [log for log in marks.logged if "loss" in log]
    assert train_logs and all(log["framework_marker"] == 1.0 for log in train_logs)  # its log override, its callback
    model, samples = build_tiny_model("sequence_classification"), make_samples("sequence_classification", 8, seed=1)
    batch = PaddingCollator()(samples)
    full_mean = full_batch_loss(float64_copy(model), batch, "sequence_classification").item()
    assert train_logs[0]["loss"] == pytest.approx(full_mean, rel=1e-5)  # the step's exact mean, logged


def test_sequence_classification_subclass_without_make_exact_is_wrong() -> None:
    comparison, _ = _step(FrameworkClassifierTrainer, "sequence_classification")
    assert comparison.relative_error > 1.0, comparison  # 4x: the stock sums GA micro-batch means


@pytest.mark.parametrize("trainer_class", [FrameworkMeanTrainer, FrameworkSuperTrainer])
@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_per_micro_batch_mean_compute_loss_is_exact(trainer_class, task: str) -> None:
    comparison, trainer = _step(_made_exact(trainer_class), task)
    assert comparison.relative_error <= TOLERANCE, comparison
    assert trainer.step_engine.source.custom_compute_loss and type(trainer).compute_loss is trainer_class.compute_loss


@pytest.mark.parametrize("trainer_class", [FrameworkMeanTrainer, FrameworkSuperTrainer])
def test_per_micro_batch_mean_compute_loss_without_make_exact_is_wrong(trainer_class) -> None:
    comparison, _ = _step(trainer_class, "sequence_classification")
    assert comparison.relative_error > 1.0, comparison  # the stock sums GA micro-batch means: 4x


def test_loss_term_return_is_honoured() -> None:
    comparison, _ = _step(_made_exact(FrameworkTermTrainer), "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison


def test_knobs_reach_the_settings() -> None:
    comparison, trainer = _step(_made_exact(FrameworkClassifierTrainer, regroup_micro_batches=True), "causal_lm")
    assert trainer.gradacc.regroup_micro_batches is True
    assert comparison.relative_error <= TOLERANCE, comparison


def test_stock_classes_map_to_the_library_classes() -> None:
    assert exact_class(Trainer) is GradAccTrainer
    assert exact_class(Seq2SeqTrainer) is GradAccSeq2SeqTrainer
    assert exact_class(FrameworkMeanTrainer) is exact_class(FrameworkMeanTrainer)  # made once per class


def _framework_trainer(trainer_class=FrameworkClassifierTrainer, task="sequence_classification", **args):
    model, samples = build_tiny_model(task), make_samples(task, BATCH_SIZE * GA, seed=1)
    return trainer_class(
        model=model, args=_args(**args), train_dataset=ListDataset(samples), data_collator=PaddingCollator()
    )


def test_already_exact_is_returned_unchanged_and_refuses_new_knobs() -> None:
    trainer = make_exact(_framework_trainer())
    cls = type(trainer)
    assert make_exact(trainer) is trainer and type(trainer) is cls
    with pytest.raises(GradAccUsageError, match=r"already exact.*regroup_micro_batches"):
        make_exact(trainer, regroup_micro_batches=True)


def test_refuses_what_is_not_a_trainer() -> None:
    with pytest.raises(GradAccTypeError, match="got a Linear"):
        make_exact(torch.nn.Linear(2, 2))


def test_refuses_after_train_started() -> None:
    trainer = _framework_trainer()
    trainer.train()
    with pytest.raises(GradAccUsageError, match=r"`train\(\)` has started.*before `train\(\)`"):
        make_exact(trainer)
    assert type(trainer) is FrameworkClassifierTrainer


def test_refuses_an_overridden_training_step() -> None:
    trainer = _framework_trainer(FrameworkStepTrainer)
    with pytest.raises(GradAccTypeError, match=r"FrameworkStepTrainer overrides \['training_step'\].*GradAccMixin"):
        make_exact(trainer)
    assert type(trainer) is FrameworkStepTrainer


def test_a_bad_knob_leaves_the_trainer_as_it_was() -> None:
    trainer = _framework_trainer()
    with pytest.raises(GradAccError, match="head_type"):
        make_exact(trainer, head_type="nonsense")
    assert type(trainer) is FrameworkClassifierTrainer
