"""One rank of ``tests/distributed/test_memory_modes.py``: memory modes and regrouping on 2 CPU ranks (gloo).

    python memory_cases.py --backend ddp --cases auto_oom_one_rank,defer_stream     # started by run_workers

``--backend`` picks how the ranks train: ``ddp`` (plain CPU DDP), ``zero2`` (DeepSpeed ZeRO-2 from
``TrainingArguments(deepspeed=...)``, with hf_gradacc's opt-in CPU patch) or ``fsdp2`` (``fsdp_config={"version": 2}``,
with the FSDP-on-CPU patch). Every case writes ``<case>.rank<r>.json`` into ``$HF_GRADACC_TEST_OUT``; a case that
raises writes its traceback (``worker_error``) and the worker exits at once, so the other rank fails in its next
collective instead of waiting for it.

Cases (the test states what each one asserts):

* ``auto_oom_one_rank`` (ddp): an out-of-memory error injected on rank 1 only (micro-batches of more than one row),
  never on rank 0; ``auto_micro_batch=True``. Update against the float64 reference and the plain fitting run.
* ``auto_two_steps`` (ddp): the same on two optimizer steps: the size found in step 1 is used in step 2.
* ``auto_oom_one_sample`` (ddp): rank 1 runs out of memory on every micro-batch, even of one row: both ranks raise.
* ``defer_stream`` (ddp): ``defer_normalization=True`` on an ``IterableDataset`` whose second (last) window is
  short, two SGD steps, against a two-step float64 reference and the prefetching run.
* ``defer_custom_count`` (ddp): ``defer_normalization=True`` with ``LossTerm(total, normalize_by=<int>)``.
* ``regroup_one_step`` (any): one SGD(lr=1) step, plain vs ``regroup_micro_batches`` vs a token budget.
* ``regroup_windows`` (any): three optimizer steps (the last one short), same comparison, per-step samples recorded.
* ``unsupported_modes`` (zero2, fsdp2): ``auto_micro_batch`` / ``defer_normalization`` must raise a clear error.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaForCausalLM, TrainerCallback

from hf_gradacc import IGNORE_INDEX, GradAccConfig, GradAccTrainer, LossTerm
from hf_gradacc.errors import GradAccDataError
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, ListIterableDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import (
    WarningRecorder,
    finish_worker,
    pack_rows_always,
    rank,
    world_size,
    write_result,
)

TASK = "causal_lm"
W = world_size()
BS, GA = 2, 4  # regrouping and deferred normalisation
AUTO_BS, AUTO_GA = 4, 2  # auto_micro_batch: 4 rows -> 2 -> 1 on the rank that runs out of memory
BUDGET = 40  # padded tokens per micro-batch (the longest sample has 39)
COLLECTIVE_TIMEOUT_S = 60  # a desynchronised collective fails well inside the launcher's timeout
ZERO2_CONFIG = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}
REGROUP_MODES = {
    "plain": {},
    "regroup": {"regroup_micro_batches": True},
    "budget": {"max_tokens_per_micro_batch": BUDGET},
    # one padding-free row per micro-batch (PackedCollator replaces the recording collator: sizes come from the trainer)
    "pack": {"pack_micro_batches": True, "max_tokens_per_micro_batch": BUDGET},
}


# ---------------------------------------------------------------------------------------------- helpers
def backend_overrides(backend: str) -> dict[str, Any]:
    """TrainingArguments that put the Trainer on ``backend`` on CPU ranks."""
    common: dict[str, Any] = {"ddp_timeout": COLLECTIVE_TIMEOUT_S, "seed": 0}
    if backend == "ddp":
        return {**common, "use_cpu": True, "ddp_backend": "gloo"}
    if backend == "zero2":
        # use_cpu would bypass DeepSpeed; the CPU patch makes accelerate pick gloo
        return {**common, "use_cpu": False, "deepspeed": copy.deepcopy(ZERO2_CONFIG)}
    if backend == "fsdp2":
        return {**common, "use_cpu": True, "ddp_backend": "gloo", "fsdp": True, "fsdp_config": {"version": 2}}
    raise ValueError(f"unknown backend {backend!r}")


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].double().reshape(-1) for n in sorted(tensors)])


def relative_difference(update: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    a, b = flat(update), flat(other)
    return float((a - b).norm() / b.norm())


def max_abs_diff_vs_rank0(update: dict[str, torch.Tensor]) -> float:
    """How far this rank's update is from rank 0's (0.0: the replicas agree)."""
    vector = flat(update)
    from_rank0 = vector.clone()
    dist.broadcast(from_rank0, src=0)
    return float((vector - from_rank0).abs().max())


def unique_ids(samples: list[dict[str, Any]]) -> dict[tuple[int, ...], int]:
    ids = {tuple(s["input_ids"]): k for k, s in enumerate(samples)}
    assert len(ids) == len(samples), "sample ids must be unique (the input ids identify a sample)"
    return ids


class Recorder(PaddingCollator):
    """A PaddingCollator that records the sample ids of every micro-batch it collates, in order."""

    def __init__(self, ids: dict[tuple[int, ...], int]) -> None:
        super().__init__()
        self.ids = ids
        self.micro_batches: list[list[int]] = []

    def __call__(self, samples):
        self.micro_batches.append([self.ids[tuple(s["input_ids"])] for s in samples])
        return super().__call__(samples)


class WindowProbe(GradAccTrainer):
    """Records how many micro-batches each optimizer step holds (no compute_loss / training_step override)."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.__dict__.setdefault("window_sizes", []).append(len(batches))
        self.__dict__.setdefault("rows", []).extend(int(b["input_ids"].shape[0]) for b in batches)
        return batches, count


