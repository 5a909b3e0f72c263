"""One `accelerate launch` rank of the DeepSpeed tests: runs a list of one-step cases on CPU (gloo).

    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        tests/distributed/workers/deepspeed_cases.py --cases '[{"name": "a", "task": "causal_lm"}]'
    torchrun --nproc_per_node 2 tests/distributed/workers/deepspeed_cases.py --cases '[...]' \
        --deepspeed-config '{"zero_optimization": {"stage": 3}, ...}'

The ZeRO stage comes from the accelerate config, or from ``--deepspeed-config`` (then passed to
``TrainingArguments(deepspeed=...)``, the Hugging Face way). Each "step" case trains ONE optimizer step with SGD(lr=1) (the
`optim="sgd"` of TrainingArguments: DeepSpeed drops an optimizer instance passed to the Trainer) on a dataset of
exactly one window (all ranks together), so the parameter update is minus the accumulated gradient, and compares it
with the float64 full-batch reference over every rank's samples. Every rank writes its JSON result.

Case keys: name, task, trainer ('gradacc' | 'stock'), zero_reduction, max_grad_norm (0 = no clipping),
read_grads (read the accumulated gradient with `safe_get_full_grad` in `on_pre_optimizer_step`), observe_step
(only record whether the engine already stepped when `on_pre_optimizer_step` runs), count_reductions
(count the ZeRO optimizer's gradient reductions per micro-batch), hook_scale (an accumulated-gradient hook that
scales every gradient; hook_local: on this rank's part only), optimizer ('closure_sgd': a torch optimizer DeepSpeed cannot step), mode ('step' |
'config_error': build the trainer with the `env` overrides, train it when `train` is true, report the error),
env (environment variables set meanwhile), unpatched (undo the CPU-distributed patch for the case),
multi_backward (two LossTerms, `backward_per_term=True`: two backward passes per micro-batch), num_windows (train
that many optimizer steps; reports a projection of the total update instead of a reference comparison), moe (a tiny
mixture-of-experts causal LM of that family, one sample fewer so one micro-batch is short; its float64 reference
needs every rank's micro-batches for the router term, so it is computed after training from the gathered batches).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer, LossTerm
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, build_tiny_moe, make_samples
from tests.distributed.workers._common import ZeroReductionCounter, finish_worker, rank, world_size, write_result

PER_DEVICE_BATCH = 2
GRAD_ACC = 4
# `--deepspeed-config`: TrainingArguments(deepspeed=...) under torchrun, the HF way, instead of accelerate's config
DEEPSPEED_CONFIG: dict[str, Any] | None = None


class GradReader(TrainerCallback):
    """Reads the full accumulated gradient of every trainable parameter in ``on_pre_optimizer_step``.

    ``safe_get_full_grad`` is a collective: every rank calls it for every parameter in the same order.
    """

    def __init__(self, *, read: bool = True) -> None:
        self.read = read
        self.trainer: Trainer | None = None
        self.grads: dict[str, torch.Tensor] = {}
        self.engine_steps_before: int | None = None
        self.backend_norm: float | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        from deepspeed.utils import safe_get_full_grad

        assert self.trainer is not None
        engine = self.trainer.model_wrapped
        self.engine_steps_before = int(engine.global_steps)
        if not self.read:
            # After engine.step() (the stock Trainer) safe_get_full_grad raises on the ranks that own a fragment
            # of the parameter and all-reduces on the others: a deadlock, not an error. Only observe the step.
            return
        module = self.trainer.accelerator.unwrap_model(engine)
        for name, param in module.named_parameters():
            if param.requires_grad:
                grad = safe_get_full_grad(param)
                self.grads[name] = grad.detach().float().cpu().clone() if grad is not None else None
        backend = getattr(self.trainer, "backend", None)
        if backend is not None:
            params = [p for p in module.parameters() if p.requires_grad]
            self.backend_norm = float(backend.grad_sq_norms(params).sum().sqrt())


class ReductionCounter(TrainerCallback):
    """The ZeRO optimizer's gradient reductions (`ZeroReductionCounter`) per micro-batch of the optimizer step."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.counter = ZeroReductionCounter()
        self.per_micro_batch: list[int] = []

    @property
    def wrapped(self) -> list[str]:
        return self.counter.wrapped

    def on_train_begin(self, args, state, control, **kwargs):
        assert self.trainer is not None
        self.counter.install(self.trainer.model_wrapped.optimizer)

    def _snapshot(self) -> None:
        self.per_micro_batch.append(self.counter.calls)
        self.counter.calls = 0

    def on_substep_end(self, args, state, control, **kwargs):
        self._snapshot()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._snapshot()


class ScaleHook:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, name: str, grad: torch.Tensor) -> None:
        grad.mul_(self.factor)


