"""Which loss family a model belongs to, and the one rule per family: what is counted and what is summed.

:class:`Head` is built once per trainer from the model and the settings. It is the only place that decides a
micro-batch's denominator (:meth:`Head.count`), the sequence-classification problem type, and the sum-reduced loss
of the built-in heads (:meth:`Head.sum_loss`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from .errors import GradAccConfigError, GradAccLossError
from .loss import (
    HEAD_TYPES,
    IGNORE_INDEX,
    HeadType,
    ProblemType,
    causal_targets,
    infer_problem_type,
    sequence_classification_sum,
    token_cross_entropy_sum,
)
from .window import LABEL_KEY, SHIFT_LABELS_KEY, MicroBatchCounts, count_micro_batch

logger = logging.get_logger(__name__)

# Class-name suffixes of the Hugging Face heads, checked along the MRO so user subclasses keep their family.
_SUFFIXES: tuple[tuple[str, HeadType], ...] = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForTokenClassification", "token_classification"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForSeq2SeqLM", "seq2seq"),
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed / FSDP ``.module`` wrappers and PEFT's ``get_base_model``."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            break
    return model


@functools.lru_cache(maxsize=1)
def _mapping_heads() -> dict[str, HeadType]:
    from transformers.models.auto import modeling_auto as ma

    tables: list[tuple[str, HeadType]] = [
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal_lm"),
        ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "causal_lm"),
        ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
        ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked_lm"),
        ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token_classification"),
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence_classification"),
    ]
    heads: dict[str, HeadType] = {}
    for table_name, head in tables:
        for value in getattr(ma, table_name, {}).values():
            for name in value if isinstance(value, (list, tuple)) else [value]:
                heads.setdefault(name, head)
    return heads


def detect_head_type(model: nn.Module) -> HeadType | None:
    """The loss family of ``model``, or None when it cannot be told from the class.

    Encoder-decoder models whose class ends in ``ForConditionalGeneration`` are ``seq2seq`` (unshifted
    targets); decoder-only ones (most VLMs) are ``causal_lm``.
    """
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    for cls in type(base).__mro__:
        if cls in (nn.Module, object):
            break
        head = _mapping_heads().get(cls.__name__)
        if head is None:
            for suffix, family in _SUFFIXES:
                if cls.__name__.endswith(suffix):
                    head = family
                    break
        if head is None and cls.__name__.endswith("ForConditionalGeneration"):
            head = "seq2seq" if is_encoder_decoder else "causal_lm"
        if head is not None:
            if head == "causal_lm" and is_encoder_decoder:
                return "seq2seq"
            return head
    return None


def resolve_head_type(model: nn.Module, requested: str) -> HeadType:
    """``requested`` when it is a head type, else the detected one; a clear error when neither is known."""
    if requested != "auto":
        if requested not in HEAD_TYPES:
            raise GradAccConfigError(f"`head_type` ({requested!r}) must be 'auto' or one of {HEAD_TYPES}")
        return requested  # type: ignore[return-value]
    head = detect_head_type(model)
    if head is None:
        raise GradAccConfigError(
            f"Cannot tell the loss family of {type(unwrap_model(model)).__name__}: set `head_type` in GradAccConfig "
            f"to one of {HEAD_TYPES}, or override `compute_loss` and return an `hf_gradacc.LossTerm`."
        )
    return head


@dataclass(frozen=True, slots=True, kw_only=True)
class Head:
    """The count and loss rule of one model's head family.

    Args:
        type: the head family, or None when unknown (only possible with an overridden ``compute_loss``: tokens are
            then counted on unshifted labels).
        ignore_index: the label value that is neither a target nor counted.
        num_labels / problem_type: the model config's, for sequence classification.
        label_smoothing: `TrainingArguments.label_smoothing_factor`.
        allow_unlabelled: a batch without labels counts its rows as samples (an overridden ``compute_loss`` that
            returns ``LossTerm(..., "samples")`` needs no labels).

    Example:
        ```python
        head = Head.for_model(model, requested="auto")
        counts = head.count(batch)                 # MicroBatchCounts(num_tokens=..., num_samples=...)
        total = head.sum_loss(model(**inputs).logits, batch["labels"])
        ```
    """

    type: HeadType | None
    ignore_index: int = IGNORE_INDEX
    num_labels: int = 2
    problem_type: str | None = None
    label_smoothing: float = 0.0
    allow_unlabelled: bool = False

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        *,
        requested: str = "auto",
        ignore_index: int = IGNORE_INDEX,
        label_smoothing: float = 0.0,
        custom_loss: bool = False,
    ) -> Head:
        """The rule of ``model``. With ``custom_loss`` (an overridden ``compute_loss``) an unknown family is allowed."""
        if custom_loss:
            head = detect_head_type(model) if requested == "auto" else resolve_head_type(model, requested)
        else:
            head = resolve_head_type(model, requested)
        config = getattr(unwrap_model(model), "config", None)
        return cls(
            type=head,
            ignore_index=ignore_index,
            num_labels=int(getattr(config, "num_labels", 2) or 2),
            problem_type=getattr(config, "problem_type", None),
            label_smoothing=float(label_smoothing or 0.0),
            allow_unlabelled=custom_loss,
        )

    @property
    def is_sequence_level(self) -> bool:
        return self.type == "sequence_classification"

    def denominator(self, *, labelled: bool = True) -> str:
        """``"samples"`` for sequence-level heads and unlabelled batches, ``"tokens"`` for every other head."""
        return "samples" if self.is_sequence_level or not labelled else "tokens"

    def problem_type_of(self, labels: torch.Tensor | None) -> ProblemType | None:
        if labels is None or not self.is_sequence_level:
            return None
        return infer_problem_type(self.num_labels, labels, self.problem_type)

    def count(self, batch: Mapping[str, Any]) -> MicroBatchCounts:
        """The denominator counts of one micro-batch (see :func:`~hf_gradacc.window.count_micro_batch`)."""
        return count_micro_batch(
            batch,
            self.type or "masked_lm",
            ignore_index=self.ignore_index,
            problem_type=self.problem_type_of(batch.get(LABEL_KEY)),
            allow_unlabelled=self.allow_unlabelled,
        )

    def count_labels(self, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None) -> int:
        """The count of the head's denominator for these labels alone (evaluation)."""
        batch = {LABEL_KEY: labels} if shift_labels is None else {LABEL_KEY: labels, SHIFT_LABELS_KEY: shift_labels}
        counts = count_micro_batch(
            batch,
            self.type or "masked_lm",
            ignore_index=self.ignore_index,
            problem_type=self.problem_type_of(labels),
        )
        return counts.get(self.denominator())

    def sum_loss(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The micro-batch's SUM-reduced loss of this head family (see :mod:`hf_gradacc.loss`)."""
        smoothing = self.label_smoothing
        if self.type == "causal_lm":
            targets = shift_labels if shift_labels is not None else causal_targets(labels, self.ignore_index)
            return token_cross_entropy_sum(logits, targets, self.ignore_index, smoothing)
        if self.type in ("seq2seq", "masked_lm", "token_classification"):
            return token_cross_entropy_sum(logits, labels, self.ignore_index, smoothing)
        if self.type == "sequence_classification":
            problem_type = self.problem_type_of(labels)
            if smoothing and problem_type != "single_label_classification":
                logger.warning_once(
                    f"`label_smoothing_factor` ({smoothing}) is ignored for problem type {problem_type!r}."
                )
                smoothing = 0.0
            total, _ = sequence_classification_sum(logits, labels, problem_type, self.ignore_index, smoothing)
            return total
        raise GradAccLossError(f"No built-in loss for head type {self.type!r}: set `head_type` or return a LossTerm.")
