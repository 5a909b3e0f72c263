"""Trainer wiring of the data planners: the training dataloader with regrouped micro-batches, and the number of
micro-batches of each optimizer step that the training loop reads from it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler
from transformers.utils import logging

from ..compat import shard_even_batches
from ..errors import GradAccConfigError, GradAccDataError
from .pack import AttentionCostModel, PackedCollator, WindowPackBatchSampler
from .regroup import WindowRegroupBatchSampler, sample_lengths

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from ..config import GradAccSettings

logger = logging.get_logger(__name__)


def find_regroup_sampler(dataloader: Any) -> WindowRegroupBatchSampler | None:
    """The :class:`WindowRegroupBatchSampler` under a (prepared, possibly skipping) dataloader, or None."""
    node = getattr(dataloader, "batch_sampler", None)
    for _ in range(6):  # DataLoaderShard -> SkipBatchSampler -> BatchSamplerShard -> ours
        if isinstance(node, WindowRegroupBatchSampler):
            return node
        node = getattr(node, "batch_sampler", None)
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainData:
    """What the dataloader wiring takes from the Trainer: its training dataset and collator, the Trainer's own
    handling of unused columns and of its sampler, and the run's batch size. :class:`~hf_gradacc.GradAccMixin` builds
    it (``trainer.train_data``) from its Trainer's members; the planners below take it, never the trainer.

    Attributes:
        dataset / collator: ``train_dataset`` and ``data_collator``.
        args / accelerator / model / processing_class: the Trainer's.
        batch_size: rows per micro-batch on this rank (`Trainer._train_batch_size`).
        remove_columns: `Trainer._remove_unused_columns` (a `datasets.Dataset`, with a description).
        wrap_collator: `Trainer._get_collator_with_removed_columns` (any other dataset).
        train_sampler: `Trainer._get_train_sampler`.
        prepare: `Trainer._prepare_inputs` (a batch on the model's device).
    """

    dataset: Any
    collator: Any
    args: Any
    accelerator: Any
    model: Any
    processing_class: Any
    batch_size: int
    remove_columns: Callable[..., Any]
    wrap_collator: Callable[..., Any]
    train_sampler: Callable[[Any], Any]
    prepare: Callable[[Any], Any]

    def without_unused_columns(self, description: str) -> tuple[Any, Any]:
        """``(dataset, collator)`` as the Trainer's own dataloaders use them: a `datasets.Dataset` loses the columns
        the model's forward does not name; any other dataset keeps them and the collator drops them."""
        if is_hf_dataset(self.dataset):
            return self.remove_columns(self.dataset, description=description), self.collator
        return self.dataset, self.wrap_collator(self.collator, description=description)


def is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def window_schedule(dataloader: Any, epoch: int) -> tuple[int, ...] | None:
    """Micro-batches per rank of each window of ``epoch`` when ``dataloader`` regroups, else None (stock)."""
    sampler = find_regroup_sampler(dataloader)
    if sampler is None:
        return None
    sampler.set_epoch(epoch)
    return sampler.num_micro_batches_per_window


def build_train_dataloader(
    data: TrainData,
    settings: GradAccSettings,
    *,
    lengths_of: Callable[[Any], list[int]] | None = None,
    packing_collator: Callable | None = None,
) -> DataLoader | None:
    """The training dataloader of ``data`` (:class:`TrainData`) with regrouped micro-batches, or None when the stock
    one applies.

    Mirrors `Trainer._get_dataloader` (collator with removed columns, workers, pinning, worker seeding) and passes
    the result through ``accelerator.prepare``, which shards it over ranks and seeds the base sampler.

    Trainers whose samples are not one sequence each, or whose collator already knows how to build a padding-free
    row, say so here (:mod:`hf_gradacc.trl` does): ``lengths_of(dataset)`` gives the length the planner uses for
    every sample of the training dataset (default :func:`~hf_gradacc.data.regroup.sample_lengths`: a length
    column, or ``len(input_ids)``), and ``packing_collator`` builds ONE padding-free row from the samples of a
    micro-batch with ``pack_micro_batches`` (default :class:`~hf_gradacc.data.pack.PackedCollator`, which replaces
    the trainer's collator with a warning).
    """
    args = data.args
    if not settings.regroups or data.dataset is None:
        return None
    dataset = data.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        logger.warning_once(
            "`regroup_micro_batches` / `max_tokens_per_micro_batch` are not applied to an IterableDataset (there is "
            "no index order to regroup): micro-batches are trained as the dataset yields them, still exactly.",
        )
        return None
    accelerator = data.accelerator
    for flag in ("split_batches", "dispatch_batches"):
        if getattr(accelerator, flag, False):
            logger.warning_once(
                f"`regroup_micro_batches` is not applied with accelerate's `{flag}=True` (each batch is cut into "
                "equal row slices, which regrouped micro-batches of varying rows cannot be); training continues with "
                "the stock grouping, exactly.",
            )
            return None
    if accelerator.num_processes > 1 and not accelerator.even_batches:
        logger.warning_once(
            "`regroup_micro_batches` is not applied with accelerate's `even_batches=False` (ranks may get different "
            "numbers of micro-batches); training continues with the stock grouping, exactly.",
        )
        return None

    if lengths_of is not None:
        lengths = lengths_of(dataset)
    else:
        model_input_names = getattr(data.processing_class, "model_input_names", None) or ["input_ids"]
        lengths = sample_lengths(
            dataset, length_column_name=args.length_column_name, model_input_name=model_input_names[0]
        )
    dataset, collator = data.without_unused_columns("Training")
    base_sampler = data.train_sampler(dataset)
    if base_sampler is None or isinstance(base_sampler, BatchSampler) or not hasattr(base_sampler, "__len__"):
        raise GradAccConfigError(
            f"`regroup_micro_batches` regroups the order of an index sampler; `_get_train_sampler` returned "
            f"{type(base_sampler).__name__} (`train_sampling_strategy`={args.train_sampling_strategy!r}). Use "
            "'random', 'sequential' or 'group_by_length', or set `regroup_micro_batches=False`."
        )
    if accelerator.num_processes > 1 and not accelerator.dataloader_config.use_seedable_sampler:
        logger.warning_once(
            "`regroup_micro_batches` with `use_seedable_sampler=False`: every rank must draw the same sample order "
            "for the windows to agree; keep accelerate's default `use_seedable_sampler=True`.",
        )
    from transformers.trainer_utils import seed_worker

    sampler_class = WindowPackBatchSampler if settings.pack_micro_batches else WindowRegroupBatchSampler
    packing: dict[str, Any] = {}
    if settings.pack_micro_batches:  # a dense attention kernel: pad where one packed row would cost more
        packing["cost_model"] = AttentionCostModel.for_model(data.model, padded_layout=packing_collator is None)
        collator = _packing_collator(data, settings, packing_collator, packing["cost_model"])
    batch_sampler = sampler_class(
        base_sampler,
        lengths,
        batch_size=data.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_processes=accelerator.num_processes,
        drop_last=args.dataloader_drop_last,
        even_batches=accelerator.even_batches,
        max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch,
        **packing,
    )
    params: dict[str, Any] = {
        "batch_sampler": batch_sampler,
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
    }
    # TrainingArguments fields that transformers 5.6 does not have yet (its Trainer passes neither to the DataLoader)
    for key in ("multiprocessing_context", "in_order"):
        if hasattr(args, f"dataloader_{key}"):
            params[key] = getattr(args, f"dataloader_{key}")
    shard_even = shard_even_batches(accelerator.even_batches)
    if shard_even == accelerator.even_batches or accelerator.num_processes == 1:
        dataloader = accelerator.prepare(DataLoader(dataset, **params))
    else:  # older accelerate: the sampler already evened the ranks out (compat.shard_even_batches)
        accelerator.even_batches = shard_even
        try:
            dataloader = accelerator.prepare(DataLoader(dataset, **params))
        finally:
            accelerator.even_batches = True
    shard = getattr(dataloader, "batch_sampler", None)
    if shard is not batch_sampler and getattr(shard, "batch_sampler", None) is batch_sampler:
        batch_sampler.num_processes = shard.num_processes  # what accelerate really deals to (device meshes)
    elif shard is batch_sampler:
        batch_sampler.num_processes = 1
    return dataloader


def _packing_collator(
    data: TrainData,
    settings: GradAccSettings,
    packed: Callable | None = None,
    cost_model: AttentionCostModel | None = None,
) -> Callable:
    """``packed`` (the trainer's own padding-free collator) or :class:`~hf_gradacc.data.pack.PackedCollator`, behind
    the Trainer's unused-column removal; PackedCollator comes with a warning when it replaces a collator of the
    user's: its padding has nothing left to do, but any other work it did is skipped."""
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding, default_data_collator

    if packed is None:
        user = data.collator
        pads_only = isinstance(user, (PackedCollator, DataCollatorWithFlattening, DataCollatorWithPadding)) or getattr(
            user,
            "only_pads",
            False,  # a collator that declares it does nothing but pad (hf_gradacc's PaddingCollator)
        )
        if not pads_only and user is not default_data_collator:
            logger.warning_once(
                f"`pack_micro_batches=True`: micro-batches are built by hf_gradacc's PackedCollator (one padding-free "
                f"row each), not by the given data_collator ({type(user).__name__}). If that collator did more than "
                "pad, do that work in the dataset instead, or turn packing off."
            )
        packed = PackedCollator(ignore_index=settings.ignore_index, cost_model=cost_model)
    return packed if is_hf_dataset(data.dataset) else data.wrap_collator(packed, description="Training")


def adjust_training_values(
    dataloader: Any,
    args: TrainingArguments,
    values: tuple,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple:
    """Fix `Trainer.set_initial_training_values`:

    - for a regrouping dataloader whose windows hold another number of micro-batches than
      ``gradient_accumulation_steps`` (a token budget, packed rows), optimizer steps per epoch are the windows, not
      ``len(dataloader) / gradient_accumulation_steps``;
    - with ``all_gather`` (several ranks), the loop's lengths are agreed: every rank takes the largest steps per
      epoch, batches per epoch and ``max_steps``. Each rank computes them from its OWN dataloader, and ranks dealt
      different numbers of batches (``even_batches=False``) would otherwise leave the loop at different steps and
      pair unrelated collectives. A rank with fewer batches then meets empty windows, which the loop handles on
      every rank alike.
    """
    num_train_epochs, num_update_steps, num_examples, num_train_samples, total_batch, steps_in_epoch, max_steps = (
        values
    )
    sampler = find_regroup_sampler(dataloader)
    if sampler is not None and (
        isinstance(sampler, WindowPackBatchSampler) or sampler.max_tokens_per_micro_batch is not None
    ):
        num_update_steps = max(sampler.num_windows, 1)
        if args.max_steps > 0:
            num_train_epochs = math.ceil(max_steps / num_update_steps)
        else:
            max_steps = math.ceil(args.num_train_epochs * num_update_steps)
    if all_gather is not None and None not in (num_update_steps, steps_in_epoch, max_steps):
        local = torch.tensor([num_update_steps, steps_in_epoch, max_steps], dtype=torch.int64)
        num_update_steps, steps_in_epoch, max_steps = (
            int(v) for v in all_gather(local).reshape(-1, 3).max(dim=0).values
        )
    return (
        num_train_epochs,
        num_update_steps,
        num_examples,
        num_train_samples,
        total_batch,
        steps_in_epoch,
        max_steps,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochPlan:
    """How one epoch's batches split into optimizer steps.

    Attributes:
        epoch_iterator: the epoch's batches (already past the ones a resumed run trained before its checkpoint).
        num_batches: micro-batches per rank of each remaining optimizer step, in order (with an accumulation
            schedule, decided lazily, one step at a time).
        steps_in_epoch: micro-batches per rank in the whole epoch.
        step: index of the last micro-batch already trained in this epoch (-1: none).
        resumed_mid_epoch: batches were skipped; the RNG state of the checkpoint is restored after the next fetch.
    """

    epoch_iterator: Iterator[Any]
    num_batches: Iterable[int]
    steps_in_epoch: int
    step: int
    resumed_mid_epoch: bool


def plan_epoch(
    train_dataloader: Any,
    epoch: int,
    *,
    gradient_accumulation_steps: int,
    steps_in_epoch: int,
    num_update_steps_per_epoch: int,
    steps_trained_in_current_epoch: int = 0,
    accumulation: Callable[[], int] | None = None,
) -> EpochPlan:
    """The optimizer steps of ``epoch``: ``gradient_accumulation_steps`` micro-batches each (the last one short), or
    the regrouping sampler's schedule; with ``steps_trained_in_current_epoch`` > 0 (a resumed run) the trained steps
    are skipped whole. With ``accumulation`` (an accumulation schedule) each step takes ``accumulation()``
    micro-batches, asked just before the step (the schedule reads the optimizer steps taken so far), and
    ``steps_trained_in_current_epoch`` counts micro-batches, which must end a step.

    Example:
        ```python
        plan = plan_epoch(loader, 0, gradient_accumulation_steps=4, steps_in_epoch=10, num_update_steps_per_epoch=3)
        assert plan.num_batches == [4, 4, 2]
        ```
    """
    from accelerate.data_loader import skip_first_batches

    gas = gradient_accumulation_steps
    schedule = None if accumulation is not None else window_schedule(train_dataloader, epoch)
    if accumulation is not None:
        num_batches: Iterable[int] = _scheduled_windows(accumulation, steps_in_epoch - steps_trained_in_current_epoch)
    elif schedule is not None:
        steps_in_epoch = max(sum(schedule), 1)
        num_batches = [schedule[k] if k < len(schedule) else 0 for k in range(num_update_steps_per_epoch)]
    else:
        remainder = steps_in_epoch % gas or gas
        num_batches = [gas] * (num_update_steps_per_epoch - 1) + [remainder] * (num_update_steps_per_epoch > 0)
    skipped_steps = steps_trained_in_current_epoch // gas
    skipped_batches = 0
    if steps_trained_in_current_epoch > 0:
        skipped_batches = sum(num_batches[:skipped_steps]) if schedule is not None else steps_trained_in_current_epoch
        train_dataloader = skip_first_batches(train_dataloader, skipped_batches)
        if accumulation is None:
            num_batches = num_batches[skipped_steps:]
    if hasattr(train_dataloader, "set_epoch"):
        train_dataloader.set_epoch(epoch)
    # `DataLoaderShard.set_epoch` does not forward to a batch sampler wrapped in `BatchSamplerShard`: reach it here.
    underlying_sampler = getattr(getattr(train_dataloader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(underlying_sampler, "set_epoch"):
        underlying_sampler.set_epoch(epoch)
    return EpochPlan(
        epoch_iterator=iter(train_dataloader),
        num_batches=num_batches,
        steps_in_epoch=steps_in_epoch,
        step=skipped_batches - 1,
        resumed_mid_epoch=steps_trained_in_current_epoch > 0,
    )


def _scheduled_windows(accumulation: Callable[[], int], left: int) -> Iterator[int]:
    while left > 0:
        size = min(accumulation(), left)
        yield size
        left -= size


class SkipFirstSamples(Sampler):
    """An index sampler that leaves out the first ``num_samples`` indices of ``sampler``'s order in epoch ``epoch``
    and passes every other epoch through whole. Batching, regrouping, sharding over ranks and the epoch's seed stay
    with the loader: a resumed run re-batches the rest of the epoch's order in its own layout. The epoch is the one
    last given to ``set_epoch`` (the training loop sets it before each epoch), ``epoch`` to begin with.

    Example:
        ```python
        from torch.utils.data import SequentialSampler

        sampler = SkipFirstSamples(SequentialSampler(range(6)), 4, epoch=1)
        assert (len(sampler), list(sampler)) == (2, [4, 5])
        sampler.set_epoch(2)
        assert list(sampler) == [0, 1, 2, 3, 4, 5]
        ```
    """

    def __init__(self, sampler: Any, num_samples: int, *, epoch: int) -> None:
        self.sampler, self.num_samples, self.skip_epoch, self.epoch = sampler, num_samples, epoch, epoch

    def num_skipped(self) -> int:
        """The samples left out of the current epoch (``num_samples`` in epoch ``epoch``, else 0)."""
        return self.num_samples if self.epoch == self.skip_epoch else 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.num_skipped(), None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.num_skipped(), 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def skip_first_samples(dataloader: Any, num_samples: int, epoch: int) -> bool:
    """Make epoch ``epoch`` of ``dataloader`` (stock or prepared by accelerate, batched or regrouped) leave out the
    first ``num_samples`` samples of the epoch's order, before batching and sharding; False when it has no index
    sampler under its batch sampler to do it on."""
    node = getattr(dataloader, "batch_sampler", None)
    for _ in range(4):  # DataLoaderShard -> BatchSamplerShard -> BatchSampler / WindowRegroupBatchSampler
        if hasattr(node, "batch_sampler"):  # a wrapper (accelerate's shard is a BatchSampler too): go under it
            node = node.batch_sampler
            continue
        inner = getattr(node, "sampler", None)
        if inner is None or not isinstance(node, (BatchSampler, WindowRegroupBatchSampler)):
            return False
        if isinstance(inner, SkipFirstSamples):
            inner = inner.sampler
        node.sampler = SkipFirstSamples(inner, num_samples, epoch=epoch)
        node.sampler.set_epoch(epoch)
        return True
    return False


def check_train_dataset(dataset: Any) -> None:
    """A clear error for an empty map-style training dataset (torch's sampler would fail on ``num_samples=0``)."""
    if dataset is not None and not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__"):
        if len(dataset) == 0:
            raise GradAccDataError(
                "`train_dataset` is empty (0 samples): there is nothing to train on. Check the filtering or the split "
                "that produced it."
            )


def fetch_batches(epoch_iterator: Iterator[Any], num_batches: int) -> list[Any]:
    """Up to ``num_batches`` batches of ``epoch_iterator``; an IterableDataset that yields nothing at all gets a clear
    error (accelerate's batch dispatcher raises "Batch does not contain any data" for it)."""
    try:
        return list(itertools.islice(epoch_iterator, num_batches))
    except ValueError as error:
        if "Batch does not contain any data" not in str(error):
            raise
        raise GradAccDataError(
            "The training dataset yielded no batch: an empty IterableDataset (or one whose samples were all filtered "
            "out). Check the data pipeline that feeds `train_dataset`."
        ) from error