class TwoTermTrainer(GradAccTrainer):
    """compute_loss returns the loss as two LossTerms (1/4 and 3/4 of it): with `backward_per_term=True` every
    micro-batch runs two backward passes through one forward pass (the first with retain_graph)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        total = self.sum_loss_from_logits(model(**inputs).logits, labels)
        return {
            "quarter": LossTerm(total=0.25 * total, normalize_by=self.primary_denominator),
            "rest": LossTerm(total=0.75 * total, normalize_by=self.primary_denominator),
        }


def _sq_norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in tensors.values()))


def _world_info(trainer: Trainer) -> dict[str, Any]:
    state = trainer.accelerator.state
    return {
        "accelerate_num_processes": trainer.accelerator.num_processes,
        "args_world_size": trainer.args.world_size,
        "torch_world_size": dist.get_world_size(),
        "backend": state.backend,
        "distributed_type": str(state.distributed_type),
        "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
    }


def _args(case: dict[str, Any], output_dir: str) -> TrainingArguments:
    gradacc = case.get("trainer", "gradacc") == "gradacc"
    extra: dict[str, Any] = {"zero_reduction": case.get("zero_reduction", "per_micro_batch")} if gradacc else {}
    if case.get("multi_backward"):
        extra["backward_per_term"] = True
    if DEEPSPEED_CONFIG is not None:
        extra["deepspeed"] = copy.deepcopy(DEEPSPEED_CONFIG)
    if case.get("moe"):
        extra["accelerator_config"] = {"even_batches": False}  # no repeated samples in the short micro-batch
    return one_step_args(
        output_dir,
        per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=GRAD_ACC,
        max_steps=case.get("num_windows", 1),
        args_class=GradAccConfig if gradacc else TrainingArguments,
        use_cpu=False,  # a DeepSpeed launch: accelerate (patched) picks gloo; use_cpu would bypass DeepSpeed
        optim="sgd",
        max_grad_norm=case.get("max_grad_norm", 0.0),
        seed=case.get("seed", 0),
        **extra,
    )


class ClosureSGD(torch.optim.SGD):
    """A torch optimizer whose step() needs a closure, which DeepSpeed never passes."""

    def step(self, closure):
        return super().step(closure)


OPTIMIZERS = {"closure_sgd": (ClosureSGD, {"lr": 1.0})}


def _build_trainer(
    case: dict[str, Any], model: torch.nn.Module, samples: list, output_dir: str, collator: Any = None
) -> Trainer:
    args = _args(case, output_dir)
    trainer_class = GradAccTrainer if case.get("trainer", "gradacc") == "gradacc" else Trainer
    if case.get("multi_backward"):
        trainer_class = TwoTermTrainer
    kwargs: dict[str, Any] = {}
    if case.get("optimizer"):
        kwargs["optimizer_cls_and_kwargs"] = OPTIMIZERS[case["optimizer"]]
    return trainer_class(
        model=model, args=args, train_dataset=ListDataset(samples), data_collator=collator or PaddingCollator(),
        **kwargs,
    )


def run_config_error(case: dict[str, Any], model: torch.nn.Module, samples: list) -> dict[str, Any]:
    """Build (and with ``train``, train) a trainer that must fail; report the error.

    ``unpatched``: undo the CPU-distributed patch first, as a user who did not opt in: accelerate then reports one
    process on every rank, which GradAccTrainer must refuse.
    """
    from hf_gradacc.patches import disable_cpu_distributed, enable_cpu_distributed

    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    if case.get("unpatched"):
        disable_cpu_distributed()
    try:
        trainer = _build_trainer(case, copy.deepcopy(model), samples, tempfile.mkdtemp(prefix="ds_err_"))
        if case.get("train", False):
            trainer.train()
        return {"error_type": None, "error": None}
    except Exception as err:
        return {"error_type": type(err).__name__, "error": str(err)}
    finally:
        if case.get("unpatched"):
            enable_cpu_distributed()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_step(case: dict[str, Any], base: torch.nn.Module, samples: list, reference: dict) -> dict[str, Any]:
    import deepspeed

    model = copy.deepcopy(base)
    initial = {n: p.detach().clone().float() for n, p in model.named_parameters() if p.requires_grad}
    micro_batches: list[list[dict[str, Any]]] = []  # this rank's, as features (moe: the router reference needs them)

    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        micro_batches.append([dict(f) for f in features])
        return PaddingCollator()(features)

    trainer = _build_trainer(case, model, samples, tempfile.mkdtemp(prefix="ds_case_"), collate)
    stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
    if stage == 3:
        # Tiny models: without this every parameter stays whole on every rank and ZeRO-3 shards nothing.
        trainer.accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"][
            "stage3_param_persistence_threshold"
        ] = 0
    reader = counter = None
    if case.get("read_grads") or case.get("observe_step"):
        reader = GradReader(read=bool(case.get("read_grads")))
        reader.trainer = trainer
        trainer.add_callback(reader)
    if case.get("count_reductions"):
        counter = ReductionCounter()
        counter.trainer = trainer
        trainer.add_callback(counter)
    if case.get("hook_scale") is not None:
        trainer.register_accumulated_grad_hook(
            ScaleHook(float(case["hook_scale"])), local=bool(case.get("hook_local"))
        )
    info = _world_info(trainer)
    trainer.train()

    engine = trainer.model_wrapped
    module = trainer.accelerator.unwrap_model(engine)
    params = list(module.parameters())
    gather = deepspeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext()
    with gather:  # a collective under ZeRO-3: every rank
        final = {n: p.detach().clone().float().cpu() for n, p in module.named_parameters() if n in initial}
    update = {n: initial[n] - final[n] for n in initial}

    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    common = {
        **info,
        "global_step": trainer.state.global_step,
        "engine_global_steps": int(engine.global_steps),
        "logged_grad_norms": logged,
        "num_unchanged": sum(int(bool((u == 0).all())) for u in update.values()),
    }
    if case.get("num_windows", 1) > 1:
        # No reference for several steps: a fixed random projection of the total update lets launches (stages)
        # and reduction modes be compared with each other.
        g = torch.Generator().manual_seed(1234)
        flat = torch.cat([update[n].double().reshape(-1) for n in sorted(update)])
        direction = torch.randn(flat.numel(), generator=g, dtype=torch.float64)
        return {**common, "projection": float(flat @ direction), "update_norm": float(flat.norm())}

    router: list[str] = []
    if case.get("moe"):
        every_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, micro_batches)
        step = [mb for per_rank in every_rank for mb in per_rank]
        reference = reference_gradients(base, samples, case["task"], PaddingCollator(), micro_batches=step)
        router = [n for n in reference if n.endswith("mlp.gate.weight")]
    ref_norm = math.sqrt(_sq_norm(reference))
    expected = reference
    max_norm = float(case.get("max_grad_norm", 0.0) or 0.0)
    if case.get("hook_scale") is not None:
        expected = {n: g * float(case["hook_scale"]) for n, g in expected.items()}
    if max_norm > 0:
        norm = math.sqrt(_sq_norm(expected))
        coef = min(1.0, max_norm / (norm + 1e-6))
        expected = {n: g * coef for n, g in expected.items()}
    cmp = compare(update, expected)
    payload: dict[str, Any] = {
        **common,
        "relative_error": cmp.relative_error,
        "cosine": cmp.cosine,
        "norm_ratio": cmp.norm_ratio,
        "num_params": len(update),
        "logged_grad_norm": logged[-1] if logged else None,
        "reference_grad_norm": ref_norm,
    }
    if router:  # the router weights alone: the router term is a small share of the whole update
        payload["router_relative_error"] = compare({n: update[n] for n in router}, {n: expected[n] for n in router}).relative_error
        payload["num_router"] = len(router)
        payload["micro_batch_sizes"] = sorted(len(mb) for mb in step)
    if reader is not None:
        payload["engine_steps_before_callback"] = reader.engine_steps_before
        payload["backend_norm"] = reader.backend_norm
        if reader.grads and all(g is not None for g in reader.grads.values()):
            read = compare(reader.grads, reference)
            payload["read_relative_error"] = read.relative_error
            payload["read_cosine"] = read.cosine
    if counter is not None:
        payload["reductions_per_micro_batch"] = counter.per_micro_batch
        payload["wrapped_methods"] = counter.wrapped
    del trainer, engine, module
    return payload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of case dicts")
    parser.add_argument("--deepspeed-config", default=None, help="a DeepSpeed config (JSON) for TrainingArguments")
    opts = parser.parse_args()
    cases = json.loads(opts.cases)
    if opts.deepspeed_config is not None:
        global DEEPSPEED_CONFIG
        DEEPSPEED_CONFIG = json.loads(opts.deepspeed_config)
        from hf_gradacc.patches import enable_cpu_distributed

        # TrainingArguments fills the config's 'auto' values from its world size: patch before building it
        enable_cpu_distributed()

    # Models, samples and references first: nothing DeepSpeed-related may touch them (ZeRO-3 partitions in place).
    def key(case: dict[str, Any]) -> tuple[str, int, int, str]:
        return case["task"], case.get("seed", 0), case.get("num_windows", 1), case.get("moe", "")

    prepared: dict[tuple[str, int, int, str], tuple[torch.nn.Module, list, dict]] = {}
    for case in cases:
        task, seed, num_windows, moe = key(case)
        if key(case) not in prepared:
            model = build_tiny_moe(moe, seed=seed) if moe else build_tiny_model(task, seed=seed)
            num = world_size() * PER_DEVICE_BATCH * GRAD_ACC * num_windows - bool(moe)
            samples = make_samples(task, num, seed=seed)
            one_step = num_windows == 1 and not moe  # moe: after training, from the gathered micro-batches
            reference = reference_gradients(model, samples, task, PaddingCollator()) if one_step else {}
            prepared[key(case)] = (model, samples, reference)

    for case in cases:
        model, samples, reference = prepared[key(case)]
        try:
            if case.get("mode", "step") == "config_error":
                payload = run_config_error(case, model, samples)
            else:
                payload = run_step(case, model, samples, reference)
        except Exception:
            payload = {"crash": traceback.format_exc()}
            write_result(case["name"], payload)
            raise
        write_result(case["name"], payload)
        if rank() == 0:
            print(f"[deepspeed_cases] {case['name']}: {json.dumps(payload, default=str)[:600]}", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
