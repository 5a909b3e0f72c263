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
from .loss import IGNORE_INDEX, SAMPLE_LEVEL_HEADS, ProblemType, causal_targets

LOSS_WEIGHTS_KEY = "loss_weights"
WEIGHTS = "weights"  # the denominator: the sum of the weights of counted targets over the step and every rank


def check_weights(weights: Any, labels: torch.Tensor, *, sample_level: bool) -> torch.Tensor:
    """``weights`` as a float tensor of shape ``labels.shape`` (per token) or ``[batch]`` (per sample), or a
    :class:`~hf_gradacc.GradAccDataError` naming ``loss_weights``: wrong shape, bool, NaN / Inf, or negative.

    Example:
        ```python
        check_weights(torch.tensor([1.0, 0.5]), torch.tensor([[-100, 5], [6, 7]]), sample_level=False)
        ```
    """
    if not torch.is_tensor(weights):
        raise GradAccDataError(
            f"`{LOSS_WEIGHTS_KEY}` must be a tensor (the data collator's), got {type(weights).__name__}"
        )
    if weights.dtype == torch.bool or weights.is_complex():
        raise GradAccDataError(f"`{LOSS_WEIGHTS_KEY}` must hold real numbers, got dtype {weights.dtype}")
    rows = labels.shape[0] if labels.dim() > 0 else 1
    if tuple(weights.shape) in ((rows,), (rows, 1) if sample_level else (rows,)):
        weights = weights.reshape(rows)  # per sample
    elif sample_level or tuple(weights.shape) != tuple(labels.shape):
        want = f"[{rows}] (one per sample)" + ("" if sample_level else f" or {list(labels.shape)} (one per label)")
        raise GradAccDataError(
            f"`{LOSS_WEIGHTS_KEY}` has shape {list(weights.shape)}; `labels` have shape {list(labels.shape)}, so it "
            f"must be {want}. Pad per-token weights like the labels in the data collator."
        )
    weights = weights.detach().to(torch.float64 if weights.dtype == torch.float64 else torch.float32)
    if not bool(torch.isfinite(weights).all()):
        raise GradAccDataError(f"`{LOSS_WEIGHTS_KEY}` holds NaN or Inf; every weight must be a finite number >= 0.")
    if bool((weights < 0).any()):
        where = (weights < 0).nonzero()[0].tolist()
        raise GradAccDataError(
            f"`{LOSS_WEIGHTS_KEY}` holds a negative weight ({float(weights[tuple(where)]):g} at index {where}); every "
            "weight must be >= 0 (the step's denominator is their sum). Fix the dataset's weights column."
        )
    return weights


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
    aligned with the shifted targets; sequence-level heads: one per row), zero where the target is not counted.

    Example:
        ```python
        labels = torch.tensor([[-100, 5, 6]])
        target_weights(torch.tensor([[0.0, 2.0, 3.0]]), labels, head_type="causal_lm").tolist()  # [[2.0, 3.0, 0.0]]
        ```
    """
    sample_level = head_type in SAMPLE_LEVEL_HEADS
    if head_type == "causal_lm" and shift_labels is not None:
        weights = check_weights(weights, shift_labels, sample_level=False)
        if weights.dim() > 1:
            raise GradAccConfigError(
                f"Per-token `{LOSS_WEIGHTS_KEY}` with `shift_labels` in the batch: it cannot be told whether they are "
                "aligned with `labels` or `shift_labels`. Give per-sample weights ([batch]), or drop `shift_labels`."
            )
        targets = shift_labels
    else:
        weights = check_weights(weights, labels, sample_level=sample_level)
        targets = causal_targets(labels, ignore_index) if head_type == "causal_lm" else labels
        if head_type == "causal_lm" and weights.dim() > 1:
            weights = F.pad(weights[..., 1:], (0, 1))  # the target of position i is labels[i + 1]: so is its weight
    if sample_level:
        if problem_type in (None, "single_label_classification") and not targets.is_floating_point():
            counted = targets.reshape(weights.shape[0], -1)[:, 0] != ignore_index
        else:
            counted = torch.ones_like(weights, dtype=torch.bool)
        return weights * counted.to(weights.device)
    if weights.dim() == 1:
        weights = weights.reshape(-1, *([1] * (targets.dim() - 1))).expand(targets.shape)
    return weights * (targets != ignore_index).to(weights.device)


def target_weight_sum(batch: Mapping[str, Any], head_type: str, *, ignore_index: int = IGNORE_INDEX,
                      problem_type: str | None = None) -> float | None:  # fmt: skip
    """The sum (in float64) of the weights of the micro-batch's counted targets; None when it has no
    ``loss_weights`` (an unweighted micro-batch)."""
    weights = batch.get(LOSS_WEIGHTS_KEY)
    if weights is None:
        return None
    labels = batch.get("labels")
    shift_labels = batch.get("shift_labels")
    if not torch.is_tensor(labels) and not torch.is_tensor(shift_labels):
        raise GradAccDataError(f"The batch has `{LOSS_WEIGHTS_KEY}` but no `labels`: weights weigh counted labels.")
    per_target = target_weights(weights, labels if torch.is_tensor(labels) else shift_labels, head_type=head_type,
                                ignore_index=ignore_index, shift_labels=shift_labels, problem_type=problem_type)  # fmt: skip
    return float(per_target.double().sum())


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
    w = target_weights(weights, base, head_type=head_type, ignore_index=ignore_index, shift_labels=shift_labels,
                       problem_type=problem_type).to(logits.device)  # fmt: skip
    logits = logits.float()
    if head_type in SAMPLE_LEVEL_HEADS:
        rows = w.shape[0]
        if problem_type == "regression":
            pred, target = logits.reshape(rows, -1), labels.float().reshape(rows, -1)
            per_row = ((pred - target) ** 2).mean(-1)
        elif problem_type == "multi_label_classification":
            per_row = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
        else:
            per_row = F.cross_entropy(logits.reshape(rows, -1), labels.reshape(-1).long(), ignore_index=ignore_index,
                                      reduction="none", label_smoothing=label_smoothing)  # fmt: skip
        return (per_row * w.to(per_row.dtype)).sum()
    if head_type == "causal_lm":
        targets = shift_labels if shift_labels is not None else causal_targets(labels, ignore_index)
    else:
        targets = labels
    per_target = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long().to(logits.device), ignore_index=ignore_index,
        reduction="none", label_smoothing=label_smoothing,
    )  # fmt: skip
    return (per_target * w.reshape(-1).to(per_target.dtype)).sum()


def pop_weights(inputs: dict[str, Any]) -> Any:
    """Take ``loss_weights`` out of a batch before it reaches the model's forward (which would fail on it, or, taking
    ``**kwargs``, silently ignore it)."""
    return inputs.pop(LOSS_WEIGHTS_KEY, None)


def keep_weights_column(trainer: Any) -> None:
    """Keep ``loss_weights`` through the Trainer's unused-column removal (``remove_unused_columns=True`` drops every
    dataset column the model's forward does not name), without making it a label name (which would change what
    ``prediction_step`` hands to ``compute_metrics``)."""
    setup = getattr(trainer, "_set_signature_columns_if_needed", None)
    if not callable(setup):
        return
    setup()
    columns = getattr(trainer, "_signature_columns", None)
    if isinstance(columns, list) and LOSS_WEIGHTS_KEY not in columns:
        columns.append(LOSS_WEIGHTS_KEY)


def primary_denominator(head: Any, window: Any) -> str:
    """The built-in loss's denominator for this step: ``"weights"`` when the step's batches carry ``loss_weights``,
    else the head's (``"tokens"``, or ``"samples"`` for sequence-level heads and unlabelled batches)."""
    if window is not None and window.counts.weighted:
        return WEIGHTS
    return head.denominator(labelled=window is None or window.counts.labelled)


class LossWeightsCollator:
    """Wraps a data collator so that a ``loss_weights`` column travels with the batch: per-sample numbers stacked into
    ``[batch]``, per-token lists right-padded with 0 to the batch's ``labels`` width (padding is never counted).

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
        batch = self.collator(samples)
        if all(w is None for w in given):
            return batch
        if any(w is None for w in given):
            raise GradAccDataError(f"Some samples of a micro-batch have `{LOSS_WEIGHTS_KEY}` and some do not.")
        values = [w.tolist() if torch.is_tensor(w) else w for w in given]
        if all(isinstance(v, (int, float)) for v in values):
            batch[LOSS_WEIGHTS_KEY] = torch.tensor([float(v) for v in values], dtype=torch.float32)
            return batch
        width = batch["labels"].shape[-1] if torch.is_tensor(batch.get("labels")) else max(len(v) for v in values)
        padded = torch.zeros((len(values), width), dtype=torch.float32)
        for row, v in enumerate(values):
            padded[row, : len(v)] = torch.tensor(v, dtype=torch.float32)
        batch[LOSS_WEIGHTS_KEY] = padded
        return batch