# ---------------------------------------------------------------------------------------------- auto_micro_batch
class FragileLlama(LlamaForCausalLM):
    """A causal LM that raises an out-of-memory error on micro-batches of more than ``max_rows`` rows (None: never),
    and logs every training forward pass as ``[rows, ran out of memory]``."""

    max_rows: int | None = None

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if self.training:
            rows = int(input_ids.shape[0])
            out_of_memory = self.max_rows is not None and rows > self.max_rows
            self.forward_log.append([rows, out_of_memory])
            if out_of_memory:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate 1 GiB (injected on rank {rank()}, {rows} rows)"
                )
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


def fragile_copy(model: torch.nn.Module, max_rows: int | None) -> torch.nn.Module:
    fragile = copy.deepcopy(model)
    fragile.__class__ = FragileLlama
    fragile.max_rows = max_rows
    fragile.forward_log = []
    return fragile


class StepMarks(TrainerCallback):
    """How many forward passes the model had run when each optimizer step ended."""

    def __init__(self) -> None:
        self.marks: list[int] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.marks.append(len(model.forward_log))


def auto_run(samples, max_rows: int | None, **overrides: Any) -> dict[str, Any]:
    """Train with ``auto_micro_batch`` on a model that runs out of memory above ``max_rows`` rows on rank 1 only."""
    model = build_tiny_model(TASK, seed=0)
    fragile = fragile_copy(model, max_rows if rank() == 1 else None)
    marks = StepMarks()
    args = one_step_args(
        per_device_train_batch_size=AUTO_BS,
        gradient_accumulation_steps=AUTO_GA,
        args_class=GradAccConfig,
        auto_micro_batch=True,
        **backend_overrides("ddp"),
        **overrides,
    )
    with WarningRecorder() as warnings:
        update, trainer = one_step_update(
            GradAccTrainer, fragile, samples, args, trainer_kwargs={"callbacks": [marks]}
        )
    plain_args = one_step_args(
        per_device_train_batch_size=AUTO_BS,
        gradient_accumulation_steps=AUTO_GA,
        args_class=GradAccConfig,
        **backend_overrides("ddp"),
        **overrides,
    )
    plain, plain_trainer = one_step_update(GradAccTrainer, model, samples, plain_args)
    log = trainer.model.forward_log
    return {
        "model": model,
        "update": update,
        "auto_rows": trainer.step_engine.auto_rows,
        "warnings": [m for m in warnings.messages if "auto_micro_batch" in m],
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "plain_logs": [h for h in plain_trainer.state.log_history if "loss" in h],
        "forward_log": log,
        "step_marks": marks.marks,
        "global_step": trainer.state.global_step,
        "find_unused_parameters": trainer.model_wrapped.find_unused_parameters,
        "relative_difference_vs_plain": relative_difference(update, plain),
        "max_abs_diff_vs_rank0": max_abs_diff_vs_rank0(update),
    }


