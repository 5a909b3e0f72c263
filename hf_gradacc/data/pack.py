"""Packed micro-batches (map-style datasets, decoder-only causal LMs): the pure planning and the collation.

Once a step's loss is normalised by the count over ALL its micro-batches and ranks (what
:class:`~hf_gradacc.GradAccTrainer` does), the step no longer depends on how its samples are grouped, nor on
whether a micro-batch is a padded ``[rows, longest]`` batch or ONE row of concatenated samples, provided that the
model keeps the samples of a row apart. This module uses that freedom:

1. :class:`WindowPackBatchSampler` keeps each optimizer step's stock samples (it reuses the windows of
   :class:`~hf_gradacc.data.regroup.WindowRegroupBatchSampler`, so the steps, the even-batches duplicates and the
   short last step are the stock ones) and :func:`pack_window` packs each step's samples into the fewest rows of at
   most ``max_tokens`` tokens that every rank can hold in the same number of micro-batches, with the tokens balanced
   over micro-batches and ranks. No sample is split.
   With a dense attention kernel (eager, sdpa) :func:`cheapest_plan` picks, by an
   :class:`~hf_gradacc.data.attention_cost.AttentionCostModel`, between those rows, smaller ones and the padded
   regrouping of the step, so that packing never costs more than the padded layout it replaces.
2. :class:`PackedCollator` turns one micro-batch into ONE padding-free row (or, with a cost model, pads the
   micro-batches that cost less padded): ``input_ids`` and ``labels`` of shape ``[1, T]``, the first label of every
   sample masked (so no sample predicts the next one's first token), ``position_ids`` restarting at 0 per sample, and
   the sequence boundaries of the flash kernels (the keys ``transformers.DataCollatorWithFlattening`` emits). No
   ``attention_mask``: transformers then finds the sequences in the restarting ``position_ids`` and builds a
   block-diagonal causal mask (eager, sdpa, flex attention) or calls the variable-length flash kernels.
3. :func:`~hf_gradacc.data.pack_check.check_packing_support` refuses a model that would let the samples of a row
   attend to each other: there is no error from transformers in that case, only a wrong loss.

What counts is unchanged: a packed row's targets after the causal shift are exactly the padded batch's (each
sample's own tokens 1..n-1), and its input positions are the real tokens.

Example:
    ```python
    from torch.utils.data import DataLoader, SequentialSampler
    from hf_gradacc.data.pack import PackedCollator, WindowPackBatchSampler
    from hf_gradacc.data.pack_check import check_packing_support

    check_packing_support(model)                   # after Trainer.__init__ (it sets `model.config.use_cache`)
    batch_sampler = WindowPackBatchSampler(
        SequentialSampler(dataset), lengths, batch_size=8, gradient_accumulation_steps=8,
        max_tokens_per_micro_batch=4096,           # optional: see WindowPackBatchSampler for the default
    )
    loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=PackedCollator())
    ```
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import GradAccConfigError, GradAccDataError
from ..loss import IGNORE_INDEX
from .attention_cost import AttentionCostModel
from .regroup import WindowRegroupBatchSampler


# ---------------------------------------------------------------------------------------------- one window
def _fill_bins(sizes: Sequence[int], num_bins: int, cap: int) -> list[list[int]] | None:
    """Positions of ``sizes`` in exactly ``num_bins`` non-empty bins of at most ``cap`` each, the loads balanced; None
    when the heuristics find no such packing.

    Worst fit decreasing first (longest sample into the least-loaded bin: balanced loads, and if a sample does not
    fit there it fits nowhere); when that overflows, first fit decreasing (fewest bins), then empty bins take single
    samples from the most crowded ones, and samples move from the fullest bin to the emptiest while that narrows the
    spread. Ties keep the window order, so every rank computes the same packing.
    """
    if num_bins > len(sizes):
        return None
    order = sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for k in order:
        load, b = heapq.heappop(heap)
        if load + sizes[k] > cap:
            break
        bins[b].append(k)
        heapq.heappush(heap, (load + sizes[k], b))
    else:
        return bins

    bins, loads = [], []
    for k in order:
        b = next((b for b, load in enumerate(loads) if load + sizes[k] <= cap), None)
        if b is None:
            if len(bins) == num_bins:
                return None
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(k)
        loads[b] += sizes[k]
    while len(bins) < num_bins:  # num_bins <= len(sizes): some bin holds two samples or more
        donor = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: (len(bins[b]), loads[b], -b))
        k = bins[donor].pop()  # its shortest sample (filled longest first)
        loads[donor] -= sizes[k]
        bins.append([k])
        loads.append(sizes[k])
    for _ in range(len(sizes)):
        full = max(range(num_bins), key=lambda b: (loads[b], -b))
        empty = min(range(num_bins), key=lambda b: (loads[b], b))
        movable = [k for k in bins[full] if loads[empty] + sizes[k] < loads[full]] if len(bins[full]) > 1 else []
        if not movable:
            break
        k = min(movable, key=lambda k: (sizes[k], k))  # each move lowers the sum of squared loads: it terminates
        bins[full].remove(k)
        bins[empty].append(k)
        loads[full] -= sizes[k]
        loads[empty] += sizes[k]
    return bins


def pack_window(
    samples: Sequence[int],
    lengths: Sequence[int],
    *,
    num_processes: int,
    max_tokens: int,
    num_micro_batches_per_rank: int | None = None,
) -> list[list[list[int]]]:
    """Pack one window's ``samples`` into micro-batches of ONE row each, as ``[rank][k] -> sample indices``.

    Every sample goes whole into exactly one row (duplicates in ``samples`` stay duplicates), no row holds more than
    ``max_tokens`` tokens, and every rank gets the same number of micro-batches: by default the fewest the packing
    heuristics achieve (almost always the lower bound ``ceil(tokens / max_tokens / num_processes)``), or exactly
    ``num_micro_batches_per_rank``. Rows are balanced in tokens, ranks too; each rank's rows come largest first.
    Deterministic: every rank computes the same plan from the same arguments.

    Example:
        ```python
        lengths = [300, 10, 80, 0, 200, 0, 0, 120]          # by dataset index
        pack_window([4, 0, 7, 2], lengths, num_processes=2, max_tokens=512)
        # [[[0, 2]], [[4, 7]]]: rank 0 gets one row of samples 0 and 2 (380 tokens), rank 1 one of 4 and 7 (320)
        ```
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise GradAccConfigError(f"`num_processes` ({num_processes!r}) must be an int >= 1")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GradAccConfigError(f"`max_tokens_per_micro_batch` ({max_tokens!r}) must be an int >= 1")
    if not samples:
        raise GradAccDataError("Cannot pack an empty window: an optimizer step needs at least one sample.")
    sizes = [max(1, int(lengths[i])) for i in samples]
    longest = max(range(len(samples)), key=lambda k: (sizes[k], -k))
    if sizes[longest] > max_tokens:
        raise GradAccConfigError(
            f"Training sample {samples[longest]} has {sizes[longest]} tokens, more than the "
            f"`max_tokens_per_micro_batch` ({max_tokens}) of a packed row, and packing never splits a sample. Raise "
            f"`max_tokens_per_micro_batch` to at least {sizes[longest]} or truncate the data."
        )
    if num_micro_batches_per_rank is not None:
        candidates: Sequence[int] = [num_micro_batches_per_rank]
    else:
        # No row holds two samples longer than half the budget; the rest is the volume bound.
        num_halves = sum(2 * s > max_tokens for s in sizes)
        fewest_rows = max(math.ceil(sum(sizes) / max_tokens), num_halves)
        candidates = range(max(1, math.ceil(fewest_rows / num_processes)), len(sizes) // num_processes + 1)
    for per_rank_count in candidates:
        bins = _fill_bins(sizes, num_processes * per_rank_count, max_tokens)
        if bins is not None:
            break
    else:
        wanted = f"{num_micro_batches_per_rank} micro-batches per rank" if num_micro_batches_per_rank else "rows"
        raise GradAccDataError(
            f"Cannot pack a window of {len(samples)} samples ({sum(sizes)} tokens) into {wanted} of at most "
            f"{max_tokens} tokens, the same number on each of {num_processes} ranks, every row holding a sample."
        )
    loads = [sum(sizes[k] for k in b) for b in bins]
    # Rows to ranks, largest first, each to the least-loaded rank that still has room.
    rank_loads = [0] * num_processes
    per_rank: list[list[list[int]]] = [[] for _ in range(num_processes)]
    for b in sorted(range(len(bins)), key=lambda b: (-loads[b], b)):
        rank = min(
            (r for r in range(num_processes) if len(per_rank[r]) < per_rank_count),
            key=lambda r: (rank_loads[r], r),
        )
        per_rank[rank].append([samples[k] for k in sorted(bins[b])])
        rank_loads[rank] += loads[b]
    return per_rank


# Row budgets `cheapest_plan` tries below a window's budget: the budget divided by these (never below the longest
# sample). Long rows pay the attention of a dense kernel, short ones the fixed cost of more micro-batches.
_ROW_BUDGET_DIVISORS = (1.25, 1.6, 2.0, 2.5, 3.2, 4.0, 5.0, 6.4, 8.0)


def plan_cost(plan: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int], model: AttentionCostModel) -> float:
    """The modelled time of a window's plan (``[rank][k] -> sample indices``): its costliest rank's sum of
    :meth:`AttentionCostModel.cost` over micro-batches (ranks wait for each other at the step's end)."""
    return max(sum(model.cost([max(1, int(lengths[i])) for i in batch]) for batch in rank) for rank in plan)


