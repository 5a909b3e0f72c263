"""Worker of ``tests/distributed/test_resume_layout.py`` (and the runner its unit twin imports): train a tiny causal
LM, saving every step, and record which samples each optimizer step trained.

    python resume_layout_cases.py --name run --out DIR --batch 2 --ga 2 [--resume DIR/checkpoint-2] [--loss-check]

One launch is one run, on as many ranks as the launcher starts: a fresh run into ``--out``, or a resume from
``--resume`` with this launch's layout (batch, GA, schedule, world size). Samples are told apart by their
``input_ids`` (all different). One JSON result per rank (``--name``): the steps with every rank's sample indices,
the warnings, the final ``global_step``, ``train_loss`` and the per-step logged losses; with ``--loss-check`` also
two 2-step runs, every step logged and none logged during training, whose ``train_loss`` must agree.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Any

import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.callbacks.callback import GradAccCallback
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

NUM_SAMPLES = 24  # a multiple of every batch x world size below: no rank pads its last batch


class SampleRecorder(GradAccCallback):
    """The samples each optimizer step trains, as indices into the run's samples, over every rank
    (:meth:`all_ranks`, a collective)."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.index = {tuple(s["input_ids"]): k for k, s in enumerate(samples)}
        assert len(self.index) == len(samples), "samples are told apart by their input_ids"
        self.steps: list[tuple[int, list[int]]] = []

    def on_window_counted(self, args, state, control, window=None, **kwargs):
        ids = []
        for batch in window.micro_batches:
            if "cu_seq_lens_q" in batch:  # one packed row: its samples end at the offsets
                row, ends = batch["input_ids"].reshape(-1).tolist(), batch["cu_seq_lens_q"].tolist()
                ids += [self.index[tuple(row[a:b])] for a, b in zip(ends[:-1], ends[1:])]
                continue
            for row, n in zip(batch["input_ids"].cpu(), batch["attention_mask"].sum(-1).tolist()):
                ids.append(self.index[tuple(row[:n].tolist())])
        self.steps.append((state.global_step, ids))

    def all_ranks(self) -> list[list[Any]]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [[step, ids] for step, ids in self.steps]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.steps)
        return [[step, sorted(i for rank in gathered for i in rank[k][1])] for k, (step, _) in enumerate(self.steps)]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train_run(
    out: str,
    *,
    batch: int,
    ga: int,
    schedule: str | None = None,
    epochs: int = 1,
    resume: str | None = None,
    num_samples: int = NUM_SAMPLES,
    seed: int = 0,
    mismatch: str = "error",
    callbacks: tuple[Any, ...] = (),
    **overrides: Any,
) -> dict[str, Any]:
    """One run (fresh, or resumed from ``resume``) on this process's ranks, with ``callbacks`` beside the recorder;
    what :class:`SampleRecorder` saw and what the trainer logged."""
    torch.set_num_threads(1)
    samples = make_samples("causal_lm", num_samples, seed=11)
    recorder = SampleRecorder(samples)
    extra: dict[str, Any] = (
        {"ddp_backend": "gloo", "ddp_timeout": 120} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
    )
    settings = dict(accumulation_schedule=schedule, max_steps=-1, num_train_epochs=epochs, save_strategy="steps",
                    save_steps=1, learning_rate=0.1, seed=seed, resume_data_mismatch=mismatch)  # fmt: skip
    args = one_step_args(
        out,
        args_class=GradAccConfig,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        **{**settings, **extra, **overrides},
    )
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm", seed=0), args=args, train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(), callbacks=[recorder, *callbacks],
    )  # fmt: skip
    warnings = _Warnings()
    logging.getLogger("hf_gradacc").addHandler(warnings)
    try:
        output = trainer.train(resume_from_checkpoint=resume)
    finally:
        logging.getLogger("hf_gradacc").removeHandler(warnings)
    return {
        "steps": recorder.all_ranks(),
        "warnings": warnings.messages,
        "global_step": trainer.state.global_step,
        "train_loss": output.training_loss,
        "step_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "learning_rates": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
        "params": {n: p.detach().cpu().tolist() for n, p in trainer.model.named_parameters()},
    }


def main() -> None:
    from tests.distributed.workers._common import finish_worker, write_result

    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--ga", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--loss-check", action="store_true", help="then the two runs of the train_loss check")
    options = parser.parse_args()
    try:
        payload = train_run(
            options.out, batch=options.batch, ga=options.ga, epochs=options.epochs, resume=options.resume
        )
        if options.loss_check:
            payload["loss_check"] = {
                f"logging_steps_{n}": train_run(
                    os.path.join(options.out, f"loss_{n}"),
                    batch=options.batch,
                    ga=options.ga,
                    max_steps=2,
                    logging_steps=n,
                    save_strategy="no",
                )  # fmt: skip
                for n in (1, 500)  # every step logged; none logged during training
            }
    except BaseException:
        write_result(options.name, {"error": traceback.format_exc()})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other rank fails in its next collective instead of waiting forever
    write_result(options.name, payload)
    finish_worker()


if __name__ == "__main__":
    main()
