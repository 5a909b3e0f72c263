"""DDP worker: GradAccTrainer on CPU ranks (gloo) against the float64 full-batch reference.

Started on 2 ranks by ``tests/distributed/test_ddp.py`` through ``tests/distributed/launcher.py``:

    python tests/distributed/workers/ddp_cases.py --cases exact_causal_lm,skip_window

Each case writes ``<case>.rank<r>.json`` into ``$HF_GRADACC_TEST_OUT``. A case that raises writes its traceback
and the worker exits at once, so the other rank fails in its next collective instead of waiting for it.

Data placement is deterministic: the trainers here use a ``SequentialSampler``, and accelerate's
``BatchSamplerShard`` deals the batches round-robin, so rank ``r`` gets batches ``r, r + W, r + 2W, ...``
(:func:`shard_batches`). Each case records the counts its rank really saw, and the test checks them against
that arrangement.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import DDPCommHookCounter, WarningRecorder, rank, run_named_cases, world_size
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainerCallback

from hf_gradacc import IGNORE_INDEX, GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples

BS, GA = 2, 4
W = world_size()


# ---------------------------------------------------------------------------------------------- trainers
class SequentialShardMixin:
    """Sequential sampling, so that accelerate's round-robin sharding puts known samples on each rank."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class StockTrainer(SequentialShardMixin, Trainer):
    pass


class ProbeTrainer(SequentialShardMixin, GradAccTrainer):
    """GradAccTrainer that records each window's counts and tells which micro-batch of which step is running.

    It overrides neither ``training_step`` nor ``compute_loss``: either would switch GradAccTrainer to its
    custom-step code paths, and these tests are about the plain drop-in.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.windows: list[dict[str, Any]] = []
        self.add_callback(_WindowRecorder(self.windows))
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "bind"):
                callback.bind(self)


class _WindowRecorder(TrainerCallback):
    """Records every optimizer step's counts (the ``on_window_counted`` event of hf_gradacc)."""

    def __init__(self, windows: list[dict[str, Any]]) -> None:
        self.windows = windows

    def on_window_counted(self, args, state, control, window=None, **kwargs):
        w = window.counts
        self.windows.append(
            {
                "micro_batch_tokens": [mb.num_tokens for mb in w.micro_batches],
                "micro_batch_samples": [mb.num_samples for mb in w.micro_batches],
                "local_tokens": w.local_tokens,
                "local_samples": w.local_samples,
                "global_tokens": w.global_tokens,
                "global_samples": w.global_samples,
                "num_micro_batches_per_rank": list(w.num_micro_batches_per_rank),
            }
        )


class SequentialGradAccTrainer(SequentialShardMixin, GradAccTrainer):
    pass


class CustomStepTrainer(SequentialShardMixin, GradAccTrainer):
    """A user's ``training_step`` override (here a pass-through): GradAccTrainer's multi-backward DDP path."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


class ParamsAtFirstStep(TrainerCallback):
    """Largest parameter change between the start of training and the first optimizer step's first micro-batch."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.max_change: float | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.max_change is None:
            self.max_change = max(
                float((p.detach() - self.initial[n]).abs().max()) for n, p in model.named_parameters()
            )


