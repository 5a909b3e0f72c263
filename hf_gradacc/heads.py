"""Which loss family a model belongs to, read from its class hierarchy (PEFT and accelerate wrappers removed)."""

from __future__ import annotations

import functools

import torch.nn as nn

from .errors import GradAccConfigError
from .loss import HEAD_TYPES, HeadType

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
