"""One rank of the multi-backward tests: two loss terms with different denominators, per-term or joint backward,
accumulated-gradient hooks and ``trainer.grads``, on DDP, DeepSpeed ZeRO-1/2/3 or FSDP2 (2 CPU ranks, gloo).

    # started by tests/distributed/test_multi_backward.py
    torchrun --nproc_per_node 2 multi_backward_cases.py --backend ddp --cases '[{"name": "per_term", "backward_per_term": true}]'
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        multi_backward_cases.py --backend deepspeed --cases '[...]'

Every case trains ``NUM_WINDOWS`` optimizer steps with SGD(lr=1) (``optim="sgd"``: DeepSpeed and FSDP2 build the
optimizer themselves) on a dataset of exactly that many windows, taken in order, so that window ``k`` holds
samples ``k * SAMPLES_PER_WINDOW ...`` of BOTH ranks (sequential sampler, accelerate's round-robin sharding). The
loss is a token cross-entropy normalised by the window's tokens plus a per-sample logit penalty normalised by its
samples. For each step the worker compares, against the float64 full-batch gradient of that window at the
parameters the step started from (gathered on every rank):

- the parameter change of the step (the update is minus the gradient at lr 1);
- the gradient every accumulated-gradient hook call received (full, ``local=False``);
- ``trainer.grads.full(name)`` of every parameter and ``trainer.grads.norm()``, read in a GradAccCallback's
  ``on_pre_optimizer_step``, and ``trainer.grads.norm()`` in its ``on_accumulated_grads``;
- the logged ``loss/ce``, ``loss/reg`` and ``grad_norm``;

and counts the optimizer steps (torch optimizer step hooks, ``on_optimizer_step``, ``global_step``, DeepSpeed's
``engine.global_steps``), the backward passes per step and hf_gradacc's warnings. Each rank writes one JSON per
case (``workers/_common.write_result``); a case that raises writes its traceback and the worker exits.

Case keys: name, backward_per_term (bool), hook (register the recording hook; default True), zero_reduction
(DeepSpeed), fsdp_sync (FSDP2).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import tempfile
import traceback
from typing import Any

import torch
from torch.utils.data import SequentialSampler

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.callbacks import GradAccCallback
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare, two_term_reference
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples, two_term_loss
from tests.distributed.workers._common import (  # the repository root is on PYTHONPATH
    WarningRecorder,
    finish_worker,
    rank,
    world_size,
    write_result,
)

BS, GA, NUM_WINDOWS = 2, 4, 2
SAMPLES_PER_WINDOW = BS * GA * world_size()
# Large enough that the 'samples' term carries ~30% of the gradient: normalising it by tokens instead is ~0.2 off.
REG_WEIGHT = 10.0
TASK = "causal_lm"


# ---------------------------------------------------------------------------------------------- the trainer
class TwoTermTrainer(GradAccTrainer):
    """Token cross-entropy ('tokens') plus a per-sample logit-size penalty ('samples'), as in tests/unit/test_addons.

    Samples are taken in dataset order, so the window each rank sees is known (see the module docstring).
    """

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        terms, outputs = two_term_loss(model, inputs, reg_weight=REG_WEIGHT)
        return (terms, outputs) if return_outputs else terms


# ---------------------------------------------------------------------------------------------- observers
class Recorder(GradAccCallback):
    """Everything one case observes, per optimizer step (0-based ``state.global_step`` while the step runs)."""

    def __init__(self) -> None:
        self.hook_calls: dict[int, dict[str, int]] = {}
        self.hook_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.full_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.norm_accumulated: dict[int, float] = {}
        self.norm_pre_step: dict[int, float] = {}
        self.params_after: dict[int, dict[str, torch.Tensor]] = {}
        self.backward_passes: dict[int, list[dict[str, bool]]] = {}
        self.engine_steps_before: dict[int, int] = {}
        self.callback_optimizer_steps = 0
        self.backend_optimizer_steps = 0
        self.in_optimizer_step = False
        # (step, inside backend.optimizer_step) of every torch SGD.step(); ZeRO steps the torch optimizer once per
        # parameter group
        self.torch_steps: list[tuple[int, bool]] = []
        self.param_groups = 0

    # accumulated-gradient hook: hook(name, grad)
    def __call__(self, name: str, grad: torch.Tensor) -> None:
        step = self.trainer.state.global_step
        calls = self.hook_calls.setdefault(step, {})
        calls[name] = calls.get(name, 0) + 1
        self.hook_grads.setdefault(step, {})[name] = grad.detach().float().cpu().clone()

    def wrap_backend(self, trainer: GradAccTrainer) -> None:
        """Record every backward pass and optimizer step the trainer asks of its backend."""
        backend = trainer.backend
        original = backend.backward
        original_step = backend.optimizer_step

        def counted(loss, *, is_final, **kwargs):
            passes = self.backward_passes.setdefault(trainer.state.global_step, [])
            passes.append({"is_final": bool(is_final), "retain_graph": bool(kwargs.get("retain_graph", False))})
            return original(loss, is_final=is_final, **kwargs)

        def stepping(optimizer, **kwargs):
            self.in_optimizer_step = True
            try:
                return original_step(optimizer, **kwargs)
            finally:
                self.in_optimizer_step = False
                self.backend_optimizer_steps += 1

        # instance attributes: the trainer calls self.backend.backward(...) / self.backend.optimizer_step(...)
        backend.backward = counted
        backend.optimizer_step = stepping

    def on_train_begin(self, args, state, control, **kwargs):
        optimizer = self.trainer.optimizer
        while not isinstance(optimizer, torch.optim.SGD):  # accelerate / DeepSpeed wrappers around the torch SGD
            optimizer = optimizer.optimizer
        optimizer.register_step_post_hook(self._count_step)
        self.param_groups = len(optimizer.param_groups)

    def _count_step(self, optimizer, args, kwargs) -> None:
        self.torch_steps.append((self.trainer.state.global_step, self.in_optimizer_step))

    def on_accumulated_grads(self, args, state, control, **kwargs):
        self.norm_accumulated[state.global_step] = self.trainer.grads.norm()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = self.trainer.grads
        self.full_grads[state.global_step] = {
            name: grads.full(name).detach().float().cpu().clone() for name, _ in grads.named_parameters()
        }
        self.norm_pre_step[state.global_step] = grads.norm()
        engine = self.trainer.model_wrapped
        if hasattr(engine, "global_steps"):
            self.engine_steps_before[state.global_step] = int(engine.global_steps)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.callback_optimizer_steps += 1

    def on_step_end(self, args, state, control, **kwargs):
        # a collective on sharded backends: every rank runs it
        self.params_after[state.global_step - 1] = {
            n: p.detach().float().cpu().clone() for n, p in full_parameters(self.trainer).items()
        }


# ---------------------------------------------------------------------------------------------- one case
def _args(case: dict[str, Any], backend: str) -> GradAccConfig:
    overrides: dict[str, Any] = {"backward_per_term": bool(case["backward_per_term"]), "seed": 0}
    if backend == "deepspeed":
        overrides["use_cpu"] = False  # use_cpu would bypass DeepSpeed; the CPU patch picks gloo
        overrides["zero_reduction"] = case.get("zero_reduction", "per_micro_batch")
    elif backend == "fsdp2":
        overrides.update(
            use_cpu=True,
            fsdp=True,
            fsdp_config={"version": 2},
            ddp_backend="gloo",
            fsdp_sync=case.get("fsdp_sync", "deferred"),
        )
    else:
        overrides["use_cpu"] = True
    return one_step_args(
        tempfile.mkdtemp(prefix="hf_gradacc_mb_"),
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        max_steps=NUM_WINDOWS,
        args_class=GradAccConfig,
        **overrides,  # one_step_args: optim="sgd", lr 1 constant, no clipping, no weight decay
    )


def _model_at(base: torch.nn.Module, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def run_case(case: dict[str, Any], backend: str, base: torch.nn.Module, samples: list) -> dict[str, Any]:
    warnings = WarningRecorder()
    logging.getLogger("hf_gradacc").addHandler(warnings)
    try:
        model = copy.deepcopy(base)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        recorder = Recorder()
        trainer = TwoTermTrainer(
            model=model,
            args=_args(case, backend),
            train_dataset=ListDataset(samples),
            data_collator=PaddingCollator(),
            callbacks=[recorder],
        )
        plugin = trainer.accelerator.state.deepspeed_plugin
        zero_stage = plugin.zero_stage if plugin is not None else None
        if zero_stage == 3:
            # Tiny models: without this every parameter stays whole on every rank and ZeRO-3 shards nothing.
            plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if case.get("hook", True):
            trainer.register_accumulated_grad_hook(recorder)
        recorder.wrap_backend(trainer)
        trainer.train()
    finally:
        logging.getLogger("hf_gradacc").removeHandler(warnings)

    engine = trainer.model_wrapped
    module = trainer.accelerator.unwrap_model(engine)
    payload: dict[str, Any] = {
        "backend": backend,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "zero_stage": zero_stage,
        "backend_supports_backward_per_term": trainer.backend.supports_backward_per_term,
        "global_step": trainer.state.global_step,
        "backend_optimizer_steps": recorder.backend_optimizer_steps,
        "torch_steps_per_window": [sum(s == k for s, _ in recorder.torch_steps) for k in range(NUM_WINDOWS)],
        "torch_steps_outside_optimizer_step": sum(not inside for _, inside in recorder.torch_steps),
        "param_groups": recorder.param_groups,
        "callback_optimizer_steps": recorder.callback_optimizer_steps,
        "engine_global_steps": int(engine.global_steps) if hasattr(engine, "global_steps") else None,
        "engine_steps_before_callback": [recorder.engine_steps_before.get(k) for k in range(NUM_WINDOWS)],
        "param_types": sorted({type(p).__name__ for p in module.parameters()}),
        "fallback_warnings": sum("backward_per_term" in m for m in warnings.messages),
        "warnings": warnings.messages,
        "num_trainable": len(trainable),
        "steps": [],
    }
    logs = [h for h in trainer.state.log_history if "loss" in h]
    initial = {n: p.detach().float().clone() for n, p in base.named_parameters()}
    for k in range(NUM_WINDOWS):
        before = initial if k == 0 else recorder.params_after[k - 1]
        after = recorder.params_after[k]
        window = samples[k * SAMPLES_PER_WINDOW : (k + 1) * SAMPLES_PER_WINDOW]
        reference, ce, reg = two_term_reference(_model_at(base, before), window, PaddingCollator(), REG_WEIGHT)
        reference = {n: g for n, g in reference.items() if n in trainable}
        ref_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in reference.values()))
        update = {n: before[n] - after[n] for n in trainable}
        calls = recorder.hook_calls.get(k, {})
        passes = recorder.backward_passes.get(k, [])
        step: dict[str, Any] = {
            "reference_norm": ref_norm,
            "update": compare(update, reference).relative_error,
            "num_unchanged": sum(int(bool((u == 0).all())) for u in update.values()),
            "full_grads": compare(recorder.full_grads[k], reference).relative_error,
            "full_grads_names": sorted(recorder.full_grads[k]) == sorted(trainable),
            "norm_pre_step": _rel(recorder.norm_pre_step[k], ref_norm),
            "norm_accumulated": _rel(recorder.norm_accumulated[k], ref_norm),
            "backward_passes": len(passes),
            "final_passes": sum(p["is_final"] for p in passes),
            "last_pass_is_final": bool(passes) and passes[-1]["is_final"],
            "retain_graph_passes": sum(p["retain_graph"] for p in passes),
        }
        if case.get("hook", True):
            step.update(
                hook=compare(recorder.hook_grads[k], reference).relative_error,
                hook_names_match=sorted(calls) == sorted(trainable),
                hook_calls_per_param=sorted(set(calls.values())),
            )
        if k < len(logs):
            log = logs[k]
            step.update(
                logged_ce=_rel(log["loss/ce"], ce),
                logged_reg=_rel(log["loss/reg"], REG_WEIGHT * reg),
                logged_loss=_rel(log["loss"], ce + REG_WEIGHT * reg),
                logged_grad_norm=_rel(log["grad_norm"], ref_norm),
            )
        if k == 0:
            wrong, _, _ = two_term_reference(
                _model_at(base, before), window, PaddingCollator(), REG_WEIGHT, reg_by_tokens=True
            )
            step["wrong_denominator"] = compare({n: wrong[n] for n in trainable}, reference).relative_error
        payload["steps"].append(step)
    return payload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("ddp", "deepspeed", "fsdp2"), required=True)
    parser.add_argument("--cases", required=True, help="JSON list of case dicts")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if opts.backend == "fsdp2":
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    # Model and samples before anything DeepSpeed-related exists (ZeRO-3 partitions the model it gets in place).
    base = build_tiny_model(TASK)
    samples = make_samples(TASK, SAMPLES_PER_WINDOW * NUM_WINDOWS, seed=3)
    for case in json.loads(opts.cases):
        try:
            payload = run_case(case, opts.backend, base, samples)
        except Exception:
            write_result(case["name"], {"crash": traceback.format_exc()})
            raise
        write_result(case["name"], payload)
        if rank() == 0:
            print(f"[multi_backward_cases] {opts.backend} {case['name']}: {json.dumps(payload['steps'])[:800]}", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