# ---------------------------------------------------------------------------------------------- data
def shard_batches(num_samples: int, rank_: int, bs: int = BS) -> list[list[int]]:
    """Sample indices of each micro-batch rank ``rank_`` gets, in order (sequential sampler, round-robin shards)."""
    batches = [list(range(b * bs, min((b + 1) * bs, num_samples))) for b in range((num_samples + bs - 1) // bs)]
    return [batch for b, batch in enumerate(batches) if b % W == rank_]


def rank_of(index: int, bs: int = BS) -> int:
    return (index // bs) % W


def counted(sample: dict[str, Any], task: str) -> int:
    """The sample's counted targets, written out independently of hf_gradacc.step.window."""
    labels = sample["labels"]
    if task == "sequence_classification":
        return int(labels != IGNORE_INDEX)
    if task == "causal_lm":
        labels = labels[1:]
    return sum(1 for x in labels if x != IGNORE_INDEX)


def expected_micro_batch_counts(samples: list[dict[str, Any]], task: str, rank_: int) -> list[int]:
    return [sum(counted(samples[i], task) for i in batch) for batch in shard_batches(len(samples), rank_)]


def arranged_samples(task: str, *, light_rank_counted: int, seed: int) -> list[dict[str, Any]]:
    """One window where rank 0's rows are long and fully labelled and rank 1's are nearly (or fully) ignored.

    Rank 1 keeps mixed lengths (long rows next to short ones, so heavy padding) but only ``light_rank_counted``
    counted targets per micro-batch at most (on its longest row).
    """
    n = BS * GA * W
    heavy = make_samples(task, n, seed=seed, min_length=20, max_length=40, ignore_fraction=0.0)
    light = make_samples(task, n, seed=seed + 1, min_length=3, max_length=36, ignore_fraction=0.0)
    samples = []
    for i in range(n):
        if rank_of(i) == 0:
            sample = dict(heavy[i])
            if task != "sequence_classification":
                sample["labels"] = list(sample["input_ids"])  # every target counted
        else:
            sample = dict(light[i])
            long_row = i % BS == 0
            if long_row:
                sample["input_ids"] = (sample["input_ids"] * 40)[: 30 + i % 7]
            if task == "sequence_classification":
                sample["labels"] = sample["labels"] if (long_row and light_rank_counted) else IGNORE_INDEX
            else:
                labels = [IGNORE_INDEX] * len(sample["input_ids"])
                if long_row:
                    for k in range(light_rank_counted):
                        labels[-1 - k] = sample["input_ids"][-1 - k]
                sample["labels"] = labels
        samples.append(sample)
    return samples


# ---------------------------------------------------------------------------------------------- running
def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].double().reshape(-1) for n in sorted(tensors)])


def train_and_measure(
    trainer_class: type[Trainer],
    task: str,
    samples: list[dict[str, Any]],
    reference_samples: list[dict[str, Any]] | None = None,
    *,
    gradient_accumulation_steps: int = GA,
    callbacks: tuple[TrainerCallback, ...] = (),
    model_kwargs: dict[str, Any] | None = None,
    **arg_overrides: Any,
) -> tuple[dict[str, Any], Trainer]:
    """Train from the seed-0 model; compare the parameter update with the reference over ``reference_samples``."""
    model = build_tiny_model(task, seed=0, **(model_kwargs or {}))
    args = one_step_args(
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=gradient_accumulation_steps,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=120,  # a desynchronised collective fails in 2 minutes, inside the launcher's timeout
        seed=0,
        **arg_overrides,
    )
    update, trainer = one_step_update(
        trainer_class, model, samples, args, trainer_kwargs={"callbacks": list(callbacks)}
    )

    reference_samples = samples if reference_samples is None else reference_samples
    collate = PaddingCollator()
    reference = reference_gradients(model, reference_samples, task, collate)
    comparison = compare(update, reference)
    with torch.no_grad():
        batch = {k: v for k, v in collate(reference_samples).items()}
        batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
        reference_loss = float(full_batch_loss(copy.deepcopy(model).double().eval(), batch, task))

    update_vector = flat(update)
    from_rank0 = update_vector.clone()
    dist.broadcast(from_rank0, src=0)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    accelerator = trainer.accelerator
    result = {
        "trainer": trainer_class.__name__,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "relative_error": comparison.relative_error,
        "cosine": comparison.cosine,
        "norm_ratio": comparison.norm_ratio,
        "update_is_finite": bool(torch.isfinite(update_vector).all()),
        "num_params": len(update),
        "unchanged_params": sorted(n for n, u in update.items() if not bool(u.abs().max() > 0)),
        "max_abs_diff_vs_rank0": float((update_vector - from_rank0).abs().max()),
        "reference_loss": reference_loss,
        "reference_grad_norm": float(flat(reference).norm()),
        "logs": logs,
        "global_step": trainer.state.global_step,
    }
    if isinstance(trainer, GradAccTrainer):
        result["dp_world_size"] = trainer.backend.mesh.dp_world_size
        result["backend"] = trainer.backend.name
        result["num_skipped_windows"] = trainer.num_skipped_windows
    if isinstance(trainer, ProbeTrainer):
        result["windows"] = trainer.windows
    return result, trainer


