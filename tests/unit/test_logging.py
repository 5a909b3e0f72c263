"""The logged `loss` and `grad_norm` of a step are those of the full batch, and clipping uses that exact norm.

Per-device batch 2 x GA 4, mixed lengths and heavy padding, one SGD(lr=1) step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import TASKS, ListDataset, PaddingCollator, build_tiny_model, make_samples, two_term_loss

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4


def _reference(task: str, model: torch.nn.Module, samples: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model).double().eval()
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in PaddingCollator()(samples).items()}
    with torch.no_grad():
        loss = float(full_batch_loss(ref, batch, task))
    return loss, reference_gradients(model, samples, task, PaddingCollator())


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([g.reshape(-1).double() for g in grads.values()]).norm())


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e9], ids=["no_clipping", "clip_at_1e9"])
@pytest.mark.parametrize("task", TASKS)
def test_logged_loss_and_grad_norm_are_the_full_batch_ones(task: str, max_grad_norm: float) -> None:
    model = build_tiny_model(task)
    samples = make_samples(task, BATCH_SIZE * GA, seed=8)
    args = one_step_args(
        per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, max_grad_norm=max_grad_norm
    )
    _, trainer = one_step_update(GradAccTrainer, model, samples, args)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1
    expected_loss, reference = _reference(task, model, samples)
    assert logs[0]["loss"] == pytest.approx(expected_loss, rel=TOLERANCE)
    assert "grad_norm" in logs[0], logs[0]
    assert logs[0]["grad_norm"] == pytest.approx(_norm(reference), rel=TOLERANCE)


def test_clipping_scales_the_exact_gradient_to_max_grad_norm() -> None:
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", BATCH_SIZE * GA, seed=8)
    _, reference = _reference("causal_lm", model, samples)
    max_grad_norm = 0.25 * _norm(reference)
    args = one_step_args(
        per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, max_grad_norm=max_grad_norm
    )
    update, trainer = one_step_update(GradAccTrainer, model, samples, args)
    clipped = compare(update, {n: 0.25 * g for n, g in reference.items()})
    assert clipped.relative_error <= TOLERANCE, clipped
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged == pytest.approx([_norm(reference)], rel=TOLERANCE)  # the norm before clipping


class _TwoTerms(GradAccTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        terms, outputs = two_term_loss(model, inputs, reg_weight=0.05)
        return (terms, outputs) if return_outputs else terms


def _term_logs(logging_steps: int) -> list[dict]:
    samples = make_samples("causal_lm", BATCH_SIZE * GA * 4, seed=9)
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, max_steps=-1,
                         num_train_epochs=1, logging_steps=logging_steps, learning_rate=0.1)  # fmt: skip
    trainer = _TwoTerms(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                        data_collator=PaddingCollator())  # fmt: skip
    trainer.train()
    return [h for h in trainer.state.log_history if "loss/ce" in h]


def test_per_term_logs_are_averaged_over_the_logging_interval() -> None:
    """Logging every 2 steps: `loss/<name>` is the MEAN of the interval's steps (as `loss` is), not their sum."""
    every_step, every_other = _term_logs(1), _term_logs(2)
    assert len(every_step) == 4 and len(every_other) == 2
    for k, log in enumerate(every_other):
        steps = every_step[2 * k : 2 * k + 2]
        for key in ("loss", "loss/ce", "loss/reg"):
            assert log[key] == pytest.approx(sum(s[key] for s in steps) / 2, rel=1e-4), (key, log, steps)
        assert log["loss"] == pytest.approx(log["loss/ce"] + log["loss/reg"], rel=1e-4)
