"""One rank of the FSDP2 tests: runs a list of one-step cases on CPU (gloo); each rank writes one JSON per case.

    python fsdp2_cases.py --cases '[{"name": "a", "task": "causal_lm"}]'   # started by tests/distributed/launcher.py

Each trainer case trains ONE optimizer step with SGD(lr=1) on a dataset of exactly one window (all ranks together),
so the parameter update is minus the accumulated gradient, and rank 0 compares it with the float64 full-batch
reference over every rank's samples. The optimizer comes from ``optim="sgd"``: the Trainer refuses
``optimizers=`` under FSDP, so `hf_gradacc.testing.one_step.one_step_update` cannot be used here. Under FSDP2 the parameters
and gradients are DTensors: they are gathered with ``full_tensor()`` (a collective, on every rank in the same
order) before the comparison.

Case keys:
    name, task, trainer ('gradacc' | 'stock'), fsdp_sync, fsdp_config (extra TrainingArguments.fsdp_config),
    parallelism (TrainingArguments.parallelism_config's sizes: HSDP),
    mode ('trainer' | 'setup_error': report the error the trainer raises | 'direct': FSDP2Backend on a model sharded
    by hand, see `run_direct_case`), hsdp, two_backward (direct mode), hook (trainer mode: an accumulated-gradient
    hook zeroes ``lm_head.weight`` and ``trainer.grads.norm()`` is read before the step), moe (trainer mode: a tiny
    mixture-of-experts causal LM of that family, whose router term needs every rank's micro-batches for the
    reference; one sample fewer, so one micro-batch is short), budget (trainer mode: every collective of the step
    and of its log line by who asked, mesh_cases.Budget; not the probe's own gathers), max_grad_norm.
Every case counts FSDP2's reduce-scatter and all-reduce calls per micro-batch and (trainer mode) gathers the
accumulated gradient in ``on_pre_optimizer_step``.

With ``--launcher accelerate`` (``accelerate launch --config_file fsdp2_cpu.yaml``) the FSDP settings come from the
accelerate config, not from TrainingArguments, and the CPU patch from ``HF_GRADACC_CPU_DISTRIBUTED=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import tempfile
import traceback
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.backends.mesh import mesh_from_accelerator
from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, build_tiny_moe, make_samples
from tests.distributed.workers._common import CollectiveCounter, finish_worker, write_result

PER_DEVICE_BATCH = 2
GRAD_ACC = 4
ZEROED = "lm_head.weight"


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def comparison(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    c = compare(update, reference)
    return {"relative_error": c.relative_error, "cosine": c.cosine, "norm_ratio": c.norm_ratio}


class ProbeCallback(TrainerCallback):
    """Per-micro-batch comm counts (differences between hooks) and the accumulated gradient before the step."""

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter = counter
        self.trainer: Trainer | None = None
        self.per_micro_batch: list[dict[str, int]] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.grad_types: set[str] = set()
        self.grads_norm: float | None = None
        self.budget: Any = None  # a mesh_cases.Budget: the gathers below are the test's, not the step's
        self._last = dict(counter.counts)

    def _mark(self) -> None:
        now = dict(self.counter.counts)
        self.per_micro_batch.append({k: now[k] - self._last[k] for k in now})
        self._last = now

    def on_step_begin(self, args, state, control, **kwargs):
        self._last = dict(self.counter.counts)

    def on_substep_end(self, args, state, control, **kwargs):
        self._mark()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._mark()  # the last micro-batch's collectives (and the norm's, which FSDP2 does not route through these)
        with self.budget.paused() if self.budget is not None else contextlib.nullcontext():
            self._read_grads(kwargs["model"])

    def _read_grads(self, model: torch.nn.Module) -> None:
        # under FSDP the Trainer's `model` is the sharded one (accelerate prepared it in place)
        for name, param in model.named_parameters():
            self.grad_types.add(type(param.grad).__name__)
            if param.grad is not None:
                self.grads[name] = full(param.grad).detach().clone().cpu()
        grads = getattr(self.trainer, "grads", None)
        if grads is not None:
            self.grads_norm = grads.norm()


def run_trainer_case(case: dict[str, Any], rank: int, world: int, launcher: str) -> dict[str, Any]:
    task = case["task"]
    trainer_kind = case.get("trainer", "gradacc")
    moe = case.get("moe")
    samples = make_samples(task, world * PER_DEVICE_BATCH * GRAD_ACC - bool(moe), seed=case.get("seed", 3))
    model = build_tiny_moe(moe) if moe else build_tiny_model(task)
    overrides: dict[str, Any] = dict(use_cpu=True, seed=11, optim="sgd")
    if moe:
        overrides["accelerator_config"] = {"even_batches": False}  # no repeated samples in the short micro-batch
    if launcher == "torchrun":
        overrides.update(fsdp=True, fsdp_config={"version": 2, **case.get("fsdp_config", {})}, ddp_backend="gloo")
    if case.get("parallelism"):  # e.g. HSDP: {"dp_replicate_size": 2, "dp_shard_size": 2}
        from accelerate import ParallelismConfig

        overrides["parallelism_config"] = ParallelismConfig(**case["parallelism"])
    if "max_grad_norm" in case:
        overrides["max_grad_norm"] = case["max_grad_norm"]
    if trainer_kind == "gradacc":
        overrides["fsdp_sync"] = case.get("fsdp_sync", "deferred")
        args_class: type[TrainingArguments] = GradAccConfig
        trainer_class: type[Trainer] = GradAccTrainer
    else:
        args_class, trainer_class = TrainingArguments, Trainer
    args = one_step_args(
        tempfile.mkdtemp(prefix="hf_gradacc_fsdp2_"),
        per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=GRAD_ACC,
        args_class=args_class,
        **overrides,
    )
    work = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in work.named_parameters() if p.requires_grad}
    micro_batches: list[list[dict[str, Any]]] = []  # this rank's, as features (the router reference needs them)

    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        micro_batches.append([dict(f) for f in features])
        return PaddingCollator()(features)

    counter = CollectiveCounter()
    probe = ProbeCallback(counter)
    callbacks: list[TrainerCallback] = [probe]
    if case.get("budget"):
        from tests.distributed.workers.mesh_cases import Budget

        probe.budget = Budget()
        callbacks.append(probe.budget)
    result: dict[str, Any] = {"name": case["name"], "rank": rank}
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Capture(level=logging.WARNING)
    logging.getLogger("hf_gradacc").addHandler(handler)
    try:
        trainer = trainer_class(
            model=work,
            args=args,
            train_dataset=ListDataset(samples),
            data_collator=collate,
            callbacks=callbacks,
        )
        probe.trainer = trainer
        if probe.budget is not None:
            probe.budget.trainer = trainer
        if case.get("hook"):

            def zero_head(name: str, grad: torch.Tensor) -> None:
                if name == ZEROED:
                    grad.zero_()

            trainer.register_accumulated_grad_hook(zero_head)
        # the budget entered last: its wrappers are outermost, so it sees the caller, not the counter's wrapper
        with counter, probe.budget if probe.budget is not None else contextlib.nullcontext():
            trainer.train()
    except Exception as exc:  # reported to the test, which asserts on it
        if case.get("mode") != "setup_error":
            raise
        result.update(error_type=type(exc).__name__, error=str(exc), traceback=traceback.format_exc()[-3000:])
        return result
    finally:
        logging.getLogger("hf_gradacc").removeHandler(handler)
    if case.get("mode") == "setup_error":
        result["error"] = None
        return result

    final = {n: full(p).detach().clone().cpu() for n, p in trainer.model.named_parameters()}
    every_rank: list[Any] = [None] * world
    dist.all_gather_object(every_rank, micro_batches)
    step_micro_batches = [mb for per_rank in every_rank for mb in per_rank]
    result.update(
        mesh=mesh_from_accelerator(trainer.accelerator, trainer.model).describe(),
        distributed_type=str(trainer.accelerator.distributed_type),
        param_types=sorted({type(p).__name__ for p in trainer.model.parameters()}),
        grad_types=sorted(probe.grad_types),
        warnings=records,
        per_micro_batch=probe.per_micro_batch,
        grads_norm=probe.grads_norm,
    )
    if probe.budget is not None:
        result.update(steps=probe.budget.per_step, logs=probe.budget.per_log)
    if rank == 0:
        reference = reference_gradients(model, samples, task, PaddingCollator(),
                                        micro_batches=step_micro_batches if moe else None)  # fmt: skip
        result["micro_batch_sizes"] = sorted(len(mb) for mb in step_micro_batches)
        update = {n: initial[n] - final[n] for n in initial if n in final}
        result["missing"] = sorted(set(initial) - set(final))
        result["unchanged"] = sorted(n for n, u in update.items() if float(u.abs().max()) == 0.0)
        if case.get("hook"):
            result["zeroed_update_max"] = float(update.pop(ZEROED).abs().max())
            reference.pop(ZEROED)
            probe.grads.pop(ZEROED, None)
        result["update"] = comparison(update, reference)
        if moe:  # the router weights alone: the router term is a small share of the whole update
            router = [n for n in reference if n.endswith("mlp.gate.weight")]
            result["router"] = comparison({n: update[n] for n in router}, {n: reference[n] for n in router})
            result["num_router"] = len(router)
        result["grad"] = comparison(probe.grads, reference) if probe.grads else None
        result["num_grads"] = len(probe.grads)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result["logged_grad_norm"] = logs[0].get("grad_norm") if logs else None
        result["reference_norm"] = float(torch.cat([r.reshape(-1) for r in reference.values()]).norm())
    return result


class _Accelerator:
    """What FSDP2Backend uses of `accelerate.Accelerator`, for a model sharded by hand (no Trainer)."""

    def __init__(self, world: int) -> None:
        self.num_processes = world

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)


def run_direct_case(case: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """FSDP2Backend on a causal LM sharded by hand with ``fully_shard``.

    Covers what the Trainer cannot set up on 2 CPU ranks: HSDP (mesh replicate=2 x shard=1; accelerate refuses a
    shard dim of 1), and one forward + two backward passes per micro-batch (``retain_graph``). The loss of each
    micro-batch is its summed cross-entropy / the global token count * world size, as the trainer computes it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_gradacc.backends.fsdp2 import FSDP2Backend
    from hf_gradacc.config import GradAccSettings
    from hf_gradacc.loss import causal_targets, normalize, token_count, token_cross_entropy_sum

    task = "causal_lm"
    samples = make_samples(task, world * PER_DEVICE_BATCH * GRAD_ACC, seed=case.get("seed", 3))
    model = build_tiny_model(task)
    work = copy.deepcopy(model)
    if case.get("hsdp"):
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if case.get("reduce_dtype"):  # bf16 compute, gradients reduced (and accumulated) in reduce_dtype
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, case["reduce_dtype"])
        )
    for layer in work.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(work, **kwargs)
    backend = FSDP2Backend(
        _Accelerator(world),
        SimpleNamespace(),
        GradAccSettings(fsdp_sync=case["fsdp_sync"]),
        multi_backward=bool(case.get("two_backward")),
    )
    backend.setup(work, None)
    collate = PaddingCollator()
    n = PER_DEVICE_BATCH * GRAD_ACC
    mine = samples[rank * n : (rank + 1) * n]
    batches = [collate(mine[i : i + PER_DEVICE_BATCH]) for i in range(0, n, PER_DEVICE_BATCH)]
    count = torch.tensor(float(sum(int(token_count(causal_targets(b["labels"]))) for b in batches)))
    dist.all_reduce(count)
    global_count = int(count)
    counter = CollectiveCounter()
    per_micro_batch = []
    with counter:
        for i, batch in enumerate(batches):
            before = dict(counter.counts)
            is_last = i == len(batches) - 1
            with backend.sync_context(is_last=is_last):
                logits = work(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                targets = causal_targets(batch["labels"])
                if case.get("two_backward"):
                    # the micro-batch's loss in two parts through one forward: the first row, then the rest
                    first = normalize(token_cross_entropy_sum(logits[:1], targets[:1]), global_count, world)
                    rest = normalize(token_cross_entropy_sum(logits[1:], targets[1:]), global_count, world)
                    backend.backward(first, is_final=False, retain_graph=True)
                    backend.backward(rest, is_final=is_last)
                else:
                    loss = normalize(token_cross_entropy_sum(logits, targets), global_count, world)
                    backend.backward(loss, is_final=is_last)
            per_micro_batch.append({k: counter.counts[k] - before[k] for k in before})
    named = list(work.named_parameters())
    grads = {name: backend.full_grad(p).detach().clone() for name, p in named}
    squares = backend.grad_sq_norms([p for _, p in named])
    norm = float(backend.clip_grad_norm(float("inf")))
    result: dict[str, Any] = {"name": case["name"], "rank": rank, "per_micro_batch": per_micro_batch}
    result.update(is_hsdp=backend._hsdp, clip_norm=norm, sq_norm_sum=float(squares.sum()))
    if rank == 0:
        reference = reference_gradients(model, samples, task, collate)
        result["grad"] = comparison(grads, reference)
        result["reference_norm"] = float(torch.cat([r.reshape(-1) for r in reference.values()]).norm())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of case dicts")
    parser.add_argument("--launcher", choices=("torchrun", "accelerate"), default="torchrun")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if ns.launcher == "torchrun":
        enable_fsdp_on_cpu()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for case in json.loads(ns.cases):
        if case.get("mode") == "direct":
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            result = run_direct_case(case, rank, world)
        else:
            result = run_trainer_case(case, rank, world, ns.launcher)
        write_result(case["name"], result)
    finish_worker()


if __name__ == "__main__":
    main()
