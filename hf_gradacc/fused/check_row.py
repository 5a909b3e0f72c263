"""The row the fused LM head's start-up check runs on, cut to what it needs.

The check (:func:`hf_gradacc.fused.head.fused_row_check`) runs the model's own forward with the labels on one row: the
FULL logits of that row, ``positions x vocabulary`` in float32, plus the model's log-probabilities of them. Given a
whole micro-batch row it projects every padding position and, in a packed row, every sample of the row (476 positions
at a 151,936-token vocabulary: 0.28 GB of logits and as much again of log-probabilities; the first step's peak was
3.3-4.3x that of the fused steps after it, docs/benchmarks.md). A causal model's loss on the first ``n`` positions
depends on those positions only, so the check's row (the first with a counted target, as before) is cut after its
first :data:`CHECK_TARGETS` counted targets: the same comparison on fewer positions (the prompt before the first
target stays: it is their context). Inputs the cut cannot follow (images, 4-D masks: any key but the per-position
ones below) keep the whole row."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

CHECK_TARGETS = 32
"""Counted targets the start-up check compares on (a logit transform the fused head misses shows on every one)."""

_PER_POSITION = frozenset(
    {"input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids", "seq_idx", "cache_position"}
)
_SEQUENCE_OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")  # packed rows' sample offsets, [0, n0, n0 + n1, ..., T]
_SEQUENCE_MAX = ("max_length_q", "max_length_k")


class CheckRow(NamedTuple):
    inputs: dict[str, Any]
    targets: torch.Tensor
    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None


def check_row(
    inputs: dict[str, Any],
    targets: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    *,
    ignore_index: int,
    num_targets: int = CHECK_TARGETS,
) -> CheckRow | None:
    """One row of a causal-LM micro-batch for the fused head's start-up check: the first row with a counted target
    (the row :func:`~hf_gradacc.fused.head.fused_row_check` takes), cut right after its ``num_targets``-th counted
    target (or its last, if it has fewer); the targets (and the
    ``shift_labels``) at the cut's last position set to ``ignore_index``, since the model's own loss sees no label
    past the cut. None where nothing needs cutting or the inputs hold a key the cut cannot follow (the caller then
    checks the whole first row, as before).

    Example:
        ```python
        row = check_row(inputs, targets, labels, shift_labels, ignore_index=-100)
        one = row or CheckRow(inputs, targets, labels, shift_labels)
        pair = fused_row_check(model, one.inputs, one.targets, labels=one.labels, shift_labels=one.shift_labels,
                               ignore_index=-100)
        ```
    """
    if targets.dim() != 2:
        return None
    rows, width = targets.shape
    for key, value in inputs.items():
        if not torch.is_tensor(value) or key in _SEQUENCE_MAX:
            continue
        if key in _SEQUENCE_OFFSETS:
            if rows != 1 or value.dim() != 1:
                return None
        elif key not in _PER_POSITION or value.dim() < 2 or tuple(value.shape[:2]) != (rows, width):
            return None
    for given in (labels, shift_labels):
        if given is not None and tuple(given.shape) != (rows, width):
            return None
    counted = targets != ignore_index
    totals = counted.sum(dim=-1)
    if not bool((totals > 0).any()):
        return None
    row = int(torch.nonzero(totals > 0)[0, 0])  # the row the check always took: the first with a counted target
    need = min(int(totals[row]), num_targets)
    last = int(((counted[row].cumsum(dim=-1) >= need) & counted[row]).int().argmax())  # its need-th counted target
    length = last + 2  # the model's own loss needs the label one past the last target it scores
    if length >= width:
        if rows == 1:
            return None
        length = width
    cut = slice(row, row + 1), slice(0, length)
    one = {}
    for key, value in inputs.items():
        if key in _SEQUENCE_OFFSETS and torch.is_tensor(value):
            kept = value[value < length]
            one[key] = torch.cat([kept, kept.new_tensor([length])])
        elif torch.is_tensor(value) and key not in _SEQUENCE_MAX:
            one[key] = value[cut]
        else:
            one[key] = value
    for key in _SEQUENCE_MAX:  # the longest sample left (an int, as the packing collator gives it)
        offsets = one.get(key.replace("max_length", "cu_seq_lens"))
        if key in one and torch.is_tensor(offsets):
            one[key] = int(offsets.diff().max())
    one_targets = targets[cut].clone()
    one_shift = shift_labels[cut].clone() if shift_labels is not None else None
    if length < width:
        one_targets[0, -1] = ignore_index
        if one_shift is not None:
            one_shift[0, -1] = ignore_index
    return CheckRow(one, one_targets, labels[cut] if labels is not None else None, one_shift)