def cheapest_plan(
    samples: Sequence[int],
    lengths: Sequence[int],
    model: AttentionCostModel,
    *,
    num_processes: int,
    max_tokens: int,
    num_padded_micro_batches_per_rank: int,
    fewest_rows: list[list[list[int]]] | None = None,
) -> list[list[list[int]]]:
    """The plan of one window (``[rank][k] -> sample indices``) that ``model`` finds cheapest among: the fewest
    packed rows of at most ``max_tokens`` (:func:`pack_window`), the same samples packed under smaller row budgets,
    and the padded regrouping of the window into ``num_padded_micro_batches_per_rank`` micro-batches per rank
    (:func:`~hf_gradacc.data.regroup.regroup_window`, what ``regroup_micro_batches`` would run). Every micro-batch
    is then laid out by :meth:`AttentionCostModel.packs`; a plan whose padded micro-batch would hold more than
    ``max_tokens`` positions is left out (memory). The padded regrouping is always a candidate, so the plan never
    costs more, by the model, than the padded layout it replaces. Ties keep the fewest rows. Deterministic.

    Example:
        ```python
        from hf_gradacc.data.pack import AttentionCostModel, cheapest_plan

        cost = AttentionCostModel(per_score=2e-3, per_micro_batch=500.0)
        cheapest_plan(range(16), [100] * 16, cost, num_processes=1, max_tokens=800,
                      num_padded_micro_batches_per_rank=2)
        # [[[0, 2, ..., 14], [1, 3, ..., 15]]]: two micro-batches of 8, which PackedCollator pads ([8, 100] each)
        ```
    """
    from .regroup import _count_groups, regroup_window

    samples = list(samples)
    if fewest_rows is None:
        fewest_rows = pack_window(samples, lengths, num_processes=num_processes, max_tokens=max_tokens)
    sizes = sorted((max(1, int(lengths[i])) for i in samples), reverse=True)

    def fits(plan: list[list[list[int]]]) -> bool:
        for rank in plan:
            for batch in rank:
                batch_sizes = [max(1, int(lengths[i])) for i in batch]
                if not model.packs(batch_sizes) and len(batch_sizes) * max(batch_sizes) > max_tokens:
                    return False
        return True

    candidates = [fewest_rows]
    for budget in sorted(
        {max(sizes[0], int(max_tokens / d)) for d in _ROW_BUDGET_DIVISORS} - {max_tokens}, reverse=True
    ):
        candidates.append(pack_window(samples, lengths, num_processes=num_processes, max_tokens=budget))
    regrouped = []
    if model.padded_layout:
        # Sorted, contiguous groups: the padded layout's best grouping. The window's own count first (what
        # `regroup_micro_batches` runs; its cap is the window's), then counts near the fewest the budget allows.
        fewest = max(1, math.ceil(_count_groups(sizes, max_tokens) / num_processes))
        counts = {fewest, fewest + 1, fewest + 2, math.ceil(1.5 * fewest), 2 * fewest} - {
            num_padded_micro_batches_per_rank
        }
        for count in [num_padded_micro_batches_per_rank, *sorted(counts)]:
            if count * num_processes <= len(samples):
                regrouped.append(
                    regroup_window(
                        samples,
                        lengths,
                        num_processes=num_processes,
                        num_micro_batches_per_rank=count,
                        max_tokens=max_tokens,
                    )
                )
    best, best_cost = None, math.inf
    for plan in [*candidates, *regrouped]:
        if not fits(plan):
            continue
        cost = plan_cost(plan, lengths, model)
        if cost < best_cost:
            best, best_cost = plan, cost
    # Nothing within the budget in the collator's layout (a short last window, whose regrouping may need a cap above
    # the budget): what `regroup_micro_batches` runs there, else the fewest rows.
    return best if best is not None else (regrouped[0] if regrouped else fewest_rows)


