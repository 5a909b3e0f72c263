"""Runs of the catalogue's rows on label values (catalogue.py): boolean labels on a sequence classifier, integer
targets on a regression head, ``ignore_index=-1`` with the fused LM head."""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import VOCAB_SIZE, PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5


def _args(**overrides: Any) -> GradAccConfig:
    return one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         **overrides)  # fmt: skip


def _classifier(num_labels: int) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=VOCAB_SIZE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           num_labels=num_labels, pad_token_id=0)  # fmt: skip
    return tf.BertForSequenceClassification(config)


def _typed(dtype: torch.dtype):
    def collate(rows):
        batch = PaddingCollator()([{"input_ids": r["input_ids"], "labels": 0} for r in rows])
        batch["labels"] = torch.tensor([r["labels"] for r in rows], dtype=dtype)
        return batch

    return collate


def _valued(values: list) -> list[dict[str, Any]]:
    return [{**s, "labels": v} for s, v in zip(make_samples("sequence_classification", len(values), seed=11), values)]


def bool_class_labels() -> None:
    """Boolean labels on a single-label classifier (``problem_type='single_label_classification'``)."""
    model = _classifier(2)
    model.config.problem_type = "single_label_classification"
    one_step_update(GradAccTrainer, model, _valued([i % 3 == 0 for i in range(8)]), _args(),
                    data_collator=_typed(torch.bool))  # fmt: skip


def integer_regression_targets() -> float:
    """Integer targets (ratings 0-5) on a regression head (``num_labels=1``): trained as numbers."""
    model, samples = _classifier(1), _valued([3, 0, 4, 1, 5, 2, 3, 1])
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(), data_collator=_typed(torch.long))
    as_float = [{**s, "labels": float(s["labels"])} for s in samples]
    error = compare_with_reference(update, model, as_float, "regression", data_collator=_typed(torch.float32))
    assert error.relative_error <= TOLERANCE, error
    return error.relative_error


def fused_head_ignore_minus_one() -> float:
    """``ignore_index=-1`` (labels and padding) with ``fused_lm_head=True``: exact, the start-up check run."""
    model, samples = build_tiny_model("causal_lm"), make_samples("causal_lm", 8, seed=11)
    for sample in samples:
        sample["labels"] = [-1 if label == -100 else label for label in sample["labels"]]
    collate = PaddingCollator(ignore_index=-1)
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(fused_lm_head=True, ignore_index=-1),
                                data_collator=collate)  # fmt: skip
    error = compare_with_reference(update, model, samples, "causal_lm", data_collator=collate, ignore_index=-1)
    assert error.relative_error <= TOLERANCE, error
    return error.relative_error
