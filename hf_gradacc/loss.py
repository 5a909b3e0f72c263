"""Sum-reduced losses per head family, and the one normalisation rule.

Every function here takes tensors and ints and returns a SUM over the micro-batch's items, never a mean:
the mean is only correct once the denominator of the whole optimizer step (all micro-batches, all ranks)
is known, and that is :func:`normalize`'s job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .errors import GradAccLossError, GradAccTypeError

IGNORE_INDEX = -100

HeadType = Literal[
    "causal_lm",
    "seq2seq",
    "masked_lm",
    "token_classification",
    "sequence_classification",
    "image_classification",
]
HEAD_TYPES: tuple[str, ...] = (
    "causal_lm",
    "seq2seq",
    "masked_lm",
    "token_classification",
    "sequence_classification",
    "image_classification",
)
# Heads with one label per row, normalised by samples (their labels and losses follow the same problem types).
SAMPLE_LEVEL_HEADS: tuple[str, ...] = ("sequence_classification", "image_classification")
ProblemType = Literal["single_label_classification", "multi_label_classification", "regression"]
Denominator = Literal["tokens", "samples", "input_tokens", "weights"]
DENOMINATORS: tuple[str, ...] = ("tokens", "samples", "input_tokens", "weights")


@dataclass(frozen=True, slots=True)
class LossTerm:
    """A sum-reduced loss and the denominator that turns it into the exact mean of the optimizer step.

    Return one (or a ``dict[str, LossTerm]``) from an overridden ``compute_loss`` and
    :class:`~hf_gradacc.GradAccTrainer` divides ``total`` by the count summed over every micro-batch of
    the optimizer step and every data-parallel rank.

    Args:
        total: a scalar tensor, the SUM of the loss over this micro-batch's items.
        normalize_by: ``"tokens"`` (labels that are not ``ignore_index``, after the causal shift for
            causal LMs), ``"samples"`` (rows of the micro-batch with a label), ``"input_tokens"`` (input positions
            the model attends to: ``attention_mask == 1``, every position without a mask), ``"weights"`` (the sum of
            the batch's ``loss_weights`` over its counted targets, see :mod:`hf_gradacc.weights`), or this
            micro-batch's own count (a finite, non-negative whole number: an int or a one-value tensor), which the
            trainer sums over the window and all ranks — a count only known after the forward pass needs
            ``GradAccConfig(defer_normalization=True)``.

    Example:
        ```python
        from hf_gradacc import GradAccTrainer, LossTerm
        import torch.nn.functional as F

        class MyTrainer(GradAccTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                labels = inputs.pop("labels")
                outputs = model(**inputs)
                total = F.cross_entropy(outputs.logits, labels, reduction="sum")
                term = LossTerm(total=total, normalize_by="samples")
                return (term, outputs) if return_outputs else term
        ```
    """

    total: torch.Tensor
    normalize_by: Denominator | int | torch.Tensor = "tokens"

    def __post_init__(self) -> None:
        if not torch.is_tensor(self.total):
            raise GradAccTypeError(f"`LossTerm.total` must be a tensor, got {type(self.total).__name__}")
        if self.total.dim() != 0:
            raise GradAccLossError(
                f"`LossTerm.total` must be a scalar (a sum over the micro-batch), got shape {tuple(self.total.shape)}"
            )
        nb = self.normalize_by
        if isinstance(nb, str):
            if nb not in DENOMINATORS:
                raise GradAccLossError(
                    f"`LossTerm.normalize_by` ({nb!r}) must be one of {DENOMINATORS}, an int or a tensor"
                )
        elif isinstance(nb, bool) or not isinstance(nb, (int, torch.Tensor)):
            raise GradAccTypeError(
                f"`LossTerm.normalize_by` must be 'tokens', 'samples', an int or a tensor, got {nb!r}"
            )
        else:
            check_count(nb, where="`LossTerm.normalize_by`")


def check_count(count: int | torch.Tensor, *, where: str) -> int:
    """``count`` as an int, or :class:`~hf_gradacc.GradAccLossError` when it is not ONE finite, non-negative whole
    number (a tensor of several values, 2.5, -3, NaN). ``where`` names its origin in the message."""
    if torch.is_tensor(count):
        if count.numel() != 1:
            raise GradAccLossError(f"{where} as a tensor must hold one count, got shape {tuple(count.shape)}")
        value = float(count.detach().reshape(()).double())
    else:
        value = float(count)
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise GradAccLossError(
            f"{where} ({value:g}) must be a finite, non-negative whole number of items: the step's loss is divided "
            "by the sum of these counts over every micro-batch and rank."
        )
    return int(value)


def causal_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of a causal LM: position ``i`` predicts ``labels[i + 1]``; the last position predicts nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def counted_targets(
    labels: torch.Tensor | None,
    head_type: str,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    problem_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, counted)``: the targets the head's loss sums over, in the layout of its per-target losses, and
    which of them count. The one rule, asked by what a micro-batch counts (:mod:`hf_gradacc.counting`) and by what its
    weights weigh (:mod:`hf_gradacc.weights`):

    - causal LM: ``shift_labels`` as given when the batch has them (a context-parallel shard's last target lives on
      the next shard), else ``labels`` shifted (position ``i`` predicts ``labels[i + 1]``, the last one nothing);
    - sequence-level heads: one target per row; single-label integer rows count unless labelled ``ignore_index``,
      every other row counts (regression, multi-label);
    - the other token heads: ``labels``; a target counts unless it is ``ignore_index``.

    Example:
        ```python
        targets, counted = counted_targets(torch.tensor([[-100, 5, 6]]), "causal_lm")
        targets.tolist(), counted.tolist()   # [[5, 6, -100]], [[True, True, False]]
        ```
    """
    if head_type == "causal_lm":
        targets = shift_labels if shift_labels is not None else causal_targets(labels, ignore_index)
        return targets, targets != ignore_index
    if head_type in SAMPLE_LEVEL_HEADS:
        rows = labels.shape[0] if labels.dim() > 0 else 1
        if problem_type in (None, "single_label_classification") and not labels.is_floating_point():
            return labels, labels.reshape(rows, -1)[:, 0] != ignore_index
        return labels, torch.ones(rows, dtype=torch.bool, device=labels.device)
    return labels, labels != ignore_index


def model_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` as a transformers model takes them (int64, ignored positions ``-100``): its own loss and the decoder
    inputs it builds from labels know only ``-100``, so any other ``ignore_index`` (``-1``) would be a target there."""
    labels = labels.long()
    return labels if ignore_index == IGNORE_INDEX else labels.masked_fill(labels == ignore_index, IGNORE_INDEX)


def token_count(targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of targets that are not ``ignore_index`` (an int64 scalar tensor)."""
    return targets.ne(ignore_index).sum()


def token_cross_entropy_sum(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy summed over every target that is not ``ignore_index``.

    ``logits`` is ``(..., num_classes)`` and ``targets`` is ``(...)``, already aligned (shifted for causal
    LMs). The logits are upcast to float32 as the Hugging Face losses do. With no counted target the result
    is an exact zero that still depends on ``logits`` (so a backward pass reaches every parameter).
    """
    num_classes = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, num_classes),
        targets.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
        label_smoothing=label_smoothing,
    )


def sequence_classification_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    problem_type: ProblemType,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum-reduced sequence-level loss and its sample count, matching the Hugging Face mean per problem type.

    - ``single_label_classification``: cross-entropy summed over rows whose label is not ``ignore_index``.
    - ``regression``: squared error, averaged over the ``num_labels`` outputs of a row, summed over rows
      (the Hugging Face ``MSELoss`` is a mean over rows x outputs).
    - ``multi_label_classification``: binary cross-entropy, averaged over the labels of a row, summed over rows.

    Returns ``(total, num_samples)``.
    """
    if problem_type == "single_label_classification":
        targets = labels.reshape(-1)
        total = token_cross_entropy_sum(logits, targets, ignore_index, label_smoothing)
        return total, token_count(targets, ignore_index)
    if problem_type == "regression":
        num_outputs = logits.shape[-1]
        pred = logits.float().reshape(labels.shape[0], -1)
        target = labels.to(pred.dtype).reshape(labels.shape[0], -1)
        total = F.mse_loss(pred, target, reduction="sum") / num_outputs
        return total, torch.tensor(labels.shape[0], device=labels.device)
    if problem_type == "multi_label_classification":
        num_outputs = logits.shape[-1]
        target = labels.to(logits.dtype if logits.is_floating_point() else torch.float32)
        total = F.binary_cross_entropy_with_logits(logits.float(), target.float(), reduction="sum") / num_outputs
        return total, torch.tensor(labels.shape[0], device=labels.device)
    raise GradAccLossError(
        f"`problem_type` ({problem_type!r}) must be one of 'single_label_classification', "
        "'multi_label_classification', 'regression'"
    )


def bool_labels_problem(key: str, head_type: str, problem_type: str | None, shape: tuple[int, ...]) -> str | None:
    """Why boolean ``labels`` cannot train this head, or None (regression: 0.0 / 1.0 targets, as the stock Trainer's
    ``MSELoss`` takes them). The stock losses refuse them everywhere else with a raw torch error (cross-entropy:
    "expected target dtype to be Long or Byte"; binary cross-entropy: "Subtraction ... with two bool tensors"; an
    inferred problem type: multi-label, a shape error for one label per row): a ``GradAccDataError`` says what to
    do."""
    if problem_type == "regression":
        return None
    kind = f"a {head_type} head" + (f" ({problem_type})" if problem_type else "")
    if problem_type == "multi_label_classification" and len(shape) == 2:
        fix = f"Build them as float (`{key}.float()`: one 0/1 target per label) in the data collator / dataset."
    else:
        fix = (
            f"Build them as torch.int64 class ids (`{key}.long()`: False is class 0, True class 1) in the data "
            "collator / dataset."
        )
    return f"`{key}` are torch.bool (shape {tuple(shape)}); {kind} cannot train on boolean labels. {fix}"


def infer_problem_type(num_labels: int, labels: torch.Tensor, problem_type: str | None) -> ProblemType:
    """The problem type the Hugging Face sequence-classification heads would pick for these labels."""
    if problem_type is not None:
        return problem_type  # type: ignore[return-value]
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def normalize(total: torch.Tensor, global_count: torch.Tensor | int, dp_world_size: int) -> torch.Tensor:
    """The single normalisation rule of the project.

    ``total`` is a micro-batch's summed loss, ``global_count`` the denominator summed over every micro-batch
    of the optimizer step and every data-parallel rank. DDP, FSDP2 and DeepSpeed all AVERAGE gradients over
    the ``dp_world_size`` ranks, so the loss is multiplied by it to make the reduced gradient a global SUM
    divided by the global count. Nothing divides by the number of micro-batches.
    """
    if torch.is_tensor(global_count):
        global_count = global_count.to(device=total.device, dtype=total.dtype)
    return total * dp_world_size / global_count


@dataclass(frozen=True, slots=True)
class LossOutput:
    """What ``compute_loss`` returned, parsed once: either named :class:`LossTerm` s, or one plain scalar.

    A plain scalar is read as a MEAN over the micro-batch's counted items (what a model's ``outputs.loss`` is);
    ``outputs`` holds the model outputs when ``compute_loss`` returned ``(loss, outputs)``.
    """

    terms: dict[str, LossTerm]
    plain: torch.Tensor | None = None
    outputs: Any = None

    def batch_mean(self, counts: Any) -> torch.Tensor:
        """The terms as ONE batch's mean loss (evaluation): each sum over its own count in this batch (``counts``
        has ``get("tokens" | "samples")``), added up."""
        parts = [
            term.total
            / ((counts.get(term.normalize_by) if isinstance(term.normalize_by, str) else int(term.normalize_by)) or 1)
            for term in self.terms.values()
        ]
        return sum(parts[1:], parts[0])


def parse_loss_output(raw: Any) -> LossOutput:
    """The one parser of what an (overridden) ``compute_loss`` returns, with a clear error for anything unusable.

    Accepted: a scalar tensor, a :class:`LossTerm`, a non-empty ``dict[str, LossTerm]``, or a tuple whose first
    element is one of those (``(loss, outputs)``).

    Example:
        ```python
        parsed = parse_loss_output(LossTerm(total=torch.tensor(3.0), normalize_by="samples"))
        assert list(parsed.terms) == ["loss"] and parsed.plain is None
        ```
    """
    outputs = None
    if isinstance(raw, tuple):
        raw, outputs = raw[0], (raw[1] if len(raw) > 1 else None)
    if isinstance(raw, LossTerm):
        return LossOutput(terms={"loss": raw}, outputs=outputs)
    if isinstance(raw, Mapping):
        if not raw:
            raise GradAccLossError("compute_loss returned an empty dict; return at least one LossTerm")
        for name, term in raw.items():
            if not isinstance(term, LossTerm):
                raise GradAccLossError(
                    f"compute_loss returned a dict whose value {name!r} is a {type(term).__name__}; "
                    "every value must be an hf_gradacc.LossTerm"
                )
        return LossOutput(terms={str(name): term for name, term in raw.items()}, outputs=outputs)
    if not torch.is_tensor(raw):
        raise GradAccLossError(
            f"compute_loss returned a {type(raw).__name__}; return a scalar tensor, an hf_gradacc.LossTerm or a "
            "dict of LossTerms"
        )
    if raw.dim() != 0:
        raise GradAccLossError(
            f"compute_loss returned a loss of shape {tuple(raw.shape)}; it must be a scalar. Reduce it with "
            ".sum() and return hf_gradacc.LossTerm(total=..., normalize_by=...)."
        )
    return LossOutput(terms={}, plain=raw, outputs=outputs)
