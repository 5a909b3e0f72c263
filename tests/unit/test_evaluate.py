"""Evaluation is unchanged: `evaluate()` gives the plain mean loss, and evaluation during training works."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import Trainer

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.reference import full_batch_loss
from hf_gradacc.testing.tiny import TASKS, ListDataset, PaddingCollator, build_tiny_model, make_samples

NUM_EVAL = 6


def _evaluate(helpers, trainer_class, model, samples, eval_batch_size: int) -> float:
    args = helpers.make_args(per_device_eval_batch_size=eval_batch_size)
    trainer = trainer_class(
        model=copy.deepcopy(model), args=args, eval_dataset=ListDataset(samples), data_collator=PaddingCollator()
    )
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]), metrics
    return metrics["eval_loss"]


@pytest.mark.parametrize("task", ["causal_lm", "masked_lm", "sequence_classification"])
def test_eval_loss_of_one_batch_is_the_full_eval_set_mean(helpers, task: str) -> None:
    model = build_tiny_model(task)
    samples = make_samples(task, NUM_EVAL, seed=9)
    eval_loss = _evaluate(helpers, GradAccTrainer, model, samples, eval_batch_size=NUM_EVAL)
    ref = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        expected = float(full_batch_loss(ref, PaddingCollator()(samples), task))
    assert eval_loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("task", TASKS)
def test_eval_loss_over_several_batches_matches_stock_trainer(helpers, task: str) -> None:
    """Several eval batches: the Trainer's own aggregation (per-batch means), exactly as the stock Trainer."""
    model = build_tiny_model(task)
    samples = make_samples(task, NUM_EVAL, seed=9)
    ours = _evaluate(helpers, GradAccTrainer, model, samples, eval_batch_size=2)
    stock = _evaluate(helpers, Trainer, model, samples, eval_batch_size=2)
    assert ours == pytest.approx(stock, rel=1e-5)


def test_evaluation_during_training(helpers) -> None:
    model = build_tiny_model("causal_lm")
    args = helpers.make_args(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        per_device_eval_batch_size=NUM_EVAL,
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
    )
    run = helpers.run_training(
        GradAccTrainer,
        model,
        ListDataset(make_samples("causal_lm", 16, seed=10)),
        args,
        eval_dataset=ListDataset(make_samples("causal_lm", NUM_EVAL, seed=9)),
    )
    evals = [h["eval_loss"] for h in run.trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and all(math.isfinite(v) for v in evals), evals
    assert evals[0] != evals[1]  # the model moved between the two evaluations
