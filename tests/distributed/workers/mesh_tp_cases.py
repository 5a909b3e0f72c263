"""One rank of the tensor-parallel tests: 4 CPU ranks (gloo), models sharded at load time by transformers'
``DistributedConfig`` (tensor 2 x FSDP 2), one SGD(lr=1) step each, rank 0 comparing with the float64 full batch.

    python mesh_tp_cases.py --cases '[{"name": "a", "task": "causal_lm", "trainer": "gradacc"}]'

Case keys: name, task ('causal_lm' | 'sequence_classification' | 'moe': a tiny Mixtral with its router term), trainer ('gradacc' | 'stock'), sizes (the
DistributedConfig fields), max_grad_norm (clipping, from TrainingArguments), hook ('zero_lm_head' | 'nan': an
accumulated-gradient hook), settings (GradAccConfig fields), mode ('trainer' | 'setup_error': report the error the trainer raises).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Trainer, TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.patches.parallelism_cpu import enable_parallelism_on_cpu
from hf_gradacc.testing.one_step import _Recorder, one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, build_tiny_moe, make_samples
from tests.distributed.workers._common import finish_worker, rank, write_result

PER_DEVICE_BATCH = 2
GRAD_ACC = 2


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def save_models(root: str) -> dict[str, str]:
    """The tiny Llama causal LM, and a Llama sequence classifier on the same config (its base model has a tensor
    plan), saved once by rank 0 for ``from_pretrained(..., distributed_config=...)``."""
    from transformers import LlamaForSequenceClassification

    from hf_gradacc.testing.tiny import NUM_LABELS

    paths = {"causal_lm": f"{root}/causal_lm", "sequence_classification": f"{root}/sequence_classification",
             "moe": f"{root}/moe"}  # fmt: skip
    if rank() == 0:
        build_tiny_moe("mixtral").save_pretrained(paths["moe"])
        causal = build_tiny_model("causal_lm")
        causal.save_pretrained(paths["causal_lm"])
        config = causal.config
        config.num_labels = NUM_LABELS
        torch.manual_seed(1)
        LlamaForSequenceClassification(config).save_pretrained(paths["sequence_classification"])
    dist.barrier()
    return paths


class GradReader(TrainerCallback):
    """The full accumulated gradient through ``trainer.grads`` in ``on_pre_optimizer_step`` (a collective per
    parameter: every rank), and its norm."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.grads: dict[str, torch.Tensor] = {}
        self.norm: float | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = self.trainer.grads
        self.grads = {name: grads.full(name).detach().clone() for name, _ in grads.named_parameters()}
        self.norm = float(grads.norm())


def run_case(case: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    from transformers.distributed import DistributedConfig

    task = case["task"]
    auto = AutoModelForSequenceClassification if task == "sequence_classification" else AutoModelForCausalLM
    sizes = case.get("sizes", {"tp_size": 2, "fsdp_size": 2})
    model = auto.from_pretrained(paths[task], distributed_config=DistributedConfig(**sizes), dtype=torch.float32)
    data_ranks = int(sizes.get("fsdp_size", 1)) * int(sizes.get("dp_replicate_size", 1))
    # one window: data ranks x 2 x GA 2 samples; mixed lengths, masked prompts
    samples = make_samples("causal_lm" if task == "moe" else task, data_ranks * PER_DEVICE_BATCH * GRAD_ACC, seed=11)
    args = one_step_args(per_device_train_batch_size=PER_DEVICE_BATCH, gradient_accumulation_steps=GRAD_ACC,
                         ddp_backend="gloo", output_dir=tempfile.mkdtemp(prefix="tp_"),
                         max_grad_norm=case.get("max_grad_norm", 0.0), args_class=GradAccConfig,
                         **case.get("settings", {}))  # fmt: skip
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
    hook = case.get("hook")
    if hook == "zero_lm_head":  # a full-gradient hook on a tensor-sharded weight: written back shard by shard
        trainer.register_accumulated_grad_hook(lambda name, grad: grad.zero_() if name == "lm_head.weight" else None)
    elif hook == "nan":  # a non-finite gradient on every rank: the step is skipped everywhere (nonfinite_steps='skip')
        trainer.register_accumulated_grad_hook(
            lambda name, grad: grad.fill_(float("nan")) if name == "model.norm.weight" else None
        )
    trainer.train()
    update = {n: initial[n] - full(p) for n, p in trainer.model.named_parameters()}
    micro_batches = recorder.all_ranks()
    result: dict[str, Any] = {
        "first_ids": [[s["input_ids"][:4] for s in mb] for mb in recorder.batches],
        "param_placements": sorted({str(p.placements) for p in trainer.model.parameters() if isinstance(p, DTensor)}),
        "logged_grad_norm": next((h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h), None),
    }
    if trainer_class is GradAccTrainer:
        result["backend"] = trainer.backend.describe()
        result["num_nonfinite_skipped"] = trainer.num_nonfinite_skipped
        result["dp_world_size"] = trainer.backend.dp_world_size
    plain = auto.from_pretrained(paths[task], dtype=torch.float32)
    # every micro-batch of the step once: the tensor ranks hold copies, so each data rank's batches appear twice
    unique = {repr([s["input_ids"] for s in mb]): mb for mb in micro_batches}
    result["num_micro_batches_all_ranks"] = len(micro_batches)
    result["num_unique_micro_batches"] = len(unique)
    reference = reference_gradients(plain, samples, "causal_lm" if task == "moe" else task, PaddingCollator(),
                                    micro_batches=list(unique.values()) if task == "moe" else None)
    result["reference_norm"] = norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in reference.values())))
    clip = case.get("max_grad_norm", 0.0)
    if clip and clip < norm:  # clipping scales the whole gradient to max_grad_norm (torch's 1e-6 in the factor)
        reference = {n: g * (clip / (norm + 1e-6)) for n, g in reference.items()}
    if hook == "zero_lm_head":
        reference["lm_head.weight"] = torch.zeros_like(reference["lm_head.weight"])
    result["max_abs_update"] = max(float(u.abs().max()) for u in update.values())
    result["update"] = compare(update, reference).__dict__
    if reader.grads:
        result["grad"] = compare(reader.grads, reference).__dict__
        result["grads_norm"] = reader.norm
    result["unchanged"] = [n for n, u in update.items() if float(u.abs().max()) == 0.0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    cases = json.loads(parser.parse_args().cases)
    enable_parallelism_on_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    root = tempfile.mkdtemp(prefix="tp_models_") if rank() == 0 else ""
    holder = [root]
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
