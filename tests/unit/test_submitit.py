"""submitit's local executor, the way docs/elastic.md's submitit recipe runs on SLURM: the job is a
``submitit.helpers.Checkpointable`` that resumes from the newest complete checkpoint of its ``output_dir``;
``job._interrupt()`` sends the preemption signal (SIGTERM with ``SUBMITIT_PREEMPT_SIGNAL=TERM``, as SLURM's
``--signal=TERM@<s>``) mid-window. ``save_on_preemption`` saves the step in flight, then hands the signal to submitit's
handler, which requeues the job; the requeued job resumes and ends equal to an uninterrupted run in this process.

Skipped when submitit is not installed (``pip install submitit``).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

submitit = pytest.importorskip("submitit")
pytestmark = pytest.mark.slow  # two job starts (about 90 s on 2 loaded cores)

BS, GA, STEPS = 2, 4, 5
SIGNAL_STEP, SIGNAL_MICRO_BATCH = 3, 2
TOLERANCE = 1e-5
WAIT_S = 120.0


class WaitForSignal(TrainerCallback):
    """After micro-batch 2 of step 3 (mid-window): write ``ready`` for the test, then wait until the preemption signal
    has arrived (the test's ``job._interrupt()``), so the signal lands mid-window on every machine."""

    def __init__(self, ready: Path) -> None:
        self.ready, self.count, self.trainer = ready, 0, None

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 != SIGNAL_STEP:
            return
        self.count += 1
        if self.count != SIGNAL_MICRO_BATCH:
            return
        self.ready.write_text(str(self.trainer.current_window.index))
        deadline = time.monotonic() + WAIT_S
        while self.trainer.step_engine.preemption.signalled is None and time.monotonic() < deadline:
            time.sleep(0.05)


def build_trainer(output_dir: str, *callbacks: Any) -> GradAccTrainer:
    args = GradAccConfig(
        output_dir=output_dir,
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        max_steps=STEPS,
        learning_rate=0.05,
        optim="adamw_torch",
        lr_scheduler_type="linear",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        save_on_preemption=True,
    )
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=args,
        train_dataset=ListDataset(make_samples("causal_lm", BS * GA * STEPS, seed=1)),
        data_collator=PaddingCollator(),
        callbacks=list(callbacks),
    )
    for callback in callbacks:
        callback.trainer = trainer
    return trainer


class TrainJob(submitit.helpers.Checkpointable):
    """The submitted job: resumes from the newest complete checkpoint when there is one (a requeued attempt)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def __call__(self) -> dict[str, Any]:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(self.output_dir) if Path(self.output_dir).is_dir() else None
        waiter = [] if last is not None else [WaitForSignal(Path(self.output_dir) / "ready")]
        trainer = build_trainer(self.output_dir, *waiter)
        trainer.train(resume_from_checkpoint=True if last is not None else None)
        # a preempted attempt never gets here: submitit's handler, handed the signal after the checkpoint, requeues
        return {
            "resumed_from": last and Path(last).name,
            "global_step": trainer.state.global_step,
            "preempted": trainer.preempted,
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        }


def test_submitit_interrupt_saves_the_window_requeues_and_resumes_exactly(tmp_path: Path, monkeypatch) -> None:
    from submitit.core.job_environment import JobEnvironment

    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "TERM")  # the job's submitit reads it at import
    monkeypatch.setattr(JobEnvironment, "USR_SIG", "TERM")  # and job._interrupt() here
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = tmp_path / "run"
    run.mkdir()
    executor = submitit.LocalExecutor(folder=str(tmp_path / "submitit"))
    executor.update_parameters(timeout_min=10)
    job = executor.submit(TrainJob(str(run)))
    deadline = time.monotonic() + WAIT_S
    while not (run / "ready").exists():
        assert time.monotonic() < deadline and job.state == "RUNNING", (job.state, job.stderr())
        time.sleep(0.2)
    job._interrupt()  # SIGTERM to the job's task, mid-window of step 3
    result = job.result()
    output = job.stdout() + job.stderr()

    assert result["resumed_from"] == f"checkpoint-{SIGNAL_STEP}", output[-4000:]
    assert result["global_step"] == STEPS and not result["preempted"]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [f"checkpoint-{SIGNAL_STEP}"]
    assert "Requeued job" in output and f"{signal.Signals.SIGTERM.name}" in output, output[-4000:]

    initial = {n: p.detach().clone() for n, p in build_tiny_model("causal_lm").named_parameters()}
    uninterrupted = build_trainer(str(tmp_path / "full"))
    uninterrupted.train()
    theirs = {n: p.detach() for n, p in uninterrupted.model.named_parameters()}
    ours = result["params"]
    diff = sum(float((ours[n] - theirs[n]).pow(2).sum()) for n in theirs)
    change = sum(float((theirs[n] - initial[n]).pow(2).sum()) for n in theirs)
    assert (diff / change) ** 0.5 <= TOLERANCE
