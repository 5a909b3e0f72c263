"""What a micro-batch counts, and what an optimizer step counts over every rank: the one place that decides.

Every count of the library is asked from here, all pure (tensors, ints and sizes in; counts out):

- **one micro-batch** (:func:`count_micro_batch`, :class:`MicroBatchCounts`): target tokens after the causal shift
  for causal LMs (``shift_labels`` as given when the batch has them), labels that are not ``ignore_index`` for the
  other token heads, labelled rows for sequence-level heads, the ``loss_weights`` of counted targets
  (:mod:`hf_gradacc.weights`), attended input positions (``input_tokens``), and the input tokens
  ``include_num_input_tokens_seen`` tracks; :class:`Counter` counts what this rank holds of a training micro-batch
  (its context-parallel shard under ``cp_size`` > 1);
- **one optimizer step** (:func:`gather_window_counts`, :class:`WindowCounts`): the step's counts summed over every
  micro-batch and rank in one collective;
- **no device read per micro-batch**: a training window counts its micro-batches ``deferred`` (the counts and the
  label checks that need tensor values stay 0-dim tensors where the batch is, on the accelerator when the dataloader
  put it there), and the step's count gather brings them all to the host in ONE transfer;
- **one denominator dispatch** (:data:`DENOMINATOR_FIELDS`): which count a ``LossTerm``'s ``normalize_by`` names.

Over which ranks the counts add up, and which ranks the backend averages over, is the mesh's answer
(:class:`hf_gradacc.backends.mesh.Mesh`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.utils import logging

from .errors import GradAccDataError
from .loss import IGNORE_INDEX, SAMPLE_LEVEL_HEADS, HeadType, counted_targets
from .weights import target_weight_sum

logger = logging.get_logger(__name__)

LABEL_KEY = "labels"
SHIFT_LABELS_KEY = "shift_labels"
PACKED_KEY = "cu_seq_lens_q"  # a packed row's sequence offsets ([0, n0, n0 + n1, ..., T]): its samples

# ---------------------------------------------------------------------------------------------- one micro-batch
# The denominators a loss term is normalised by, each with the count that holds it: the one dispatch.
DENOMINATOR_FIELDS: dict[str, str] = {
    "tokens": "num_tokens",
    "samples": "num_samples",
    "input_tokens": "num_input_tokens",
    "weights": "weight_sum",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchCounts:
    """Counted items of one micro-batch on this rank.

    Attributes:
        num_tokens: target tokens (labels that are not ignored, after the causal shift); samples for sequence heads.
        num_samples: rows with a label.
        num_input_tokens: input positions the model attends to (``attention_mask == 1``; every position without a
            mask): the ``"input_tokens"`` denominator, e.g. the tokens a mixture-of-experts router sees.
        num_seen_tokens: input tokens as `TrainingArguments.include_num_input_tokens_seen` counts them (0 when off).
        num_positions: token positions the model computes (``input_ids`` size: padding included).
        labelled: False when the micro-batch has no labels (only samples can be counted).
        weight_sum: the sum of the ``loss_weights`` of its counted targets (:mod:`hf_gradacc.weights`); None without
            that column.
        label_errors: label ids the head's check refused (outside the model's classes and not ``ignore_index``);
            always 0 when counted at once, which raises instead.
        unattended_rows: rows with counted labels and an all-zero ``attention_mask`` (warned about).

    Counted ``deferred`` (:meth:`Counter.count`), the values that depend on tensor values are 0-dim tensors on the
    batch's device until :func:`gather_window_counts` brings them to the host with the step's one transfer; every
    count a :class:`WindowCounts` holds is a number.

    Example:
        ```python
        counts = count_micro_batch({"labels": torch.tensor([[-100, 5, 6]])}, "causal_lm")
        counts.get("tokens")   # 2: positions 0 and 1 predict 5 and 6
        ```
    """

    num_tokens: int
    num_samples: int
    num_input_tokens: int = 0
    num_seen_tokens: int = 0
    num_positions: int = 0
    labelled: bool = True
    weight_sum: float | None = None  # the `loss_weights` of its counted targets, summed (None: no weights column)
    label_errors: int = 0
    unattended_rows: int = 0

    def get(self, denominator: str) -> int | float:
        """The count of ``denominator`` (:data:`DENOMINATOR_FIELDS`; any other name counts samples)."""
        value = getattr(self, DENOMINATOR_FIELDS.get(denominator, "num_samples"))
        return 0.0 if value is None else value


def count_micro_batch(
    batch: Mapping[str, Any],
    head_type: HeadType,
    *,
    ignore_index: int = IGNORE_INDEX,
    problem_type: str | None = None,
    allow_unlabelled: bool = False,
    deferred: bool = False,
) -> MicroBatchCounts:
    """Count the targets of one micro-batch the way its loss family averages them.

    - tokens: labels that are not ``ignore_index``; for causal LMs after the shift (``labels[..., 1:]``),
      or ``shift_labels`` as given when the collator provides them (a context-parallel shard must: its last
      position's target lives on the next shard, see :func:`context_parallel_shard`).
    - samples: rows; for single-label sequence and image classification, rows whose label is not ``ignore_index``.

    With ``allow_unlabelled`` (an overridden ``compute_loss``), a batch without labels counts its rows as samples.
    With ``deferred``, the counts that need the labels' values are 0-dim tensors where the labels are (no value is
    read; :func:`gather_window_counts` reads them once per step).

    Example:
        ```python
        batch = {"labels": torch.tensor([[-100, -100, 7, 8], [-100, 3, -100, -100]])}
        count_micro_batch(batch, "causal_lm").num_tokens      # 3
        count_micro_batch(batch, "masked_lm").num_tokens      # 3 (no shift: position 0 is masked anyway)
        ```
    """
    labels = batch.get(LABEL_KEY)
    if labels is None and SHIFT_LABELS_KEY not in batch and allow_unlabelled:
        # An overridden compute_loss that returns LossTerm(..., "samples") needs no labels: count rows.
        return MicroBatchCounts(num_tokens=0, num_samples=rows_of(batch), labelled=False)
    if labels is None and SHIFT_LABELS_KEY not in batch:
        raise GradAccDataError(
            f"The micro-batch has no `{LABEL_KEY}` (keys: {sorted(batch)}), so GradAccTrainer cannot count the "
            "denominator of the step. Have the data collator return `labels`, set `label_names` if your labels "
            "use another key, or override `compute_loss` and return an `hf_gradacc.LossTerm`."
        )
    shift_labels = batch.get(SHIFT_LABELS_KEY) if head_type == "causal_lm" else None
    given = shift_labels if shift_labels is not None else labels
    if not torch.is_tensor(given):
        raise GradAccDataError(f"`{LABEL_KEY}` must be a tensor, got {type(given).__name__}")
    sample_level = head_type in SAMPLE_LEVEL_HEADS
    if not sample_level and (given.is_floating_point() or given.dtype == torch.bool):
        raise GradAccDataError(
            f"`{LABEL_KEY}` of a {head_type} model must hold integer class ids, got dtype {given.dtype}. "
            "Cast them to torch.long in the data collator, or set `head_type` if the model is not a "
            f"{head_type} model."
        )
    targets, counted = counted_targets(
        labels, head_type, ignore_index=ignore_index, shift_labels=shift_labels, problem_type=problem_type
    )
    num_tokens = counted.sum() if deferred else int(counted.sum())
    weighted = target_weight_sum(
        batch, head_type, ignore_index=ignore_index, problem_type=problem_type, deferred=deferred
    )
    if sample_level:
        return MicroBatchCounts(num_tokens=num_tokens, num_samples=num_tokens, weight_sum=weighted)
    num_samples = rows_of(batch) if PACKED_KEY in batch else targets.shape[0] if targets.dim() > 1 else 1
    return MicroBatchCounts(num_tokens=num_tokens, num_samples=num_samples, weight_sum=weighted)


def rows_of(batch: Mapping[str, Any]) -> int:
    """Number of samples of a collated micro-batch: the first dim of its first tensor, or the sequences of a packed
    row (``cu_seq_lens_q``)."""
    if torch.is_tensor(batch.get(PACKED_KEY)):
        return int(batch[PACKED_KEY].numel()) - 1
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise GradAccDataError(f"Cannot tell the number of rows of a micro-batch with keys {sorted(batch)}: no tensor")


def input_token_count(batch: Mapping[str, Any], *, deferred: bool = False) -> int:
    """Input positions the model attends to: ``attention_mask == 1``, or every position of ``input_ids`` /
    ``inputs_embeds`` without a mask (padding-free batches); 0 when the batch has none of them. ``deferred``: the
    mask's sum stays a 0-dim tensor (no value read)."""
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2:
        return mask.sum() if deferred else int(mask.sum())
    inputs = batch.get("input_ids", batch.get("inputs_embeds"))
    if torch.is_tensor(inputs) and inputs.dim() >= 2:
        return int(inputs.shape[0] * inputs.shape[1])
    return 0


