"""One rank of the gradient-noise-scale tests: GradientNoiseScaleCallback on a problem with a KNOWN noise scale
(`hf_gradacc.testing.noise_problems`), on DDP, FSDP2 or DeepSpeed ZeRO (2 CPU ranks, gloo).

    # started by tests/distributed/test_noise_scale.py
    torchrun --nproc_per_node 2 noise_scale_cases.py --backend ddp --cases '[{"name": "ddp"}]'
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        noise_scale_cases.py --backend deepspeed --cases '[{"name": "per_micro_batch", "zero_reduction": "per_micro_batch"}]'

Each case trains ``STEPS`` optimizer steps of per-device batch ``BS`` x GA ``GA`` on Gaussian samples whose per-sample
gradient has a known mean and covariance, and reports, per rank:

- for the first ``CHECKED_STEPS`` steps, the callback's ``|G_b|^2`` (first micro-batch, as a MEAN gradient) and
  ``|G_B|^2`` (the step's reduced gradient) against the float64 mean gradients of the same samples (this rank's first
  micro-batch, or every rank's when the backend reduces each micro-batch; every rank's samples of the step), and the
  small batch size it used against the count of those samples;
- the run's estimate: mean ``tr(S)`` over mean ``|G|^2`` over every step, the smoothed ``gns`` and the logged values,
  against the truth.

Case keys: name, zero_reduction (DeepSpeed), fsdp_sync (FSDP2), defer_normalization (DDP).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import traceback
from typing import Any

import torch

from hf_gradacc import GradAccConfig
from hf_gradacc.callbacks import GradAccCallback, GradientNoiseScaleCallback
from hf_gradacc.testing.noise_problems import NoiseProblem, ScoreSumTrainer, mean_gradient_sq_norm
from hf_gradacc.testing.one_step import one_step_args
from tests.distributed.workers._common import WarningRecorder, finish_worker, rank, world_size, write_result

BS, GA, STEPS, CHECKED_STEPS = 4, 4, 120, 3
TRUE_NOISE_SCALE = 16.0  # samples
PROBLEM = NoiseProblem.with_noise_scale(TRUE_NOISE_SCALE)


class SampleRecorder(GradAccCallback):
    """The float64 reference norms of the first CHECKED_STEPS steps, from the samples of each step (every rank's
    gathered in ``on_accumulated_grads``: collectives on every rank, before the noise-scale callback's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.reference: list[dict[str, float]] = []
        self._batches: list[dict[str, torch.Tensor]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        window = self.trainer.current_window
        self._batches = [] if window.streamed else list(window.micro_batches)

    def on_substep_end(self, args, state, control, **kwargs):
        window = self.trainer.current_window
        if window.streamed:  # a streamed window holds the micro-batch that just ran
            self._batches.append(window.micro_batches[0])

    def on_accumulated_grads(self, args, state, control, **kwargs):
        if state.global_step >= CHECKED_STEPS:
            return
        local = torch.cat([b["x"] for b in self._batches]).to(args.device)
        first = self._batches[0]["x"].to(args.device)
        every = self.trainer.accelerator.gather(local).cpu()  # shapes are equal: full windows on every rank
        every_first = self.trainer.accelerator.gather(first).cpu()
        self.reference.append(
            {
                "local_first_sq": mean_gradient_sq_norm(self.model, first.cpu()),
                "local_first_rows": int(first.shape[0]),
                "every_first_sq": mean_gradient_sq_norm(self.model, every_first),
                "every_first_rows": int(every_first.shape[0]),
                "step_sq": mean_gradient_sq_norm(self.model, every),
                "step_rows": int(every.shape[0]),
            }
        )


def _args(case: dict[str, Any], backend: str) -> GradAccConfig:
    overrides: dict[str, Any] = {"seed": 0, "learning_rate": 0.01, "logging_steps": 10, "max_steps": STEPS}
    if backend == "deepspeed":
        overrides["use_cpu"] = False  # use_cpu would bypass DeepSpeed; the CPU patch picks gloo
        overrides["zero_reduction"] = case.get("zero_reduction", "per_micro_batch")
    elif backend == "fsdp2":
        overrides.update(use_cpu=True, fsdp=True, fsdp_config={"version": 2}, ddp_backend="gloo",
                         fsdp_sync=case.get("fsdp_sync", "deferred"))  # fmt: skip
    else:
        overrides.update(use_cpu=True, defer_normalization=bool(case.get("defer_normalization", False)))
    return one_step_args(
        tempfile.mkdtemp(prefix="hf_gradacc_gns_"),
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        args_class=GradAccConfig,
        **overrides,  # one_step_args: optim="sgd", constant lr, no clipping, no weight decay
    )


def run_case(case: dict[str, Any], backend: str) -> dict[str, Any]:
    model = PROBLEM.model()
    reference_model = PROBLEM.model()  # the gradient does not depend on the parameters: any copy will do
    callback = GradientNoiseScaleCallback(keep_history=True)
    recorder = SampleRecorder(reference_model)
    warnings = WarningRecorder()
    with warnings:
        trainer = ScoreSumTrainer(
            model=model,
            args=_args(case, backend),
            train_dataset=PROBLEM.dataset(STEPS * BS * GA * world_size(), seed=1),
            callbacks=[recorder, callback],
        )
        plugin = trainer.accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            # A tiny model stays whole on every rank unless the persistence threshold is 0.
            plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        trainer.train()
    history = callback.history
    checked = []
    for measured, reference in zip(history[:CHECKED_STEPS], recorder.reference):
        key = "every_first" if measured.reduced else "local_first"
        checked.append(
            {
                "reduced": measured.reduced,
                "small_rel": abs(measured.small_sq_norm - reference[f"{key}_sq"]) / reference[f"{key}_sq"],
                "small_batch": measured.small_batch,
                "small_rows": reference[f"{key}_rows"],
                "big_rel": abs(measured.big_sq_norm - reference["step_sq"]) / reference["step_sq"],
                "big_batch": measured.big_batch,
                "big_rows": reference["step_rows"],
            }
        )
    mean_grad_sq = sum(s.grad_sq for s in history) / max(len(history), 1)
    mean_trace = sum(s.trace for s in history) / max(len(history), 1)
    logged = [h for h in trainer.state.log_history if "gns" in h]
    module = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    # ZeRO-3: every parameter holds only its partition on this rank (ds_tensor smaller than the parameter)
    partitioned = [hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in module.parameters()]
    return {
        "backend": backend,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "param_types": sorted({type(p).__name__ for p in module.parameters()}),
        "zero3_partitioned": all(partitioned),
        "global_step": trainer.state.global_step,
        "num_estimates": callback.num_estimates,
        "disabled_reason": callback.disabled_reason,
        "checked": checked,
        "truth": {"noise_scale": PROBLEM.noise_scale, "grad_sq": PROBLEM.grad_sq, "trace": PROBLEM.trace},
        "mean_grad_sq": mean_grad_sq,
        "mean_trace": mean_trace,
        "run_estimate": mean_trace / mean_grad_sq,
        "ema_noise_scale": callback.noise_scale,
        "logged": [{k: v for k, v in h.items() if k.startswith("gns") or k == "step"} for h in logged],
        "warnings": [m for m in warnings.messages if "Noise" in m or "noise" in m],
    }


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
    for case in json.loads(opts.cases):
        try:
            payload = run_case(case, opts.backend)
        except Exception:
            write_result(case["name"], {"crash": traceback.format_exc()})
            raise
        write_result(case["name"], payload)
        if rank() == 0:
            summary = {k: payload[k] for k in ("run_estimate", "ema_noise_scale", "num_estimates", "checked")}
            print(f"[noise_scale_cases] {opts.backend} {case['name']}: {json.dumps(summary)[:1500]}", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