# ---------------------------------------------------------------------------------------------- the sampler
class WindowPackBatchSampler(WindowRegroupBatchSampler):
    """A batch sampler that keeps each optimizer step's stock samples and packs them into padding-free rows (one row
    per micro-batch, collated by :class:`PackedCollator`), the same number on every rank.

    The windows are :class:`~hf_gradacc.data.regroup.WindowRegroupBatchSampler`'s (the stock steps, read from the
    base sampler's order once per epoch, so the plan depends only on the epoch and that order: a resumed run
    replays it); only the grouping differs. It yields the micro-batches of ALL ranks, ``num_processes`` per round,
    rank ``r`` at position ``r``, as accelerate's ``BatchSamplerShard`` deals them out;
    :attr:`num_micro_batches_per_window` tells the training loop how many each rank gets in each step (usually
    fewer than ``gradient_accumulation_steps``: a row holds the tokens of several stock micro-batches).

    ``sampler``, ``lengths``, ``batch_size``, ``gradient_accumulation_steps``, ``num_processes``, ``drop_last`` and
    ``even_batches`` are as for :class:`~hf_gradacc.data.regroup.WindowRegroupBatchSampler` (``batch_size`` and
    ``gradient_accumulation_steps`` define the stock steps, not the packed rows).

    Args:
        max_tokens_per_micro_batch: the most tokens in a packed row. ``None``: per step, the padded size (rows x
            longest row) of the largest micro-batch the stock run computes in that step. A packed row then holds no
            more token positions than a micro-batch the stock run already fits in memory (same linear-layer
            activations and ``[tokens, vocab]`` logits), the budget is never below a sample of the step, and the
            stock grouping itself fits it, so the fewest rows are at most the stock count (measured: 2 to 3 rows
            per rank for 8 stock micro-batches on long-tailed lengths). The attention of eager and sdpa computes a
            masked ``T x T`` score matrix per row, which grows with the row's square (the flash kernels and flex
            attention skip the masked blocks): with those, give a ``cost_model``. For predictable memory and
            compiled shapes, set a fixed budget.
        cost_model: an :class:`~hf_gradacc.data.attention_cost.AttentionCostModel` (the trainer passes
            :meth:`~hf_gradacc.data.attention_cost.AttentionCostModel.for_model`). When its attention is ``dense``,
            each step gets the cheapest plan of :func:`cheapest_plan` (fewest rows, smaller rows, or the padded
            regrouping), and the collator must be ``PackedCollator(cost_model=...)`` with the same model, which pads
            the micro-batches that cost less padded. ``None``: the fewest rows.

    Example:
        ```python
        from torch.utils.data import DataLoader, SequentialSampler
        from hf_gradacc.data.pack import PackedCollator, WindowPackBatchSampler

        batch_sampler = WindowPackBatchSampler(
            SequentialSampler(dataset), lengths, batch_size=8, gradient_accumulation_steps=8
        )
        loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=PackedCollator())
        schedule = batch_sampler.num_micro_batches_per_window      # rows per rank in each optimizer step
        ```
    """

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
        cost_model: AttentionCostModel | None = None,
    ) -> None:
        if cost_model is not None and not isinstance(cost_model, AttentionCostModel):
            raise GradAccConfigError(f"`cost_model` ({cost_model!r}) must be None or an AttentionCostModel")
        self.cost_model = cost_model
        budget = max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise GradAccConfigError(f"`max_tokens_per_micro_batch` ({budget!r}) must be None or an int >= 1")
        if budget is not None and len(lengths):
            longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
            if lengths[longest] > budget:
                raise GradAccConfigError(
                    f"Training sample {longest} has {lengths[longest]} tokens, more than `max_tokens_per_micro_batch` "
                    f"({budget}): packing never splits a sample. Raise `max_tokens_per_micro_batch` to at least "
                    f"{lengths[longest]} or truncate the data."
                )
        super().__init__(
            sampler,
            lengths,
            batch_size=batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_processes=num_processes,
            drop_last=drop_last,
            even_batches=even_batches,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        )
        # The packed epoch, kept with the regrouping plan it was packed from (the parent's plan list, replaced
        # whenever the parent reads the base sampler again) and the ranks it was packed for.
        self._packed: tuple[list, int, list[list[list[list[int]]]]] | None = None

    def _packed_plan(self, *, for_iteration: bool = False) -> list[list[list[list[int]]]]:
        """``[window][rank][k] -> sample indices`` of the current epoch."""
        windows = self._plan(for_iteration=for_iteration)  # each: the stock samples and the budget of the step
        if self._packed is None or self._packed[0] is not windows or self._packed[1] != self.num_processes:
            packed = [self._plan_window(window) for window in windows]
            self._packed = (windows, self.num_processes, packed)
        return self._packed[2]

    def _plan_window(self, window: Any) -> list[list[list[int]]]:
        """One window's micro-batches: the fewest rows under its budget, or, with a dense :attr:`cost_model`, the
        cheapest of those, the same samples in rows of smaller budgets, and the padded regrouping of the window."""
        packed = pack_window(
            window.samples, self.lengths, num_processes=self.num_processes, max_tokens=window.max_tokens
        )
        model = self.cost_model
        if model is None or not model.dense:
            return packed  # one row is never costlier than padding without dense attention: the fewest rows win
        return cheapest_plan(
            window.samples,
            self.lengths,
            model,
            num_processes=self.num_processes,
            max_tokens=window.max_tokens,
            num_padded_micro_batches_per_rank=window.num_micro_batches_per_rank,
            fewest_rows=packed,
        )

    @property
    def num_micro_batches_per_window(self) -> tuple[int, ...]:
        """Micro-batches (packed rows) each rank gets in each window of the current epoch; the training loop reads
        it. It depends on the epoch's order: it is planned from the base sampler's order for this epoch, and the
        plan is kept for the iteration that follows."""
        return tuple(len(per_rank[0]) for per_rank in self._packed_plan())

    def __iter__(self) -> Iterator[list[int]]:
        for per_rank in self._packed_plan(for_iteration=True):
            for k in range(len(per_rank[0])):
                for rank in range(self.num_processes):
                    yield list(per_rank[rank][k])


