"""One rank of the tests of models sharded at load time by transformers' ``DistributedConfig`` (tensor parallel x
FSDP2, tensor parallel alone, expert parallel x FSDP2 or x tensor parallel) on CPU ranks (gloo): one SGD(lr=1) step
each, every rank comparing the update and ``trainer.grads`` with the float64 full batch (a mixture of experts' router
term weighted per micro-batch by its routed tokens). Started by tests/distributed/test_mesh_tp.py (4 and 2 ranks) and
test_mesh_ep.py (2 ranks).

    python mesh_sharded_cases.py --cases '[{"name": "a", "model": "llama", "sizes": {"tp_size": 2, "fsdp_size": 2}}]'

``--patch-from-env``: leave ``hf_gradacc.patches.parallelism_cpu`` to ``HF_GRADACC_CPU_DISTRIBUTED=1`` (GradAccTrainer
applies the CPU patch set when it is created) instead of turning it on here, as a user's script does.

Case keys: name; model ('llama' | 'llama_seq_cls' | 'mixtral' | 'qwen3_moe' | 'mixtral_kv2' | 'mixtral_seq_cls' |
'mixtral_kv2_seq_cls':
the ``_seq_cls`` models are sequence classifiers, the others causal LMs; mixtral_kv2 has 2 key-value heads so that a
tensor plan can split its attention); sizes (the DistributedConfig fields); trainer ('gradacc' | 'stock');
max_grad_norm (TrainingArguments); hook ('zero_lm_head' | 'nan': an accumulated-gradient hook); settings (GradAccConfig
fields); budget (count every collective of the step, by who asked: mesh_cases.Budget); mode ('trainer' |
'setup_error': report the error the trainer raises | 'check': run `hf-gradacc check --distributed_config <sizes>` in
this launch, with ``check_args``; it tears the process group down, so it comes last).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Trainer, TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.patches.parallelism_cpu import enable_parallelism_on_cpu, is_parallelism_on_cpu_enabled
from hf_gradacc.testing.one_step import _Recorder, one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, build_tiny_moe, make_samples
from tests.distributed.workers._common import finish_worker, rank, world_size, write_result

PER_DEVICE_BATCH = 2
GRAD_ACC = 2
LOAD = "moe/load_max_over_mean"
MODELS = ("llama", "llama_seq_cls", "mixtral", "qwen3_moe", "mixtral_kv2", "mixtral_seq_cls", "mixtral_kv2_seq_cls")


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _build(name: str) -> torch.nn.Module:
    from transformers import LlamaForSequenceClassification, MixtralForSequenceClassification

    from hf_gradacc.testing.tiny import NUM_LABELS

    if name in ("llama", "mixtral", "qwen3_moe"):
        return build_tiny_model("causal_lm") if name == "llama" else build_tiny_moe(name)
    config = (build_tiny_model("causal_lm") if name == "llama_seq_cls" else build_tiny_moe("mixtral")).config
    if name.startswith("mixtral_kv2"):
        config.num_key_value_heads = 2
    if name == "mixtral_kv2":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)
    # a sequence classifier on the causal LM's config: its base model has the tensor / expert plan
    config.num_labels = NUM_LABELS
    config.output_router_logits = False  # the router term is tested on the causal LMs
    torch.manual_seed(1)
    return (LlamaForSequenceClassification if name == "llama_seq_cls" else MixtralForSequenceClassification)(config)


def save_models(root: str, names: set[str]) -> dict[str, str]:
    """The tiny models the cases name, saved once by rank 0 for ``from_pretrained(..., distributed_config=...)``."""
    paths = {name: f"{root}/{name}" for name in MODELS}
    if rank() == 0:
        for name in sorted(names):
            _build(name).save_pretrained(paths[name])
    dist.barrier()
    return paths


class GradReader(TrainerCallback):
    """The full accumulated gradient through ``trainer.grads`` in ``on_pre_optimizer_step`` (a collective per
    parameter: every rank), and its norm."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.budget: Any = None  # a mesh_cases.Budget counting the step's collectives: not these
        self.grads: dict[str, torch.Tensor] = {}
        self.norm: float | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        with self.budget.paused() if self.budget is not None else contextlib.nullcontext():
            grads = self.trainer.grads
            self.grads = {name: grads.full(name).detach().clone() for name, _ in grads.named_parameters()}
            self.norm = float(grads.norm())


def _task(case: dict[str, Any]) -> str:
    return "sequence_classification" if case["model"].endswith("_seq_cls") else "causal_lm"


def run_check(case: dict[str, Any]) -> dict[str, Any]:
    """`hf-gradacc check --distributed_config ...` in this launch: its exit status, printed report and JSON."""
    from hf_gradacc.commands.check import check_command, check_command_parser

    parser = argparse.ArgumentParser(prog="hf-gradacc")
    check_command_parser(parser.add_subparsers(dest="command"))
    report = f"{tempfile.mkdtemp(prefix='check_mesh_')}/check.json"
    sizes = ",".join(f"{k}={v}" for k, v in case["sizes"].items())
    opts = parser.parse_args(["check", "--distributed_config", sizes, "--json", report, *case.get("check_args", [])])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = check_command(opts)
    payload: dict[str, Any] = {"status": status, "stdout": printed.getvalue()}
    if rank() == 0:
        with open(report) as f:
            payload["json"] = json.load(f)
    return payload


