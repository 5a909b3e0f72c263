"""One rank of the expert-parallel tests: 2 CPU ranks (gloo), a tiny mixture of experts (Mixtral, Qwen3-MoE) sharded
at load time by transformers' ``DistributedConfig(fsdp_size=2, ep_size=2)``, one SGD(lr=1) step, every rank comparing
with the float64 full batch whose router term is weighted per micro-batch by its routed tokens.

    python mesh_ep_cases.py --cases '[{"name": "a", "family": "mixtral", "trainer": "gradacc"}]'

Case keys: name, family ('mixtral' | 'qwen3_moe'), trainer ('gradacc' | 'stock'), sizes (the DistributedConfig
fields; default fsdp 2 x ep 2), mode ('trainer' | 'setup_error': report the error the trainer raises).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.patches.parallelism_cpu import enable_parallelism_on_cpu
from hf_gradacc.testing.one_step import _Recorder, one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_moe, make_samples
from tests.distributed.workers._common import finish_worker, rank, world_size, write_result
from tests.distributed.workers.mesh_tp_cases import GradReader, full

PER_DEVICE_BATCH = 2
GRAD_ACC = 2
FAMILIES = ("mixtral", "qwen3_moe")
MODELS = (*FAMILIES, "mixtral_kv2")  # mixtral_kv2: 2 key-value heads, so that a tensor plan can split attention


def save_models(root: str) -> dict[str, str]:
    paths = {name: f"{root}/{name}" for name in MODELS}
    if rank() == 0:
        for family in FAMILIES:
            build_tiny_moe(family).save_pretrained(paths[family])
        config = build_tiny_moe("mixtral").config
        config.num_key_value_heads = 2
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(paths["mixtral_kv2"])
    dist.barrier()
    return paths


def run_case(case: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    from transformers.distributed import DistributedConfig

    path = paths[case.get("family", "mixtral")]
    sizes = case.get("sizes", {"fsdp_size": 2, "ep_size": 2})
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**sizes), dtype=torch.float32)
    data_ranks = int(sizes.get("fsdp_size", 1)) * int(sizes.get("dp_replicate_size", 1))
    # one window: data ranks x 2 x GA 2 samples; mixed lengths, masked prompts
    samples = make_samples("causal_lm", data_ranks * PER_DEVICE_BATCH * GRAD_ACC, seed=11)
    args = one_step_args(per_device_train_batch_size=PER_DEVICE_BATCH, gradient_accumulation_steps=GRAD_ACC,
                         ddp_backend="gloo", output_dir=tempfile.mkdtemp(prefix="ep_"), max_grad_norm=0.0,
                         args_class=GradAccConfig, **case.get("settings", {}))  # fmt: skip
    if case.get("mode") == "setup_error":
        try:
            GradAccTrainer(model=model, args=args, train_dataset=ListDataset(samples), data_collator=PaddingCollator())
        except Exception as error:  # noqa: BLE001  (the type is what the test checks)
            return {"error_type": type(error).__name__, "error": str(error)}
        return {"error_type": None}
    initial = {n: full(p) for n, p in model.named_parameters()}
    recorder = _Recorder(PaddingCollator(), samples)
    reader = GradReader()
    trainer_class = GradAccTrainer if case.get("trainer", "gradacc") == "gradacc" else Trainer
    callbacks = [reader] if trainer_class is GradAccTrainer else []
    trainer = trainer_class(model=model, args=args, train_dataset=ListDataset(samples), data_collator=recorder,
                            callbacks=callbacks)  # fmt: skip
    reader.trainer = trainer
    trainer.train()
    update = {n: initial[n] - full(p) for n, p in trainer.model.named_parameters()}
    unique = {repr([s["input_ids"] for s in mb]): mb for mb in recorder.all_ranks()}
    result: dict[str, Any] = {
        "first_ids": [[s["input_ids"][:4] for s in mb] for mb in recorder.batches],
        "num_unique_micro_batches": len(unique),
        "expert_placements": sorted({str(p.placements) for n, p in trainer.model.named_parameters()
                                     if "experts" in n and hasattr(p, "placements")}),  # fmt: skip
        "logged_grad_norm": next((h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h), None),
        "logged_aux": next((h["loss/aux"] for h in trainer.state.log_history if "loss/aux" in h), None),
    }
    if trainer_class is GradAccTrainer:
        result["backend"] = trainer.backend.describe()
        result["dp_world_size"] = trainer.backend.dp_world_size
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = reference_gradients(plain, samples, "causal_lm", PaddingCollator(), micro_batches=list(unique.values()))
    result["reference_norm"] = float(torch.sqrt(sum(g.double().pow(2).sum() for g in reference.values())))
    result["update"] = compare(update, reference).__dict__
    if reader.grads:
        result["grad"] = compare(reader.grads, reference).__dict__
        result["grads_norm"] = reader.norm
    # transformers #48690: the router term multiplied by the world size. The same reference with the model's
    # coefficient x world size: the stock Trainer's update matches it (ours does not).
    coefficient = plain.config.router_aux_loss_coef
    for label, factor in (("x_world", world_size()), ("x_world_x_ga", world_size() * GRAD_ACC)):
        plain.config.router_aux_loss_coef = plain.router_aux_loss_coef = coefficient * factor
        scaled = reference_gradients(plain, samples, "causal_lm", PaddingCollator(), micro_batches=list(unique.values()))
        result[f"update_vs_router_{label}"] = compare(update, scaled).__dict__
    result["unchanged"] = [n for n, u in update.items() if float(u.abs().max()) == 0.0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    cases = json.loads(parser.parse_args().cases)
    enable_parallelism_on_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    holder = [tempfile.mkdtemp(prefix="ep_models_") if rank() == 0 else ""]
    dist.broadcast_object_list(holder, src=0)
    paths = save_models(holder[0])
    status = 0
    for case in cases:
        try:
            write_result(case["name"], run_case(case, paths))
        except Exception:  # noqa: BLE001  (reported in the result: the test shows it)
            status = 1
            write_result(case["name"], {"crash": traceback.format_exc()})
        dist.barrier()
    finish_worker(status)


if __name__ == "__main__":
    main()
