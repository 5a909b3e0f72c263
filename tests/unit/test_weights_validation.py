"""Validation of the `loss_weights` column (hf_gradacc/weights.py, issue 36): weights of the wrong length or kind are
refused by name, row and both lengths, before any torch error; weights that weigh no counted target (ignored labels,
padding, a causal LM's position 0, a sample labelled -100) are neither validated nor read, a NaN there included; the
"weights" denominator sums the weights of counted targets only; the skip warning of a zero-weight step says why.

Exactness against the float64 full batch (hf_gradacc/testing/reference.py), per-device batch 2 x GA 4, rel err <= 1e-5.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccDataError, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples
from hf_gradacc.weights import (
    LOSS_WEIGHTS_KEY,
    LossWeightsCollator,
    target_weight_sum,
    target_weights,
    weighted_loss_sum,
)

TOL = 1e-5
BATCH, GA = 2, 4
NAN = float("nan")


def collator() -> LossWeightsCollator:
    return LossWeightsCollator(PaddingCollator())


def one_step(task: str, samples: list[dict]):
    model = build_tiny_model(task)
    args = one_step_args(per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, args_class=GradAccConfig)
    update, trainer = one_step_update(GradAccTrainer, model, samples, args, data_collator=collator())
    return update, trainer, model


def per_token_samples(task: str = "causal_lm", *, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 100)
    samples = make_samples(task, BATCH * GA, seed=seed)
    for s in samples:
        s[LOSS_WEIGHTS_KEY] = (3 * torch.rand(len(s["labels"]), generator=g)).tolist()
    return samples


def per_sample_samples(task: str, *, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 100)
    samples = make_samples(task, BATCH * GA, seed=seed)
    for s in samples:
        s[LOSS_WEIGHTS_KEY] = float(0.5 + 2 * torch.rand((), generator=g))
    return samples


# ---------------------------------------------------------------- the collator: length and kind, by row


@pytest.mark.parametrize("delta", [-1, 1], ids=["one_shorter", "one_longer"])
def test_collator_refuses_per_token_weights_of_another_length_naming_row_and_lengths(delta: int) -> None:
    samples = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7], LOSS_WEIGHTS_KEY: [1.0, 1.0, 1.0]},
               {"input_ids": [8, 9, 10, 11], "labels": [-100, 9, 10, 11], LOSS_WEIGHTS_KEY: [1.0] * (4 + delta)}]  # fmt: skip
    with pytest.raises(GradAccDataError, match=rf"Sample 1 of the micro-batch has {4 + delta} `loss_weights` for 4 `labels`"):
        collator()(samples)


def test_collator_measures_against_input_ids_when_the_collator_makes_the_labels() -> None:
    class MakesLabels(PaddingCollator):
        def __call__(self, samples):
            return super().__call__([{**s, "labels": list(s["input_ids"])} for s in samples])

    collate = LossWeightsCollator(MakesLabels())
    batch = collate([{"input_ids": [5, 6, 7], LOSS_WEIGHTS_KEY: [1.0, 2.0, 3.0]}, {"input_ids": [8, 9], LOSS_WEIGHTS_KEY: [4.0, 5.0]}])
    assert batch[LOSS_WEIGHTS_KEY].tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]]
    with pytest.raises(GradAccDataError, match="Sample 1 of the micro-batch has 1 `loss_weights` for 2 `input_ids`"):
        collate([{"input_ids": [5, 6, 7], LOSS_WEIGHTS_KEY: [1.0, 2.0, 3.0]}, {"input_ids": [8, 9], LOSS_WEIGHTS_KEY: [4.0]}])


def test_collator_refuses_weights_longer_than_labels_a_collator_cut() -> None:
    class Cuts(PaddingCollator):
        def __call__(self, samples):
            batch = super().__call__(samples)
            return {k: v[:, :2] for k, v in batch.items()}

    with pytest.raises(GradAccDataError, match="Sample 0 of the micro-batch has 3 `loss_weights`, but the collated `labels` are 2 wide"):
        LossWeightsCollator(Cuts())([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], LOSS_WEIGHTS_KEY: [1.0, 2.0, 3.0]}])


@pytest.mark.parametrize("task", ["sequence_classification", "regression", "multi_label_classification"])
def test_collator_refuses_per_token_weights_beside_one_label_per_sample(task: str) -> None:
    samples = make_samples(task, 2, seed=0)
    for s in samples:
        s[LOSS_WEIGHTS_KEY] = [1.0] * len(s["input_ids"])
    with pytest.raises(GradAccDataError, match=r"Sample 0 .* list of \d+ `loss_weights` \(per token\), but the batch's `labels`.*one label per sample"):
        collator()(samples)


def test_collator_refuses_a_mix_of_numbers_and_lists_and_nested_lists() -> None:
    base = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    with pytest.raises(GradAccDataError, match=r"Sample 1 .* list of 2 `loss_weights` \(per token\) and sample 0 one number"):
        collator()([{**base[0], LOSS_WEIGHTS_KEY: 1.0}, {**base[1], LOSS_WEIGHTS_KEY: [1.0, 1.0]}])
    with pytest.raises(GradAccDataError, match=r"Sample 0 of the micro-batch has `loss_weights` \[\[1.0"):
        collator()([{**base[0], LOSS_WEIGHTS_KEY: [[1.0, 2.0, 3.0]]}, {**base[1], LOSS_WEIGHTS_KEY: [1.0, 1.0]}])


def test_collator_takes_numpy_and_torch_weights() -> None:
    base = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    batch = collator()([{**base[0], LOSS_WEIGHTS_KEY: np.float32(2.0)}, {**base[1], LOSS_WEIGHTS_KEY: torch.tensor(0.5)}])
    assert batch[LOSS_WEIGHTS_KEY].tolist() == [2.0, 0.5]
    batch = collator()([{**base[0], LOSS_WEIGHTS_KEY: np.ones(3, dtype=np.float32)}, {**base[1], LOSS_WEIGHTS_KEY: torch.ones(2)}])
    assert batch[LOSS_WEIGHTS_KEY].tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


# ---------------------------------------------------------------- where the user meets it: GradAccTrainer


@pytest.mark.parametrize("delta", [-1, 1], ids=["one_shorter", "one_longer"])
def test_trainer_refuses_per_token_weights_of_another_length_before_any_torch_error(delta: int) -> None:
    samples = per_token_samples()
    samples[5][LOSS_WEIGHTS_KEY] = samples[5][LOSS_WEIGHTS_KEY][:-1] if delta < 0 else samples[5][LOSS_WEIGHTS_KEY] + [1.0]
    n = len(samples[5]["labels"])
    with pytest.raises(GradAccDataError, match=rf"has {n + delta} `loss_weights` for {n} `labels`"):
        one_step("causal_lm", samples)


@pytest.mark.parametrize("task", ["sequence_classification", "regression", "multi_label_classification"])
def test_trainer_refuses_per_token_weights_on_a_sample_level_head(task: str) -> None:
    samples = make_samples(task, BATCH * GA, seed=1)
    for s in samples:
        s[LOSS_WEIGHTS_KEY] = [1.0] * len(s["input_ids"])
    with pytest.raises(GradAccDataError, match="one label per sample"):
        one_step(task, samples)


@pytest.mark.parametrize(("problem_type", "name"), [(None, "sequence classification"), ("regression", "regression"),
                                                    ("multi_label_classification", "multi-label classification")])  # fmt: skip
def test_per_token_weights_tensor_on_a_sample_level_head_is_refused_by_name(problem_type, name) -> None:
    """A collator of the user's own (not LossWeightsCollator) that hands [batch, n] weights to a sample-level head."""
    labels = torch.tensor([1, 2]) if problem_type is None else torch.rand(2) if problem_type == "regression" else torch.ones(2, 3)
    with pytest.raises(GradAccDataError, match=rf"has shape \[2, 5\], but a {name} head's loss has one target per sample"):
        target_weight_sum({"labels": labels, LOSS_WEIGHTS_KEY: torch.ones(2, 5)}, "sequence_classification", problem_type=problem_type)