def case_exact(task: str) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        samples = make_samples(task, BS * GA * W, seed=3)
        gradacc, _ = train_and_measure(ProbeTrainer, task, samples)
        stock, _ = train_and_measure(StockTrainer, task, samples)
        expected = expected_micro_batch_counts(samples, task, rank())
        return {"gradacc": gradacc, "stock": stock, "expected_micro_batch_counts": expected}

    return run


def case_custom_step(task: str) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        samples = make_samples(task, BS * GA * W, seed=4)
        gradacc, _ = train_and_measure(CustomStepTrainer, task, samples)
        return {"gradacc": gradacc}

    return run


def case_config_flag(flag: str) -> Callable[[], dict[str, Any]]:
    """A GradAccConfig feature whose DDP path reduces the window's gradient with one extra zero backward pass."""

    def run() -> dict[str, Any]:
        samples = make_samples("causal_lm", BS * GA * W, seed=6)
        gradacc, _ = train_and_measure(
            SequentialGradAccTrainer, "causal_lm", samples, args_class=GradAccConfig, **{flag: True}
        )
        return {"gradacc": gradacc}

    return run


def case_arranged(task: str, light_rank_counted: int) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        samples = arranged_samples(task, light_rank_counted=light_rank_counted, seed=11)
        gradacc, _ = train_and_measure(ProbeTrainer, task, samples)
        expected = expected_micro_batch_counts(samples, task, rank())
        return {"gradacc": gradacc, "expected_micro_batch_counts": expected}

    return run


def case_skip_window() -> dict[str, Any]:
    """Two windows: the first has no counted token on any rank, the second is normal."""
    ga = 2
    per_window = BS * ga * W
    empty = [
        {**s, "labels": [IGNORE_INDEX] * len(s["input_ids"])} for s in make_samples("causal_lm", per_window, seed=7)
    ]
    normal = make_samples("causal_lm", per_window, seed=8)
    recorder = WarningRecorder()
    params_at_first_step = ParamsAtFirstStep()
    logging.getLogger("hf_gradacc").addHandler(recorder)
    try:
        gradacc, _ = train_and_measure(
            ProbeTrainer,
            "causal_lm",
            empty + normal,
            normal,
            gradient_accumulation_steps=ga,
            callbacks=(params_at_first_step,),
            max_steps=-1,
            num_train_epochs=1,
        )
    finally:
        logging.getLogger("hf_gradacc").removeHandler(recorder)
    return {
        "gradacc": gradacc,
        "warnings": recorder.messages,
        "max_param_change_before_first_step": params_at_first_step.max_change,
    }


def case_comm_hook() -> dict[str, Any]:
    """Two windows of GA micro-batches; a comm hook records every bucket all-reduce of the DDP reducer."""
    counter = DDPCommHookCounter()
    samples = make_samples("causal_lm", BS * GA * W * 2, seed=9)
    gradacc, _ = train_and_measure(
        ProbeTrainer,
        "causal_lm",
        samples,
        samples[: BS * GA * W],  # not compared: the run takes two steps
        callbacks=(counter,),
        model_kwargs={"hidden_size": 128},  # > 1 MiB of parameters: DDP makes more than one bucket
        ddp_bucket_cap_mb=1,
        max_steps=-1,
        num_train_epochs=1,
    )
    return {"gradacc": gradacc, "calls": counter.calls, "registered_on": counter.registered_on, "ga": GA}


