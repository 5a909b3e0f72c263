"""Weighted losses: a ``loss_weights`` column (per token ``[batch, seq]`` or per sample ``[batch]``) and the
``"weights"`` denominator.

The step's loss is ``sum_i w_i * loss_i / sum_i w_i`` over every COUNTED target ``i`` (labels that are not
``ignore_index``, after the causal shift) of every micro-batch of the optimizer step on every data-parallel rank. The
weight sum travels in the step's one count collective (:func:`hf_gradacc.counting.gather_window_counts`), so nothing
is added to a step's communication. A per-sample weight applies to every counted target of its row; a per-token
weight is aligned with ``labels`` (``loss_weights[b, j]`` weights the target ``labels[b, j]``, the one position
``j - 1`` predicts in a causal LM).

This module is pure (tensors in, tensors out): :mod:`hf_gradacc.counting` asks :func:`target_weight_sum` for a
micro-batch's weight sum, :mod:`hf_gradacc.builtin_loss` asks :func:`weighted_loss_sum` for its weighted SUM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .errors import GradAccConfigError, GradAccDataError
from .loss import IGNORE_INDEX, SAMPLE_LEVEL_HEADS, ProblemType, counted_targets

LOSS_WEIGHTS_KEY = "loss_weights"
WEIGHTS = "weights"  # the denominator: the sum of the weights of counted targets over the step and every rank


def _head_name(head_type: str, problem_type: str | None = None) -> str:
    """The head family as a user reads it in an error: ``"regression"``, ``"multi-label classification"``,
    ``"sequence classification"``, ``"causal lm"``."""
    if head_type in SAMPLE_LEVEL_HEADS and problem_type in ("regression", "multi_label_classification"):
        return "regression" if problem_type == "regression" else "multi-label classification"
    return head_type.replace("_", " ")


def check_weights(
    weights: Any,
    labels: torch.Tensor,
    *,
    sample_level: bool,
    counted: torch.Tensor | None = None,
    head: str | None = None,
) -> torch.Tensor:
    """``weights`` as a float tensor of shape ``labels.shape`` (per token) or ``[batch]`` (per sample), or a
    :class:`~hf_gradacc.GradAccDataError` naming ``loss_weights``: wrong shape (per-token weights for a ``head`` with
    one target per sample included), bool, or, where ``counted`` (a mask of the weights' shape; everywhere without
    it) is True, NaN / Inf or negative. A weight that weighs no counted target is never read, so never refused.

    Example:
        ```python
        check_weights(torch.tensor([1.0, 0.5]), torch.tensor([[-100, 5], [6, 7]]), sample_level=False)
        ```
    """
    weights = _shaped_weights(weights, labels, sample_level=sample_level, head=head)
    _check_values(weights, torch.ones_like(weights, dtype=torch.bool) if counted is None else counted)
    return weights


def _shaped_weights(
    weights: Any, labels: torch.Tensor, *, sample_level: bool, head: str | None = None
) -> torch.Tensor:
    """``weights`` as a float tensor of shape ``labels.shape`` or ``[batch]``; its values are not looked at."""
    if not torch.is_tensor(weights):
        raise GradAccDataError(
            f"`{LOSS_WEIGHTS_KEY}` must be a tensor (the data collator's), got {type(weights).__name__}"
        )
    if weights.dtype == torch.bool or weights.is_complex():
        raise GradAccDataError(f"`{LOSS_WEIGHTS_KEY}` must hold real numbers, got dtype {weights.dtype}")
    rows = labels.shape[0] if labels.dim() > 0 else 1
    if tuple(weights.shape) in ((rows,), (rows, 1) if sample_level else (rows,)):
        weights = weights.reshape(rows)  # per sample
    elif sample_level:
        raise GradAccDataError(
            f"`{LOSS_WEIGHTS_KEY}` has shape {list(weights.shape)}, but a {head or 'sample-level'} head's loss has "
            "one "
            f"target per sample (`labels` have shape {list(labels.shape)}): per-token weights cannot weigh it. Give "
            f"`{LOSS_WEIGHTS_KEY}` of shape [{rows}] (one per sample): a number per sample in the dataset."
        )
    elif tuple(weights.shape) != tuple(labels.shape):
        raise GradAccDataError(
            f"`{LOSS_WEIGHTS_KEY}` has shape {list(weights.shape)}; `labels` have shape {list(labels.shape)}, so it "
            f"must be [{rows}] (one per sample) or {list(labels.shape)} (one per label). Pad per-token weights like "
            "the labels in the data collator (hf_gradacc.weights.LossWeightsCollator)."
        )
    weights = weights.detach().to(torch.float64 if weights.dtype == torch.float64 else torch.float32)
    return weights


def _check_values(weights: torch.Tensor, counted: torch.Tensor, *, offset: int = 0) -> None:
    """A :class:`~hf_gradacc.GradAccDataError` for the first NaN / Inf or negative weight where ``counted`` is True,
    naming its index (its last coordinate plus ``offset``: the causal shift, so that the index is the user's)."""
    counted = counted.to(weights.device)
    for bad, what in ((counted & ~torch.isfinite(weights), "a NaN or Inf"), (counted & (weights < 0), "a negative")):
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            value = float(weights[tuple(where)])
            if offset and len(where) > 1:
                where[-1] += offset
            raise GradAccDataError(
                f"`{LOSS_WEIGHTS_KEY}` holds {what} weight ({value:g} at index {where}, row {where[0]}) on a counted "
                "target; every weight of a counted target must be a finite number >= 0 (the step's denominator is "
                "their sum; weights of ignored labels and padding are not read). Fix the dataset's weights column."
            )


def target_weights(
    weights: Any,
    labels: torch.Tensor,
    *,
    head_type: str,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    problem_type: ProblemType | str | None = None,
) -> torch.Tensor:
    """The weight of every target the head's loss sums over, in the layout of its per-target losses (causal LM:
    aligned with the shifted targets; sequence-level heads: one per row), an exact zero where the target is not
    counted (whatever the weight given there, NaN included: it is neither validated nor read).

    Example:
        ```python
        labels = torch.tensor([[-100, 5, 6]])
        target_weights(torch.tensor([[0.0, 2.0, 3.0]]), labels, head_type="causal_lm").tolist()  # [[2.0, 3.0, 0.0]]
        ```
    """
    sample_level = head_type in SAMPLE_LEVEL_HEADS
    head = _head_name(head_type, problem_type)
    offset = 0
    if head_type == "causal_lm" and shift_labels is not None:
        weights = _shaped_weights(weights, shift_labels, sample_level=False, head=head)  # values: where counted, below
        if weights.dim() > 1:
            raise GradAccConfigError(
                f"Per-token `{LOSS_WEIGHTS_KEY}` with `shift_labels` in the batch: it cannot be told whether they are "
                "aligned with `labels` or `shift_labels`. Give per-sample weights ([batch]), or drop `shift_labels`."
            )
    else:
        weights = _shaped_weights(weights, labels, sample_level=sample_level, head=head)
        if head_type == "causal_lm" and weights.dim() > 1:
            weights, offset = (
                F.pad(weights[..., 1:], (0, 1)),
                1,
            )  # the target of position i is labels[i + 1]: so is its weight
    # which targets the loss sums, and which count: the one rule (hf_gradacc.loss.counted_targets)
    targets, counted = counted_targets(
        labels, head_type, ignore_index=ignore_index, shift_labels=shift_labels, problem_type=problem_type
    )
    if not sample_level and weights.dim() == 1:  # per sample: a row's weight is read when the row has a counted target
        _check_values(weights, counted.reshape(weights.shape[0], -1).any(-1))
        weights = weights.reshape(-1, *([1] * (targets.dim() - 1))).expand(targets.shape)
    counted = counted.to(weights.device)
    _check_values(weights, counted, offset=offset)
    # where, not a product: a NaN weight on an uncounted target must not make its product (and the loss) NaN
    return torch.where(counted, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


def target_weight_sum(
    batch: Mapping[str, Any],
    head_type: str,
    *,
    ignore_index: int = IGNORE_INDEX,
    problem_type: str | None = None,
    deferred: bool = False,
) -> float | None:
    """The sum (in float64) of the weights of the micro-batch's counted targets; None when it has no
    ``loss_weights`` (an unweighted micro-batch). ``deferred``: the sum stays a 0-dim float64 tensor (the weights'
    value checks still read)."""
    weights = batch.get(LOSS_WEIGHTS_KEY)
    if weights is None:
        return None
    labels = batch.get("labels")
    shift_labels = batch.get("shift_labels")
    if not torch.is_tensor(labels) and not torch.is_tensor(shift_labels):
        raise GradAccDataError(f"The batch has `{LOSS_WEIGHTS_KEY}` but no `labels`: weights weigh counted labels.")
    per_target = target_weights(
        weights,
        labels if torch.is_tensor(labels) else shift_labels,
        head_type=head_type,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        problem_type=problem_type,
    )
    total = per_target.double().sum()
    return total if deferred else float(total)


def weighted_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    weights: Any,
    *,
    head_type: str,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    problem_type: ProblemType | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``sum_i w_i * loss_i`` over the micro-batch's counted targets: the weighted SUM of the head family's loss (the
    same per-target losses as :mod:`hf_gradacc.loss`, float32), to be normalised by ``"weights"``.

    Example:
        ```python
        total = weighted_loss_sum(outputs.logits, batch["labels"], batch["loss_weights"], head_type="causal_lm")
        term = LossTerm(total=total, normalize_by="weights")
        ```
    """
    base = labels if labels is not None else shift_labels
    w = target_weights(
        weights,
        base,
        head_type=head_type,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        problem_type=problem_type,
    ).to(logits.device)
    logits = logits.float()
    if head_type in SAMPLE_LEVEL_HEADS:
        rows = w.shape[0]
        if problem_type == "regression":
            pred, target = logits.reshape(rows, -1), labels.float().reshape(rows, -1)
            per_row = ((pred - target) ** 2).mean(-1)
        elif problem_type == "multi_label_classification":
            per_row = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
        else:
            per_row = F.cross_entropy(
                logits.reshape(rows, -1),
                labels.reshape(-1).long(),
                ignore_index=ignore_index,
                reduction="none",
                label_smoothing=label_smoothing,
            )
        return (per_row * w.to(per_row.dtype)).sum()
    targets, _ = counted_targets(base, head_type, ignore_index=ignore_index, shift_labels=shift_labels)
    per_target = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1).long().to(logits.device),
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return (per_target * w.reshape(-1).to(per_target.dtype)).sum()


def pop_weights(inputs: dict[str, Any]) -> Any:
    """Take ``loss_weights`` out of a batch before it reaches the model's forward (which would fail on it, or, taking
    ``**kwargs``, silently ignore it)."""
    return inputs.pop(LOSS_WEIGHTS_KEY, None)


def primary_denominator(head: Any, window: Any) -> str:
    """The built-in loss's denominator for this step: ``"weights"`` when the step's batches carry ``loss_weights``,
    else the head's (``"tokens"``, or ``"samples"`` for sequence-level heads and unlabelled batches)."""
    if window is not None and window.counts.weighted:
        return WEIGHTS
    return head.denominator(labelled=window is None or window.counts.labelled)


class LossWeightsCollator:
    """Wraps a data collator so that a ``loss_weights`` column travels with the batch: per-sample numbers stacked into
    ``[batch]``, per-token lists right-padded with 0 to the batch's ``labels`` width (padding is never counted).

    A per-token list must be as long as its sample's ``labels`` (its ``input_ids`` when the sample has no labels and
    the collator makes them), and the batch's labels must be per token: a list of another length, per-token weights
    beside one label per sample (sequence classification, regression, multi-label), and a micro-batch mixing numbers
    and lists are refused with a :class:`~hf_gradacc.GradAccDataError` naming the row.

    Args:
        collator: the collator of everything else (it never sees ``loss_weights``).

    Example:
        ```python
        from hf_gradacc.testing.tiny import PaddingCollator
        from hf_gradacc.weights import LossWeightsCollator

        collate = LossWeightsCollator(PaddingCollator())
        batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "loss_weights": 2.0},
                         {"input_ids": [8, 9], "labels": [8, 9], "loss_weights": 0.5}])
        batch["loss_weights"]          # tensor([2.0, 0.5])
        ```
    """

    def __init__(self, collator: Any) -> None:
        self.collator = collator
        self.only_pads = bool(getattr(collator, "only_pads", False))

    def __call__(self, samples: Any) -> dict[str, Any]:
        samples = [dict(s) for s in samples]
        given = [s.pop(LOSS_WEIGHTS_KEY, None) for s in samples]
        lengths = [_label_length(s) for s in samples]  # before the collator, which may change the samples
        batch = self.collator(samples)
        if all(w is None for w in given):
            return batch
        if any(w is None for w in given):
            raise GradAccDataError(f"Some samples of a micro-batch have `{LOSS_WEIGHTS_KEY}` and some do not.")
        values = [_weight_values(w, row) for row, w in enumerate(given)]
        lists = [row for row, v in enumerate(values) if isinstance(v, list)]
        if not lists:
            batch[LOSS_WEIGHTS_KEY] = torch.tensor(values, dtype=torch.float32)
            return batch
        if len(lists) < len(values):
            number = next(row for row, v in enumerate(values) if not isinstance(v, list))
            raise GradAccDataError(
                f"Sample {lists[0]} of the micro-batch has a list of {len(values[lists[0]])} `{LOSS_WEIGHTS_KEY}` "
                "(per "
                f"token) and sample {number} one number (per sample): give every sample the same kind of weights."
            )
        labels = batch.get("labels")
        if torch.is_tensor(labels) and (labels.dim() < 2 or labels.is_floating_point()):
            raise GradAccDataError(
                f"Sample {lists[0]} of the micro-batch has a list of {len(values[lists[0]])} `{LOSS_WEIGHTS_KEY}` "
                "(per "
                f"token), but the batch's `labels` (shape {list(labels.shape)}, dtype {labels.dtype}) hold one label "
                "per sample (sequence classification, regression, multi-label): such a head takes one weight per "
                f"sample. Give each sample one number as its `{LOSS_WEIGHTS_KEY}`."
            )
        width = labels.shape[-1] if torch.is_tensor(labels) else max(len(v) for v in values)
        for row, v in enumerate(values):
            if lengths[row] is not None and len(v) != lengths[row][1]:
                name, length = lengths[row]
                raise GradAccDataError(
                    f"Sample {row} of the micro-batch has {len(v)} `{LOSS_WEIGHTS_KEY}` for {length} `{name}`: "
                    f"per-token weights need one weight per label (`{LOSS_WEIGHTS_KEY}[j]` weighs `labels[j]`). "
                    "Give the sample's weights the length of its labels in the dataset."
                )
            if len(v) > width:
                raise GradAccDataError(
                    f"Sample {row} of the micro-batch has {len(v)} `{LOSS_WEIGHTS_KEY}`, but the collated `labels` "
                    "are "
                    f"{width} wide (the collator cut the row): cut the weights with the labels in the dataset."
                )
        padded = torch.zeros((len(values), width), dtype=torch.float32)
        for row, v in enumerate(values):
            padded[row, : len(v)] = torch.tensor(v, dtype=torch.float32)
        batch[LOSS_WEIGHTS_KEY] = padded
        return batch


def _label_length(sample: Mapping[str, Any]) -> tuple[str, int] | None:
    """The key and length of the sequence a sample's per-token weights must match: its ``labels``, else (the
    collator makes the labels) its ``input_ids``; None when neither is a sequence."""
    for name in ("labels", "input_ids"):
        value = sample.get(name)
        if value is None:
            continue
        if torch.is_tensor(value) or hasattr(value, "ndim"):  # a torch / numpy array
            return (name, int(value.shape[0])) if value.ndim == 1 else None
        return (name, len(value)) if isinstance(value, (list, tuple)) else None
    return None


def _weight_values(weights: Any, row: int) -> float | list[float]:
    """A sample's ``loss_weights`` as a float (per sample) or a list of floats (per token)."""
    value = weights.tolist() if hasattr(weights, "tolist") else weights  # torch / numpy: numbers or lists
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) for x in value):
        return [float(x) for x in value]
    raise GradAccDataError(
        f"Sample {row} of the micro-batch has `{LOSS_WEIGHTS_KEY}` {str(value)[:60]} ({type(weights).__name__}): give "
        "one number per sample, or a flat list of numbers (one per label) per token."
    )
