"""``save_on_preemption`` on one process: a SIGTERM at micro-batch k of a GA-4 window ends training at the end of
THAT window with a complete checkpoint of it (its weights are the uninterrupted run's after that step: the whole
window was trained, nothing of the next), the previous SIGTERM handler is put back and handed the signal, and the
resumed run ends equal to the uninterrupted one. The 2-rank case (SIGTERM to rank 1 only) is
tests/distributed/test_preemption.py; transformers' ``enable_jit_checkpoint`` is taken over here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.checkpoints import latest_complete_checkpoint
from hf_gradacc.step.nonfinite import step_verdict
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

BS, GA, STEPS = 2, 4, 5
SIGNAL_STEP, SIGNAL_MICRO_BATCH = 3, 2  # SIGTERM after micro-batch 2 of the 4 of optimizer step 3
TOLERANCE = 1e-5


class SigtermAt(TrainerCallback):
    """Sends SIGTERM to this process after micro-batch ``micro_batch`` of optimizer step ``step`` (mid-window)."""

    def __init__(self, step: int, micro_batch: int) -> None:
        self.step, self.micro_batch, self.count, self.sent_in_window = step, micro_batch, 0, None
        self.trainer: Any = None

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 != self.step:
            return
        self.count += 1
        if self.count == self.micro_batch:
            window = self.trainer.current_window
            self.sent_in_window = (window.num_micro_batches, window.is_last)
            os.kill(os.getpid(), signal.SIGTERM)


class Snapshots(TrainerCallback):
    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.trainer: Any = None

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}


def _trainer(output_dir: Path, *callbacks: Any, **overrides: Any) -> GradAccTrainer:
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        max_steps=STEPS,
        learning_rate=0.05,
        optim="adamw_torch",
        lr_scheduler_type="linear",
        save_strategy="no",  # the preemption checkpoint is saved whatever the strategy
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        save_on_preemption=True,
    )
    kwargs.update(overrides)
    samples = make_samples("causal_lm", BS * GA * STEPS, seed=1)
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=GradAccConfig(**kwargs),
        train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(),
        callbacks=list(callbacks),
    )
    for callback in callbacks:
        callback.trainer = trainer
    return trainer


def _relative(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    """||ours - theirs|| / ||theirs - initial|| over every parameter: the error against the run's parameter change."""
    diff = sum(float((ours[n].float() - theirs[n].float()).pow(2).sum()) for n in theirs)
    change = sum(float((theirs[n].float() - initial[n].float()).pow(2).sum()) for n in theirs)
    return (diff / change) ** 0.5


@pytest.fixture
def sigterm_recorder():
    """A Python SIGTERM handler in place before train() (as submitit installs one); restored after the test."""
    calls: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    handler = signal.getsignal(signal.SIGTERM)
    yield handler, calls
    signal.signal(signal.SIGTERM, original)


def test_sigterm_mid_window_saves_that_window_and_resumes_exactly(tmp_path: Path, sigterm_recorder) -> None:
    previous, calls = sigterm_recorder
    initial = {n: p.detach().clone() for n, p in build_tiny_model("causal_lm").named_parameters()}

    full = Snapshots()
    uninterrupted = _trainer(tmp_path / "full", full)
    uninterrupted.train()
    assert not uninterrupted.preempted and uninterrupted.state.global_step == STEPS
    assert calls == []  # no signal, nothing handed on

    sender = SigtermAt(SIGNAL_STEP, SIGNAL_MICRO_BATCH)
    stopped = _trainer(tmp_path / "run", sender)
    stopped.train()
    assert sender.sent_in_window == (GA, False)  # the signal came mid-window
    assert stopped.preempted and stopped.state.global_step == SIGNAL_STEP  # stopped at the end of that window
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler in place before train() is back
    assert calls == [signal.SIGTERM]  # and it got the signal, once, after the checkpoint
    checkpoint = latest_complete_checkpoint(str(tmp_path / "run"))
    assert Path(checkpoint).name == f"checkpoint-{SIGNAL_STEP}"
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [f"checkpoint-{SIGNAL_STEP}"]
    # the checkpoint holds the whole window: the uninterrupted run's weights after that step, not one micro-batch less
    saved = load_file(str(Path(checkpoint) / "model.safetensors"))
    after = full.after[SIGNAL_STEP]
    assert max(float((saved[n] - after[n]).abs().max()) for n in saved) == 0.0

    resumed = _trainer(tmp_path / "run")
    resumed.train(resume_from_checkpoint=True)
    assert not resumed.preempted and resumed.state.global_step == STEPS
    final = {n: p.detach() for n, p in resumed.model.named_parameters()}
    error = _relative(final, full.after[STEPS], initial)
    assert error <= TOLERANCE, error


