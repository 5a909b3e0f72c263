"""Bad input gets a clear error (or a warning for an ignored setting) that names the value and the field."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from transformers.modeling_outputs import TokenClassifierOutput

from hf_gradacc import (
    GradAccConfig,
    GradAccConfigError,
    GradAccDataError,
    GradAccLossError,
    GradAccTrainer,
    LossTerm,
)
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import NUM_LABELS, VOCAB_SIZE, PaddingCollator, build_tiny_model, make_samples

BATCH_SIZE, GA = 2, 4


def _train_one_step(trainer_class, *, collator=None, task="causal_lm", model=None, **arg_overrides):
    samples = make_samples(task, BATCH_SIZE * GA, seed=11)
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA, **arg_overrides)
    return one_step_update(trainer_class, model or build_tiny_model(task), samples, args, data_collator=collator)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("gas", [0, -2])
def test_gradacc_config_rejects_ga_below_one(gas: int) -> None:
    with pytest.raises(GradAccConfigError, match=re.escape(f"`gradient_accumulation_steps` ({gas})")):
        GradAccConfig(output_dir="unused", gradient_accumulation_steps=gas, use_cpu=True, report_to=[])


def test_trainer_rejects_plain_training_arguments_with_ga_below_one(helpers) -> None:
    try:
        args = helpers.make_args(gradient_accumulation_steps=0)
    except ValueError as e:  # should transformers start rejecting it itself, its message must name the field
        assert "gradient_accumulation_steps" in str(e)
        return
    with pytest.raises(GradAccConfigError, match=re.escape("`gradient_accumulation_steps` (0) must be")):
        GradAccTrainer(model=build_tiny_model("causal_lm"), args=args)


@pytest.mark.parametrize(
    "field, value",
    [
        ("head_type", "causal"),
        ("zero_reduction", "per_step"),
        ("fsdp_sync", "sometimes"),
        ("ignore_index", "-100"),
    ],
)
def test_gradacc_config_rejects_bad_choices(field: str, value) -> None:
    with pytest.raises(GradAccConfigError, match=re.escape(f"`{field}` ({value!r})")):
        GradAccConfig(output_dir="unused", use_cpu=True, report_to=[], **{field: value})


def test_ignored_average_tokens_across_devices_is_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        GradAccConfig(output_dir="unused", use_cpu=True, report_to=[], average_tokens_across_devices=False)
    assert any("average_tokens_across_devices" in r.getMessage() for r in caplog.records)


class ConfiglessTagger(torch.nn.Module):
    """A plain module: no `config`, no Hugging Face class name to read the head from."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB_SIZE, 16)
        self.head = torch.nn.Linear(16, NUM_LABELS)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return TokenClassifierOutput(logits=self.head(torch.tanh(self.embed(input_ids))))


def test_unknown_head_asks_for_head_type(helpers) -> None:
    with pytest.raises(GradAccConfigError, match="`head_type`") as info:
        GradAccTrainer(model=ConfiglessTagger(), args=helpers.make_args())
    assert "ConfiglessTagger" in str(info.value)


def test_unknown_head_with_head_type_set_is_exact() -> None:
    model = ConfiglessTagger()
    samples = make_samples("token_classification", BATCH_SIZE * GA, seed=11)
    args = one_step_args(
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=GA,
        args_class=GradAccConfig,
        head_type="token_classification",
    )
    update, _ = one_step_update(GradAccTrainer, model, samples, args)
    comparison = compare_with_reference(update, model, samples, "token_classification")
    assert comparison.relative_error <= 1e-5, comparison


# ---------------------------------------------------------------- data


def test_batch_without_labels_is_a_data_error() -> None:
    def drop_labels(samples):
        batch = PaddingCollator()(samples)
        del batch["labels"]
        return batch

    with pytest.raises(GradAccDataError, match="`labels`") as info:
        _train_one_step(GradAccTrainer, collator=drop_labels)
    assert "input_ids" in str(info.value)  # the keys the batch does have


@pytest.mark.parametrize("task", ["causal_lm", "masked_lm", "token_classification"])
def test_float_token_labels_are_a_data_error(task: str) -> None:
    def float_labels(samples):
        batch = PaddingCollator()(samples)
        batch["labels"] = batch["labels"].float()
        return batch

    with pytest.raises(GradAccDataError, match="torch.float32") as info:
        _train_one_step(GradAccTrainer, collator=float_labels, task=task)
    assert "`labels`" in str(info.value) and "head_type" in str(info.value)


# ---------------------------------------------------------------- what compute_loss returns


def _returning(value_fn):
    class Returning(GradAccTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            value = value_fn(outputs)
            return (value, outputs) if return_outputs else value

    return Returning


@pytest.mark.parametrize(
    "value_fn, match",
    [
        (lambda out: out.logits.float().logsumexp(-1), r"shape \(2, \d+\)"),
        (lambda out: float(out.loss.detach()), "returned a float"),
        (lambda out: {"lm": out.loss}, "'lm' is a Tensor"),
        (lambda out: {}, "empty dict"),
    ],
    ids=["non_scalar_tensor", "python_float", "dict_of_tensor", "empty_dict"],
)
def test_unusable_compute_loss_result_is_a_loss_error(value_fn, match: str) -> None:
    with pytest.raises(GradAccLossError, match=match):
        _train_one_step(_returning(value_fn))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(total=torch.tensor(1.0), normalize_by="rows"), GradAccLossError, r"`LossTerm.normalize_by` \('rows'\)"),
        (dict(total=torch.ones(3)), GradAccLossError, r"`LossTerm.total` must be a scalar.*shape \(3,\)"),
        (dict(total=1.0), TypeError, "`LossTerm.total` must be a tensor, got float"),
        (dict(total=torch.tensor(1.0), normalize_by=True), TypeError, "`LossTerm.normalize_by`"),
        (dict(total=torch.tensor(1.0), normalize_by=torch.ones(2)), GradAccLossError, r"one count, got shape \(2,\)"),
    ],
    ids=["unknown_denominator", "non_scalar_total", "total_not_tensor", "bool_count", "count_of_two_values"],
)
def test_bad_loss_term_is_rejected_on_creation(kwargs, error, match: str) -> None:
    with pytest.raises(error, match=match):
        LossTerm(**kwargs)


