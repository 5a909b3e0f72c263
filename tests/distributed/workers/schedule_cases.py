"""Worker of ``tests/distributed/test_schedule.py``: an accumulation schedule on 2 ranks, one backend per launch.

    python schedule_cases.py --backend ddp                                                  # run_workers
    accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml schedule_cases.py --backend zero2
    accelerate launch --config_file examples/accelerate_configs/fsdp2_cpu.yaml schedule_cases.py --backend fsdp2

Each rank trains GradAccTrainer for two epochs under ``accumulation_schedule`` with ``lr_scaling="linear"`` and
plain SGD at a constant rate 1 (the update is minus the scaled accumulated gradient), records every optimizer step
(:class:`~hf_gradacc.testing.steps.StepRecorder`: its samples on every rank, the parameters before it and the full
gradient, gathered on sharded backends), and rank 0 compares each step with the float64 reference over that step's
own samples. One JSON result per rank ("schedule").
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.schedule import AccumulationSchedule
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.steps import StepRecorder, check_steps
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, rank, world_size, write_result

BS, BASE_GA = 2, 2
SCHEDULE = "0:1,2:3,4:2"
MICRO_BATCHES_PER_RANK = 11  # per epoch: windows [1, 1, 3, 3, 2, 1] then [2, 2, 2, 2, 2, 1]


def run(backend: str) -> dict:
    torch.set_num_threads(1)
    model = build_tiny_model("causal_lm", seed=0)
    samples = make_samples("causal_lm", BS * MICRO_BATCHES_PER_RANK * world_size(), seed=5)
    recorder = StepRecorder(samples)
    extra: dict = {"ddp_backend": "gloo", "ddp_timeout": 120}
    if backend == "zero2":
        extra = {"use_cpu": False}  # the accelerate config selects DeepSpeed; use_cpu would bypass it
    if backend == "fsdp2":
        extra["fsdp_sync"] = "deferred"
    args = one_step_args(
        args_class=GradAccConfig,
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=BASE_GA,
        accumulation_schedule=SCHEDULE,
        lr_scaling="linear",
        max_steps=-1,
        num_train_epochs=2,
        seed=0,
        **extra,
    )
    trainer = GradAccTrainer(
        model=model,
        args=args,
        train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(),
        callbacks=[recorder],
    )
    reference_model = build_tiny_model("causal_lm", seed=0)  # untouched by sharding
    trainer.train()
    steps = recorder.all_ranks()  # a collective
    final = trainer.backend.full_parameters(trainer.model_wrapped)  # a collective on sharded backends
    payload = {
        "backend": trainer.backend.name,
        "global_step": trainer.state.global_step,
        "micro_batches": [s.micro_batches for s in recorder.steps],
        "learning_rates": [s.learning_rate for s in steps],
        "logged_accumulation": [h["accumulation_steps"] for h in trainer.state.log_history if "loss" in h],
        "logged_effective_batch": [h["effective_batch_size"] for h in trainer.state.log_history if "loss" in h],
        "step_samples": [len(s.samples) for s in steps],
        "epoch_one_samples": sorted(i for s in steps[:6] for i in s.samples),
    }
    if rank() == 0:
        payload["relative_errors"] = [c.relative_error for c in check_steps(steps, reference_model, samples, "causal_lm")]
        # SGD at rate 1: each step moved the parameters by -factor x its gradient (factor = GA / base)
        schedule = AccumulationSchedule.parse(SCHEDULE, base=BASE_GA)
        afters = [s.params for s in steps[1:]] + [{n: final[n].float() for n in steps[-1].params}]
        update_errors = []
        for step, after in zip(steps, afters):
            factor = schedule.lr_factor(step.step, "linear")
            moved = torch.cat([(step.params[n] - after[n]).reshape(-1) for n in step.grads])
            grad = torch.cat([step.grads[n].reshape(-1) for n in step.grads]) * factor
            update_errors.append(float((moved - grad).norm() / grad.norm()))
        payload["update_errors"] = update_errors
    return payload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("ddp", "zero2", "fsdp2"), required=True)
    backend = parser.parse_args().backend
    try:
        payload = run(backend)
    except BaseException:
        write_result("schedule", {"error": traceback.format_exc()})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other rank fails in its next collective instead of waiting forever
    write_result("schedule", payload)
    finish_worker()


if __name__ == "__main__":
    main()
