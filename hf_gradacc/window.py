"""One optimizer step's micro-batches ("the window") and its denominators, local and global.

The window knows nothing about backends: it is handed an ``all_gather`` callable that returns one row per
data-parallel rank, and issues exactly one such collective per optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .errors import GradAccDataError
from .loss import IGNORE_INDEX, HeadType, token_count

LABEL_KEY = "labels"
SHIFT_LABELS_KEY = "shift_labels"

# Order of the values in the per-rank count vector that is gathered once per window.
_TOKENS, _SAMPLES, _MICRO_BATCHES = 0, 1, 2


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchCounts:
    """Counted items of one micro-batch on this rank."""

    num_tokens: int
    num_samples: int
    labelled: bool = True

    def get(self, denominator: str) -> int:
        return self.num_tokens if denominator == "tokens" else self.num_samples


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowCounts:
    """Denominators of one optimizer step: per micro-batch on this rank, and summed over the window and all ranks."""

    micro_batches: tuple[MicroBatchCounts, ...]
    global_tokens: int
    global_samples: int
    num_micro_batches_per_rank: tuple[int, ...]

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

    def global_count(self, denominator: str) -> int:
        return self.global_tokens if denominator == "tokens" else self.global_samples

    def with_micro_batches(self, micro_batches: Sequence[MicroBatchCounts]) -> WindowCounts:
        """The same window (same samples, same global counts) cut into other micro-batches on this rank."""
        return replace(self, micro_batches=tuple(micro_batches))


def count_micro_batch(
    batch: Mapping[str, Any],
    head_type: HeadType,
    *,
    ignore_index: int = IGNORE_INDEX,
    problem_type: str | None = None,
    allow_unlabelled: bool = False,
) -> MicroBatchCounts:
    """Count the targets of one micro-batch the way its loss family averages them.

    - tokens: labels that are not ``ignore_index``; for causal LMs after the shift (``labels[..., 1:]``),
      or ``shift_labels`` as given when the collator provides them.
    - samples: rows; for single-label sequence classification, rows whose label is not ``ignore_index``.

    With ``allow_unlabelled`` (an overridden ``compute_loss``), a batch without labels counts its rows as samples.
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
    if SHIFT_LABELS_KEY in batch and head_type == "causal_lm":
        targets = batch[SHIFT_LABELS_KEY]
    else:
        targets = labels
    if not torch.is_tensor(targets):
        raise GradAccDataError(f"`{LABEL_KEY}` must be a tensor, got {type(targets).__name__}")

    if head_type == "sequence_classification":
        rows = targets.shape[0] if targets.dim() > 0 else 1
        if problem_type in (None, "single_label_classification") and not targets.is_floating_point():
            num_samples = int(token_count(targets.reshape(rows, -1)[:, 0], ignore_index))
        else:
            num_samples = rows
        return MicroBatchCounts(num_tokens=num_samples, num_samples=num_samples)

    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise GradAccDataError(
            f"`{LABEL_KEY}` of a {head_type} model must hold integer class ids, got dtype {targets.dtype}. "
            "Cast them to torch.long in the data collator, or set `head_type` if the model is not a "
            f"{head_type} model."
        )
    if head_type == "causal_lm" and SHIFT_LABELS_KEY not in batch:
        targets = targets[..., 1:]
    num_samples = targets.shape[0] if targets.dim() > 1 else 1
    return MicroBatchCounts(num_tokens=int(token_count(targets, ignore_index)), num_samples=num_samples)


def gather_window_counts(
    micro_batches: Sequence[MicroBatchCounts],
    all_gather: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str = "cpu",
) -> WindowCounts:
    """Sum the window's counts over all ranks with ONE collective.

    ``all_gather`` takes this rank's int64 vector and returns a ``(world_size, 3)`` tensor (or the
    vector itself on a single process).
    """
    local = torch.tensor(
        [
            sum(mb.num_tokens for mb in micro_batches),
            sum(mb.num_samples for mb in micro_batches),
            len(micro_batches),
        ],
        dtype=torch.int64,
        device=device,
    )
    rows = all_gather(local).reshape(-1, 3).cpu()
    return WindowCounts(
        micro_batches=tuple(micro_batches),
        global_tokens=int(rows[:, _TOKENS].sum()),
        global_samples=int(rows[:, _SAMPLES].sum()),
        num_micro_batches_per_rank=tuple(int(n) for n in rows[:, _MICRO_BATCHES]),
    )


def rows_of(batch: Mapping[str, Any]) -> int:
    """Number of rows (samples) of a collated micro-batch: the first dim of its first tensor."""
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise GradAccDataError(f"Cannot tell the number of rows of a micro-batch with keys {sorted(batch)}: no tensor")


def split_micro_batches(micro_batches: Sequence[Mapping[str, Any]], max_rows: int) -> list[dict[str, Any]]:
    """Cut every micro-batch into pieces of at most ``max_rows`` rows, keeping the order of samples.

    Tensors whose first dim is the row count are sliced; other values are shared by every piece.
    """
    if max_rows < 1:
        raise ValueError(f"`max_rows` ({max_rows}) must be >= 1")
    pieces: list[dict[str, Any]] = []
    for batch in micro_batches:
        rows = rows_of(batch)
        for start in range(0, rows, max_rows):
            stop = min(start + max_rows, rows)
            pieces.append(
                {
                    key: value[start:stop] if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows
                    else value
                    for key, value in batch.items()
                }
            )
    return pieces