def position_count(batch: Mapping[str, Any]) -> int:
    """Token positions the model computes (``input_ids`` / ``inputs_embeds`` rows x length, padding included)."""
    inputs = batch.get("input_ids", batch.get("inputs_embeds"))
    return int(inputs.shape[0] * inputs.shape[1]) if torch.is_tensor(inputs) and inputs.dim() >= 2 else 0


def seen_token_count(
    main_input: Any,
    attention_mask: Any,
    mode: str,
    pad_token_id: int | None,
    *,
    padded: bool = True,
    deferred: bool = False,
) -> int:
    """Input tokens as `TrainingArguments.include_num_input_tokens_seen` counts them: ``"all"`` every position of the
    main input, ``"non_padding"`` the attention mask's ones (else the non-pad ids; else every position, with a
    warning unless the batch is ``padded=False``, packed). 0 without a main input. ``deferred``: a sum of values
    stays a 0-dim tensor (no value read)."""
    if not torch.is_tensor(main_input):
        return 0
    if mode == "non_padding":
        if torch.is_tensor(attention_mask):
            return attention_mask.sum() if deferred else int(attention_mask.sum())
        if pad_token_id is not None:
            kept = (main_input != pad_token_id).sum()
            return kept if deferred else int(kept)
        if padded and main_input.dim() >= 2 and main_input.shape[0] > 1:
            logger.warning_once(
                "`include_num_input_tokens_seen='non_padding'` found no `attention_mask` and no pad id (pass the "
                "tokenizer as `processing_class`): padding is counted too. Add an attention mask in the collator."
            )
    return int(main_input.numel())


# ---------------------------------------------------------------------------------------------- the step's counts
# One row per micro-batch of this rank, in the order of MicroBatchCounts (the weight sum as the 64 bits of its float64,
# 0 without weights), then the deferred checks' findings.
_MB_COUNTS = ("num_tokens", "num_samples", "num_input_tokens", "num_seen_tokens", "num_positions")
_MB_WEIGHT_BITS, _MB_LABEL_ERRORS, _MB_UNATTENDED = 5, 6, 7
_MB_WIDTH = 8
# Order of the values in the per-rank count vector that is gathered once per window.
_TOKENS, _SAMPLES, _INPUT_TOKENS, _SEEN_TOKENS, _POSITIONS, _MICRO_BATCHES, _FAILED = range(7)
_FIRST_TOKENS, _FIRST_SAMPLES, _FIRST_INPUT_TOKENS = range(7, 10)  # micro-batch 0 of the rank (0 without one)
# Micro-batches with `loss_weights`, and their weight sum: a float64 carried as its 64 bits in the int64 vector (a
# gather moves bits unchanged; the sum over ranks is taken in float64 after it, in rank order, alike on every rank).
_WEIGHTED, _WEIGHT_BITS = 10, 11
_LABEL_ERRORS = 12  # label ids the rank's deferred checks refused
_WIDTH = 13
# What a step's batches must carry for a denominator to be counted, and what to do otherwise.
_NEEDS: dict[str, tuple[str, str]] = {
    "weights": (
        "weighted",
        "the step's batches have no `loss_weights` column to sum; add it to the dataset (and the "
        "data collator), or use 'tokens' / 'samples'",
    ),
    "tokens": (
        "labelled",
        "the batch has no `labels` to count them; use normalize_by='samples', or have the data "
        "collator return `labels`",
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowCounts:
    """Denominators of one optimizer step: per micro-batch on this rank, and summed over the window and all ranks."""

    micro_batches: tuple[MicroBatchCounts, ...]
    global_tokens: int
    global_samples: int
    num_micro_batches_per_rank: tuple[int, ...]
    global_input_tokens: int = 0
    global_seen_tokens: int = 0
    global_positions: int = 0
    # Micro-batch 0 of every rank, summed over ranks: the items behind the gradient after the first micro-batch when
    # the backend reduces every micro-batch (gradient noise scale). None for streamed windows and after a resplit.
    global_first: MicroBatchCounts | None = None
    # The `loss_weights` of counted targets, summed over the window and every rank (hf_gradacc.weights).
    global_weights: float = 0.0
    num_weighted_micro_batches: int = 0

    @property
    def weighted(self) -> bool:
        """True when the step's micro-batches carry `loss_weights` (every one of them, on every rank)."""
        return self.num_weighted_micro_batches > 0

    @property
    def labelled(self) -> bool:
        """False when this rank's micro-batches carry no labels (only samples can be counted)."""
        return all(mb.labelled for mb in self.micro_batches)

    @property
    def local_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def local_samples(self) -> int:
        return sum(mb.num_samples for mb in self.micro_batches)

    @property
    def local_input_tokens(self) -> int:
        return sum(mb.num_input_tokens for mb in self.micro_batches)

    @property
    def local_seen_tokens(self) -> int:
        return sum(mb.num_seen_tokens for mb in self.micro_batches)

    @property
    def totals(self) -> MicroBatchCounts:
        """The step's counts summed over every micro-batch and rank, as one :class:`MicroBatchCounts`."""
        return MicroBatchCounts(
            num_tokens=self.global_tokens,
            num_samples=self.global_samples,
            num_input_tokens=self.global_input_tokens,
            num_seen_tokens=self.global_seen_tokens,
            num_positions=self.global_positions,
            weight_sum=self.global_weights if self.weighted else None,
        )

    def global_count(self, denominator: str) -> int | float:
        """The step's count of ``denominator`` over every micro-batch and rank."""
        return self.totals.get(denominator)

    def unavailable(self, denominator: str) -> str | None:
        """Why this step cannot count ``denominator`` (its batches lack what it counts), or None."""
        need, why = _NEEDS.get(denominator, (None, None))
        return why if need is not None and not getattr(self, need) else None

    def with_micro_batches(self, micro_batches: Sequence[MicroBatchCounts]) -> WindowCounts:
        """The same window (same samples, same global counts) cut into other micro-batches on this rank; the first
        micro-batch is another one then, so ``global_first`` is dropped."""
        return replace(self, micro_batches=tuple(micro_batches), global_first=None)


def gather_window_counts(
    micro_batches: Sequence[MicroBatchCounts],
    all_gather: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
    *,
    error: BaseException | None = None,
    recheck: Callable[[int], Any] | None = None,
) -> WindowCounts:
    """Sum the window's counts over all ranks with ONE collective, and bring them to the host with ONE transfer.

    ``all_gather`` takes this rank's int64 vector and returns a ``(world_size, n)`` tensor (or the vector itself on a
    single process). ``micro_batches`` may hold counts still on the device (counted ``deferred``): they are stacked
    there, gathered, and read once, with this rank's own per-micro-batch counts, in one transfer.

    ``error``: this rank could not count its micro-batches; every rank learns it from the same collective and raises
    (this rank its own error, the others one naming this rank), so no rank is left waiting. Refused label ids found by
    a deferred check count as such an error: ``recheck(i)`` checks this rank's micro-batch ``i`` again at once (reading
    its values: only when the transfer showed a problem), which raises the check's own error naming the id; a
    micro-batch with unattended rows is checked again the same way, for its warning.

    Example:
        ```python
        counts = [count_micro_batch({"labels": torch.tensor([[-100, 5, 6]])}, "causal_lm", deferred=True)]
        gather_window_counts(counts, all_gather=lambda v: v).global_tokens   # 2
        ```
    """
    per_mb = _pack([_mb_values(mb) for mb in micro_batches], device).reshape(-1, _MB_WIDTH)
    host = torch.tensor(
        [len(micro_batches), int(error is not None), sum(mb.weight_sum is not None for mb in micro_batches)],
        dtype=torch.int64,
        device=device,
    )
    weights = per_mb[:, _MB_WEIGHT_BITS].view(torch.float64).sum().reshape(1).view(torch.int64)
    first = per_mb[0, :3] if micro_batches else per_mb.new_zeros(3)
    label_errors = per_mb[:, _MB_LABEL_ERRORS].sum().reshape(1)
    sums = per_mb[:, : len(_MB_COUNTS)].sum(0)
    local = torch.cat([sums, host[:2], first, host[2:], weights, label_errors])
    gathered = all_gather(local).reshape(-1, _WIDTH)
    values = torch.cat([gathered.reshape(-1), per_mb.reshape(-1)]).tolist()  # the step's one device read
    split = gathered.numel()
    rows = [values[r : r + _WIDTH] for r in range(0, split, _WIDTH)]
    mine = [values[i : i + _MB_WIDTH] for i in range(split, len(values), _MB_WIDTH)]
    for i, row in enumerate(mine):  # this rank's deferred checks, in micro-batch order (a refused id raises here)
        if (row[_MB_LABEL_ERRORS] or row[_MB_UNATTENDED]) and recheck is not None:
            recheck(i)
    if error is not None:
        raise error
    refused = [i for i, row in enumerate(mine) if row[_MB_LABEL_ERRORS]]
    if refused:
        raise GradAccDataError(
            f"Micro-batch {refused[0]} of this optimizer step holds {mine[refused[0]][_MB_LABEL_ERRORS]} label id(s) "
            "outside the model's classes that are not `ignore_index`. Mask such positions with `ignore_index`, or set "
            "`ignore_index` to the value your data uses."
        )
    failed = [r for r, row in enumerate(rows) if row[_FAILED] or row[_LABEL_ERRORS]]
    if failed:
        raise GradAccDataError(
            f"Rank(s) {failed} could not count their micro-batches of this optimizer step (see the error on those "
            "ranks); every rank stops here rather than wait for them."
        )
    num_micro_batches = sum(row[_MICRO_BATCHES] for row in rows)
    num_weighted = sum(row[_WEIGHTED] for row in rows)
    if 0 < num_weighted < num_micro_batches:
        raise GradAccDataError(
            f"{num_weighted} of the {num_micro_batches} micro-batches of this optimizer step (over "
            "every rank) carry `loss_weights`, the others none: the step's denominator would mix weights and counts. "
            "Give every sample a weight (1.0 for an unweighted one), or drop the column."
        )

    def total(column: int) -> int:
        return sum(row[column] for row in rows)

    return WindowCounts(
        global_weights=sum((_bits_float(row[_WEIGHT_BITS]) for row in rows), 0.0),
        num_weighted_micro_batches=num_weighted,
        micro_batches=tuple(_resolved(mb, row) for mb, row in zip(micro_batches, mine, strict=True)),
        global_tokens=total(_TOKENS),
        global_samples=total(_SAMPLES),
        num_micro_batches_per_rank=tuple(row[_MICRO_BATCHES] for row in rows),
        global_input_tokens=total(_INPUT_TOKENS),
        global_seen_tokens=total(_SEEN_TOKENS),
        global_positions=total(_POSITIONS),
        global_first=MicroBatchCounts(
            num_tokens=total(_FIRST_TOKENS),
            num_samples=total(_FIRST_SAMPLES),
            num_input_tokens=total(_FIRST_INPUT_TOKENS),
        ),
    )


def _mb_values(mb: MicroBatchCounts) -> list[Any]:
    """One micro-batch's row of the step's vector (numbers, or 0-dim tensors of a deferred count)."""
    weight = mb.weight_sum
    if torch.is_tensor(weight):
        bits: Any = weight.to(torch.float64).reshape(1).view(torch.int64)[0]
    else:
        bits = 0 if weight is None else _float_bits(weight)
    return [*(getattr(mb, name) for name in _MB_COUNTS), bits, mb.label_errors, mb.unattended_rows]


def _resolved(mb: MicroBatchCounts, row: list[int]) -> MicroBatchCounts:
    """``mb`` with the numbers the step's transfer brought (every count on the host)."""
    weight = None if mb.weight_sum is None else _bits_float(row[_MB_WEIGHT_BITS])
    counts = {name: row[k] for k, name in enumerate(_MB_COUNTS)}
    return replace(
        mb, **counts, weight_sum=weight, label_errors=row[_MB_LABEL_ERRORS], unattended_rows=row[_MB_UNATTENDED]
    )


def _pack(rows: Sequence[Sequence[Any]], device: torch.device | str) -> torch.Tensor:
    """``rows`` of numbers and 0-dim tensors as one flat int64 vector on ``device``, no tensor's value read: the
    numbers travel in one copy, the tensors are stacked where they are and put in their places there."""
    numbers: list[int] = []
    where: list[int] = []
    tensors: list[torch.Tensor] = []
    for row in rows:
        for value in row:
            if isinstance(value, torch.Tensor):
                where.append(len(numbers))
                tensors.append(value)
                numbers.append(0)
            else:
                numbers.append(value)
    vector = torch.tensor(numbers, dtype=torch.int64, device=device)
    if not tensors:
        return vector
    try:
        stacked = torch.stack(tensors)
    except RuntimeError:  # counts on different devices (a batch's tensors spread over several): each moved first
        stacked = torch.stack([t.to(device) for t in tensors])
    stacked = stacked.to(device=device, dtype=torch.int64)
    return vector.index_put((torch.tensor(where, device=device),), stacked)


def _float_bits(value: float) -> int:
    """The 64 bits of the float64 ``value`` as an int64 (to travel in an int64 gather unchanged)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    """The float64 whose 64 bits the int64 ``bits`` holds (:func:`_float_bits` undone)."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


# ---------------------------------------------------------------------------------------------- this rank's counts
@dataclass(frozen=True, slots=True, kw_only=True)
class SeenTokens:
    """How `TrainingArguments.include_num_input_tokens_seen` counts input tokens (``mode`` ``"no"``: not at all)."""

    mode: str = "no"
    main_input_name: str = "input_ids"
    pad_token_id: int | None = None


class Counter:
    """What one micro-batch counts on this rank, for the trainer's head: the one object every count is asked from.

    :meth:`count` is what this rank holds of a training micro-batch: the whole micro-batch, or under context
    parallelism its shard (``cp``, a :class:`~hf_gradacc.backends.context_parallel.ContextParallel`: its targets and
    input tokens, which add up over the ``cp`` group, and its samples on ``cp`` rank 0 only; the same for the slice
    DeepSpeed Ulysses hands each rank of a sequence group: samples on sequence rank 0 only); plus the input tokens
    ``include_num_input_tokens_seen`` tracks. :meth:`count_batch` counts a batch as it is (evaluation).

    Example:
        ```python
        counter = Counter(Head.for_model(model))
        counter.count({"input_ids": ids, "labels": labels}).num_tokens     # target tokens after the shift
        ```
    """

    def __init__(self, head: Any, *, cp: Any = None, seen: SeenTokens | None = None) -> None:
        self.head, self.cp, self.seen = head, cp, seen or SeenTokens()

    def count_batch(self, batch: Mapping[str, Any], *, deferred: bool = False) -> MicroBatchCounts:
        """The head's counts of ``batch`` as it is (:func:`count_micro_batch`, after the head checked its labels),
        with its attended input positions and its computed positions. ``deferred``: see :meth:`count`."""
        head = self.head
        label_errors, unattended = head.check_batch(batch, deferred=deferred)
        if head.type is None and LABEL_KEY in batch:
            logger.warning_once(
                "hf_gradacc could not tell the model's loss family; 'tokens' are counted on unshifted labels. Set "
                "`head_type` if the model shifts its labels (causal LM)."
            )
        counts = count_micro_batch(
            batch,
            head.type or "masked_lm",
            ignore_index=head.ignore_index,
            problem_type=head.problem_type_of(batch.get(LABEL_KEY)),
            allow_unlabelled=head.allow_unlabelled,
            deferred=deferred,
        )
        return replace(
            counts,
            num_input_tokens=input_token_count(batch, deferred=deferred),
            num_positions=position_count(batch),
            label_errors=label_errors,
            unattended_rows=unattended,
        )

    def count(self, batch: Mapping[str, Any], *, deferred: bool = False) -> MicroBatchCounts:
        """What this rank holds of the training micro-batch ``batch``, counted (see the class docstring).

        ``deferred`` (what a training window asks): no value of the batch's tensors is read; the counts that need
        them, and the label checks' findings (:meth:`~hf_gradacc.heads.Head.check_batch`), stay 0-dim tensors where
        the batch is, for :func:`gather_window_counts` to bring to the host with the step's one transfer. (Under
        context parallelism the shard's view may still read.)"""
        cp = self.cp
        sharded = cp is not None and cp.size > 1
        if cp is not None:
            cp.check_slice(batch)  # a sequence-parallel slice refused by name (left padding)
        view = cp.count_view(batch) if sharded else batch
        counts = self.count_batch(view, deferred=deferred)
        if self.seen.mode != "no":
            packed = PACKED_KEY in view  # a packed row has no padding, and may hold end-of-sequence ids equal to pad
            seen = seen_token_count(
                view.get(self.seen.main_input_name),
                view.get("attention_mask"),
                self.seen.mode,
                None if packed else self.seen.pad_token_id,
                padded=not packed,
                deferred=deferred,
            )
            counts = replace(counts, num_seen_tokens=seen)
        # a context shard or a Ulysses slice holds part of every row of the micro-batch: its rows are counted once over
        # the group, on its first rank (the tokens of each slice add up over the group)
        return replace(counts, num_samples=0) if cp is not None and (cp.rank, cp.sp_rank) != (0, 0) else counts
