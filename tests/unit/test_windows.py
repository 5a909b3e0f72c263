"""Where optimizer steps fall: short last windows, epochs of an IterableDataset, windows without counted tokens.

Every step is checked on its own: parameters are snapshotted before and after each optimizer step, the optimizer
is SGD(lr=1), so the update of step k must equal the float64 full-batch gradient of step k's samples at the
parameters before step k (relative error <= 1e-5).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import Trainer

from hf_gradacc import IGNORE_INDEX, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import ListDataset, ListIterableDataset, build_tiny_model, make_samples

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4


def _sgd_args(helpers, **overrides):
    kwargs = dict(
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=GA,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
    )
    return helpers.make_args(**{**kwargs, **overrides})


def _windows(samples: list[dict], sizes: list[int]) -> list[list[dict]]:
    out, start = [], 0
    for size in sizes:
        out.append(samples[start : start + size])
        start += size
    return out


def _assert_steps_exact(helpers, run, model, windows, task="causal_lm") -> None:
    assert run.trainer.state.global_step == len(windows)
    assert run.num_optimizer_steps == len(windows)
    for k, window in enumerate(windows, start=1):
        reference = helpers.reference_at(model, run.snapshots[k - 1], window, task)
        comparison = compare(run.update(k), reference)
        assert comparison.relative_error <= TOLERANCE, f"step {k} ({len(window)} samples): {comparison}"


# ---------------------------------------------------------------- IterableDataset, epoch not a multiple of GA


def test_iterable_dataset_short_last_window_is_its_own_step(helpers) -> None:
    """10 samples = 5 micro-batches per epoch = windows of 4 + 1 micro-batches; 4 steps span 2 epochs."""
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 10, seed=3)
    run = helpers.run_training(
        GradAccTrainer, model, ListIterableDataset(samples), _sgd_args(helpers, max_steps=4), sgd_lr=1.0
    )
    # epoch 1: [0:8], [8:10]; epoch 2 starts clean: [0:8], [8:10]
    _assert_steps_exact(helpers, run, model, _windows(samples + samples, [8, 2, 8, 2]))


def test_stock_trainer_leaks_iterable_leftover_into_next_epoch(helpers) -> None:
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 10, seed=3)
    args = _sgd_args(helpers, max_steps=2)
    run = helpers.run_training(Trainer, model, ListIterableDataset(samples), args, sgd_lr=1.0)
    assert run.trainer.state.global_step == 2
    first = compare(run.update(1), helpers.reference_at(model, run.snapshots[0], samples[:8], "causal_lm"))
    assert first.relative_error <= TOLERANCE, first
    # the first step of epoch 2 should be samples[0:8] alone; the stock Trainer adds the leftover micro-batch
    fresh = helpers.reference_at(model, run.snapshots[1], samples[:8], "causal_lm")
    second = compare(run.update(2), fresh)
    assert second.relative_error > 1e-2, second
    leftover = helpers.reference_at(model, run.snapshots[1], samples[8:], "causal_lm")
    leaked = compare(run.update(2), {n: fresh[n] + leftover[n] for n in fresh})
    assert leaked.relative_error <= TOLERANCE, leaked


# ---------------------------------------------------------------- map-style, size not a multiple of bs * GA


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_map_style_short_last_window_is_exact(helpers, task: str) -> None:
    """11 samples = micro-batches of 2,2,2,2 | 2,1: the last window holds 2 micro-batches and 3 samples."""
    model = build_tiny_model(task)
    samples = make_samples(task, 11, seed=4)
    run = helpers.run_training(
        helpers.sequential(GradAccTrainer),
        model,
        ListDataset(samples),
        _sgd_args(helpers, num_train_epochs=2),
        sgd_lr=1.0,
    )
    _assert_steps_exact(helpers, run, model, _windows(samples + samples, [8, 3, 8, 3]), task)


# ---------------------------------------------------------------- windows without counted tokens


def _without_labels(sample: dict, task: str) -> dict:
    sample = dict(sample)
    if task == "sequence_classification":
        sample["labels"] = IGNORE_INDEX
    else:
        sample["labels"] = [IGNORE_INDEX] * len(sample["labels"])
    return sample


@pytest.mark.parametrize("task", ["causal_lm", "token_classification", "sequence_classification"])
def test_window_without_counted_labels_is_skipped(helpers, task: str, caplog) -> None:
    """Window 1 has no counted label: skipped with a warning; window 2 becomes the one, exact, optimizer step."""
    model = build_tiny_model(task)
    samples = make_samples(task, 16, seed=5)
    samples[:8] = [_without_labels(s, task) for s in samples[:8]]
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        run = helpers.run_training(
            helpers.sequential(GradAccTrainer),
            model,
            ListDataset(samples),
            _sgd_args(helpers, num_train_epochs=1, max_grad_norm=1e9),
            sgd_lr=1.0,
        )
    assert run.trainer.num_skipped_windows == 1
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and str(IGNORE_INDEX) in skipped[0], skipped
    _assert_steps_exact(helpers, run, model, [samples[8:]], task)
    for entry in run.logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]), entry


def test_only_window_without_counted_labels_leaves_parameters_unchanged(helpers, caplog) -> None:
    model = build_tiny_model("causal_lm")
    samples = [_without_labels(s, "causal_lm") for s in make_samples("causal_lm", 8, seed=5)]
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        run = helpers.run_training(
            GradAccTrainer, model, ListDataset(samples), _sgd_args(helpers, num_train_epochs=1), sgd_lr=1.0
        )
    assert run.trainer.state.global_step == 0 and run.num_optimizer_steps == 0
    assert run.trainer.num_skipped_windows == 1
    assert any("skipped" in r.getMessage() for r in caplog.records)
    final = helpers.trainable_params(run.trainer.model)
    initial = helpers.trainable_params(model)
    assert all(torch.equal(initial[n], final[n]) for n in initial)
    for entry in run.trainer.state.log_history:
        assert all(math.isfinite(v) for v in entry.values() if isinstance(v, float)), entry


@pytest.mark.parametrize("empty_micro_batches", [(1,), (3,), (0, 2)], ids=lambda m: "empty_" + "_".join(map(str, m)))
def test_window_with_some_empty_micro_batches_is_exact(helpers, empty_micro_batches: tuple[int, ...]) -> None:
    """Micro-batches whose labels are all ignored add nothing, and do not shift the others' weights."""
    samples = make_samples("causal_lm", BATCH_SIZE * GA, seed=6)
    for m in empty_micro_batches:
        for i in range(m * BATCH_SIZE, (m + 1) * BATCH_SIZE):
            samples[i] = _without_labels(samples[i], "causal_lm")
    model = build_tiny_model("causal_lm")
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    update, _ = one_step_update(helpers.sequential(GradAccTrainer), model, samples, args)
    assert all(bool(torch.isfinite(u).all()) for u in update.values())
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison
