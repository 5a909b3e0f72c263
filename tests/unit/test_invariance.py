"""Trajectory invariance: the split of a step into micro-batches does not change training.

Causal LM with mixed lengths, the default AdamW and linear schedule, exactly 3 windows of 8 samples and 3 optimizer
steps: per-device batch 8 x GA 1, 4 x 2, 2 x 4 and 1 x 8 end on the same parameters (difference <= 1e-5 of the
distance travelled). The Trainer's seeded sampler yields the same permutation of the 24 indices whatever the batch
size, so each step sees the same samples; the stock Trainer with a masked-LM head is shown to differ.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.tiny import ListDataset, build_tiny_model, make_samples

TOLERANCE = 1e-5
STEPS, WINDOW = 3, 8
SPLITS = [(8, 1), (4, 2), (2, 4), (1, 8)]


_RUNS: dict[tuple, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _final_params(helpers, trainer_class, task: str, batch_size: int, ga: int):
    """(initial, final) trainable parameters after STEPS optimizer steps; cached per configuration."""
    key = (trainer_class, task, batch_size, ga)
    if key not in _RUNS:
        _RUNS[key] = _train(helpers, trainer_class, task, batch_size, ga)
    return _RUNS[key]


def _train(helpers, trainer_class, task: str, batch_size: int, ga: int):
    model = build_tiny_model(task)
    samples = make_samples(task, STEPS * WINDOW, seed=7)
    args = helpers.make_args(
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=ga,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=100,
    )
    run = helpers.run_training(trainer_class, model, ListDataset(samples), args)
    assert run.trainer.state.global_step == STEPS
    return run.snapshots[0], run.snapshots[-1]


def _relative_difference(initial, a, b) -> float:
    diff = torch.cat([(a[n] - b[n]).reshape(-1) for n in a]).double().norm()
    travelled = torch.cat([(a[n] - initial[n]).reshape(-1) for n in a]).double().norm()
    return float(diff / travelled)


@pytest.mark.parametrize("split", SPLITS[1:], ids=lambda s: f"bs{s[0]}_ga{s[1]}")
def test_gradacc_trajectory_does_not_depend_on_the_split(helpers, split) -> None:
    initial, full_batch = _final_params(helpers, GradAccTrainer, "causal_lm", *SPLITS[0])
    _, accumulated = _final_params(helpers, GradAccTrainer, "causal_lm", *split)
    assert _relative_difference(initial, full_batch, accumulated) <= TOLERANCE


def test_stock_trainer_trajectory_depends_on_the_split(helpers) -> None:
    # masked LM: the stock step has the wrong direction, not only the wrong scale (which AdamW would hide)
    initial, full_batch = _final_params(helpers, Trainer, "masked_lm", *SPLITS[0])
    _, accumulated = _final_params(helpers, Trainer, "masked_lm", *SPLITS[-1])
    assert _relative_difference(initial, full_batch, accumulated) > 1e-2
