"""One rank of the bf16 tests: one-step cases under bf16 mixed precision on CPU ranks (gloo).

    python bf16_cases.py --backend ddp --cases '[{"name": "a", "task": "causal_lm"}]'   # via tests/distributed/launcher.py

Each case trains ONE optimizer step with SGD(lr=1) (``optim="sgd"``, built by the Trainer on every backend) with
``bf16=True`` on a dataset of exactly one window (all ranks together), so the update is minus the accumulated
gradient; rank 0 compares it with the float64 full-batch reference over every rank's samples.

What bf16 means per backend (``--backend``):

- ``ddp``: ``use_cpu=True, bf16=True``: accelerate runs the forward under ``torch.autocast("cpu", torch.bfloat16)``;
  parameters, gradients and the all-reduce stay float32.
- ``fsdp2``: ``fsdp_config={"version": 2}`` with the CPU patch; accelerate's FSDP2 ``MixedPrecisionPolicy``
  (param_dtype = reduce_dtype = bf16) computes with bf16 copies of the float32 shards and reduces in bf16.
- ``zero2``: ``TrainingArguments(deepspeed={... "bf16": {"enabled": "auto"}})`` with the CPU patch: DeepSpeed casts
  the module to bf16 and keeps float32 master weights in its ZeRO optimizer. The update is read from the float32
  masters (``safe_get_full_fp32_param``) and taken from the bf16-rounded initial weights the masters start from,
  so that it is the step the optimizer took, not the rounding of the final bf16 copy.

Case keys: name, task, trainer ('gradacc' | 'stock'), fsdp_sync (fsdp2), fsdp_config (fsdp2, extra fsdp_config).
A case whose trainer raises reports ``error_type`` / ``error`` instead of numbers (the test decides if that is fine).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import tempfile
import traceback
from typing import Any
from unittest import mock

import torch
from transformers import Trainer, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, write_result

PER_DEVICE_BATCH = 2
GRAD_ACC = 4
MP_POLICY_FIELDS = ("param_dtype", "reduce_dtype")
DEEPSPEED_CONFIG: dict[str, Any] = {
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},  # follows TrainingArguments.bf16
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}


def _args(backend: str, case: dict[str, Any], args_class: type[TrainingArguments]) -> TrainingArguments:
    overrides: dict[str, Any] = dict(bf16=True, seed=11)
    if backend == "ddp":
        overrides.update(use_cpu=True, ddp_backend="gloo")
    elif backend == "fsdp2":
        overrides.update(
            use_cpu=True, ddp_backend="gloo", fsdp=True, fsdp_config={"version": 2, **case.get("fsdp_config", {})}
        )
    else:  # a DeepSpeed launch: the patched accelerate picks gloo; use_cpu would bypass DeepSpeed
        overrides.update(use_cpu=False, deepspeed=copy.deepcopy(DEEPSPEED_CONFIG))
    if args_class is GradAccConfig and backend == "fsdp2":
        overrides["fsdp_sync"] = case.get("fsdp_sync", "deferred")
    build = functools.partial(
        one_step_args,
        tempfile.mkdtemp(prefix="hf_gradacc_bf16_"),
        per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=GRAD_ACC,
        args_class=args_class,
        **overrides,
    )
    if backend != "zero2" or case.get("unpatched_args"):
        return build()
    # transformers 5.23 refuses `bf16=True` without `use_cpu` when no GPU has bf16 ("Your setup doesn't support
    # bf16/gpu"), and `use_cpu` would replace DeepSpeed by DDP; DeepSpeed's CPU accelerator runs bf16 fine. Only
    # this check is bypassed, only while the arguments are built.
    with mock.patch("transformers.training_args.is_torch_bf16_gpu_available", return_value=True):
        return build()


def _final_parameters(trainer: Trainer, backend: str) -> dict[str, torch.Tensor]:
    """The parameters after the step in float32: DeepSpeed's float32 masters, elsewhere the (gathered) parameters."""
    if backend != "zero2":
        return {n: p.float() for n, p in full_parameters(trainer).items()}
    from deepspeed.utils import safe_get_full_fp32_param

    module = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    # a collective per parameter: every rank, same order
    return {n: safe_get_full_fp32_param(p).detach().float().cpu() for n, p in module.named_parameters()}


def run_case(backend: str, case: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    task = case["task"]
    samples = make_samples(task, world * PER_DEVICE_BATCH * GRAD_ACC, seed=case.get("seed", 3))
    model = build_tiny_model(task)
    work = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in work.named_parameters() if p.requires_grad}
    stock = case.get("trainer") == "stock"
    args_class: type[TrainingArguments] = TrainingArguments if stock else GradAccConfig
    trainer_class: type[Trainer] = Trainer if stock else GradAccTrainer
    # What the matmuls computed in (the model's outputs are cast back to float32 by accelerate under autocast).
    linear_dtypes: set[str] = set()

    def record_dtype(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        linear_dtypes.add(str(output.dtype).replace("torch.", ""))

    hooks = [m.register_forward_hook(record_dtype) for m in work.modules() if isinstance(m, torch.nn.Linear)]
    result: dict[str, Any] = {"name": case["name"], "rank": rank, "backend": backend}
    try:
        trainer = trainer_class(
            model=work,
            args=_args(backend, case, args_class),
            train_dataset=ListDataset(samples),
            data_collator=PaddingCollator(),
        )
        trainer.train()
    except Exception as exc:  # reported to the test, which asserts on it
        result.update(error_type=type(exc).__name__, error=str(exc), traceback=traceback.format_exc()[-3000:])
        return result
    finally:
        for hook in hooks:
            hook.remove()
    final = _final_parameters(trainer, backend)
    module = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    result.update(
        distributed_type=str(trainer.accelerator.distributed_type).split(".")[-1],
        mixed_precision=str(trainer.accelerator.mixed_precision),
        world_size=trainer.args.world_size,
        linear_output_dtypes=sorted(linear_dtypes),
        param_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()}),
        global_step=trainer.state.global_step,
    )
    if backend == "fsdp2":
        policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
        result["mp_policy"] = {k: str(getattr(policy, k, None)).replace("torch.", "") for k in MP_POLICY_FIELDS}
    if rank == 0:
        if backend == "zero2":  # the masters start from the bf16-rounded weights DeepSpeed cast the module to
            initial = {n: p.to(torch.bfloat16).float() for n, p in initial.items()}
        update = {n: initial[n] - final[n] for n in initial if n in final}
        reference = reference_gradients(model, samples, task, PaddingCollator())
        c = compare(update, reference)
        result.update(
            relative_error=c.relative_error,
            cosine=c.cosine,
            norm_ratio=c.norm_ratio,
            missing=sorted(set(initial) - set(final)),
            unchanged=sorted(n for n, u in update.items() if float(u.abs().max()) == 0.0),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("ddp", "fsdp2", "zero2"), required=True)
    parser.add_argument("--cases", required=True, help="JSON list of case dicts")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if opts.backend != "ddp":
        from hf_gradacc.patches import enable_cpu_distributed

        # before the first TrainingArguments: they build accelerate's state in their constructor
        enable_cpu_distributed(fsdp=opts.backend == "fsdp2")
    if opts.backend == "zero2":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for case in json.loads(opts.cases):
        write_result(case["name"], run_case(opts.backend, case, rank, world))
    finish_worker()


if __name__ == "__main__":
    main()