# ---------------------------------------------------------------- weights of uncounted targets: not validated, not read


def test_nan_weights_of_uncounted_targets_are_zero_and_cannot_poison_the_loss() -> None:
    labels = torch.tensor([[-100, 5, 6, -100], [7, 8, -100, 9]])
    # NaN on ignored labels, on padding and on position 0 (no position predicts labels[:, 0])
    weights = torch.tensor([[NAN, 1.0, 2.0, NAN], [NAN, 3.0, NAN, 4.0]])
    per_target = target_weights(weights, labels, head_type="causal_lm")
    assert per_target.tolist() == [[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 4.0, 0.0]]
    assert target_weight_sum({"labels": labels, LOSS_WEIGHTS_KEY: weights}, "causal_lm") == 10.0
    logits = torch.randn(2, 4, 11, requires_grad=True)
    total = weighted_loss_sum(logits, labels, weights, head_type="causal_lm")
    total.backward()
    assert math.isfinite(float(total.detach())) and bool(torch.isfinite(logits.grad).all())
    # sample level: a NaN weight of a sample labelled -100
    logits = torch.randn(2, 3, requires_grad=True)
    total = weighted_loss_sum(logits, torch.tensor([1, -100]), torch.tensor([2.0, NAN]), head_type="sequence_classification")
    total.backward()
    assert math.isfinite(float(total.detach())) and bool(torch.isfinite(logits.grad).all())


def test_a_nan_or_negative_weight_on_a_counted_target_is_still_refused_naming_its_index() -> None:
    labels = torch.tensor([[-100, 5, 6], [7, 8, -100]])
    with pytest.raises(GradAccDataError, match=r"holds a NaN or Inf weight \(nan at index \[1, 1\], row 1\) on a counted"):
        target_weights(torch.tensor([[NAN, 1.0, 1.0], [1.0, NAN, 1.0]]), labels, head_type="causal_lm")
    with pytest.raises(GradAccDataError, match=r"holds a negative weight \(-2 at index \[0, 2\], row 0\)"):
        target_weights(torch.tensor([[1.0, 1.0, -2.0], [1.0, 1.0, 1.0]]), labels, head_type="causal_lm")
    with pytest.raises(GradAccDataError, match=r"holds a NaN or Inf weight \(inf at index \[0\], row 0\)"):
        target_weights(torch.tensor([math.inf, 1.0]), labels, head_type="causal_lm")
    with pytest.raises(GradAccDataError, match=r"NaN or Inf weight \(nan at index \[1\]"):
        target_weights(torch.tensor([1.0, NAN]), torch.tensor([0, 2]), head_type="sequence_classification")


@pytest.mark.parametrize("kind", ["per_token", "per_sample"])
def test_nan_weights_of_uncounted_targets_train_exactly(kind: str) -> None:
    """Through GradAccTrainer: NaN weights where no counted target is (ignored prompt labels, position 0, whole rows
    labelled -100) are accepted and the step equals the float64 reference (which reads no weight there either)."""
    samples = per_token_samples(seed=2) if kind == "per_token" else per_sample_samples("causal_lm", seed=2)
    poisoned = 0
    for s in samples:
        if kind == "per_token":
            w = s[LOSS_WEIGHTS_KEY]
            for j, label in enumerate(s["labels"]):
                if label == -100 or j == 0:
                    w[j], poisoned = NAN, poisoned + 1
        elif all(label == -100 for label in s["labels"][1:]):
            s[LOSS_WEIGHTS_KEY], poisoned = NAN, poisoned + 1
    assert poisoned >= 1
    update, trainer, model = one_step("causal_lm", samples)
    assert trainer.state.global_step == 1 and trainer.num_skipped_windows == 0
    assert all(bool(torch.isfinite(u).all()) for u in update.values())
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison


# ---------------------------------------------------------------- the "weights" denominator: counted samples only


def test_weights_of_samples_labelled_ignore_index_are_not_in_the_denominator() -> None:
    batch = {"labels": torch.tensor([1, -100]), LOSS_WEIGHTS_KEY: torch.tensor([2.5, 3.0])}
    assert target_weight_sum(batch, "sequence_classification") == 2.5  # not 5.5
    assert target_weight_sum(batch, "image_classification", problem_type="single_label_classification") == 2.5


def test_sequence_classification_with_ignored_samples_is_exact() -> None:
    samples = per_sample_samples("sequence_classification", seed=3)
    for i in (1, 4, 6):
        samples[i]["labels"] = -100
    update, _, model = one_step("sequence_classification", samples)
    comparison = compare_with_reference(update, model, samples, "sequence_classification", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison


# ---------------------------------------------------------------- the skip warning says what happened


def test_skip_warning_of_a_zero_weight_step_names_the_weights(caplog) -> None:
    samples = per_sample_samples("causal_lm")
    for s in samples:
        s[LOSS_WEIGHTS_KEY] = 0.0
    with caplog.at_level(logging.WARNING):
        _, trainer, _ = one_step("causal_lm", samples)
    assert trainer.num_skipped_windows == 1
    assert "has no counted weights on any rank (every `loss_weights` of its" in caplog.text
    assert "counted targets is 0): skipped" in caplog.text and "every label is -100" not in caplog.text


@pytest.mark.parametrize("weighted", [True, False])
def test_skip_warning_of_an_all_ignored_step_keeps_saying_every_label_is_ignored(caplog, weighted: bool) -> None:
    samples = per_sample_samples("causal_lm")
    for s in samples:
        s["labels"] = [-100] * len(s["labels"])
        if not weighted:
            del s[LOSS_WEIGHTS_KEY]
    with caplog.at_level(logging.WARNING):
        _, trainer, _ = one_step("causal_lm", samples)
    assert trainer.num_skipped_windows == 1
    kind = "weights" if weighted else "tokens"
    assert f"has no counted {kind} on any rank (every label is -100): skipped" in caplog.text
