"""Padding-aware regrouping of each optimizer step's samples into micro-batches (map-style datasets): the pure
planning. The Trainer wiring (the dataloader that uses it) is in :mod:`hf_gradacc.data.loader`.

Once a step's loss is normalised by the count over ALL its micro-batches and ranks (what
:class:`~hf_gradacc.GradAccTrainer` does), the step no longer depends on how its samples are grouped into
micro-batches. :class:`WindowRegroupBatchSampler` uses that freedom:

1. it takes the index order of the stock sampler (the `RandomSampler` the Trainer builds, seeded the same way, so
   every rank sees the same order) and cuts it into the SAME windows the stock Trainer would feed to each optimizer
   step: the micro-batches accelerate's ``BatchSamplerShard`` deals out (batch ``i`` to rank ``i % W``),
   ``gradient_accumulation_steps`` of them per rank, the epoch's short last window and even-batches padding included;
2. inside each window it sorts the samples by length and cuts them into contiguous groups that minimise padded
   tokens (rows x longest row), under a cap on padded tokens per micro-batch (``max_tokens_per_micro_batch``, or by
   default the largest micro-batch the stock grouping has in that window, so peak memory does not grow);
3. it deals the groups to ranks so that every rank gets the same number of micro-batches and about the same padded
   tokens, and yields them in the order ``BatchSamplerShard`` will hand them out.

The samples of every optimizer step are therefore exactly those of the stock run; only their grouping changes.
Iterable datasets have no index order to regroup: they are trained as they come (a warning says so), still exactly.

Example:
    ```python
    from hf_gradacc import GradAccConfig, GradAccTrainer

    args = GradAccConfig(
        output_dir="out",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=8,
        regroup_micro_batches=True,          # same samples per step, less padding
        max_tokens_per_micro_batch=8192,     # optional: cap rows x longest row per micro-batch
    )
    trainer = GradAccTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator)
    trainer.train()
    ```
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, Sampler

from ..errors import GradAccConfigError, GradAccDataError

# The default cap on padded tokens of a regrouped micro-batch, relative to the smallest cap that still fits the
# window into its micro-batches: a little slack lets the padding-minimising partition isolate long rows, and keeps
# micro-batches (and so ranks) close in size. Measured on log-normal lengths: 1.0 pads ~4% more, 1.5 no better.
CAP_SLACK = 1.25


# ---------------------------------------------------------------------------------------------- lengths
def sample_lengths(
    dataset: Any, *, length_column_name: str = "length", model_input_name: str = "input_ids"
) -> list[int]:
    """Length of every sample of a map-style ``dataset``: the ``length_column_name`` column when there is one, else
    ``len(sample[model_input_name])``, read once.

    Example:
        ```python
        from hf_gradacc.data import sample_lengths
        lengths = sample_lengths(train_dataset)            # [37, 5, 112, ...]
        ```
    """
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list):  # datasets.Dataset: read whole columns, not rows
        if length_column_name in column_names:
            return [int(x) for x in dataset[length_column_name]]
        if model_input_name in column_names:
            return [len(x) for x in dataset[model_input_name]]
        raise GradAccConfigError(
            f"`regroup_micro_batches` needs each sample's length, but the training dataset has neither a "
            f"`{length_column_name}` column (`length_column_name`) nor a `{model_input_name}` column (columns: "
            f"{column_names}). Add a length column or set `regroup_micro_batches=False`."
        )
    lengths = []
    for index in range(len(dataset)):
        sample = dataset[index]
        if isinstance(sample, dict) and length_column_name in sample:
            lengths.append(int(sample[length_column_name]))
        elif isinstance(sample, dict) and model_input_name in sample:
            lengths.append(len(sample[model_input_name]))
        else:
            keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
            raise GradAccConfigError(
                f"`regroup_micro_batches` needs each sample's length, but training sample {index} has neither a "
                f"`{length_column_name}` key (`length_column_name`) nor `{model_input_name}` (it has: {keys}). "
                "Add a length field to the samples or set `regroup_micro_batches=False`."
            )
    return lengths


# ---------------------------------------------------------------------------------------------- stock windows
def stock_windows(
    order: Sequence[int],
    *,
    batch_size: int,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
    drop_last: bool = False,
    even_batches: bool = True,
) -> list[list[list[list[int]]]]:
    """The micro-batches each rank gets in each optimizer step of the stock pipeline, as ``[window][rank][k]``.

    It runs the stock pieces themselves on ``order``: torch's ``BatchSampler`` and, on several processes,
    accelerate's ``BatchSamplerShard`` (batch ``i`` to rank ``i % W``, the epoch's tail completed from its start
    when ``even_batches``); then each rank's micro-batches are taken ``gradient_accumulation_steps`` at a time.
    """
    batches = BatchSampler(list(order), batch_size, drop_last)
    if num_processes == 1:
        per_rank = [list(batches)]
    else:
        from accelerate.data_loader import BatchSamplerShard

        per_rank = [
            list(BatchSamplerShard(batches, num_processes, rank, split_batches=False, even_batches=even_batches))
            for rank in range(num_processes)
        ]
    counts = {len(b) for b in per_rank}
    if len(counts) != 1:
        raise GradAccDataError(
            f"The ranks get different numbers of micro-batches per epoch ({[len(b) for b in per_rank]}): regrouping "
            "needs accelerate's `even_batches=True` (the default) or a dataset size that splits evenly."
        )
    (count,) = counts
    gas = gradient_accumulation_steps
    return [[rank_batches[start : start + gas] for rank_batches in per_rank] for start in range(0, count, gas)]


# ---------------------------------------------------------------------------------------------- one window
def _padded(lengths: Sequence[int], group: Sequence[int]) -> int:
    return len(group) * max(lengths[i] for i in group)


def _count_groups(sorted_lengths: Sequence[int], cap: int) -> int:
    """Fewest contiguous groups of the descending ``sorted_lengths`` with rows x longest row <= ``cap`` (greedy)."""
    start, num_groups = 0, 0
    while start < len(sorted_lengths):
        start += max(1, cap // max(1, sorted_lengths[start]))
        num_groups += 1
    return num_groups


def _min_cap(sorted_lengths: Sequence[int], num_groups: int) -> int:
    """Smallest cap on padded tokens per group that fits the descending ``sorted_lengths`` into ``num_groups``."""
    lo = max(1, sorted_lengths[0])
    hi = lo * len(sorted_lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        if _count_groups(sorted_lengths, mid) <= num_groups:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _min_padding_cuts(sorted_lengths: Sequence[int], num_groups: int, cap: int) -> list[int]:
    """Cut the descending ``sorted_lengths`` into exactly ``num_groups`` non-empty contiguous groups of at most
    ``cap`` padded tokens each, with the fewest padded tokens in total; returns the group boundaries.

    Dynamic programme over (groups left, first row): a group starting at row ``i`` with ``d`` rows costs
    ``d * length[i]``. For sorted lengths, contiguous groups are optimal, and the cap bounds ``d``. Among equally
    padded partitions the most even one wins.
    """
    import numpy as np

    lengths = np.maximum(np.asarray(sorted_lengths, dtype=np.int64), 1)
    n = len(lengths)
    # Only the (first row, rows) pairs within the cap and the window, flattened row by row.
    num_rows = np.minimum(n - np.arange(n), np.maximum(1, cap // lengths))
    first = np.repeat(np.arange(n), num_rows)
    row_starts = np.concatenate(([0], np.cumsum(num_rows)[:-1]))
    extra_rows = np.arange(len(first)) - np.repeat(row_starts, num_rows)  # rows - 1
    ends = first + extra_rows + 1
    padded = ((extra_rows + 1) * lengths[first]).astype(np.float64)
    # Ties in padded tokens (equal lengths) go to the most even split: a sum of squares, scaled below one token.
    cost = padded + padded**2 * (0.5 / (num_groups * float(cap) ** 2))
    cost[padded > cap] = np.inf
    best = np.full(n + 1, np.inf)
    best[n] = 0.0  # zero groups cover the empty suffix
    choices = []
    for _ in range(num_groups):
        total = cost + best[ends]
        lowest = np.minimum.reduceat(total, row_starts)
        hits = np.flatnonzero(total == lowest[first])  # every row has one (inf == inf for infeasible rows)
        is_first_hit = np.concatenate(([True], first[hits][1:] != first[hits][:-1]))
        choice = np.empty(n, dtype=np.int64)
        choice[first[hits[is_first_hit]]] = extra_rows[hits[is_first_hit]]
        best = np.append(lowest, np.inf)
        choices.append(choice)
    if not np.isfinite(best[0]):
        raise AssertionError(f"no partition of {n} rows into {num_groups} groups under cap {cap}")
    cuts, start = [0], 0
    for choice in reversed(choices):
        start += int(choice[start]) + 1
        cuts.append(start)
    assert cuts[-1] == n
    return cuts


def regroup_window(
    samples: Sequence[int],
    lengths: Sequence[int],
    *,
    num_processes: int,
    num_micro_batches_per_rank: int,
    max_tokens: int,
) -> list[list[list[int]]]:
    """Split one window's ``samples`` into ``num_micro_batches_per_rank`` micro-batches for each of
    ``num_processes`` ranks: minimal padded tokens under ``max_tokens`` per micro-batch, ranks balanced.

    Returns ``[rank][k] -> sample indices``; each rank's micro-batches are ordered largest first (the peak
    allocation happens at once instead of growing through the window). Deterministic: every rank computes the same.
    """
    num_groups = num_processes * num_micro_batches_per_rank
    if num_groups > len(samples):
        raise GradAccDataError(
            f"Cannot make {num_groups} non-empty micro-batches ({num_micro_batches_per_rank} per rank on "
            f"{num_processes} ranks) out of a window of {len(samples)} samples."
        )
    order = sorted(range(len(samples)), key=lambda k: -lengths[samples[k]])  # stable: ties keep window order
    ranked = [samples[k] for k in order]
    sorted_lengths = [max(1, lengths[i]) for i in ranked]
    smallest = _min_cap(sorted_lengths, num_groups)
    # An explicit budget is never below `smallest` (the window got enough micro-batches for it); the default cap
    # (the window's largest stock micro-batch) can be, in a short last window: then the smallest cap wins.
    cap = max(smallest, min(max_tokens, math.ceil(CAP_SLACK * smallest)))
    cuts = _min_padding_cuts(sorted_lengths, num_groups, cap)
    groups = [ranked[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    # Longest-processing-time-first, with every rank taking exactly num_micro_batches_per_rank groups.
    costs = [_padded(lengths, g) for g in groups]
    load = [0] * num_processes
    per_rank: list[list[list[int]]] = [[] for _ in range(num_processes)]
    for k in sorted(range(num_groups), key=lambda k: (-costs[k], k)):
        rank = min(
            (r for r in range(num_processes) if len(per_rank[r]) < num_micro_batches_per_rank),
            key=lambda r: (load[r], r),
        )
        per_rank[rank].append(groups[k])
        load[rank] += costs[k]
    return per_rank


# ---------------------------------------------------------------------------------------------- the sampler
@dataclass(frozen=True, slots=True, kw_only=True)
class _Window:
    samples: tuple[int, ...]
    num_micro_batches_per_rank: int
    max_tokens: int


class WindowRegroupBatchSampler(Sampler[list[int]]):
    """A batch sampler that keeps each optimizer step's samples and regroups them into padding-minimal
    micro-batches, balanced over ranks (see the module docstring).

    It yields the micro-batches of ALL ranks (``num_processes`` of them per round, rank ``r`` at position ``r``),
    as accelerate's ``BatchSamplerShard`` expects; ``len()`` is the total number of micro-batches of the epoch.
    Every rank gets :attr:`num_micro_batches_per_window` ``[w]`` micro-batches in window ``w``; with
    ``max_tokens_per_micro_batch`` a window may need more than ``gradient_accumulation_steps`` of them.

    Args:
        sampler: the index sampler of the stock Trainer (its order decides the windows).
        lengths: the length of every dataset sample, by index.
        batch_size: the stock per-device micro-batch size.
        gradient_accumulation_steps: stock micro-batches per rank per optimizer step.
        num_processes: data-parallel ranks that the batches are dealt to.
        drop_last: as in the stock dataloader.
        even_batches: as in accelerate.
        max_tokens_per_micro_batch: cap on rows x longest row per micro-batch; ``None``: the window's largest stock
            micro-batch (no micro-batch grows, the count per window stays the stock one).

    Example:
        ```python
        from torch.utils.data import DataLoader, SequentialSampler
        from hf_gradacc.data import WindowRegroupBatchSampler

        batch_sampler = WindowRegroupBatchSampler(
            SequentialSampler(dataset), lengths, batch_size=8, gradient_accumulation_steps=8
        )
        loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collator)
        ```
    """

    # BatchSamplerShard reads `batch_size`; None tells it that batch sizes vary (a whole batch per rank per round).
    batch_size = None

    def __init__(
        self,
        sampler: Sampler[int] | Sequence[int],
        lengths: Sequence[int],
        *,
        batch_size: int,
        gradient_accumulation_steps: int,
        num_processes: int = 1,
        drop_last: bool = False,
        even_batches: bool = True,
        max_tokens_per_micro_batch: int | None = None,
    ) -> None:
        if isinstance(sampler, BatchSampler):
            raise GradAccConfigError(
                f"WindowRegroupBatchSampler regroups the indices of an index sampler; got the batch sampler "
                f"{type(sampler).__name__}. Keep `train_sampling_strategy` at 'random' (or 'sequential' / "
                "'group_by_length') when `regroup_micro_batches=True`."
            )
        for name, value in (
            ("per_device_train_batch_size", batch_size),
            ("gradient_accumulation_steps", gradient_accumulation_steps),
            ("num_processes", num_processes),
        ):
            if not isinstance(value, int) or value < 1:
                raise GradAccConfigError(f"`{name}` ({value!r}) must be an int >= 1")
        self.sampler = sampler  # accelerate swaps in its seedable copy here (DataLoaderShard.set_sampler)
        self.lengths = [int(x) for x in lengths]
        self.micro_batch_size = batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.num_processes = num_processes
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        if max_tokens_per_micro_batch is not None and self.lengths:
            longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
            if self.lengths[longest] > max_tokens_per_micro_batch:
                raise GradAccConfigError(
                    f"`max_tokens_per_micro_batch` ({max_tokens_per_micro_batch}) is smaller than training sample "
                    f"{longest}, which has {self.lengths[longest]} tokens: a micro-batch holds at least one row. "
                    f"Raise `max_tokens_per_micro_batch` to at least {self.lengths[longest]} or truncate the data."
                )
        self.epoch = 0
        # The epoch's plan: ((epoch, id(base sampler)), windows, whether an iteration has used it already).
        self._plan_state: tuple[tuple[int, int], list[_Window], bool] | None = None
        self._stock_counts_cache: tuple[tuple, list[int]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Forwarded by the Trainer / accelerate at each epoch; the base sampler's order is read once per epoch."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._plan_state = None
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    @property
    def num_windows(self) -> int:
        """Optimizer steps per epoch: the stock count, whatever the regrouping."""
        return len(self._stock_counts())

    def _stock_counts(self) -> list[int]:
        """Stock micro-batches per rank in each window (independent of the order: computed on ``range(N)``)."""
        key = (
            len(self.sampler),  # type: ignore[arg-type]
            self.micro_batch_size,
            self.gradient_accumulation_steps,
            self.num_processes,
            self.drop_last,
            self.even_batches,
        )
        if self._stock_counts_cache is None or self._stock_counts_cache[0] != key:
            windows = stock_windows(
                range(key[0]),
                batch_size=self.micro_batch_size,
                gradient_accumulation_steps=self.gradient_accumulation_steps,
                num_processes=self.num_processes,
                drop_last=self.drop_last,
                even_batches=self.even_batches,
            )
            self._stock_counts_cache = (key, [len(w[0]) for w in windows])
        return list(self._stock_counts_cache[1])

    def _plan(self, *, for_iteration: bool = False) -> list[_Window]:
        """This epoch's windows. Queries (len, schedule) reuse the current plan; an iteration uses a plan no
        iteration has used yet, else reads the base sampler again (as a second pass of the stock loader would)."""
        key = (self.epoch, id(self.sampler))
        state = self._plan_state
        if state is not None and state[0] == key and not (for_iteration and state[2]):
            self._plan_state = (key, state[1], state[2] or for_iteration)
            return state[1]
        order = list(iter(self.sampler))  # the ONE pass over the base sampler this epoch, as the stock loader does
        bad = [i for i in order if not 0 <= i < len(self.lengths)]
        if bad:
            raise GradAccDataError(
                f"The sampler yielded index {bad[0]}, but lengths are known for {len(self.lengths)} samples only."
            )
        windows = []
        for stock in stock_windows(
            order,
            batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_processes=self.num_processes,
            drop_last=self.drop_last,
            even_batches=self.even_batches,
        ):
            samples = tuple(i for rank_batches in stock for batch in rank_batches for i in batch)
            num_per_rank = len(stock[0])
            if self.max_tokens_per_micro_batch is None:
                cap = max(_padded(self.lengths, batch) for rank_batches in stock for batch in rank_batches)
            else:
                cap = self.max_tokens_per_micro_batch
                ranked = sorted((max(1, self.lengths[i]) for i in samples), reverse=True)
                needed = math.ceil(_count_groups(ranked, cap) / self.num_processes)
                num_per_rank = max(num_per_rank, needed)
            windows.append(_Window(samples=samples, num_micro_batches_per_rank=num_per_rank, max_tokens=cap))
        self._plan_state = (key, windows, for_iteration)
        return windows

    @property
    def num_micro_batches_per_window(self) -> tuple[int, ...]:
        """Micro-batches each rank gets in each window of the current epoch (the trainer's loop reads it).

        Without a token budget this is the stock schedule (``gradient_accumulation_steps``, the short last window
        aside). With one it depends on the epoch's order: it is planned from the base sampler's order for this
        epoch, and the plan is kept for the iteration that follows.
        """
        if self.max_tokens_per_micro_batch is None:
            return tuple(self._stock_counts())
        return tuple(w.num_micro_batches_per_rank for w in self._plan())

    def __len__(self) -> int:
        return sum(self.num_micro_batches_per_window) * self.num_processes

    def __iter__(self) -> Iterator[list[int]]:
        windows = self._plan(for_iteration=True)
        for window in windows:
            per_rank = regroup_window(
                window.samples,
                self.lengths,
                num_processes=self.num_processes,
                num_micro_batches_per_rank=window.num_micro_batches_per_rank,
                max_tokens=window.max_tokens,
            )
            for k in range(window.num_micro_batches_per_rank):
                for rank in range(self.num_processes):
                    yield list(per_rank[rank][k])
