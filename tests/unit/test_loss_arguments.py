"""The Trainer arguments that change the loss, under hf_gradacc (the table in docs/frameworks.md): honoured exactly or
refused, never ignored.

- ``compute_loss_func``: called as `Trainer` calls it, with ``num_items_in_batch`` = the micro-batch's own count; a
  3 x cross-entropy trains a 3 x update; a LossTerm is honoured; an unusable return is refused, naming the function.
- ``label_smoothing_factor``: the smoothed cross-entropy of the whole step.
- ``model_accepts_loss_kwargs``: no effect on the built-in loss (exact either way).
(``average_tokens_across_devices=False`` is warned about as ignored: tests/unit/test_errors.py.)

Causal LM, per-device batch 2 x GA 4, mixed lengths, heavy padding, ignored targets; one SGD(lr=1) step against a
float64 full-batch reference (relative error <= 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer

from hf_gradacc import IGNORE_INDEX, GradAccLossError, GradAccTrainer, LossTerm, make_exact
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, float64_copy
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4
FACTOR = 3.0


def _shifted_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def triple_ce(outputs, labels, num_items_in_batch=None):
    """The transformers convention: the token SUM divided by `num_items_in_batch`, times 3."""
    return FACTOR * _shifted_ce_sum(outputs.logits, labels) / num_items_in_batch


def triple_ce_mean(outputs, labels, num_items_in_batch=None):
    """A function that ignores `num_items_in_batch`: its own mean over the counted tokens, times 3."""
    logits = outputs.logits
    return FACTOR * F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


def triple_ce_term(outputs, labels, num_items_in_batch=None):
    return LossTerm(total=FACTOR * _shifted_ce_sum(outputs.logits, labels), normalize_by="tokens")


def per_token_losses(outputs, labels, num_items_in_batch=None):
    return F.cross_entropy(outputs.logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], reduction="none")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model("causal_lm")


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    return make_samples("causal_lm", BATCH_SIZE * GA, seed=1)


def _args(**overrides):
    return one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, **overrides)


def _made_exact(**kwargs):
    return make_exact(Trainer(**kwargs))


def _scaled(update: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {n: g / factor for n, g in update.items()}


@pytest.mark.parametrize("func", [triple_ce, triple_ce_mean, triple_ce_term])
@pytest.mark.parametrize("trainer_class", [GradAccTrainer, _made_exact], ids=["GradAccTrainer", "make_exact"])
def test_compute_loss_func_three_times_trains_three_times(model, samples, func, trainer_class) -> None:
    update, _ = one_step_update(trainer_class, model, samples, _args(), trainer_kwargs={"compute_loss_func": func})
    plain = compare_with_reference(update, model, samples, "causal_lm")
    assert plain.norm_ratio == pytest.approx(FACTOR, rel=1e-4), plain  # not the built-in loss: 3 x it
    comparison = compare_with_reference(_scaled(update, FACTOR), model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison


def test_stock_trainer_compute_loss_func_is_not_exact(model, samples) -> None:
    """What the stock Trainer does with the same function (the count comes from its own prefetch, per rank): measured
    to show the exactness assertion above can fail on this data."""
    update, _ = one_step_update(Trainer, model, samples, _args(), trainer_kwargs={"compute_loss_func": triple_ce_mean})
    comparison = compare_with_reference(_scaled(update, FACTOR), model, samples, "causal_lm")
    assert comparison.relative_error > 0.1, comparison


def test_compute_loss_func_with_an_unusable_return_is_refused(model, samples) -> None:
    with pytest.raises(GradAccLossError, match=r"`compute_loss_func` \('per_token_losses'\).*num_items_in_batch"):
        one_step_update(GradAccTrainer, model, samples, _args(), trainer_kwargs={"compute_loss_func": per_token_losses})


def _smoothed_reference(model: torch.nn.Module, samples: list[dict], epsilon: float) -> dict[str, torch.Tensor]:
    """Float64 gradient of the label-smoothed next-token cross-entropy, a mean over every counted token of the step."""
    ref = float64_copy(model)
    batch = PaddingCollator()(samples)
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        label_smoothing=epsilon,
    )
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def test_label_smoothing_factor_is_the_smoothed_loss_of_the_step(model, samples) -> None:
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(label_smoothing_factor=0.1))
    assert compare(update, _smoothed_reference(model, samples, 0.1)).relative_error <= TOLERANCE
    assert compare(update, _smoothed_reference(model, samples, 0.0)).relative_error > 1e-3  # smoothing is not dropped


@pytest.mark.parametrize("accepts", [True, False])
def test_model_accepts_loss_kwargs_does_not_change_the_built_in_loss(model, samples, accepts: bool) -> None:
    def build(**kwargs):
        trainer = GradAccTrainer(**kwargs)
        trainer.model_accepts_loss_kwargs = accepts
        return trainer

    update, _ = one_step_update(build, copy.deepcopy(model), samples, _args())
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOLERANCE
