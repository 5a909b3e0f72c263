"""Weighted losses (hf_gradacc/weights.py): a `loss_weights` column, per token or per sample, and the denominator the
sum of the weights of counted targets over the whole step and every rank.

One process, per-device batch 2 x GA 4, mixed lengths, heavy padding, against the float64 full batch written out by
hand (hf_gradacc/testing/reference.py). Two data ranks: tests/distributed/test_weighted_ddp.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccDataError, GradAccLossError, GradAccTrainer, LossTerm
from hf_gradacc.counting import MicroBatchCounts, gather_window_counts
from hf_gradacc.errors import GradAccConfigError
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from hf_gradacc.weights import LOSS_WEIGHTS_KEY, LossWeightsCollator, target_weight_sum, weighted_loss_sum

TOL = 1e-5
BATCH, GA = 2, 4


def weighted_samples(task: str, kind: str, *, seed: int = 1, n: int = BATCH * GA) -> list[dict]:
    """``make_samples`` with a ``loss_weights`` column: per sample (one number in [0, 3), one sample weighed 0) or per
    token (one number per label position, a quarter of them 0)."""
    g = torch.Generator().manual_seed(seed + 100)
    samples = make_samples(task, n, seed=seed)
    for i, s in enumerate(samples):
        if kind == "per_sample":
            s[LOSS_WEIGHTS_KEY] = 0.0 if i == 2 else float(3 * torch.rand((), generator=g))
        else:
            w = 3 * torch.rand(len(s["labels"]), generator=g)
            s[LOSS_WEIGHTS_KEY] = (w * (torch.rand(len(w), generator=g) > 0.25)).tolist()
    return samples


def collator() -> LossWeightsCollator:
    return LossWeightsCollator(PaddingCollator())


def one_step(task: str, samples: list[dict], trainer_class=GradAccTrainer, **config):
    model = build_tiny_model(task)
    args = one_step_args(per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, args_class=GradAccConfig,
                         **config)  # fmt: skip
    update, trainer = one_step_update(trainer_class, model, samples, args, data_collator=collator())
    return update, trainer, model


CASES = [
    ("causal_lm", "per_token"),
    ("causal_lm", "per_sample"),
    ("token_classification", "per_token"),
    ("sequence_classification", "per_sample"),
    ("regression", "per_sample"),
]


@pytest.mark.parametrize(("task", "kind"), CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_weighted_step_equals_float64_full_batch(task: str, kind: str) -> None:
    samples = weighted_samples(task, kind)
    update, trainer, model = one_step(task, samples)
    comparison = compare_with_reference(update, model, samples, task, data_collator=collator())
    assert trainer.state.global_step == 1
    assert comparison.relative_error <= TOL, comparison
    # the weights matter: the unweighted reference is far from the update
    plain = [{k: v for k, v in s.items() if k != LOSS_WEIGHTS_KEY} for s in samples]
    assert compare_with_reference(update, model, plain, task).relative_error > 1e-2


@pytest.mark.parametrize("layout", ["regroup", "pack"])
def test_weighted_step_is_exact_regrouped_and_packed(layout: str) -> None:
    samples = weighted_samples("causal_lm", "per_token", seed=3)
    config = {"regroup_micro_batches": True} if layout == "regroup" else {"pack_micro_batches": True}
    update, trainer, model = one_step("causal_lm", samples, **config)
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison


def test_packed_collator_carries_per_sample_weights_per_token() -> None:
    from hf_gradacc.data.pack import PackedCollator

    batch = PackedCollator()([{"input_ids": [5, 6, 7], LOSS_WEIGHTS_KEY: 2.0},
                              {"input_ids": [8, 9], LOSS_WEIGHTS_KEY: [0.5, 0.25]}])  # fmt: skip
    assert batch[LOSS_WEIGHTS_KEY].tolist() == [[2.0, 2.0, 2.0, 0.5, 0.25]]
    # the first label of each sample is masked: 2 + 2 (sample 0) + 0.25 (sample 1)
    assert target_weight_sum(batch, "causal_lm") == pytest.approx(4.25)


def test_weight_sum_travels_in_the_one_count_collective_as_float64() -> None:
    ranks = [
        [MicroBatchCounts(num_tokens=3, num_samples=1, weight_sum=0.1), MicroBatchCounts(num_tokens=2, num_samples=1, weight_sum=0.2)],
        [MicroBatchCounts(num_tokens=1, num_samples=1, weight_sum=1e-9)],
    ]  # fmt: skip
    calls = []

    def all_gather(local: torch.Tensor) -> torch.Tensor:  # two ranks, stacked
        calls.append(local.dtype)
        return torch.stack([local, _vector(ranks[1])])

    counts = gather_window_counts(ranks[0], all_gather)
    assert calls == [torch.int64]  # ONE collective, the count vector's dtype unchanged
    assert counts.global_weights == 0.1 + 0.2 + 1e-9  # float64, no rounding to an integer
    assert counts.global_tokens == 6 and counts.weighted


def _vector(micro_batches) -> torch.Tensor:
    captured = []
    gather_window_counts(micro_batches, lambda t: captured.append(t) or t.unsqueeze(0))
    return captured[0]


def test_micro_batches_with_and_without_weights_are_refused_on_every_rank() -> None:
    ranks = [[MicroBatchCounts(num_tokens=3, num_samples=1, weight_sum=1.0)], [MicroBatchCounts(num_tokens=1, num_samples=1)]]
    with pytest.raises(GradAccDataError, match="loss_weights"):
        gather_window_counts(ranks[0], lambda t: torch.stack([t, _vector(ranks[1])]))


def test_zero_weight_window_is_skipped_without_nan(caplog) -> None:
    samples = weighted_samples("causal_lm", "per_sample")
    for s in samples:
        s[LOSS_WEIGHTS_KEY] = 0.0
    with caplog.at_level(logging.WARNING):
        update, trainer, _ = one_step("causal_lm", samples)
    assert trainer.num_skipped_windows == 1
    assert all(bool(torch.isfinite(u).all()) and not bool(u.any()) for u in update.values())


def test_zero_weight_micro_batch_beside_weighted_ones_is_exact() -> None:
    samples = weighted_samples("causal_lm", "per_token", seed=5)
    for s in samples[:BATCH]:  # the whole first micro-batch weighs 0
        s[LOSS_WEIGHTS_KEY] = [0.0] * len(s["labels"])
    update, _, model = one_step("causal_lm", samples)
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison


def test_negative_weight_is_refused_by_name() -> None:
    samples = weighted_samples("causal_lm", "per_sample")
    samples[4][LOSS_WEIGHTS_KEY] = -0.5
    with pytest.raises(GradAccDataError, match=r"`loss_weights` holds a negative weight \(-0.5"):
        one_step("causal_lm", samples)


def test_per_token_weights_of_the_wrong_shape_are_refused() -> None:
    labels = torch.tensor([[-100, 5, 6], [7, 8, -100]])
    with pytest.raises(GradAccDataError, match="loss_weights` has shape"):
        target_weight_sum({"labels": labels, LOSS_WEIGHTS_KEY: torch.ones(2, 4)}, "causal_lm")
    with pytest.raises(GradAccDataError, match="one per sample"):  # a sequence head takes one weight per row
        target_weight_sum({"labels": torch.tensor([1, 2]), LOSS_WEIGHTS_KEY: torch.ones(2, 3)}, "sequence_classification")


def test_weights_never_reach_the_forward_and_survive_remove_unused_columns() -> None:
    import datasets

    samples = weighted_samples("causal_lm", "per_sample")
    seen: list[set] = []
    model = build_tiny_model("causal_lm")
    model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    args = one_step_args(per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, remove_unused_columns=True)
    dataset = datasets.Dataset.from_list(samples)
    update, trainer = one_step_update(GradAccTrainer, model, samples, args, train_dataset=dataset,
                                      data_collator=collator())  # fmt: skip
    assert trainer.current_window is None and trainer.state.global_step == 1
    assert seen and not any(LOSS_WEIGHTS_KEY in keys for keys in seen)
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison  # the column reached the loss (else 1e-1 off)
    assert LOSS_WEIGHTS_KEY not in trainer.label_names


def test_one_token_off_in_the_weight_sum_fails_the_check(monkeypatch) -> None:
    """The check can fail: a weight sum that leaves out the weight of one counted token (the last one of each
    micro-batch) moves the update past the tolerance."""
    import hf_gradacc.counting as counting
    from hf_gradacc import weights as weights_module

    def one_token_short(batch, head_type, **kwargs):
        total = weights_module.target_weight_sum(batch, head_type, **kwargs)
        w = weights_module.target_weights(batch[LOSS_WEIGHTS_KEY], batch["labels"], head_type=head_type)
        return total - float(w[w > 0].reshape(-1)[-1])

    samples = weighted_samples("causal_lm", "per_token")
    monkeypatch.setattr(counting, "target_weight_sum", one_token_short)
    update, _, model = one_step("causal_lm", samples)
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error > 10 * TOL, comparison


class WeightedOverride(GradAccTrainer):
    """A LossTerm override: per-token losses weighted by the column, normalised by 'weights'."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels, weights = inputs.pop("labels"), inputs.pop(LOSS_WEIGHTS_KEY)
        outputs = model(**inputs)
        total = weighted_loss_sum(outputs.logits, labels, weights, head_type="causal_lm")
        term = LossTerm(total=total, normalize_by="weights")
        return (term, outputs) if return_outputs else term


class PlainOverride(GradAccTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        inputs.pop(LOSS_WEIGHTS_KEY)
        return model(**inputs).loss


def test_loss_term_normalised_by_weights_is_exact() -> None:
    samples = weighted_samples("causal_lm", "per_sample", seed=2)
    update, _, model = one_step("causal_lm", samples, trainer_class=WeightedOverride)
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison


def test_plain_loss_in_a_weighted_step_and_weights_without_column_are_refused() -> None:
    samples = weighted_samples("causal_lm", "per_sample")
    with pytest.raises(GradAccLossError, match="plain tensor for a step whose batches carry `loss_weights`"):
        one_step("causal_lm", samples, trainer_class=PlainOverride)
    unweighted = make_samples("causal_lm", BATCH * GA, seed=1)
    with pytest.raises(GradAccLossError, match="normalised by 'weights' but the step's batches have no"):
        model = build_tiny_model("causal_lm")

        class NoColumn(GradAccTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return LossTerm(total=super().compute_loss(model, inputs).total, normalize_by="weights")

        args = one_step_args(per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA)
        one_step_update(NoColumn, model, unweighted, args)


def test_weights_with_defer_normalization_or_fused_head_are_refused_by_name() -> None:
    samples = weighted_samples("causal_lm", "per_sample")
    with pytest.raises(GradAccConfigError, match="defer_normalization"):
        one_step("causal_lm", samples, defer_normalization=True)
    with pytest.raises(GradAccConfigError, match="fused_lm_head=True` cannot take `loss_weights`"):
        one_step("causal_lm", samples, fused_lm_head=True)


def test_evaluation_loss_is_the_weighted_mean() -> None:
    samples = weighted_samples("causal_lm", "per_sample", n=4)
    model = build_tiny_model("causal_lm")
    args = one_step_args(per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, per_device_eval_batch_size=4)
    trainer = GradAccTrainer(model=model, args=args, train_dataset=ListDataset(samples), data_collator=collator())
    loss = trainer.evaluate(ListDataset(samples))["eval_loss"]
    from hf_gradacc.testing.reference import float64_copy, full_batch_loss

    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in collator()(samples).items()}
    with torch.no_grad():
        expected = float(full_batch_loss(float64_copy(model), batch, "causal_lm"))
    assert loss == pytest.approx(expected, rel=1e-5)


def test_weighted_loss_example_is_exact_and_trains(tmp_path) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "weighted_loss.py"
    spec = importlib.util.spec_from_file_location("weighted_loss_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["weighted_loss_example"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    summary = module.main(["--output_dir", str(tmp_path), "--max_steps", "1", "--per_device_train_batch_size", "2",
                           "--gradient_accumulation_steps", "4", "--report_to", "none", "--use_cpu", "true",
                           "--save_strategy", "no", "--disable_tqdm", "true", "--num_samples", "16"])  # fmt: skip
    assert summary["relative_error"] <= TOL, summary
    assert summary["steps"] == 1 and summary["changed"] and 0 < summary["train_loss"] < 10


def test_automatic_fused_head_stays_off_for_weighted_steps(monkeypatch) -> None:
    """fused_lm_head=None (automatic) never picks the fused head for a weighted step (it would be refused), even where
    the cost model would."""
    import hf_gradacc.fused.choice as fused_choice

    monkeypatch.setattr(fused_choice, "choose", lambda *a, **k: fused_choice.FusedChoice(enabled=True, reason="forced"))
    samples = weighted_samples("causal_lm", "per_sample", seed=4)
    update, trainer, model = one_step("causal_lm", samples)
    assert trainer.step_engine.fused.choice is not None and not trainer.step_engine.fused.choice.enabled
    comparison = compare_with_reference(update, model, samples, "causal_lm", data_collator=collator())
    assert comparison.relative_error <= TOL, comparison
