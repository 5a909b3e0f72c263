"""Faults between ranks, one case per launch (a fault can end the process group): every rank must end with a clear
outcome within the collective timeout, never hang, never abort gloo, never train silently wrong.

    python fault_cases.py --case frozen --backend ddp      # started by tests/distributed/launcher.run_workers

Cases:

* ``frozen`` / ``killed`` / ``erroring``: at optimizer step 2 rank 1 sleeps, SIGKILLs itself, or raises inside its
  forward; rank 0 must stop with a GradAccDistributedError naming the step (``ddp_timeout`` = TIMEOUT_S).
* ``nan_one_rank``: rank 1's first micro-batch of step 1 has a NaN loss: both ranks drop step 1 together, and step 2
  equals the float64 reference of its own samples (backends: ddp, fsdp2, deepspeed through accelerate).
* ``hook_nan_one_rank``: an accumulated-gradient hook writes NaN on rank 1 only, after the reduction: both ranks
  drop step 1 together (one verdict from values agreed across ranks), step 2 is exact.
* ``save_resume``: 2 ranks save into one folder (the marker lists both RNG states); with rank 1's RNG state of the
  newest checkpoint gone, ``resume_from_checkpoint=True`` takes the older one on both ranks.
* ``save_killed`` / ``save_disk_full``: rank 1 SIGKILLs itself, or gets a disk-full OSError, while it saves its RNG
  state into step 2's checkpoint: rank 0 must end with a GradAccDistributedError naming the step, the folder left
  incomplete and the previous complete checkpoint (not gloo's "Connection reset by peer"); rank 1 keeps its OSError.
* ``uneven_prefetched`` / ``uneven_streamed``: the ranks' data run out at different steps (``even_batches=False``):
  the default path stops every rank with the same clear error; ``defer_normalization`` trains every step exactly.
* ``tokens_seen_uneven``: ``include_num_input_tokens_seen='all'`` with a [2, 1] window: no per-micro-batch
  collective, the same count on both ranks.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import WarningRecorder, finish_worker, out_dir, rank, world_size, write_result

BS, GA = 2, 2
TIMEOUT_S = 10
POISON = 95  # the first token id that makes a micro-batch's logits NaN (no other sample starts with it)


class PoisonableLlama(LlamaForCausalLM):
    """NaN logits for a micro-batch holding a sample that starts with POISON; on rank 1 at step 2 of ``erroring``, a
    ValueError in the forward (a user's bug on one rank only)."""

    fail_at_step: int | None = None
    trainer: Any = None

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        step = None if self.trainer is None else self.trainer.state.global_step + 1
        if self.fail_at_step is not None and step == self.fail_at_step:
            raise ValueError("a bug in rank 1's forward (injected)")
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if bool((input_ids[:, 0] == POISON).any()):
            out.logits = out.logits * float("nan")
        return out


class Sequential(GradAccTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class Fault(TrainerCallback):
    """At optimizer step ``at``, rank 1 freezes or dies; rank 0 notes when that step began."""

    def __init__(self, kind: str, at: int = 2) -> None:
        self.kind, self.at, self.began = kind, at, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 != self.at:
            return
        self.began = time.monotonic()
        if rank() == 1 and self.kind == "frozen":
            time.sleep(TIMEOUT_S + 25)  # longer than the peer's timeout; then leave without a word
            os._exit(3)
        if rank() == 1 and self.kind == "killed":
            os.kill(os.getpid(), signal.SIGKILL)


class Snapshots(TrainerCallback):
    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.params.append(self._full())

    def on_step_end(self, args, state, control, **kwargs):
        self.params.append(self._full())

    def _full(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in full_parameters(self.trainer).items()}


def _samples(num_batches: int, seed: int) -> list[dict[str, Any]]:
    samples = make_samples("causal_lm", num_batches * BS, seed=seed)
    for sample in samples:
        if sample["input_ids"][0] == POISON:
            sample["input_ids"][0] = POISON - 1
    return samples


def _args(backend: str, **overrides: Any) -> GradAccConfig:
    kwargs: dict[str, Any] = dict(ddp_backend="gloo", ddp_timeout=TIMEOUT_S, seed=0, max_steps=-1, num_train_epochs=1)
    if backend == "deepspeed":
        kwargs["use_cpu"] = False  # the CPU patch picks gloo for DeepSpeed
    elif backend == "fsdp2":
        kwargs.update(use_cpu=True, fsdp=True, fsdp_config={"version": 2})
    else:
        kwargs["use_cpu"] = True
    kwargs.update(overrides)
    output_dir = kwargs.pop("output_dir", None) or tempfile.mkdtemp(prefix="hf_gradacc_fault_")
    return one_step_args(output_dir, per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, args_class=GradAccConfig, **kwargs)  # fmt: skip


def _model() -> PoisonableLlama:
    base = build_tiny_model("causal_lm")
    model = PoisonableLlama(base.config)
    model.load_state_dict(base.state_dict())
    return model


def _train(backend: str, samples: list, *, callbacks=(), resume_from_checkpoint: Any = None,
           **overrides: Any) -> tuple[Sequential, Snapshots]:  # fmt: skip
    model = _model()
    snapshots = Snapshots()
    trainer = Sequential(model=model, args=_args(backend, **overrides), train_dataset=ListDataset(samples),
                         data_collator=PaddingCollator(), callbacks=[snapshots, *callbacks])  # fmt: skip
    snapshots.trainer = trainer
    model.trainer = trainer
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, snapshots


def _rank_batches(samples: list) -> list[list[list[dict]]]:
    """The micro-batches of each rank under a sequential sampler: batch b goes to rank b % W."""
    batches = [samples[i : i + BS] for i in range(0, len(samples), BS)]
    return [batches[r::world_size()] for r in range(world_size())]


def case_peer_fault(kind: str, backend: str) -> dict[str, Any]:
    samples = _samples(GA * world_size() * 3, seed=1)
    fault = Fault(kind)
    model_hook = kind == "erroring" and rank() == 1
    started = time.monotonic()
    try:
        model = _model()
        if model_hook:
            model.fail_at_step = 2
        trainer = Sequential(model=model, args=_args(backend), train_dataset=ListDataset(samples),
                             data_collator=PaddingCollator(), callbacks=[fault])  # fmt: skip
        model.trainer = trainer
        trainer.train()
    except Exception as error:  # noqa: BLE001 - the outcome is the result
        now = time.monotonic()
        return {"error_type": type(error).__name__, "error": str(error), "cause": repr(error.__cause__),
                "since_fault_s": now - (fault.began or started)}  # fmt: skip
    return {"error_type": None}


def case_nan_one_rank(backend: str) -> dict[str, Any]:
    samples = _samples(GA * world_size() * 2, seed=2)
    batches = _rank_batches(samples)
    batches[1][0][0]["input_ids"][0] = POISON  # rank 1's first micro-batch of step 1
    with WarningRecorder() as warnings:
        trainer, snapshots = _train(backend, samples)
    step2 = [s for rank_batches in batches for s in [x for b in rank_batches[GA:] for x in b]]
    model = _model()
    reference = reference_gradients(model, step2, "causal_lm", PaddingCollator())  # at the initial parameters
    first, last = snapshots.params[0], snapshots.params[-1]
    update = {n: first[n] - last[n] for n in first}
    c = compare(update, reference)
    return {
        "skipped": trainer.num_nonfinite_skipped,
        "global_step": trainer.state.global_step,
        "relative_error": c.relative_error,
        "finite": all(bool(torch.isfinite(p).all()) for p in last.values()),
        "warnings": [w for w in warnings.messages if "Optimizer step" in w],
        "logs": [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h],
    }


def case_hook_nan_one_rank(backend: str) -> dict[str, Any]:
    """An accumulated-gradient hook writes NaN into one parameter's full gradient on rank 1 at step 1 only, AFTER the
    gradients were reduced: the ranks must agree to drop step 1 (one verdict, or gloo aborts on mismatched
    collectives), and step 2 equals the float64 reference of its own samples."""
    samples = _samples(GA * world_size() * 2, seed=5)
    batches = _rank_batches(samples)
    model = _model()
    snapshots = Snapshots()
    trainer = Sequential(model=model, args=_args(backend), train_dataset=ListDataset(samples),
                         data_collator=PaddingCollator(), callbacks=[snapshots])  # fmt: skip
    snapshots.trainer = trainer
    poisoned = next(n for n, p in model.named_parameters() if p.requires_grad)
    seen = []

    def nan_on_rank_1(name: str, grad: torch.Tensor) -> None:
        if name == poisoned:
            seen.append(name)
            if rank() == 1 and len(seen) == 1:  # the first step only (a dropped step leaves global_step at 0)
                grad.fill_(float("nan"))

    trainer.register_accumulated_grad_hook(nan_on_rank_1)
    with WarningRecorder() as warnings:
        trainer.train()
    step2 = [s for rank_batches in batches for s in [x for b in rank_batches[GA:] for x in b]]
    reference = reference_gradients(_model(), step2, "causal_lm", PaddingCollator())  # at the initial parameters
    first, last = snapshots.params[0], snapshots.params[-1]
    c = compare({n: first[n] - last[n] for n in first}, reference)
    return {
        "skipped": trainer.num_nonfinite_skipped,
        "global_step": trainer.state.global_step,
        "relative_error": c.relative_error,
        "finite": all(bool(torch.isfinite(p).all()) for p in last.values()),
        "warnings": [w for w in warnings.messages if "Optimizer step" in w],
    }


def case_save_resume(backend: str) -> dict[str, Any]:
    """2 ranks save every step into one shared folder; the marker lists both ranks' RNG states. Then rank 1's
    ``rng_state_1.pth`` of the newest checkpoint is removed (its rank died while saving): ``resume_from_checkpoint=True``
    takes the older checkpoint on BOTH ranks (agreed), with a warning naming the file, and finishes the epoch."""
    import torch.distributed as dist

    from hf_gradacc.checkpoints import COMPLETE_NAME

    samples = _samples(GA * world_size() * 2, seed=6)
    shared = str(out_dir() / "save_resume")
    save = dict(output_dir=shared, save_strategy="steps", save_steps=1, optim="adamw_torch", learning_rate=1e-3)
    trainer, _ = _train(backend, samples, **save)
    listed = json.loads((Path(shared) / "checkpoint-2" / COMPLETE_NAME).read_text())["files"]
    dist.barrier()
    if rank() == 1:
        os.remove(os.path.join(shared, "checkpoint-2", "rng_state_1.pth"))
    dist.barrier()
    with WarningRecorder() as warnings:
        resumed, _ = _train(backend, samples, resume_from_checkpoint=True, **save)
    return {
        "listed": sorted(listed),
        "global_step": resumed.state.global_step,
        "warnings": [w for w in warnings.messages if "Resuming from" in w],
    }


class FailingSave(Sequential):
    """Rank 1 SIGKILLs itself (``save_killed``) or finds its disk full (``save_disk_full``) while it writes its RNG
    state into the checkpoint of optimizer step 2, after the model and optimizer were saved."""

    fault: str | None = None

    def _save_rng_state(self, output_dir):
        if rank() == 1 and self.state.global_step == 2:
            if self.fault == "save_killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, "No space left on device (injected)", os.path.join(output_dir, "rng_state_1.pth"))
        super()._save_rng_state(output_dir)


def case_save_fault(kind: str, backend: str) -> dict[str, Any]:
    """Saving every step into ``<out>/save_fault``; rank 1 dies or fails while saving step 2's checkpoint: rank 0
    must get the library's error naming the step, the incomplete folder and the checkpoint the next resume takes."""
    samples = _samples(GA * world_size() * 3, seed=7)
    save = dict(output_dir=str(out_dir() / "save_fault"), save_strategy="steps", save_steps=1, optim="adamw_torch")
    try:
        trainer = FailingSave(model=_model(), args=_args(backend, **save), train_dataset=ListDataset(samples),
                              data_collator=PaddingCollator())  # fmt: skip
        trainer.fault = kind
        trainer.train()
    except Exception as error:  # noqa: BLE001 - the outcome is the result
        return {"error_type": type(error).__name__, "error": str(error), "cause": repr(error.__cause__)}
    return {"error_type": None}


def case_uneven(streamed: bool, backend: str) -> dict[str, Any]:
    samples = _samples(5, seed=3)  # 5 micro-batches: rank 0 gets 3, rank 1 gets 2 (even_batches=False)
    overrides = dict(defer_normalization=streamed, accelerator_config={"even_batches": False})
    try:
        trainer, snapshots = _train(backend, samples, **overrides)
    except Exception as error:  # noqa: BLE001
        return {"error_type": type(error).__name__, "error": str(error)}
    batches = [samples[i : i + BS] for i in range(0, len(samples), BS)]
    # Step k holds micro-batches k*GA*W .. (k+1)*GA*W - 1 of the sequential order, dealt round-robin.
    errors = []
    for k in range(trainer.state.global_step):
        step = [s for b in batches[k * GA * world_size() : (k + 1) * GA * world_size()] for s in b]
        model = _model()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(snapshots.params[k][n])
        reference = reference_gradients(model, step, "causal_lm", PaddingCollator())
        update = {n: snapshots.params[k][n] - snapshots.params[k + 1][n] for n in reference}
        errors.append(compare(update, reference).relative_error)
    return {"error_type": None, "global_step": trainer.state.global_step, "relative_errors": errors}


def case_tokens_seen(backend: str) -> dict[str, Any]:
    samples = _samples(3, seed=4)  # a [2, 1] window on 2 ranks
    trainer, _ = _train(backend, samples, include_num_input_tokens_seen="all", accelerator_config={"even_batches": False})
    batches = [PaddingCollator()(samples[i : i + BS]) for i in range(0, len(samples), BS)]
    return {"seen": trainer.state.num_input_tokens_seen, "expected": sum(b["input_ids"].numel() for b in batches),
            "global_step": trainer.state.global_step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--backend", choices=("ddp", "fsdp2", "deepspeed"), default="ddp")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.backend == "fsdp2":
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    cases = {
        "frozen": lambda: case_peer_fault("frozen", opts.backend),
        "killed": lambda: case_peer_fault("killed", opts.backend),
        "erroring": lambda: case_peer_fault("erroring", opts.backend),
        "nan_one_rank": lambda: case_nan_one_rank(opts.backend),
        "hook_nan_one_rank": lambda: case_hook_nan_one_rank(opts.backend),
        "save_resume": lambda: case_save_resume(opts.backend),
        "save_killed": lambda: case_save_fault("save_killed", opts.backend),
        "save_disk_full": lambda: case_save_fault("save_disk_full", opts.backend),
        "uneven_prefetched": lambda: case_uneven(False, opts.backend),
        "uneven_streamed": lambda: case_uneven(True, opts.backend),
        "tokens_seen_uneven": lambda: case_tokens_seen(opts.backend),
    }
    try:
        payload = cases[opts.case]()
    except Exception:  # noqa: BLE001 - a crash is written as a result, then the rank fails
        write_result(opts.case, {"crash": traceback.format_exc()})
        raise
    write_result(opts.case, payload)
    if opts.case in ("frozen", "killed", "erroring", "save_killed", "save_disk_full"):
        os._exit(0)  # the process group is broken: no barrier to wait in
    finish_worker()


if __name__ == "__main__":
    main()

