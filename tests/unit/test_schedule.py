"""Accumulation schedules (``accumulation_schedule``, ``lr_scaling``) on one process.

Every optimizer step is compared with the float64 full-batch reference over ITS OWN samples at the parameters it
started from (:mod:`hf_gradacc.testing.steps`), with mixed lengths, heavy padding and ignored targets; the loop's
lengths (steps per epoch, ``max_steps``, epochs, the scheduler) follow the schedule; a run resumed mid-schedule
ends bit-identical to the uninterrupted one. A 1 % error in the denominator fails the tier.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import HfArgumentParser, TrainerCallback

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer
from hf_gradacc.schedule import AccumulationSchedule, scaled_learning_rate, scheduled_training_values
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.steps import StepRecorder, check_steps
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
BS, BASE_GA = 2, 2
SCHEDULE = "0:1,2:3,4:2"
NUM_SAMPLES = 22  # 11 micro-batches per epoch: windows [1, 1, 3, 3, 2, 1] then [2, 2, 2, 2, 2, 1]


# ---------------------------------------------------------------------------------------------- the schedule itself
def test_parse_and_lookup() -> None:
    schedule = AccumulationSchedule.parse("0:1, 200:4 ,1000:8", base=8)
    assert [schedule.at(s) for s in (0, 199, 200, 999, 1000, 10**9)] == [1, 1, 4, 4, 8, 8]
    assert str(schedule) == "0:1,200:4,1000:8"
    assert AccumulationSchedule.parse({5: 2}, base=3).at(4) == 3  # before the first milestone: the base
    assert schedule.lr_factor(0, "linear") == pytest.approx(1 / 8)
    assert schedule.lr_factor(250, "sqrt") == pytest.approx(math.sqrt(4 / 8))
    assert schedule.lr_factor(250, "none") == 1.0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("0:1,200", "is not 'step:accumulation'"),
        ("0:1,-5:2", "step '-5' must be an int >= 0"),
        ("0:0", "accumulation '0' at step 0 must be an int >= 1"),
        ("0:2.5", "accumulation '2.5'"),
        ("10:2,5:4", "increasing and distinct"),
        ("0:1,0:2", "increasing and distinct"),
        (3, "must be a string like"),
    ],
)
def test_bad_schedules_name_the_field_and_value(spec, needle) -> None:
    with pytest.raises(GradAccConfigError, match="accumulation_schedule") as info:
        GradAccConfig(output_dir="out", use_cpu=True, accumulation_schedule=spec)
    assert needle in str(info.value)


def test_schedule_refuses_regrouping_and_warns_about_ignored_lr_scaling(caplog) -> None:
    with pytest.raises(GradAccConfigError, match="cannot be combined with `regroup_micro_batches`"):
        GradAccConfig(output_dir="out", use_cpu=True, accumulation_schedule="0:1", pack_micro_batches=True)
    with pytest.raises(GradAccConfigError, match="`lr_scaling` \\('cube'\\) must be one of"):
        GradAccConfig(output_dir="out", use_cpu=True, lr_scaling="cube")
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    with caplog.at_level("WARNING"):
        GradAccConfig(output_dir="out", use_cpu=True, lr_scaling="linear")
    assert "`lr_scaling` ('linear') is ignored" in caplog.text


def test_from_the_command_line() -> None:
    (args,) = HfArgumentParser(GradAccConfig).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "true", "--gradient_accumulation_steps", "8",
         "--accumulation_schedule", "0:1,200:4,1000:8", "--lr_scaling", "sqrt"]
    )  # fmt: skip
    assert args.accumulation_schedule == "0:1,200:4,1000:8" and args.lr_scaling == "sqrt"


def test_windows_and_run_lengths_agree_with_a_simulation() -> None:
    schedule = AccumulationSchedule.parse("0:1,3:4,6:8", base=8)
    for first in range(12):
        for batches in range(1, 40):
            windows = list(schedule.windows(first, batches))
            assert sum(windows) == batches and schedule.steps_per_epoch(first, batches) == len(windows)
            assert all(w == schedule.at(first + k) for k, w in enumerate(windows[:-1]))
    # 2.5 epochs of 20 micro-batches: 7 + 3 steps, then half (rounded up) of the third epoch's 3
    assert schedule.plan(20, num_train_epochs=2.5) == (12, 3)
    assert schedule.plan(20, max_steps=11) == (11, 3)
    # where a run stands, for every step of 4 epochs: replaying the windows gives the same answer
    step = 0
    for epoch in range(4):
        done = 0
        for size in schedule.windows(step, 20):
            assert schedule.locate(step, 20) == (epoch, done)
            done, step = done + size, step + 1
    assert schedule.locate(5, None) == (0, 1 + 1 + 1 + 4 + 4)  # no length: one long epoch
    run = scheduled_training_values(
        schedule, batches_per_epoch=20, num_train_epochs=2, max_steps=-1, samples_per_micro_batch=4
    )
    assert (run.max_steps, run.num_train_epochs, run.num_train_samples) == (10, 2, 2 * 20 * 4)


def test_scaled_learning_rate_restores_the_groups() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.5)
    param.grad = torch.ones(3)
    with scaled_learning_rate(optimizer.param_groups, 0.25):
        assert optimizer.param_groups[0]["lr"] == 0.125
        optimizer.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert torch.allclose(param.detach(), torch.full((3,), 1 - 0.125))


# ---------------------------------------------------------------------------------------------- training
def _train(tmp_path, *, lr_scaling: str = "none", callbacks=(), sgd: bool = True, **overrides):
    model = build_tiny_model("causal_lm", seed=0)
    samples = make_samples("causal_lm", NUM_SAMPLES, seed=3)
    recorder = StepRecorder(samples)
    kwargs = dict(
        args_class=GradAccConfig,
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=BASE_GA,
        accumulation_schedule=SCHEDULE,
        lr_scaling=lr_scaling,
        max_steps=-1,
        num_train_epochs=2,
        seed=0,
    )
    if not sgd:  # the Trainer's AdamW with a warm-up: optimizer and scheduler state matter on resume
        kwargs.update(optim="adamw_torch", learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=3)
    kwargs.update(overrides)
    args = one_step_args(str(tmp_path / "run"), **kwargs)
    trainer = GradAccTrainer(
        model=model,
        args=args,
        train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(),
        callbacks=[recorder, *callbacks],
    )
    return model, samples, recorder, trainer


def test_every_step_is_exact_for_its_own_window(tmp_path) -> None:
    model, samples, recorder, trainer = _train(tmp_path)
    trainer.train()
    assert [s.micro_batches for s in recorder.steps] == [1, 1, 3, 3, 2, 1, 2, 2, 2, 2, 2, 1]
    assert trainer.state.global_step == trainer.state.max_steps == 12
    assert sorted(i for s in recorder.steps[:6] for i in s.samples) == list(range(NUM_SAMPLES))  # epoch 1, whole
    errors = [c.relative_error for c in check_steps(recorder.steps, model, samples, "causal_lm")]
    assert max(errors) <= TOLERANCE, errors
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["accumulation_steps"] for h in history] == [1, 1, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2]  # the schedule's
    assert [h["effective_batch_size"] for h in history] == [len(s.samples) for s in recorder.steps]
    assert history[-1]["epoch"] == pytest.approx(2.0)


def test_a_one_percent_denominator_error_fails_the_tier(tmp_path, monkeypatch) -> None:
    from hf_gradacc.counting import WindowCounts

    counted = WindowCounts.global_count

    def off_by_one(self, denominator):
        return counted(self, denominator) + 1  # one token more: about 1 % of these windows' counts

    monkeypatch.setattr(WindowCounts, "global_count", off_by_one)
    model, samples, recorder, trainer = _train(tmp_path)
    trainer.train()
    errors = [c.relative_error for c in check_steps(recorder.steps, model, samples, "causal_lm")]
    assert min(errors) > 100 * TOLERANCE, errors


@pytest.mark.parametrize(("rule", "factor"), [("linear", lambda r: r), ("sqrt", math.sqrt)])
def test_lr_scaling_multiplies_the_rate_the_step_uses(tmp_path, rule, factor) -> None:
    _, _, recorder, trainer = _train(tmp_path, lr_scaling=rule)
    trainer.train()
    schedule = AccumulationSchedule.parse(SCHEDULE, base=BASE_GA)
    steps = recorder.steps
    for step, after in zip(steps, [*steps[1:], None]):
        expected = factor(schedule.at(step.step) / BASE_GA)
        assert step.learning_rate == pytest.approx(expected)  # logged: the constant rate 1.0 x the factor
        if after is None:
            continue
        # SGD: the update is -lr x factor x gradient
        moved = torch.cat([(step.params[n] - after.params[n]).reshape(-1) for n in step.grads])
        grad = torch.cat([step.grads[n].reshape(-1) for n in step.grads])
        assert float((moved - expected * grad).norm() / (expected * grad).norm()) <= 1e-5
    assert trainer.optimizer.param_groups[0]["lr"] == 1.0  # the scheduler's own rate is left in the groups


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("stop_at", [3, 5, 6, 9])  # mid-stretch, mid-epoch, an epoch boundary, epoch 2
def test_resume_mid_schedule_is_bit_identical(tmp_path, stop_at: int) -> None:
    common = dict(sgd=False, lr_scaling="sqrt", save_strategy="steps", save_steps=stop_at)
    _, _, _, full = _train(tmp_path / "full", **common)
    full.train()
    _, _, _, first = _train(tmp_path / "resumed", callbacks=[_StopAt(stop_at)], **common)
    first.train()
    assert first.state.global_step == stop_at
    _, _, recorder, second = _train(tmp_path / "resumed", **common)
    second.train(resume_from_checkpoint=True)
    assert [s.step for s in recorder.steps] == list(range(stop_at, 12))
    for name, param in full.model.named_parameters():
        assert torch.equal(param, dict(second.model.named_parameters())[name]), name
    resumed_logs = [h for h in second.state.log_history if "loss" in h]
    full_logs = [h for h in full.state.log_history if "loss" in h]
    assert resumed_logs[-1]["loss"] == full_logs[-1]["loss"]
    assert resumed_logs[-1]["learning_rate"] == full_logs[-1]["learning_rate"]


def test_max_steps_stops_inside_the_schedule_and_the_scheduler_spans_it(tmp_path) -> None:
    _, _, recorder, trainer = _train(tmp_path, max_steps=8, sgd=False)
    trainer.train()
    assert trainer.state.global_step == 8 and trainer.state.num_train_epochs == 2
    assert [s.micro_batches for s in recorder.steps] == [1, 1, 3, 3, 2, 1, 2, 2]
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0)  # linear decay reached its end at step 8


def test_an_iterable_dataset_follows_the_schedule(tmp_path) -> None:
    from hf_gradacc.testing.tiny import ListIterableDataset

    model = build_tiny_model("causal_lm", seed=0)
    samples = make_samples("causal_lm", NUM_SAMPLES, seed=3)
    recorder = StepRecorder(samples)
    args = one_step_args(
        str(tmp_path), args_class=GradAccConfig, per_device_train_batch_size=BS, gradient_accumulation_steps=BASE_GA,
        accumulation_schedule=SCHEDULE, max_steps=5,
    )  # fmt: skip
    trainer = GradAccTrainer(
        model=model, args=args, train_dataset=ListIterableDataset(samples), data_collator=PaddingCollator(),
        callbacks=[recorder],
    )  # fmt: skip
    trainer.train()
    assert [s.micro_batches for s in recorder.steps] == [1, 1, 3, 3, 2]
    errors = [c.relative_error for c in check_steps(recorder.steps, model, samples, "causal_lm")]
    assert max(errors) <= TOLERANCE, errors


def test_the_example_follows_its_schedule_exactly(tmp_path) -> None:
    """examples/accumulation_schedule.py, unchanged: 40 documents at batch 4, 10 micro-batches per epoch, base GA 4,
    schedule 0:1,3:2,5:4 (windows [1, 1, 1, 2, 2, 3] then [4, 4, 2]), sqrt scaling of a constant rate 1e-2. Every
    logged number is checked, and every step against the float64 reference of its own samples."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "accumulation_schedule.py"
    spec = importlib.util.spec_from_file_location("accumulation_schedule_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    from hf_gradacc.testing.tiny import synthetic_clm_dataset

    dataset = synthetic_clm_dataset(40, seed=42, mean_log_words=2.3)  # what the script builds (--seed 42, its default)
    samples = [dict(row) for row in dataset]
    recorder = StepRecorder(samples)
    summary = module.main(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", "--num_samples", "40",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4", "--accumulation_schedule",
         "0:1,3:2,5:4", "--lr_scaling", "sqrt", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
         "--num_train_epochs", "2", "--logging_steps", "1", "--save_strategy", "no", "--optim", "sgd",
         "--max_grad_norm", "0"],
        callbacks=[recorder],
    )  # fmt: skip
    windows = [1, 1, 1, 2, 2, 3, 4, 4, 2]
    assert summary["global_step"] == summary["max_steps"] == len(windows)
    assert [s.micro_batches for s in recorder.steps] == windows
    scheduled = [1, 1, 1, 2, 2, 4, 4, 4, 4]
    assert [h["accumulation_steps"] for h in summary["logs"]] == scheduled
    assert [h["effective_batch_size"] for h in summary["logs"]] == [len(s.samples) for s in recorder.steps]
    assert [h["learning_rate"] for h in summary["logs"]] == pytest.approx([1e-2 * math.sqrt(g / 4) for g in scheduled])
    from hf_gradacc.testing.tiny import build_tiny_model as tiny

    errors = [c.relative_error for c in check_steps(recorder.steps, tiny("causal_lm", seed=42), samples, "causal_lm")]
    assert max(errors) <= TOLERANCE, errors


def test_logged_values_are_means_per_step_between_log_lines(tmp_path) -> None:
    _, _, recorder, trainer = _train(tmp_path, logging_steps=3)
    trainer.train()
    scheduled = [AccumulationSchedule.parse(SCHEDULE, base=BASE_GA).at(s.step) for s in recorder.steps]
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in history] == [3, 6, 9, 12]
    for k, h in enumerate(history):
        steps = recorder.steps[3 * k : 3 * k + 3]
        assert h["accumulation_steps"] == pytest.approx(sum(scheduled[3 * k : 3 * k + 3]) / 3)
        assert h["effective_batch_size"] == pytest.approx(sum(len(s.samples) for s in steps) / 3)
