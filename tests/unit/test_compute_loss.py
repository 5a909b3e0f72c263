"""Overridden `compute_loss`: a plain `outputs.loss`, one `LossTerm`, and a dict of two `LossTerm`s.

Causal LM, per-device batch 2 x GA 4, mixed lengths and heavy padding, one SGD(lr=1) step: the parameter update
is the accumulated gradient, compared with a float64 full-batch gradient (relative error <= 1e-5).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

from hf_gradacc import IGNORE_INDEX, GradAccConfig, GradAccTrainer, LossTerm
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4
Z_WEIGHT = 0.1  # weight of the per-sample z-loss term


def _plain_outputs_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The classic override: the model's own loss, a mean over this micro-batch's tokens."""
    outputs = model(**inputs)
    return (outputs.loss, outputs) if return_outputs else outputs.loss


class PlainLossTrainer(GradAccTrainer):
    compute_loss = _plain_outputs_loss


class StockPlainLossTrainer(Trainer):
    compute_loss = _plain_outputs_loss


def lm_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the counted targets."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def z_loss_sum(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of logsumexp(logits)^2 over the row's real positions, summed over rows."""
    z = torch.logsumexp(logits, dim=-1).pow(2)
    mask = attention_mask.to(z.dtype)
    return ((z * mask).sum(dim=1) / mask.sum(dim=1)).sum()


class TokenTermTrainer(GradAccTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        term = LossTerm(total=lm_sum(outputs.logits.float(), labels), normalize_by="tokens")
        return (term, outputs) if return_outputs else term


class TwoTermTrainer(GradAccTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()
        terms = {
            "lm": LossTerm(total=lm_sum(logits, labels), normalize_by="tokens"),
            "z": LossTerm(total=Z_WEIGHT * z_loss_sum(logits, inputs["attention_mask"]), normalize_by="samples"),
        }
        return (terms, outputs) if return_outputs else terms


def two_term_reference(model: torch.nn.Module, samples: list[dict]) -> tuple[dict[str, torch.Tensor], float]:
    """Float64 gradient and value of mean_tokens(lm) + Z_WEIGHT * mean_samples(z) over the full batch."""
    ref = copy.deepcopy(model).double().eval()
    batch = PaddingCollator()(samples)
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    num_tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    num_samples = batch["labels"].shape[0]
    loss = lm_sum(logits, batch["labels"]) / num_tokens + Z_WEIGHT * z_loss_sum(logits, batch["attention_mask"]) / (
        num_samples
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return grads, loss.detach().item()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model("causal_lm")


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    return make_samples("causal_lm", BATCH_SIZE * GA, seed=1)


def _args(**overrides):
    return one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, **overrides)


def _gradacc_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hf_gradacc") and r.levelno >= logging.WARNING]


PLAIN_TASKS = ["causal_lm", "masked_lm", "sequence_classification"]


@pytest.mark.parametrize("task", PLAIN_TASKS)
def test_plain_outputs_loss_is_exact_with_one_warning(task: str, caplog) -> None:
    model, samples = build_tiny_model(task), make_samples(task, BATCH_SIZE * GA, seed=1)
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        update, trainer = one_step_update(PlainLossTrainer, model, samples, _args())
    comparison = compare_with_reference(update, model, samples, task)
    assert comparison.relative_error <= TOLERANCE, comparison
    plain = [m for m in _gradacc_warnings(caplog) if "plain tensor" in m]
    assert len(plain) == 1, _gradacc_warnings(caplog)
    assert "LossTerm" in plain[0] and "warn_on_plain_loss" in plain[0]


def test_plain_outputs_loss_warning_can_be_silenced(model, samples, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        update, _ = one_step_update(
            PlainLossTrainer, model, samples, _args(args_class=GradAccConfig, warn_on_plain_loss=False)
        )
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOLERANCE
    assert not [m for m in _gradacc_warnings(caplog) if "plain tensor" in m]


@pytest.mark.parametrize("task", PLAIN_TASKS)
def test_stock_trainer_plain_outputs_loss_is_wrong(task: str) -> None:
    model, samples = build_tiny_model(task), make_samples(task, BATCH_SIZE * GA, seed=1)
    update, _ = one_step_update(StockPlainLossTrainer, model, samples, _args())
    comparison = compare_with_reference(update, model, samples, task)
    # DESIGN.md: ~5.3x on causal LM. The GA micro-batch means are summed: nothing divides by GA or weighs by count.
    assert comparison.norm_ratio > 3.0 and comparison.relative_error > 2.0, comparison


def test_token_loss_term_is_exact_without_warning(model, samples, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        update, _ = one_step_update(TokenTermTrainer, model, samples, _args())
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison
    assert not _gradacc_warnings(caplog)


def test_dict_of_token_and_sample_terms_is_exact(model, samples, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        update, trainer = one_step_update(TwoTermTrainer, model, samples, _args())
    reference, reference_loss = two_term_reference(model, samples)
    comparison = compare(update, reference)
    assert comparison.relative_error <= TOLERANCE, comparison
    assert not _gradacc_warnings(caplog)
    # the z term must matter, or the test would pass with it dropped
    lm_only = compare(update, reference_gradients(model, samples, "causal_lm", PaddingCollator()))
    assert lm_only.relative_error > 1e-3
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx([reference_loss], rel=1e-5)


@pytest.mark.parametrize(
    "trainer_class", [GradAccTrainer, TokenTermTrainer, TwoTermTrainer, PlainLossTrainer], ids=lambda c: c.__name__
)
def test_evaluate_with_overridden_compute_loss(model, samples, trainer_class, helpers) -> None:
    """One eval batch: eval_loss is the full-batch mean of the returned terms (a LossTerm is read as its mean)."""
    args = helpers.make_args(per_device_eval_batch_size=len(samples))
    trainer = trainer_class(
        model=copy.deepcopy(model), args=args, eval_dataset=ListDataset(samples), data_collator=PaddingCollator()
    )
    eval_loss = trainer.evaluate()["eval_loss"]
    if trainer_class is TwoTermTrainer:
        _, expected = two_term_reference(model, samples)
    else:
        ref = copy.deepcopy(model).double().eval()
        with torch.no_grad():
            expected = float(full_batch_loss(ref, PaddingCollator()(samples), "causal_lm"))
    assert eval_loss == pytest.approx(expected, rel=1e-5)