def test_without_a_python_handler_the_process_lives_on_and_the_default_is_back(tmp_path: Path) -> None:
    original = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        sender = SigtermAt(2, 1)
        trainer = _trainer(tmp_path, sender, max_steps=3)
        trainer.train()
        assert trainer.preempted and trainer.state.global_step == 2
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored; the default action is not replayed
    finally:
        signal.signal(signal.SIGTERM, original)


def test_off_by_default_and_the_flag_rides_in_the_verdicts_all_reduce() -> None:
    assert GradAccConfig(output_dir="unused", report_to=[]).save_on_preemption is False
    sent: list[list[float]] = []

    def agree(tensor: torch.Tensor) -> torch.Tensor:
        sent.append(tensor.tolist())
        return tensor * 2  # two ranks alike

    # propagate, preemption off: no collective at all; on: one, carrying [nonfinite 0, signalled]
    assert step_verdict("propagate", 1.0, step=1, rank=0, losses=[], agree=agree).ranks_signalled == 0
    assert sent == []
    assert step_verdict("propagate", 1.0, step=1, rank=0, losses=[], agree=agree, signalled=True).ranks_signalled == 2
    assert sent == [[0.0, 1.0]]
    verdict = step_verdict("skip", 1.0, step=1, rank=0, losses=[], agree=agree, signalled=False)
    assert sent[-1] == [0.0, 0.0] and not verdict.skip and verdict.ranks_signalled == 0
    verdict = step_verdict("skip", float("nan"), step=1, rank=0, losses=[], agree=agree, signalled=True)
    assert verdict.skip and verdict.ranks_signalled == 2 and len(sent) == 3  # still ONE all-reduce per step


def test_enable_jit_checkpoint_is_taken_over_by_the_agreed_checkpoint(tmp_path: Path, caplog) -> None:
    original = signal.getsignal(signal.SIGTERM)
    args = TrainingArguments(output_dir=str(tmp_path), enable_jit_checkpoint=True, report_to=[], use_cpu=True)
    with caplog.at_level("WARNING"):
        trainer = GradAccTrainer(
            model=build_tiny_model("causal_lm"),
            args=args,
            train_dataset=ListDataset(make_samples("causal_lm", 4, seed=1)),
            data_collator=PaddingCollator(),
        )
    assert trainer.gradacc.save_on_preemption is True
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert "JITCheckpointCallback" not in names, names
    assert signal.getsignal(signal.SIGTERM) == original  # the handler transformers installed at construction is gone
    assert any("enable_jit_checkpoint=True" in r.getMessage() and "wins" in r.getMessage() for r in caplog.records)


def test_a_preemption_checkpoint_that_cannot_be_resumed_is_warned_about(tmp_path: Path, caplog) -> None:
    with caplog.at_level("WARNING"):
        GradAccConfig(output_dir=str(tmp_path), save_on_preemption=True, save_only_model=True, report_to=[])
    assert any("save_only_model=True" in r.getMessage() and "cannot resume" in r.getMessage() for r in caplog.records)