def case_auto_oom_one_rank() -> dict[str, Any]:
    samples = make_samples(TASK, AUTO_BS * AUTO_GA * W, seed=31)
    out = auto_run(samples, max_rows=1)
    model, update = out.pop("model"), out.pop("update")
    out["relative_error_vs_reference"] = compare_with_reference(update, model, samples, TASK).relative_error
    return out


def case_auto_two_steps(**overrides: Any) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        samples = make_samples(TASK, AUTO_BS * AUTO_GA * W * 2, seed=32)
        out = auto_run(samples, max_rows=1, max_steps=2, learning_rate=0.1, **overrides)
        del out["model"], out["update"]
        return out

    return run


def case_auto_oom_one_sample() -> dict[str, Any]:
    """Rank 1 runs out of memory even on one row; rank 0 never does. Both ranks must raise, none may hang."""
    samples = make_samples(TASK, AUTO_BS * AUTO_GA * W, seed=33)
    fragile = fragile_copy(build_tiny_model(TASK, seed=0), 0 if rank() == 1 else None)
    args = one_step_args(
        per_device_train_batch_size=AUTO_BS,
        gradient_accumulation_steps=AUTO_GA,
        args_class=GradAccConfig,
        auto_micro_batch=True,
        **backend_overrides("ddp"),
    )
    start = time.monotonic()
    error: BaseException | None = None
    try:
        one_step_update(GradAccTrainer, fragile, samples, args)
    except Exception as exc:  # reported to the test, which asserts on it
        error = exc
    elapsed = time.monotonic() - start
    dist.barrier()  # both ranks are still in step with each other after the error
    return {
        "error_type": type(error).__name__ if error is not None else None,
        "is_data_error": isinstance(error, GradAccDataError),
        "error": str(error) if error is not None else None,
        "seconds": elapsed,
    }


# ---------------------------------------------------------------------------------------------- defer_normalization
def case_defer_stream() -> dict[str, Any]:
    """Two SGD steps on a stream of 28 samples: a full window of 16 and a short one of 12 (3 micro-batches per rank
    on GA 4). Each rank reads the stream itself (``dispatch_batches=False``: accelerate cannot dispatch batches of
    different padded widths) and keeps micro-batch ``r`` of every W, so step 1 holds samples 0..15 and step 2
    samples 16..27, each exactly once."""
    lr = 1.0  # the largest update: float32 rounding of the parameters weighs least
    full, short = BS * GA * W, BS * (GA - 1) * W
    samples = make_samples(TASK, full + short, seed=41)
    ids = unique_ids(samples)
    model = build_tiny_model(TASK, seed=0)
    updates, logs, seen = {}, {}, {}
    for mode, extra in (("deferred", {"defer_normalization": True}), ("plain", {})):
        collator = Recorder(ids)
        args = one_step_args(
            per_device_train_batch_size=BS,
            gradient_accumulation_steps=GA,
            args_class=GradAccConfig,
            max_steps=2,
            learning_rate=lr,
            accelerator_config={"dispatch_batches": False},
            **backend_overrides("ddp"),
            **extra,
        )
        updates[mode], trainer = one_step_update(
            GradAccTrainer, model, samples, args, data_collator=collator, train_dataset=ListIterableDataset(samples)
        )
        logs[mode] = [h for h in trainer.state.log_history if "loss" in h]
        seen[mode] = collator.micro_batches
    # The float64 reference of the same two SGD steps: g1 over the first window, g2 at (initial - lr g1) over the rest
    collate = PaddingCollator()
    g1 = reference_gradients(model, samples[:full], TASK, collate)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in moved.named_parameters():
            if name in g1:
                param.copy_((param.double() - lr * g1[name]).to(param.dtype))
    g2 = reference_gradients(moved, samples[full:], TASK, collate)
    reference = {n: lr * (g1[n] + g2[n]) for n in g1}
    return {
        "relative_error_vs_reference": compare(updates["deferred"], reference).relative_error,
        "plain_relative_error_vs_reference": compare(updates["plain"], reference).relative_error,
        "relative_difference_vs_plain": relative_difference(updates["deferred"], updates["plain"]),
        "max_abs_diff_vs_rank0": max_abs_diff_vs_rank0(updates["deferred"]),
        "logs": logs["deferred"],
        "plain_logs": logs["plain"],
        "collated": seen["deferred"],
        "plain_collated": seen["plain"],
        "num_samples": len(samples),
    }


