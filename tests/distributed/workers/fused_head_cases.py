"""One rank of the fused LM head tests on 2 CPU ranks (gloo), started with torchrun:

    torchrun --nproc_per_node 2 tests/distributed/workers/fused_head_cases.py --backend zero3 \
        --cases '[{"name": "exact"}]'

``--backend``: ``ddp`` (TrainingArguments on CPU), ``fsdp2`` (``fsdp=True``, ``fsdp_config={"version": 2}``, the CPU
patch), ``zero1`` / ``zero2`` / ``zero3`` (``TrainingArguments(deepspeed=...)``, the CPU-distributed patch; ZeRO-3
with ``stage3_param_persistence_threshold=0`` so that even the tiny model's head is partitioned). One launch per
backend: accelerate's state cannot hold DeepSpeed and FSDP2 in one process.

Each case trains ONE optimizer step (SGD, lr 1) with ``fused_lm_head=True`` on exactly one window (every rank's
micro-batches together), gathers the final parameters and compares the update (minus the accumulated gradient) with
the float64 full-batch reference over the micro-batches of every rank, as the other backend tests do. The samples
have mixed lengths (2 to 60 tokens: heavy padding), prompts masked with -100 (70 % of a row on average) and rows
without any counted label.

Case keys: name; packed (``pack_micro_batches=True``: rows holding several documents); moe (a tiny mixture-of-experts family: the router term joins the fused loss); off_by (every fused
loss sum divided by this, with the start-up check off: the test must see the error); empty_first (rank 1's first
micro-batch has no counted label: its start-up check runs a dummy row, no rank waits); wrong_transform_on (this rank
alone applies a logit transform the model does not have, a scale of 1.5: the start-up check must stop EVERY rank);
expect_error (report the error training raises instead of comparing).
Every rank writes one JSON per case; rank 0 holds the comparison.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hf_gradacc.fused.head as fused_head
import hf_gradacc.fused.into_grad as fused_into_grad
from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, build_tiny_moe, make_samples
from tests.distributed.workers._common import finish_worker, write_result

PER_DEVICE_BATCH = 2
GRAD_ACC = 4
DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}


def _args(backend: str, case: dict[str, Any]) -> GradAccConfig:
    overrides: dict[str, Any] = {"seed": 11, "fused_lm_head": True}
    if backend == "ddp":
        overrides.update(use_cpu=True, ddp_backend="gloo")
    elif backend == "fsdp2":
        overrides.update(use_cpu=True, ddp_backend="gloo", fsdp=True, fsdp_config={"version": 2})
    else:
        stage = int(backend[-1])
        zero: dict[str, Any] = {"stage": stage}
        if stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        overrides.update(use_cpu=False, deepspeed={**DEEPSPEED, "zero_optimization": zero})
    if case.get("moe"):
        overrides["accelerator_config"] = {"even_batches": False}  # no repeated samples in the short micro-batch
    if case.get("off_by"):
        overrides["check_loss_at_start"] = False
    if case.get("packed"):  # several documents per row (shift_labels, position_ids), at most 60 tokens a row
        overrides.update(pack_micro_batches=True, max_tokens_per_micro_batch=60)
    return one_step_args(
        tempfile.mkdtemp(prefix="hf_gradacc_fused_"),
        per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=GRAD_ACC,
        args_class=GradAccConfig,
        **overrides,
    )


def _final_parameters(trainer: GradAccTrainer, backend: str) -> dict[str, torch.Tensor]:
    """The parameters after the step, whole, on every rank (a collective under ZeRO-3 and FSDP2)."""
    if backend == "zero3":
        import deepspeed

        module = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {n: p.detach().float().clone() for n, p in module.named_parameters()}
    module = trainer.model if backend == "fsdp2" else trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for n, p in module.named_parameters()
    }


def run_case(case: dict[str, Any], backend: str, rank: int, world: int) -> dict[str, Any]:
    moe = case.get("moe")
    samples = make_samples("causal_lm", world * PER_DEVICE_BATCH * GRAD_ACC - bool(moe), seed=3, min_length=2,
                           max_length=60, ignore_fraction=0.7)  # fmt: skip
    base = build_tiny_moe(moe) if moe else build_tiny_model("causal_lm")
    if case.get("packed"):
        base.config._attn_implementation = "sdpa"  # honours packed position_ids
    work = copy.deepcopy(base)
    initial = {n: p.detach().clone() for n, p in work.named_parameters() if p.requires_grad}
    micro_batches: list[list[dict[str, Any]]] = []  # this rank's, as trained

    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        features = [dict(f) for f in features]
        if case.get("empty_first") and rank == 1 and not micro_batches:
            features = [{**f, "labels": [-100] * len(f["labels"])} for f in features]
        micro_batches.append(features)
        return PaddingCollator()(features)

    fused_rows: list[int] = []  # counted targets projected by the fused head in each training forward
    original_capture = fused_head._Capture.__call__

    def counting_capture(self, hidden, *args, **kwargs):
        out = original_capture(self, hidden, *args, **kwargs)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            fused_rows.append(self.rows)
        return out

    original_sum = fused_head.fused_cross_entropy_sum
    original_of = fused_head.LogitTransform.of
    fused_head._Capture.__call__ = counting_capture
    if case.get("off_by"):
        fused_head.fused_cross_entropy_sum = lambda *a, **k: original_sum(*a, **k) / case["off_by"]
    if case.get("wrong_transform_on") == rank:
        fused_head.LogitTransform.of = classmethod(lambda cls, model: cls(scale=1.5))
    result: dict[str, Any] = {"name": case["name"], "rank": rank}
    written_before = fused_into_grad.STATS.written  # micro-batches whose head gradient went straight into .grad
    try:
        trainer = GradAccTrainer(model=work, args=_args(backend, case), train_dataset=ListDataset(samples),
                                 data_collator=collate)  # fmt: skip
        try:
            trainer.train()
        except Exception as error:  # noqa: BLE001 - reported to the test, which asserts on it
            if not case.get("expect_error"):
                raise
            result.update(error_type=type(error).__name__, error=str(error))
            return result
    finally:
        fused_head._Capture.__call__ = original_capture
        fused_head.fused_cross_entropy_sum = original_sum
        fused_head.LogitTransform.of = original_of
    result["error_type"] = None
    final = _final_parameters(trainer, backend)
    every_rank: list[Any] = [None] * world
    dist.all_gather_object(every_rank, micro_batches)
    trained = [mb for per_rank in every_rank for mb in per_rank]
    result["step_counted"] = sum(sum(t != -100 for t in s["labels"][1:]) for s in samples)
    result.update(fused_rows=fused_rows, counted=[sum(sum(t != -100 for t in f["labels"][1:]) for f in mb)
                                                  for mb in micro_batches])  # fmt: skip
    result["distributed_type"] = str(trainer.accelerator.distributed_type)
    result["into_grad_written"] = fused_into_grad.STATS.written - written_before
    if rank == 0:
        step = samples if case.get("packed") else [f for mb in trained for f in mb]  # packed: the step is the set
        reference = reference_gradients(base, step, "causal_lm", PaddingCollator(),
                                        micro_batches=trained if moe else None)  # fmt: skip
        update = {n: initial[n] - final[n] for n in initial if n in final}
        c = compare(update, reference)
        result.update(relative_error=c.relative_error, cosine=c.cosine, missing=sorted(set(reference) - set(update)))
        if moe:  # the router weights alone: the router term is a small share of the whole update
            router = [n for n in reference if n.endswith("mlp.gate.weight")]
            rc = compare({n: update[n] for n in router}, {n: reference[n] for n in router})
            result.update(router_relative_error=rc.relative_error, num_router=len(router))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=("ddp", "fsdp2", "zero1", "zero2", "zero3"))
    parser.add_argument("--cases", required=True, help="JSON list of case dicts")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    if ns.backend == "fsdp2":
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    elif ns.backend.startswith("zero"):
        from hf_gradacc.patches import enable_cpu_distributed

        enable_cpu_distributed()  # TrainingArguments fills DeepSpeed's 'auto' values from its world size
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for case in json.loads(ns.cases):
        try:
            payload = run_case(case, ns.backend, rank, world)
        except Exception:
            write_result(case["name"], {"crash": traceback.format_exc()})
            raise
        write_result(case["name"], payload)
        if rank == 0:
            print(
                f"[fused_head_cases {ns.backend}] {case['name']}: {json.dumps(payload, default=str)[:400]}", flush=True
            )
    finish_worker()


if __name__ == "__main__":
    main()
