"""``save_on_preemption`` on 2 CPU ranks, one launch (started by tests/distributed/test_preemption.py):

1. ``full``: the uninterrupted run (GA 4, 5 optimizer steps), its parameters after every step;
2. ``stopped``: the same run, where rank 1 ALONE sends itself SIGTERM after micro-batch 2 of optimizer step 3; both
   ranks must stop after step 3 with ONE complete checkpoint-3 saved together, and go on to phase 3;
3. ``resumed``: ``resume_from_checkpoint=True`` to the end: its parameters against phase 1's.

    python preemption_cases.py      # by tests/distributed/launcher.run_workers, 2 ranks
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.checkpoints import latest_complete_checkpoint
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, out_dir, rank, world_size, write_result

BS, GA, STEPS = 2, 4, 5
SIGNAL_STEP, SIGNAL_MICRO_BATCH, SIGNAL_RANK = 3, 2, 1
TIMEOUT_S = 20  # ddp_timeout: a rank left waiting in a collective fails after it (the test's plant)


class SigtermAt(TrainerCallback):
    """Rank ``SIGNAL_RANK`` only: SIGTERM to itself after micro-batch ``SIGNAL_MICRO_BATCH`` of ``SIGNAL_STEP``."""

    def __init__(self) -> None:
        self.count, self.sent = 0, False

    def on_substep_end(self, args, state, control, **kwargs):
        if rank() != SIGNAL_RANK or state.global_step + 1 != SIGNAL_STEP:
            return
        self.count += 1
        if self.count == SIGNAL_MICRO_BATCH:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class Snapshots(TrainerCallback):
    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.trainer: Any = None

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}


def _trainer(output_dir: str, *callbacks: Any) -> GradAccTrainer:
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
        ddp_backend="gloo",
        ddp_timeout=TIMEOUT_S,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        save_on_preemption=True,
    )
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=args,
        train_dataset=ListDataset(make_samples("causal_lm", BS * GA * STEPS * world_size(), seed=1)),
        data_collator=PaddingCollator(),
        callbacks=list(callbacks),
    )
    for callback in callbacks:
        callback.trainer = trainer
    return trainer


def _relative(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    diff = sum(float((ours[n] - theirs[n]).pow(2).sum()) for n in theirs)
    change = sum(float((theirs[n] - initial[n]).pow(2).sum()) for n in theirs)
    return (diff / change) ** 0.5


def main() -> None:
    initial = {n: p.detach().clone() for n, p in build_tiny_model("causal_lm").named_parameters()}
    full = Snapshots()
    _trainer(str(out_dir() / "full"), full).train()

    run = str(out_dir() / "run")
    sender = SigtermAt()
    stopped = _trainer(run, sender)
    stopped.train()
    folders = sorted(p.name for p in (out_dir() / "run").glob("checkpoint-*"))
    complete = latest_complete_checkpoint(run, world_size=world_size(), rank=rank())
    write_result(
        "stopped",
        {
            "sent": sender.sent,
            "preempted": stopped.preempted,
            "global_step": stopped.state.global_step,
            "folders": folders,
            "complete": os.path.basename(complete),
            "files": sorted(os.listdir(complete)),
            "handler_restored": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        },
    )

    resumed = _trainer(run)
    resumed.train(resume_from_checkpoint=True)
    final = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    write_result(
        "resumed",
        {
            "global_step": resumed.state.global_step,
            "relative_error": _relative(final, full.after[STEPS], initial),
        },
    )
    finish_worker(0)


if __name__ == "__main__":
    main()