def case_moe(family: str, ga: int = GA, trainer_class: Callable[..., Any] | None = None) -> Callable[[], dict[str, Any]]:
    """A tiny mixture-of-experts model at accumulation ``ga``, unequal micro-batches: the router term follows the
    routed-token rule. ``trainer_class`` (default SequentialGradAccTrainer) builds the trainer."""

    def run() -> dict[str, Any]:
        from hf_gradacc.testing.tiny import build_tiny_moe

        model = build_tiny_moe(family)
        samples = make_samples("causal_lm", BS * ga * W - 1, seed=5)  # the last micro-batch of rank 1 is short
        args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=ga, use_cpu=True,
                             ddp_backend="gloo", ddp_timeout=120, seed=0,
                             accelerator_config={"even_batches": False})  # no padding of the tail with repeats
        # fmt: skip
        micro_batches: list = []
        update, trainer = one_step_update(trainer_class or SequentialGradAccTrainer, model, samples, args,
                                          micro_batches=micro_batches)  # fmt: skip
        reference = reference_gradients(model, samples, "causal_lm", PaddingCollator(), micro_batches=micro_batches)
        router = [n for n in reference if n.endswith("mlp.gate.weight")]
        c, r = compare(update, reference), compare({n: update[n] for n in router}, {n: reference[n] for n in router})
        logs = trainer.state.log_history[0]
        return {"relative_error": c.relative_error, "router_relative_error": r.relative_error,
                "micro_batch_sizes": [len(mb) for mb in micro_batches], "aux": logs.get("loss/aux"),
                "main": logs.get("loss/main"), "loss": logs.get("loss"),
                "model_wrapped": type(trainer.model_wrapped).__name__, "num_processes": trainer.accelerator.num_processes}  # fmt: skip

    return run


def _recording_collator(batches: list[dict[str, torch.Tensor]]) -> Callable:
    collate = PaddingCollator()

    def record(features):
        batch = collate(features)
        batches.append(batch)
        return batch

    return record


def case_token_stats() -> dict[str, Any]:
    """Two optimizer steps with TokenStatsCallback: each rank's logged numbers and its own direct counts per step."""
    from hf_gradacc.callbacks import TokenStatsCallback
    from hf_gradacc.testing.tiny import ListDataset

    batches: list[dict[str, torch.Tensor]] = []
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, use_cpu=True,
                         ddp_backend="gloo", ddp_timeout=120, seed=0, max_steps=2)  # fmt: skip
    trainer = SequentialGradAccTrainer(
        model=build_tiny_model("causal_lm", seed=0), args=args, callbacks=[TokenStatsCallback()],
        train_dataset=ListDataset(make_samples("causal_lm", BS * GA * W * 2, seed=12)),
        data_collator=_recording_collator(batches),
    )  # fmt: skip
    trainer.train()
    direct = []
    for step in range(2):
        step_batches = batches[step * GA : (step + 1) * GA]
        direct.append({
            "tokens/real": sum(int(b["attention_mask"].sum()) for b in step_batches),
            "tokens/computed": sum(b["input_ids"].numel() for b in step_batches),
            "tokens/target": sum(int(b["labels"][:, 1:].ne(IGNORE_INDEX).sum()) for b in step_batches),
            "effective_batch_size": sum(b["input_ids"].shape[0] for b in step_batches),
            "micro_batches": len(step_batches),
        })  # fmt: skip
    keys = set(direct[0])
    logs = [{k: v for k, v in h.items() if k in keys or k.startswith("tokens/")} for h in trainer.state.log_history
            if "loss" in h]  # fmt: skip
    return {"logs": logs, "direct": direct, "num_processes": trainer.accelerator.num_processes}


