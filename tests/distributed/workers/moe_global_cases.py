"""One rank of the `router_balance="global_batch"` tests on 2 CPU ranks (gloo), started with torchrun:

    torchrun --nproc_per_node 2 tests/distributed/workers/moe_global_cases.py --cases '[{"name": "a", "bs": 2}]'

ONE launch runs the DDP cases first, then (``"backend": "fsdp2"``, the CPU patch switched on before them) the FSDP2
cases: accelerate's state moves from MULTI_CPU to FSDP between trainers, never back. DeepSpeed cases
(``"backend": "zero2"`` / ``"zero3"``, the CPU-distributed patch) need a launch of their own.

Each case trains ONE optimizer step (SGD, lr 1) over exactly one window of 16 samples (8 per rank: bs x ga = 8) and
compares the update (minus the accumulated gradient) with the float64 reference of definition B over all 16
samples (hf_gradacc.testing.moe_reference): mixed lengths (2 to 40 tokens), masked prompts, padding.

Case keys: name; family (``mixtral`` / ``qwen3_moe``); bs, ga; backend (``ddp`` / ``fsdp2`` / ``zero2`` / ``zero3``); mode (``global_batch``,
default, or ``micro_batch``); checkpointing (activation checkpointing on); local_counts (the pre-pass's collective
replaced by this rank's own counts: the update must leave the tolerance). Every rank writes one JSON per case;
rank 0 holds the comparison.
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
from torch.distributed.tensor import DTensor

import hf_gradacc.moe_balance as moe_balance
import hf_gradacc.step.engine as engine
from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.moe_reference import global_balance_gradients
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_moe, make_samples
from tests.distributed.workers._common import finish_worker, write_result

NUM_SAMPLES = 16
DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}


def _args(case: dict[str, Any]) -> GradAccConfig:
    overrides: dict[str, Any] = {"seed": 5, "use_cpu": True, "ddp_backend": "gloo",
                                 "router_balance": case.get("mode", "global_batch")}  # fmt: skip
    backend = case.get("backend", "ddp")
    if backend == "fsdp2":
        overrides.update(fsdp=True, fsdp_config={"version": 2})
    elif backend.startswith("zero"):
        zero: dict[str, Any] = {"stage": int(backend[-1])}
        if backend == "zero3":
            zero["stage3_param_persistence_threshold"] = 0  # even the tiny model's router weights are partitioned
        overrides.update(use_cpu=False, deepspeed={**DEEPSPEED, "zero_optimization": zero})
        overrides.pop("ddp_backend")
    if case.get("checkpointing"):
        overrides["gradient_checkpointing"] = True
    return one_step_args(tempfile.mkdtemp(prefix="hf_gradacc_moe_"), per_device_train_batch_size=case["bs"],
                         gradient_accumulation_steps=case["ga"], args_class=GradAccConfig, **overrides)  # fmt: skip


def _final_parameters(trainer: GradAccTrainer, backend: str) -> dict[str, torch.Tensor]:
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


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    samples = make_samples("causal_lm", NUM_SAMPLES, seed=7, min_length=2, max_length=40, ignore_fraction=0.5)
    base = build_tiny_moe(case["family"], router_aux_loss_coef=0.1)
    work = copy.deepcopy(base)
    initial = {n: p.detach().clone() for n, p in work.named_parameters() if p.requires_grad}
    original_prepass = engine.routing_prepass  # the step's owner runs the pre-pass
    if case.get("local_counts"):  # every rank forms B from its own tokens only
        engine.routing_prepass = lambda *a, **k: original_prepass(*a, **{**k, "all_gather": lambda t: t[None]})
    try:
        trainer = GradAccTrainer(model=work, args=_args(case), train_dataset=ListDataset(samples),
                                 data_collator=PaddingCollator())  # fmt: skip
        trainer.train()
    finally:
        engine.routing_prepass = original_prepass
    backend = case.get("backend", "ddp")
    final = _final_parameters(trainer, backend)
    logs = trainer.state.log_history[0]
    result: dict[str, Any] = {"name": case["name"], "rank": rank, "distributed_type": str(trainer.accelerator.distributed_type),
                              "load": logs.get(moe_balance.LOAD_KEY), "aux": logs.get("loss/aux")}  # fmt: skip
    if rank == 0:
        reference = global_balance_gradients(base, samples, PaddingCollator())
        update = {n: initial[n] - final[n] for n in initial if n in final}
        whole = compare(update, reference)
        router = [n for n in reference if n.endswith("mlp.gate.weight")]
        rc = compare({n: update[n] for n in router}, {n: reference[n] for n in router})
        result.update(relative_error=whole.relative_error, router_relative_error=rc.relative_error,
                      num_router=len(router), missing=sorted(set(reference) - set(update)))  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of case dicts (DDP cases before FSDP2 ones)")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    fsdp_on = False
    cases = json.loads(ns.cases)
    if any(c.get("backend", "").startswith("zero") for c in cases):  # a launch of its own: DeepSpeed cases only
        from hf_gradacc.patches import enable_cpu_distributed

        enable_cpu_distributed()  # TrainingArguments fills DeepSpeed's 'auto' values from its world size
    for case in cases:
        if case.get("backend") == "fsdp2" and not fsdp_on:
            from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

            enable_fsdp_on_cpu()
            fsdp_on = True
        try:
            payload = run_case(case, rank)
        except Exception:
            write_result(case["name"], {"crash": traceback.format_exc()})
            raise
        write_result(case["name"], payload)
        if rank == 0:
            print(f"[moe_global_cases] {case['name']}: {json.dumps(payload, default=str)[:300]}", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