class CountLearnableRows(GradAccTrainer):
    """Causal LM loss summed over tokens, normalised by a count of the user's own: rows with a counted target."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits.float()
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        rows = int((targets != IGNORE_INDEX).any(dim=1).sum())
        return LossTerm(total=total, normalize_by=rows)


def case_defer_custom_count() -> dict[str, Any]:
    samples = make_samples(TASK, BS * GA * W, seed=42)
    model = build_tiny_model(TASK, seed=0)
    args = one_step_args(
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        args_class=GradAccConfig,
        defer_normalization=True,
        **backend_overrides("ddp"),
    )
    update, trainer = one_step_update(CountLearnableRows, model, samples, args)
    # Written out independently: the step's loss is sum(CE) / learnable rows = token mean x tokens / learnable rows
    tokens = sum(sum(1 for x in s["labels"][1:] if x != IGNORE_INDEX) for s in samples)
    learnable = sum(1 for s in samples if any(x != IGNORE_INDEX for x in s["labels"][1:]))
    reference = reference_gradients(model, samples, TASK, PaddingCollator())
    expected = {n: g * (tokens / learnable) for n, g in reference.items()}
    return {
        "relative_error_vs_reference": compare(update, expected).relative_error,
        "tokens": tokens,
        "learnable_rows": learnable,
        "num_samples": len(samples),
        "max_abs_diff_vs_rank0": max_abs_diff_vs_rank0(update),
        "global_step": trainer.state.global_step,
    }


# ---------------------------------------------------------------------------------------------- regrouping
def regroup_run(backend: str, samples, mode: str, **overrides: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    ids = unique_ids(samples)
    collator = Recorder(ids)
    args = one_step_args(
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        args_class=GradAccConfig,
        **backend_overrides(backend),
        **REGROUP_MODES[mode],
        **overrides,
    )
    update, trainer = one_step_update(
        WindowProbe, build_tiny_model(TASK, seed=0), samples, args, data_collator=collator
    )
    windows, start = [], 0
    for size in trainer.window_sizes:
        windows.append(collator.micro_batches[start : start + size])
        start += size
    lengths = [len(s["input_ids"]) for s in samples]
    padded = [len(b) * max(lengths[i] for i in b) for b in collator.micro_batches[:start]]
    out = {
        "windows": windows,
        "window_sizes": list(trainer.window_sizes),
        "rows_per_micro_batch": sorted(set(trainer.rows)),
        "padded_per_micro_batch": padded,
        "padded_tokens": sum(padded),
        "global_step": trainer.state.global_step,
        "backend": trainer.backend.name,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "param_types": sorted({type(p).__name__ for p in trainer.model_wrapped.parameters()}),
        "zero_stage": getattr(trainer.backend, "zero_stage", None),
        "num_processes": trainer.accelerator.num_processes,
        "unchanged_params": sorted(n for n, u in update.items() if not bool(u.abs().max() > 0)),
        "max_abs_diff_vs_rank0": max_abs_diff_vs_rank0(update),
    }
    return out, update


def regroup_case(backend: str, samples, *, reference: bool, **overrides: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    updates = {}
    for mode in REGROUP_MODES:
        payload[mode], updates[mode] = regroup_run(backend, samples, mode, **overrides)
    for mode in REGROUP_MODES:
        payload[mode]["relative_difference_vs_plain"] = relative_difference(updates[mode], updates["plain"])
        if reference:
            model = build_tiny_model(TASK, seed=0)
            payload[mode]["relative_error_vs_reference"] = compare_with_reference(
                updates[mode], model, samples, TASK
            ).relative_error
    return payload


def case_regroup_one_step(backend: str) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        return regroup_case(backend, make_samples(TASK, BS * GA * W, seed=21), reference=True)

    return run


def case_regroup_windows(backend: str) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        samples = make_samples(TASK, BS * GA * W * 2 + BS * W, seed=22, min_length=16)
        return regroup_case(backend, samples, reference=False, max_steps=-1, num_train_epochs=1, learning_rate=0.1)

    return run


def case_unsupported_modes(backend: str) -> Callable[[], dict[str, Any]]:
    """Building the trainer with a memory mode the sharded backend cannot run must raise, on every rank."""

    def run() -> dict[str, Any]:
        samples = make_samples(TASK, BS * GA * W, seed=23)
        payload = {}
        for flag in ("auto_micro_batch", "defer_normalization"):
            args = one_step_args(
                per_device_train_batch_size=BS,
                gradient_accumulation_steps=GA,
                args_class=GradAccConfig,
                **backend_overrides(backend),
                **{flag: True},
            )
            try:
                GradAccTrainer(
                    model=build_tiny_model(TASK, seed=0),
                    args=args,
                    train_dataset=ListDataset(samples),
                    data_collator=PaddingCollator(),
                )
                payload[flag] = {"error_type": None, "error": None}
            except Exception as exc:  # reported to the test, which asserts on it
                payload[flag] = {"error_type": type(exc).__name__, "error": str(exc)}
        return payload

    return run


CASES: dict[str, Callable[[str], Callable[[], dict[str, Any]]]] = {
    "auto_oom_one_rank": lambda backend: case_auto_oom_one_rank,
    "auto_two_steps": lambda backend: case_auto_two_steps(),
    # DDP rebuilds its buckets (a broadcast) in the first forward pass after the first reduction when it does not
    # search for unused parameters: in step 2, after rank 1 ran out of memory in step 1
    "auto_two_steps_static_buckets": lambda backend: case_auto_two_steps(ddp_find_unused_parameters=False),
    "auto_oom_one_sample": lambda backend: case_auto_oom_one_sample,
    "defer_stream": lambda backend: case_defer_stream,
    "defer_custom_count": lambda backend: case_defer_custom_count,
    "regroup_one_step": case_regroup_one_step,
    "regroup_windows": case_regroup_windows,
    "unsupported_modes": case_unsupported_modes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("ddp", "zero2", "fsdp2"), required=True)
    parser.add_argument("--cases", required=True, help=f"comma-separated, from {sorted(CASES)}")
    opts = parser.parse_args()
    pack_rows_always()
    names = [n for n in opts.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
    torch.set_num_threads(1)
    if opts.backend == "zero2":
        from hf_gradacc.patches import enable_cpu_distributed

        enable_cpu_distributed()  # before any TrainingArguments: they fill DeepSpeed's 'auto' values for W ranks
    elif opts.backend == "fsdp2":
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    for name in names:
        start = time.monotonic()
        try:
            payload = CASES[name](opts.backend)()
        except BaseException:
            write_result(name, {"worker_error": traceback.format_exc()})
            print(f"[rank {rank()}] case {name} failed", file=sys.stderr, flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # do not wait in the next collective for a rank that will never join it
        payload["case_seconds"] = time.monotonic() - start
        write_result(name, payload)
        print(f"[rank {rank()}] case {name} done in {payload['case_seconds']:.1f}s", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