def case_batchnorm_precise() -> dict[str, Any]:
    """A tiny ResNet with `batchnorm="precise"`: each rank's running statistics after training, and the per-layer
    statistics of the batches this rank drew for them (the test averages them over ranks)."""
    from hf_gradacc.callbacks import BatchNormCallback
    from hf_gradacc.callbacks.batchnorm import batchnorm_layers
    from hf_gradacc.testing.reference import batchnorm_statistics
    from hf_gradacc.testing.tiny import ListDataset, build_tiny_image_model

    args = GradAccConfig(output_dir="unused", per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                         max_steps=2, use_cpu=True, ddp_backend="gloo", ddp_timeout=120, seed=0, report_to=[],
                         save_strategy="no", disable_tqdm=True, batchnorm="precise", precise_bn_batches=3)  # fmt: skip
    trainer = SequentialGradAccTrainer(
        model=build_tiny_image_model("resnet"), args=args, data_collator=PaddingCollator(),
        train_dataset=ListDataset(make_samples("image_classification", BS * GA * W * 2, seed=13)),
    )  # fmt: skip
    trainer.train()
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, BatchNormCallback)]
    stats = batchnorm_statistics(trainer.model, list(callback.precise_batches(trainer.state)))
    direct = {name: {"mean": mean.tolist(), "var": var.tolist()} for name, (mean, var) in stats.items()}
    running = {name: {"mean": layer.running_mean.tolist(), "var": layer.running_var.tolist()}
               for name, layer in batchnorm_layers(trainer.model)}  # fmt: skip
    return {"running": running, "direct": direct, "num_recomputed": callback.num_recomputed,
            "num_processes": trainer.accelerator.num_processes}  # fmt: skip


def case_batchnorm_freeze() -> dict[str, Any]:
    """A tiny ResNet with `batchnorm="freeze_stats"`, one SGD(lr=1) step over both ranks' micro-batches: the update
    against the float64 full-batch gradient with the statistics fixed (the reference runs in eval mode), and whether
    any running statistic moved."""
    from hf_gradacc.callbacks.batchnorm import batchnorm_layers
    from hf_gradacc.testing.tiny import build_tiny_image_model

    model = build_tiny_image_model("resnet")
    samples = make_samples("image_classification", BS * GA * W, seed=14)
    before = {name: layer.running_mean.clone() for name, layer in batchnorm_layers(model)}
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, use_cpu=True,
                         ddp_backend="gloo", ddp_timeout=120, seed=0)  # fmt: skip
    update, trainer = one_step_update(SequentialGradAccTrainer, model, samples, args,
                                      trainer_kwargs={"gradacc_args": {"batchnorm": "freeze_stats"}})  # fmt: skip
    reference = reference_gradients(model, samples, "image_classification", PaddingCollator())
    after = dict(batchnorm_layers(trainer.accelerator.unwrap_model(trainer.model)))
    moved = [name for name, mean in before.items() if not torch.equal(mean, after[name].running_mean)]
    return {"relative_error": compare(update, reference).relative_error, "moved": moved, "num_layers": len(before),
            "num_processes": trainer.accelerator.num_processes}  # fmt: skip


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "moe_mixtral": case_moe("mixtral"),
    "moe_qwen3_moe": case_moe("qwen3_moe"),
    **{f"moe_{family}_ga{ga}": case_moe(family, ga) for family in ("mixtral", "qwen3_moe") for ga in (1, 8)},
    "exact_causal_lm": case_exact("causal_lm"),
    "exact_sequence_classification": case_exact("sequence_classification"),
    "exact_masked_lm": case_exact("masked_lm"),
    "imbalanced_causal_lm": case_arranged("causal_lm", light_rank_counted=1),
    "zero_rank_causal_lm": case_arranged("causal_lm", light_rank_counted=0),
    "zero_rank_masked_lm": case_arranged("masked_lm", light_rank_counted=0),
    "zero_rank_sequence_classification": case_arranged("sequence_classification", light_rank_counted=0),
    "custom_step_causal_lm": case_custom_step("causal_lm"),
    "defer_normalization_causal_lm": case_config_flag("defer_normalization"),
    "auto_micro_batch_causal_lm": case_config_flag("auto_micro_batch"),
    "skip_window": case_skip_window,
    "comm_hook": case_comm_hook,
    "token_stats": case_token_stats,
    "batchnorm_precise": case_batchnorm_precise,
    "batchnorm_freeze": case_batchnorm_freeze,
}


def main() -> None:
    run_named_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