def test_plain_mean_loss_of_a_micro_batch_without_labels_is_a_loss_error(helpers) -> None:
    """`outputs.loss` of a micro-batch with no counted token is NaN (0/0): the step is refused, not taken."""

    class PlainLoss(helpers.sequential(GradAccTrainer)):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    samples = make_samples("causal_lm", BATCH_SIZE * GA, seed=11)
    for sample in samples[:BATCH_SIZE]:  # the first micro-batch
        sample["labels"] = [-100] * len(sample["labels"])
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    with pytest.raises(GradAccLossError, match="non-finite.*LossTerm"):
        one_step_update(PlainLoss, build_tiny_model("causal_lm"), samples, args)


@pytest.mark.parametrize("patched", [False, True])
def test_a_downgraded_fsdp_launch_says_what_to_change(monkeypatch, patched: bool) -> None:
    """An FSDP config that accelerate turned into CPU DDP: without the patch the message names the variable; with the
    patch on (the variable set) it names the missing `--use_cpu true` instead."""
    from hf_gradacc.backends import check_requested_backend
    from hf_gradacc.errors import UnsupportedBackendError

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    if patched:
        monkeypatch.setenv("HF_GRADACC_CPU_DISTRIBUTED", "1")
    else:
        monkeypatch.delenv("HF_GRADACC_CPU_DISTRIBUTED", raising=False)
    with pytest.raises(UnsupportedBackendError, match="asks for FSDP") as info:
        check_requested_backend("DistributedType.MULTI_CPU")
    message = str(info.value)
    assert ("--use_cpu true" in message) and (("is set, so the CPU patch is on" in message) == patched)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    check_requested_backend("DistributedType.MULTI_CPU")  # nothing asked: nothing raised


# ---------------------------------------------------------------- boolean and integer labels on sequence heads


class _TypedLabels:
    """Pads the inputs and builds ``labels`` of one dtype (bool, int64, float32) from the samples' values."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, rows):
        batch = PaddingCollator()([{"input_ids": r["input_ids"], "labels": 0} for r in rows])
        batch["labels"] = torch.tensor([r["labels"] for r in rows], dtype=self.dtype)
        return batch


def _sequence_model(num_labels: int, problem_type: str | None):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=VOCAB_SIZE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           num_labels=num_labels, problem_type=problem_type, pad_token_id=0)  # fmt: skip
    return tf.BertForSequenceClassification(config)


def _valued_samples(values):
    samples = make_samples("sequence_classification", len(values), seed=11)
    return [{**sample, "labels": value} for sample, value in zip(samples, values)]


@pytest.mark.parametrize(
    ("num_labels", "problem_type", "per_row", "fix"),
    [
        (2, None, 1, r"`labels.long\(\)`: False is class 0"),  # stock: a shape error (inferred multi-label)
        (2, "single_label_classification", 1, r"`labels.long\(\)`"),  # stock: "expected ... Long or Byte, got Bool"
        (3, "multi_label_classification", 3, r"`labels.float\(\)`: one 0/1 target per label"),  # stock: bool subtraction
        (3, None, 3, r"`labels.float\(\)`"),
    ],
)
def test_boolean_class_labels_are_a_data_error(num_labels, problem_type, per_row, fix) -> None:
    """Boolean labels on a single- or multi-label head: the stock Trainer's loss raises a raw torch error for each
    (measured with transformers 5.24: the comments above); ours names the dtype and the conversion, before any step."""
    values = [[bool((i + j) % 2) for j in range(per_row)] if per_row > 1 else bool(i % 2) for i in range(8)]
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    with pytest.raises(GradAccDataError, match=r"`labels` are torch.bool .*" + fix):
        one_step_update(GradAccTrainer, _sequence_model(num_labels, problem_type), _valued_samples(values), args,
                        data_collator=_TypedLabels(torch.bool))  # fmt: skip


@pytest.mark.parametrize(("dtype", "values"), [(torch.bool, [i % 3 == 0 for i in range(8)]), (torch.long, [3, 0, 4, 1, 5, 2, 3, 1])])
def test_boolean_and_integer_regression_targets_train_as_numbers(dtype: torch.dtype, values: list) -> None:
    """A regression head (num_labels=1) takes bool and integer labels as 0.0 / 1.0 and as numbers, as the stock
    Trainer's MSELoss does: exact against the float64 reference of the same values as float (integer ratings were
    refused as class ids outside [0, 1))."""
    model = _sequence_model(1, None)
    samples = _valued_samples(values)
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    update, _ = one_step_update(GradAccTrainer, model, samples, args, data_collator=_TypedLabels(dtype))
    reference = compare_with_reference(update, model, [{**s, "labels": float(s["labels"])} for s in samples],
                                       "regression", data_collator=_TypedLabels(torch.float32))  # fmt: skip
    assert reference.relative_error <= 1e-5, reference