def run_case(case: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    from transformers.distributed import DistributedConfig

    task = _task(case)
    path = paths[case["model"]]
    auto = AutoModelForSequenceClassification if task == "sequence_classification" else AutoModelForCausalLM
    sizes = case["sizes"]
    model = auto.from_pretrained(path, distributed_config=DistributedConfig(**sizes), dtype=torch.float32)
    data_ranks = int(sizes.get("fsdp_size", 1)) * int(sizes.get("dp_replicate_size", 1))
    # one window: data ranks x 2 x GA 2 samples; mixed lengths, masked prompts
    samples = make_samples(task, data_ranks * PER_DEVICE_BATCH * GRAD_ACC, seed=11)
    args = one_step_args(per_device_train_batch_size=PER_DEVICE_BATCH, gradient_accumulation_steps=GRAD_ACC,
                         ddp_backend="gloo", output_dir=tempfile.mkdtemp(prefix="sharded_"),
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
    callbacks: list[Any] = [reader] if trainer_class is GradAccTrainer else []
    budget = None
    if case.get("budget"):
        from tests.distributed.workers.mesh_cases import Budget

        budget = reader.budget = Budget()
        callbacks.append(budget)
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
    patched_when_built = is_parallelism_on_cpu_enabled()  # by the variable, when the worker left it off
    if budget is not None:
        budget.trainer = trainer
        with budget:
            trainer.train()
    else:
        trainer.train()
    update = {n: initial[n] - full(p) for n, p in trainer.model.named_parameters()}
    micro_batches = recorder.all_ranks()
    # every micro-batch of the step once: the tensor / expert ranks hold copies of the data ranks' batches
    unique = {repr([s["input_ids"] for s in mb]): mb for mb in micro_batches}
    result: dict[str, Any] = {
        "first_ids": [[s["input_ids"][:4] for s in mb] for mb in recorder.batches],
        "num_micro_batches_all_ranks": len(micro_batches),
        "num_unique_micro_batches": len(unique),
        "param_placements": sorted({str(p.placements) for p in trainer.model.parameters() if isinstance(p, DTensor)}),
        "expert_placements": sorted({str(p.placements) for n, p in trainer.model.named_parameters()
                                     if "experts" in n and hasattr(p, "placements")}),  # fmt: skip
        "logged_grad_norm": next((h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h), None),
        "logged_aux": next((h["loss/aux"] for h in trainer.state.log_history if "loss/aux" in h), None),
        "logged_load": next((h[LOAD] for h in trainer.state.log_history if LOAD in h), None),
        "parallelism_patch_on_when_built": patched_when_built,
    }
    if budget is not None:
        result["steps"], result["logs"] = budget.per_step, budget.per_log
    if trainer_class is GradAccTrainer:
        result["backend"] = trainer.backend.describe()
        result["num_nonfinite_skipped"] = trainer.num_nonfinite_skipped
        result["dp_world_size"] = trainer.backend.mesh.dp_world_size
    plain = auto.from_pretrained(path, dtype=torch.float32)
    reference = reference_gradients(plain, samples, task, PaddingCollator(), micro_batches=list(unique.values()))
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
    coefficient = getattr(plain.config, "router_aux_loss_coef", None)
    if task == "causal_lm" and coefficient is not None and plain.config.output_router_logits:
        # transformers #48690: the router term multiplied by the world size. The same reference with the model's
        # coefficient x world size (x GA): is the stock Trainer's update that one?
        for label, factor in (("x_world", world_size()), ("x_world_x_ga", world_size() * GRAD_ACC)):
            plain.config.router_aux_loss_coef = plain.router_aux_loss_coef = coefficient * factor
            scaled = reference_gradients(plain, samples, task, PaddingCollator(), micro_batches=list(unique.values()))
            result[f"update_vs_router_{label}"] = compare(update, scaled).__dict__
    if task == "causal_lm" and getattr(plain.config, "output_router_logits", False):
        result["expected_load"] = expected_load(plain, list(unique.values()))
    result["unchanged"] = [n for n, u in update.items() if float(u.abs().max()) == 0.0]
    return result


def expected_load(model: torch.nn.Module, micro_batches: list[list[dict[str, Any]]]) -> float:
    """``moe/load_max_over_mean`` of the step from the unsharded model on every micro-batch of every data rank: per
    layer, the top-k assignments of the unpadded tokens to each expert, the most loaded over the mean, averaged over
    layers (written here from the definition, not with hf_gradacc.moe_balance)."""
    counts: torch.Tensor | None = None
    with torch.no_grad():
        for features in micro_batches:
            batch = PaddingCollator()(features)
            outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            output_router_logits=True)  # fmt: skip
            keep = batch["attention_mask"].reshape(-1).bool()
            top_k = model.config.num_experts_per_tok
            chosen = [torch.topk(gate.float()[keep], top_k, dim=-1).indices.reshape(-1) for gate in outputs.router_logits]
            layers = torch.stack([torch.bincount(c, minlength=gate.shape[-1]) for c, gate in
                                  zip(chosen, outputs.router_logits, strict=True)]).double()  # fmt: skip
            counts = layers if counts is None else counts + layers
    assert counts is not None
    return float((counts.max(-1).values / counts.mean(-1)).mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--patch-from-env", action="store_true", help="leave the CPU patch to HF_GRADACC_CPU_DISTRIBUTED")
    opts = parser.parse_args()
    cases = json.loads(opts.cases)
    if not opts.patch_from_env:
        enable_parallelism_on_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    holder = [tempfile.mkdtemp(prefix="sharded_models_") if rank() == 0 else ""]
    dist.broadcast_object_list(holder, src=0)
    paths = save_models(holder[0], {case["model"] for case in cases if "model" in case})
    status = 0
    for case in cases:
        is_check = case.get("mode") == "check"
        try:
            write_result(case["name"], run_check(case) if is_check else run_case(case, paths))
        except Exception:  # noqa: BLE001  (reported in the result: the test shows it)
            status = 1
            write_result(case["name"], {"crash": traceback.format_exc()})
        if not is_check:  # the check tore the process group down
            dist.barrier()
    finish_worker(status)


if __name__ == "__main__":
    main()