# ---------------------------------------------------------------------------------------------- the collator
def _as_list(value: Any, *, key: str, index: int) -> list[int]:
    if torch.is_tensor(value):
        if value.dim() != 1:
            raise GradAccDataError(
                f"Sample {index} of the micro-batch has `{key}` of shape {tuple(value.shape)}; PackedCollator packs "
                "unpadded samples, one 1-D sequence each."
            )
        return [int(x) for x in value.tolist()]
    return [int(x) for x in value]


@dataclass
class PackedCollator:
    """Collates the samples of a micro-batch into ONE padding-free row for a decoder-only causal LM.

    Returns ``input_ids``, ``labels`` and ``position_ids`` of shape ``[1, T]`` (int64; ``T`` the sum of the
    samples' lengths): ``labels`` are the samples' own (``input_ids`` when a sample has none) with the first label of
    each sample set to ``ignore_index``, and ``position_ids`` restart at 0 for each sample. With
    ``return_flash_attn_kwargs`` also ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 sequence offsets, ``[0, n0, n0 +
    n1, ..., T]``) and ``max_length_q`` / ``max_length_k`` (ints), which the flash kernels take as is (without them
    they rebuild the offsets from ``position_ids`` in every layer); with ``return_seq_idx`` also ``seq_idx`` (int32
    ``[1, T]``, the sample each token belongs to, read by Mamba-style layers). These are the keys and dtypes of
    ``transformers.DataCollatorWithFlattening``. There is no ``attention_mask``: its absence is what makes
    transformers read the sequences from ``position_ids`` (and the counting count every position as an input token).

    Why the first label: a causal LM predicts ``labels[i]`` from position ``i - 1``; the position before a sample's
    first token is the previous sample's last token, so masking each sample's first label cuts every boundary. The
    targets left are each sample's tokens 1..n-1, exactly those of the padded batch. Samples may hold ``input_ids``,
    ``labels`` (same length; lists or 1-D tensors), an all-ones ``attention_mask`` and ``loss_weights`` (one number, or
    one per token: packed per token, see :mod:`hf_gradacc.weights`); anything else is an error.
    The lengths of the samples are ``cu_seq_lens_q.diff()`` (:func:`packed_sequence_lengths`).

    With ``cost_model`` (an :class:`~hf_gradacc.data.attention_cost.AttentionCostModel`, the one given to
    :class:`WindowPackBatchSampler`), a micro-batch that costs less padded than as one dense row
    (:meth:`AttentionCostModel.packs` is False) is returned padded instead: ``input_ids`` ``[n, longest]`` right-padded
    with ``pad_token_id``, ``labels`` padded with ``ignore_index`` (each sample's first label masked as above, which
    the causal shift drops anyway) and an ``attention_mask``. Its targets are the same; only the layout differs.

    Example:
        ```python
        from hf_gradacc.data.pack import PackedCollator

        batch = PackedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        # input_ids [[5, 6, 7, 8, 9]], labels [[-100, 6, 7, -100, 9]], position_ids [[0, 1, 2, 0, 1]],
        # cu_seq_lens_q / cu_seq_lens_k [0, 3, 5], max_length_q / max_length_k 3
        ```
    """

    ignore_index: int = IGNORE_INDEX
    return_flash_attn_kwargs: bool = True
    return_seq_idx: bool = False
    cost_model: AttentionCostModel | None = None
    pad_token_id: int = 0

    ACCEPTED_KEYS = ("input_ids", "labels", "attention_mask", "loss_weights")
    # Columns a dataset carries for the sampler, not for the model: dropped.
    IGNORED_KEYS = ("length",)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise GradAccDataError("PackedCollator got an empty micro-batch: a packed row needs at least one sample.")
        input_ids: list[int] = []
        labels: list[int] = []
        position_ids: list[int] = []
        seq_idx: list[int] = []
        offsets = [0]
        rows: list[tuple[list[int], list[int]]] = []
        weights: list[
            list[float]
        ] = []  # `loss_weights` per token (a sample's one weight repeated), hf_gradacc.weights
        for index, sample in enumerate(samples):
            extra = sorted(set(sample) - set(self.ACCEPTED_KEYS) - set(self.IGNORED_KEYS))
            if extra:
                raise GradAccDataError(
                    f"Sample {index} of the micro-batch has keys {extra} that PackedCollator cannot pack (it "
                    f"concatenates {self.ACCEPTED_KEYS[:2]} only). Remove them from the dataset, or do not pack."
                )
            ids = _as_list(sample["input_ids"], key="input_ids", index=index)
            if not ids:
                raise GradAccDataError(f"Sample {index} of the micro-batch has no `input_ids`: nothing to pack.")
            own = _as_list(sample["labels"], key="labels", index=index) if "labels" in sample else ids
            if len(own) != len(ids):
                raise GradAccDataError(
                    f"Sample {index} of the micro-batch has {len(own)} labels for {len(ids)} input ids; a causal LM "
                    "needs one label per token."
                )
            mask = sample.get("attention_mask")
            if mask is not None and any(int(m) != 1 for m in _as_list(mask, key="attention_mask", index=index)):
                raise GradAccDataError(
                    f"Sample {index} of the micro-batch is padded (its `attention_mask` has zeros); PackedCollator "
                    "packs unpadded samples."
                )
            if ("loss_weights" in sample) != ("loss_weights" in samples[0]):
                raise GradAccDataError(
                    f"Sample {index} of the micro-batch differs from sample 0 in having `loss_weights`."
                )
            if "loss_weights" in sample:
                weights.append(_weights_per_token(sample["loss_weights"], len(ids), index))
            rows.append((ids, [self.ignore_index, *own[1:]]))
            input_ids += ids
            labels += [self.ignore_index, *own[1:]]
            position_ids += range(len(ids))
            seq_idx += [index] * len(ids)
            offsets.append(offsets[-1] + len(ids))
        if self.cost_model is not None and not self.cost_model.packs([len(ids) for ids, _ in rows]):
            batch = self._padded(rows)
            if weights:
                batch["loss_weights"] = torch.zeros(batch["labels"].shape, dtype=torch.float32)
                for row, w in enumerate(weights):
                    batch["loss_weights"][row, : len(w)] = torch.tensor(w, dtype=torch.float32)
            return batch
        batch: dict[str, Any] = {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([position_ids], dtype=torch.long),
        }
        if self.return_flash_attn_kwargs:
            cu_seq_lens = torch.tensor(offsets, dtype=torch.int32)
            longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
            batch.update(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens.clone())
            batch.update(max_length_q=longest, max_length_k=longest)
        if self.return_seq_idx:
            batch["seq_idx"] = torch.tensor([seq_idx], dtype=torch.int32)
        if weights:
            batch["loss_weights"] = torch.tensor([[x for w in weights for x in w]], dtype=torch.float32)
        return batch

    def _padded(self, rows: Sequence[tuple[list[int], list[int]]]) -> dict[str, Any]:
        """The samples right-padded to ``[n, longest]`` with an ``attention_mask``: the layout of a padded batch,
        for a micro-batch that :attr:`cost_model` finds cheaper padded than packed."""
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), self.ignore_index, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (ids, own) in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            labels[row, : len(own)] = torch.tensor(own, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _weights_per_token(value: Any, length: int, index: int) -> list[float]:
    """A sample's ``loss_weights``, one per token: a number (per sample) is repeated over its ``length`` tokens."""
    values = value.tolist() if torch.is_tensor(value) else value
    if isinstance(values, (int, float)):
        return [float(values)] * length
    if len(values) != length:
        raise GradAccDataError(
            f"Sample {index} of the micro-batch has {len(values)} `loss_weights` for {length} input ids: give one "
            "weight per token, or one number per sample."
        )
    return [float(x) for x in values]


def packed_sequence_lengths(batch: Mapping[str, Any]) -> list[int]:
    """The lengths of the samples of a packed row (a :class:`PackedCollator` batch), in order: from
    ``cu_seq_lens_q`` when the batch has it, else from where ``position_ids`` restart at 0. ``len()`` of it is the
    micro-batch's number of samples, which a ``[1, T]`` row no longer shows in its shape.

    Example:
        ```python
        batch = PackedCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        packed_sequence_lengths(batch)        # [3, 2]
        ```
    """
    offsets = batch.get("cu_seq_lens_q")
    if torch.is_tensor(offsets):
        return [int(n) for n in offsets.diff().tolist()]
    positions = batch.get("position_ids")
    if not torch.is_tensor(positions) or positions.dim() != 2 or positions.shape[0] != 1:
        raise GradAccDataError(
            "packed_sequence_lengths needs a packed row: `cu_seq_lens_q`, or `position_ids` of shape [1, T]; got "
            f"keys {sorted(batch)}."
        )
    starts = (positions[0] == 0).nonzero().reshape(-1).tolist()
    if not starts or starts[0] != 0:
        raise GradAccDataError("The `position_ids` of a packed row must start at 0 for its first sample.")
    return [b - a for a, b in zip(starts, [*starts[1:], positions.shape[1]])]
