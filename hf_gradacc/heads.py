"""Which loss family a model belongs to, its labels' checks, and the one sum-reduced loss per family.

:class:`Head` is built once per trainer from the model and the settings: the family, the sequence-classification
problem type, the checks a micro-batch's labels pass (:meth:`Head.check_batch`), and the sum-reduced loss of the
built-in heads (:meth:`Head.sum_loss`). What a micro-batch counts is decided in :mod:`hf_gradacc.counting`, which
takes the head's family and problem type.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from .counting import LABEL_KEY, SHIFT_LABELS_KEY
from .errors import GradAccConfigError, GradAccDataError, GradAccLossError
from .loss import (
    HEAD_TYPES,
    IGNORE_INDEX,
    SAMPLE_LEVEL_HEADS,
    HeadType,
    ProblemType,
    bool_labels_problem,
    causal_targets,
    infer_problem_type,
    sequence_classification_sum,
    token_cross_entropy_sum,
)

logger = logging.get_logger(__name__)

_LM_HEADS = ("causal_lm", "seq2seq", "masked_lm")

# Class-name suffixes of the Hugging Face heads, checked along the MRO so user subclasses keep their family.
_SUFFIXES: tuple[tuple[str, HeadType], ...] = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForTokenClassification", "token_classification"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForSeq2SeqLM", "seq2seq"),
    ("ForImageClassification", "image_classification"),
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed / FSDP ``.module`` wrappers, ``torch.compile``'s ``_orig_mod`` and PEFT's
    ``get_base_model``."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile(model)
            model = model._orig_mod
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
        ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image_classification"),
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
        num_labels / problem_type: the model config's, for sequence and image classification.
        label_smoothing: `TrainingArguments.label_smoothing_factor`.
        allow_unlabelled: a batch without labels counts its rows as samples (an overridden ``compute_loss`` that
            returns ``LossTerm(..., "samples")`` needs no labels).

    Example:
        ```python
        head = Head.for_model(model, requested="auto")
        head.check_batch(batch)                    # labels of the wrong shape, dtype or range raise
        total = head.sum_loss(model(**inputs).logits, batch["labels"])
        ```
    """

    type: HeadType | None
    ignore_index: int = IGNORE_INDEX
    num_labels: int = 2
    problem_type: str | None = None
    label_smoothing: float = 0.0
    allow_unlabelled: bool = False
    num_classes: int | None = None

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
        """The rule of ``model``. With ``custom_loss`` (an overridden ``compute_loss``) an unknown family is
        allowed."""
        if custom_loss:
            head = detect_head_type(model) if requested == "auto" else resolve_head_type(model, requested)
        else:
            head = resolve_head_type(model, requested)
        base = unwrap_model(model)
        config = getattr(base, "config", None)
        num_labels = int(getattr(config, "num_labels", 2) or 2)
        classes = num_labels if config is not None and getattr(config, "num_labels", None) else None
        return cls(
            type=head,
            ignore_index=ignore_index,
            num_labels=num_labels,
            problem_type=getattr(config, "problem_type", None),
            label_smoothing=float(label_smoothing or 0.0),
            allow_unlabelled=custom_loss,
            num_classes=classes if head in ("token_classification", *SAMPLE_LEVEL_HEADS) else _vocab(base),
        )

    @property
    def is_sequence_level(self) -> bool:
        """One label per row (sequence and image classification): normalised by samples."""
        return self.type in SAMPLE_LEVEL_HEADS

    def denominator(self, *, labelled: bool = True) -> str:
        """``"samples"`` for sequence-level heads and unlabelled batches, ``"tokens"`` for every other head."""
        return "samples" if self.is_sequence_level or not labelled else "tokens"

    def problem_type_of(self, labels: torch.Tensor | None) -> ProblemType | None:
        if labels is None or not self.is_sequence_level:
            return None
        return infer_problem_type(self.num_labels, labels, self.problem_type)

    def count(self, batch: Mapping[str, Any]) -> Any:
        """The counts of ``batch`` for this head (a :class:`~hf_gradacc.counting.MicroBatchCounts`), after its label
        checks: what :class:`hf_gradacc.counting.Counter` decides, the one place that counts.

        Example:
            ```python
            trainer.head.count(batch).get("tokens")   # the micro-batch's counted target tokens
            ```
        """
        from .counting import Counter

        return Counter(self).count_batch(batch)

    def check_batch(self, batch: Mapping[str, Any], *, deferred: bool = False) -> tuple[Any, Any]:
        """The checks every micro-batch passes before it is counted (:class:`~hf_gradacc.counting.Counter`): its
        labels (:meth:`check_labels`), and a warning for rows trained on positions the model does not attend to.

        Returns ``(label_errors, unattended_rows)``: ``(0, 0)`` when checked at once (a refused id raises, the rows
        are warned about). ``deferred``: the two checks that need tensor values read none; their findings are 0-dim
        tensors where the batch is, which the step's count transfer brings to the host
        (:func:`~hf_gradacc.counting.gather_window_counts`, which checks a flagged micro-batch again at once). Checks
        of shapes and dtypes raise at once either way.

        Example:
            ```python
            head.check_batch(batch)                      # raises for a label id outside the vocabulary
            bad, _ = head.check_batch(batch, deferred=True)
            int(bad)                                     # the number of such ids (a read of a device value)
            ```
        """
        label_errors = self.check_labels(batch, deferred=deferred)
        return label_errors, self._warn_unattended_rows(batch, deferred=deferred)

    def _warn_unattended_rows(self, batch: Mapping[str, Any], *, deferred: bool = False) -> Any:
        """A row whose ``attention_mask`` is all zeros but whose labels count: trained and counted on positions the
        model does not attend to (most often a collator bug, e.g. a mask built for another padding side). Returns 0,
        or with ``deferred`` the number of such rows, unread, instead of the warning."""
        mask, labels = batch.get("attention_mask"), batch.get(LABEL_KEY)
        if (
            not (torch.is_tensor(mask) and mask.dim() == 2 and torch.is_tensor(labels))
            or labels.shape[:1] != mask.shape[:1]
        ):
            return 0
        counted = labels.reshape(labels.shape[0], -1) != self.ignore_index if not labels.is_floating_point() else None
        counted = counted.any(1) if counted is not None else torch.ones_like(mask[:, 0], dtype=torch.bool)
        unattended = (mask.sum(1) == 0) & counted
        if deferred:
            return unattended.sum()
        rows = unattended.nonzero().reshape(-1).tolist()
        if rows:
            logger.warning_once(
                f"Row(s) {rows} of a micro-batch have an `attention_mask` of all zeros but counted `labels`: they are "
                f"trained and counted on positions the model does not attend to. Mask their labels with "
                f"`ignore_index` ({self.ignore_index}) or drop such rows in the data collator."
            )
        return 0

    def check_labels(self, batch: Mapping[str, Any], *, deferred: bool = False) -> Any:
        """Raise :class:`~hf_gradacc.GradAccDataError` for labels this head cannot train on: the wrong shape for the
        family (token labels on a sequence head and the reverse, a length that differs from ``input_ids``) or class
        ids outside ``[0, num_classes)`` other than ``ignore_index``. Nothing is checked for an unknown head.

        Returns 0; with ``deferred``, the number of refused class ids as a 0-dim tensor, unread (the range check is
        the one that needs the labels' values): the caller raises once it has read it."""
        labels = batch.get(SHIFT_LABELS_KEY) if self.type == "causal_lm" and SHIFT_LABELS_KEY in batch else None
        key = SHIFT_LABELS_KEY if labels is not None else LABEL_KEY
        labels = labels if labels is not None else batch.get(LABEL_KEY)
        if self.type is None or not torch.is_tensor(labels):
            return 0
        fix = f"Fix the data collator, or set `head_type` if the model's head is not a {self.type} head."
        why = labels.dtype == torch.bool and bool_labels_problem(
            key, self.type, self.problem_type_of(labels), labels.shape
        )
        if why:  # stock raises torch's dtype error for these; regression trains on 0.0 / 1.0 as stock does
            raise GradAccDataError(why)
        if self.is_sequence_level:
            if not labels.is_floating_point() and labels.dim() == 2 and labels.shape[1] > 1:
                raise GradAccDataError(
                    f"`{key}` has shape {tuple(labels.shape)}: integer labels per token, but the model has a "
                    f"{self.type} head (one label per row). {fix}"
                )
        else:
            if labels.dim() != 2:
                raise GradAccDataError(
                    f"`{key}` has shape {tuple(labels.shape)}; a {self.type} head needs one label per token, shape "
                    f"(batch, sequence). {fix}"
                )
            inputs = batch.get("input_ids", batch.get("inputs_embeds"))
            if self.type != "seq2seq" and torch.is_tensor(inputs) and tuple(inputs.shape[:2]) != tuple(labels.shape):
                raise GradAccDataError(
                    f"`{key}` has shape {tuple(labels.shape)} but the inputs have shape {tuple(inputs.shape[:2])}: a "
                    f"{self.type} head needs one label per input token. {fix}"
                )
        if labels.is_floating_point() or labels.dtype == torch.bool or self.problem_type_of(labels) == "regression":
            return 0  # regression: any number is a target (integer ratings too), as in the stock Trainer's MSELoss
        self._check_label_dtype(key, labels)
        if self.num_classes is None:
            return 0
        bad = (labels != self.ignore_index) & ((labels < 0) | (labels >= self.num_classes))
        if deferred:
            return bad.sum()
        if bool(bad.any()):
            value = int(labels[bad].reshape(-1)[0])
            raise GradAccDataError(
                f"`{key}` holds the id {value}, outside [0, {self.num_classes}) (the model's "
                f"{'vocabulary' if self.type in _LM_HEADS else 'num_labels'}) and not `ignore_index` "
                f"({self.ignore_index}). Mask such positions with {self.ignore_index}, or set `ignore_index` to the "
                "value your data uses."
            )
        return 0

    def _check_label_dtype(self, key: str, labels: torch.Tensor) -> None:
        """Integer labels of a dtype that cannot hold ``ignore_index`` or every class id: before any compare with
        ``ignore_index``, which a narrow dtype wraps (-100 in uint8 is 156: masked positions would be trained)."""
        info = torch.iinfo(labels.dtype)
        largest = None if self.num_classes is None else self.num_classes - 1
        if self.ignore_index < info.min or self.ignore_index > info.max:
            wrapped = self.ignore_index % (info.max + 1 - info.min)
            why = f"cannot hold `ignore_index` ({self.ignore_index}): it wraps to {wrapped}"
        elif largest is not None and largest > info.max:
            why = f"cannot hold the class ids up to {largest}: larger ids wrapped when the labels were built"
        else:
            return
        raise GradAccDataError(
            f"`{key}` are {labels.dtype}, which {why}. Build the labels as torch.int64 (or int32) in the data "
            "collator / dataset."
        )

    def sum_loss(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The micro-batch's SUM-reduced loss of this head family (see :mod:`hf_gradacc.loss`)."""
        smoothing = self.label_smoothing
        if labels is not None and labels.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
            labels = labels.long()  # cross-entropy takes int64 class ids
        if self.type == "causal_lm":
            targets = shift_labels if shift_labels is not None else causal_targets(labels, self.ignore_index)
            return token_cross_entropy_sum(logits, targets.long(), self.ignore_index, smoothing)
        if self.type in ("seq2seq", "masked_lm", "token_classification"):
            return token_cross_entropy_sum(logits, labels, self.ignore_index, smoothing)
        if self.type in SAMPLE_LEVEL_HEADS:
            problem_type = self.problem_type_of(labels)
            if smoothing and problem_type != "single_label_classification":
                logger.warning_once(
                    f"`label_smoothing_factor` ({smoothing}) is ignored for problem type {problem_type!r}."
                )
                smoothing = 0.0
            total, _ = sequence_classification_sum(logits, labels, problem_type, self.ignore_index, smoothing)
            return total
        raise GradAccLossError(f"No built-in loss for head type {self.type!r}: set `head_type` or return a LossTerm.")


def _vocab(model: nn.Module) -> int | None:
    """Rows of the output embeddings (the classes of an LM head), or the config's ``vocab_size``; None if unknown."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        output = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        output = None
    weight = getattr(output, "weight", None)
    if torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[0] > 0:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
        size = getattr(cfg, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None
