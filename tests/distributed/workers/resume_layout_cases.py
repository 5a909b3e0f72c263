"""Worker of ``tests/distributed/test_resume_layout.py`` (and the runner its unit twin imports): train a tiny causal
LM, saving every step, and record which samples each optimizer step trained.

    python resume_layout_cases.py --name run --out DIR --batch 2 --ga 2 [--resume DIR/checkpoint-2] [--loss-check]
    python resume_layout_cases.py --name run --out DIR --batch 2 --ga 1 --total 12 --tasks causal_lm,...
        [--resume DIR/{task}/checkpoint-1] [--num-samples 36]

One launch is one run, on as many ranks as the launcher starts: a fresh run into ``--out``, or a resume from
``--resume`` with this launch's layout (batch, GA, schedule, world size). Samples are told apart by their
``input_ids`` (all different). One JSON result per rank (``--name``): the steps with every rank's sample indices,
the warnings, the final ``global_step``, ``train_loss`` and the per-step logged losses; with ``--loss-check`` also
two 2-step runs, every step logged and none logged during training, whose ``train_loss`` must agree. With
``--total`` (``total_train_batch_size``, linear learning-rate decay): one run per head of ``--tasks`` into
``DIR/<task>``, one JSON result per rank keyed by task (``tests/distributed/test_total_train_batch_size.py``).
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


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter: an FSDP2 shard (DTensor) or a ZeRO-3 partition gathered (a collective: every rank, the
    same order)."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()
    return param.full_tensor() if hasattr(param, "full_tensor") else param


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
    task: str = "causal_lm",
    callbacks: tuple[Any, ...] = (),
    **overrides: Any,
) -> dict[str, Any]:
    """One run (fresh, or resumed from ``resume``) on this process's ranks, with ``callbacks`` beside the recorder;
    what :class:`SampleRecorder` saw and what the trainer logged. ``task``: the tiny model's head
    (:data:`~hf_gradacc.testing.tiny.TASKS`)."""
    torch.set_num_threads(1)
    samples = make_samples(task, num_samples, seed=11)
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
        model=build_tiny_model(task, seed=0), args=args, train_dataset=ListDataset(samples),
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
        "params": {n: _full(p).detach().cpu().tolist() for n, p in trainer.model.named_parameters()},
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "max_steps": trainer.state.max_steps,
        "mesh": trainer.backend.mesh.describe(),
        "data_parallel_size": trainer.backend.mesh.data_parallel_size,
    }


# A --total run's schedule and optimizer: linear decay (a changed run length would show), momentum (optimizer state to
# carry over, sharded under FSDP2 / ZeRO)
TOTAL_RUN: dict[str, Any] = {"lr_scheduler_type": "linear", "optim_args": "momentum=0.9"}
# The backends a --total run may take: the TrainingArguments each needs (its CPU patch applied first).
BACKENDS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp2": {"fsdp": True, "fsdp_config": {"version": 2}, "ddp_backend": "gloo"},
    "fsdp2_sharded": {
        "fsdp": True,
        "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
        "ddp_backend": "gloo",
    },
    # AdamW: DeepSpeed's universal checkpoint (a resume on another world) converts Adam-family states only. eps 1e-3:
    # the tiny BERT's attention key biases have a zero gradient (softmax ignores them) that is rounding noise alone,
    # which Adam with eps 1e-8 turns into full steps (3.4e-03 off between two layouts, all of it in those biases)
    "zero2": {
        "deepspeed": {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True},
        "use_cpu": False,
        "optim": "adamw_torch",
        "optim_args": None,
        "adam_epsilon": 1e-3,
    },
    "zero2_universal": {
        "deepspeed": {
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "checkpoint": {"load_universal": True},
        },
        "use_cpu": False,
        "optim": "adamw_torch",
        "optim_args": None,
        "adam_epsilon": 1e-3,
    },
}
# ZeRO-3 as examples/accelerate_configs/zero3_cpu.yaml sets it (no offload, the 16-bit model gathered at save); the
# same AdamW as ZeRO-2. The arguments are built before the model: transformers partitions it at construction.
_ZERO3 = {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
          "stage3_gather_16bit_weights_on_model_save": True}  # fmt: skip
BACKENDS["zero3"] = {
    **BACKENDS["zero2"],
    "deepspeed": {"zero_optimization": _ZERO3, "zero_allow_untested_optimizer": True},
}
BACKENDS["zero3_universal"] = {
    **BACKENDS["zero2"],
    "deepspeed": {
        "zero_optimization": _ZERO3,
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": True},
    },
}


def backend_arguments(backend: str) -> dict[str, Any]:
    """``backend``'s TrainingArguments, after the CPU patch it needs (before the arguments are built: they fill
    DeepSpeed's 'auto' values from the world size)."""
    if backend.startswith("fsdp2"):
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    if backend.startswith("zero"):
        from hf_gradacc.patches import enable_cpu_distributed

        enable_cpu_distributed()
    return dict(BACKENDS[backend])


def backend_for(arguments: dict[str, Any], task: str) -> dict[str, Any]:
    """FSDP2 wraps the tiny BERT's layers only (its embeddings would be wrapped twice: refused by name)."""
    if "fsdp_config" in arguments and task != "causal_lm":
        return {**arguments, "fsdp_config": {**arguments["fsdp_config"], "transformer_layer_cls_to_wrap": ["BertLayer"]}}
    return arguments


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
    parser.add_argument("--total", type=int, default=None, help="total_train_batch_size: one run per --tasks")
    parser.add_argument("--tasks", default="causal_lm", help="with --total: comma-separated tiny-model heads")
    parser.add_argument("--num-samples", type=int, default=NUM_SAMPLES)
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="ddp", help="with --total")
    parser.add_argument("--parallelism", default=None, help="with an fsdp2 --backend: 'R x S', ParallelismConfig's "
                        "dp_replicate_size x dp_shard_size (HSDP 2x2)")  # fmt: skip
    options = parser.parse_args()
    try:
        if options.total is not None:  # tests/distributed/test_total_train_batch_size.py: a run per head
            backend = backend_arguments(options.backend)
            if options.parallelism is not None:
                from accelerate import ParallelismConfig

                replicate, shard = (int(n) for n in options.parallelism.split("x"))
                backend["parallelism_config"] = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)
            payload = {
                task: train_run(
                    os.path.join(options.out, task), batch=options.batch, ga=options.ga, task=task,
                    resume=None if options.resume is None else options.resume.format(task=task),
                    num_samples=options.num_samples, total_train_batch_size=options.total,
                    **{**TOTAL_RUN, **backend_for(backend, task)},
                )  # fmt: skip
                for task in options.tasks.split(",")
            }
            write_result(options.name, payload)
            finish_worker()
            return
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
