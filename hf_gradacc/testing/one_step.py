"""Measure one accumulated optimizer step against the float64 full-batch reference.

This is the engine of `hf-gradacc check` and of the exactness tests: run a trainer for ONE optimizer step with
SGD(lr=1, no momentum, no weight decay, no clipping) on a dataset of exactly one window, so that the parameter
update is minus the accumulated gradient, and compare it with :mod:`hf_gradacc.testing.reference`.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from .reference import Comparison, compare, reference_gradients
from .tiny import ListDataset, PaddingCollator


def one_step_args(
    output_dir: str | None = None,
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    args_class: type[TrainingArguments] = TrainingArguments,
    **overrides: Any,
) -> TrainingArguments:
    """`TrainingArguments` (or ``args_class``) for one plain SGD step: constant lr 1, no clipping, no decay."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="hf_gradacc_"),
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_steps=1,
        optim="sgd",  # built by the Trainer (so DeepSpeed and FSDP2 get it too): plain SGD, no momentum
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_drop_last=False,
        use_cpu=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return args_class(**kwargs)


def one_step_update(
    trainer_class: type[Trainer],
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    args: TrainingArguments,
    *,
    data_collator: Callable | None = None,
    train_dataset: Any = None,
    trainer_kwargs: dict[str, Any] | None = None,
    micro_batches: list[list[dict[str, Any]]] | None = None,
) -> tuple[dict[str, torch.Tensor], Trainer]:
    """Train a deep copy of ``model`` for one optimizer step; return ``{name: initial - final}`` and the trainer.

    With :func:`one_step_args` the step is SGD(lr=1) built by the Trainer itself, so the update is the accumulated
    gradient on every backend. Final parameters are gathered in full (ZeRO-3 / FSDP2 shards) through the backend
    when the trainer has one. ``micro_batches`` (a list) receives the samples of every micro-batch the step ran, on
    every rank (what the reference of a router loss needs).
    """
    model = copy.deepcopy(model)
    initial = {n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.requires_grad}
    kwargs = dict(trainer_kwargs or {})
    if str(getattr(args.optim, "value", args.optim)) != "sgd" and "optimizers" not in kwargs:
        # Arguments not made by one_step_args: keep the promise of a plain SGD(lr=1) step.
        params = [p for p in model.parameters() if p.requires_grad]
        kwargs["optimizers"] = (torch.optim.SGD(params, lr=1.0), None)
    collate = data_collator or PaddingCollator()
    recorder = _Recorder(collate, samples) if micro_batches is not None else None
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=train_dataset if train_dataset is not None else ListDataset(samples),
        data_collator=recorder or collate,
        **kwargs,
    )
    trainer.train()
    if recorder is not None:
        micro_batches.extend(recorder.all_ranks())
    final = full_parameters(trainer)
    update = {n: initial[n] - final[n].float() for n in initial if n in final}
    return update, trainer


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the trained model, whole and on the CPU, on every backend."""
    backend = getattr(trainer, "backend", None)
    if backend is None:  # the stock Trainer: its ZeRO-3 / FSDP2 shards are gathered by the matching backend too
        from ..backends import resolve_backend

        backend = resolve_backend(trainer.accelerator, trainer.args)
    return backend.full_parameters(trainer.model_wrapped)


def compare_with_reference(
    update: dict[str, torch.Tensor],
    model: torch.nn.Module,
    samples: Sequence[dict[str, Any]],
    task: str,
    *,
    data_collator: Callable | None = None,
    ignore_index: int = -100,
    micro_batches: Sequence[Sequence[dict[str, Any]]] | None = None,
) -> Comparison:
    """Compare ``update`` with the float64 full-batch gradient of ``model`` over all ``samples`` (``micro_batches``:
    the step's micro-batches, for a model with a router loss)."""
    reference = reference_gradients(
        model, samples, task, data_collator or PaddingCollator(), ignore_index, micro_batches=micro_batches
    )
    return compare(update, reference)


class _Recorder:
    """A collator that remembers the samples of every micro-batch it collates (matched by content)."""

    def __init__(self, collate: Callable, samples: Sequence[dict[str, Any]]) -> None:
        self.collate = collate
        self.by_key = {_key(s): s for s in samples}
        self.batches: list[list[dict[str, Any]]] = []

    def __call__(self, features: Sequence[dict[str, Any]]) -> Any:
        self.batches.append([self.by_key[_key(f)] for f in features])
        return self.collate(features)

    def all_ranks(self) -> list[list[dict[str, Any]]]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.batches
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.batches)
        return [batch for rank_batches in gathered for batch in rank_batches]


def _key(sample: dict[str, Any]) -> str:
    main = sample["input_ids"] if "input_ids" in sample else sample["pixel_values"]  # text, or image samples
    return repr((main.tolist() if torch.is_tensor(main) else list(main), sample.get("labels")))
