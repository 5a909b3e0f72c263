"""BatchNorm under gradient accumulation (``GradAccArguments.batchnorm``), on the tiny ResNet (one process).

- ``per_micro_batch`` (default) is the stock behaviour: each micro-batch normalised by its own statistics, the
  running statistics moved once per micro-batch; a warning, once, with the measured consequence;
- ``freeze_stats``: running statistics unchanged through training, and the accumulated step exact;
- ``precise``: before each evaluation, each save and at the end, the running statistics are those of the
  ``precise_bn_batches`` training batches (checked against a direct computation from the layers' inputs,
  :func:`hf_gradacc.testing.reference.batchnorm_statistics`).
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer
from hf_gradacc.callbacks import BatchNormCallback
from hf_gradacc.callbacks.batchnorm import MEASURED_CONSEQUENCE, batchnorm_layers
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import batchnorm_statistics, compare
from hf_gradacc.testing.tiny import (
    ListDataset,
    PaddingCollator,
    build_tiny_image_model,
    build_tiny_model,
    make_samples,
)

BATCH_SIZE, GA = 2, 4
WARNING = "BatchNorm layer(s)"


def _trainer(*, num_samples: int = 24, callbacks=(), eval_samples: int = 0, **overrides) -> GradAccTrainer:
    kwargs = dict(
        output_dir=overrides.pop("output_dir", "unused"), per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=GA, max_steps=3, learning_rate=0.1, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    kwargs.update(overrides)
    eval_dataset = ListDataset(make_samples("image_classification", eval_samples, seed=5)) if eval_samples else None
    return GradAccTrainer(
        model=build_tiny_image_model("resnet"),
        args=GradAccConfig(**kwargs),
        train_dataset=ListDataset(make_samples("image_classification", num_samples, seed=1)),
        eval_dataset=eval_dataset,
        data_collator=PaddingCollator(),
        callbacks=list(callbacks),
    )


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _bn_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


# ---------------------------------------------------------------------------------------------- per_micro_batch
def test_the_warning_fires_once_with_the_measured_consequence(caplog) -> None:
    trainer = _trainer(eval_samples=4, eval_strategy="steps", eval_steps=1)
    with caplog.at_level(logging.WARNING):
        trainer.train()
        trainer.train()  # a second run of the same trainer: still the one warning
    messages = _bn_warnings(caplog)
    assert len(messages) == 1, messages
    assert "6 BatchNorm layer(s)" in messages[0] and "gradient_accumulation_steps=4" in messages[0]
    assert MEASURED_CONSEQUENCE in messages[0] and "batchnorm='freeze_stats'" in messages[0]


@pytest.mark.parametrize("overrides", [{"gradient_accumulation_steps": 1}, {"batchnorm": "freeze_stats"}])
def test_no_warning_without_accumulation_or_with_frozen_statistics(caplog, overrides) -> None:
    with caplog.at_level(logging.WARNING):
        _trainer(max_steps=1, **overrides).train()
    assert _bn_warnings(caplog) == []


def test_per_micro_batch_is_the_stock_behaviour() -> None:
    """One step: the running statistics move once per micro-batch, exactly as under the stock Trainer."""
    model = build_tiny_image_model("resnet")
    samples = make_samples("image_classification", BATCH_SIZE * GA, seed=1)
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    _, ours = one_step_update(GradAccTrainer, model, samples, args)
    _, stock = one_step_update(Trainer, model, samples, one_step_args(per_device_train_batch_size=BATCH_SIZE,
                                                                      gradient_accumulation_steps=GA))  # fmt: skip
    assert isinstance(ours.callback_handler.callbacks[-1], BatchNormCallback)
    ours_buffers, stock_buffers = _buffers(ours.model), _buffers(stock.model)
    assert ours_buffers.keys() == stock_buffers.keys()
    for name, value in ours_buffers.items():
        torch.testing.assert_close(value, stock_buffers[name], rtol=1e-6, atol=1e-7, msg=name)
    tracked = [v for n, v in ours_buffers.items() if n.endswith("num_batches_tracked")]
    assert len(tracked) == 6 and all(int(v) == GA for v in tracked)


# Measured: tiny ResNet, seeds 0-3, GA 4, the update of N micro-batches against the update of one full batch.
MEASURED = {2: (0.76, 1.16), 8: (0.40, 0.69)}


@pytest.mark.parametrize("micro_batch", sorted(MEASURED))
def test_per_micro_batch_step_is_not_the_full_batch_step(micro_batch: int) -> None:
    errors = []
    for seed in range(4):
        model = build_tiny_image_model("resnet", seed=seed)
        samples = make_samples("image_classification", GA * micro_batch, seed=seed + 1)
        full, _ = one_step_update(GradAccTrainer, model, samples, one_step_args(
            per_device_train_batch_size=GA * micro_batch, gradient_accumulation_steps=1))  # fmt: skip
        accumulated, _ = one_step_update(GradAccTrainer, model, samples, one_step_args(
            per_device_train_batch_size=micro_batch, gradient_accumulation_steps=GA))  # fmt: skip
        errors.append(compare(accumulated, full).relative_error)
    low, high = MEASURED[micro_batch]
    assert min(errors) == pytest.approx(low, abs=0.01) and max(errors) == pytest.approx(high, abs=0.01), errors
    assert f"{low:.2f}-{high:.2f}" in MEASURED_CONSEQUENCE
    assert f"micro-batches of {micro_batch}" in MEASURED_CONSEQUENCE


# ---------------------------------------------------------------------------------------------- freeze_stats
def test_freeze_stats_keeps_running_statistics_and_the_step_exact() -> None:
    trainer = _trainer(batchnorm="freeze_stats")
    before = _buffers(trainer.model)
    params_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 3
    after = _buffers(trainer.model)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert moved == []
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, params_before[n])]
    assert len(changed) == len(params_before)  # the BatchNorm weights and biases still train
    # The hooks are gone after training: in train mode the layers update their statistics again.
    trainer.model.train()
    with torch.no_grad():
        trainer.model(**PaddingCollator()(make_samples("image_classification", 4, seed=9)))
    assert not torch.equal(before["resnet.embedder.embedder.normalization.running_mean"],
                           trainer.model.resnet.embedder.embedder.normalization.running_mean)  # fmt: skip


def test_freeze_stats_accumulated_step_equals_the_full_batch_step() -> None:
    model = build_tiny_image_model("resnet")
    samples = make_samples("image_classification", BATCH_SIZE * GA, seed=3)
    gradacc_args = {"gradacc_args": {"batchnorm": "freeze_stats"}}
    full, _ = one_step_update(GradAccTrainer, model, samples, one_step_args(
        per_device_train_batch_size=BATCH_SIZE * GA, gradient_accumulation_steps=1), trainer_kwargs=gradacc_args)
    accumulated, _ = one_step_update(GradAccTrainer, model, samples, one_step_args(
        per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA), trainer_kwargs=gradacc_args)
    assert compare(accumulated, full).relative_error <= 1e-5  # fmt: skip


# ---------------------------------------------------------------------------------------------- precise
class _AtEvaluation(TrainerCallback):
    def __init__(self) -> None:
        self.models: list[tuple[int, torch.nn.Module]] = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.models.append((state.global_step, copy.deepcopy(model)))


def _assert_precise(model: torch.nn.Module, callback: BatchNormCallback, step: int) -> None:
    batches = list(callback.precise_batches(types.SimpleNamespace(global_step=step)))
    assert len(batches) == callback.num_batches
    direct = batchnorm_statistics(model, batches)
    assert len(direct) == 6
    for name, layer in batchnorm_layers(model):
        mean, var = direct[name]
        torch.testing.assert_close(layer.running_mean, mean, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")
        torch.testing.assert_close(layer.running_var, var, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")
        assert layer.momentum == 0.1  # restored after the cumulative average


def test_precise_statistics_before_each_evaluation_and_at_the_end() -> None:
    at_evaluation = _AtEvaluation()
    trainer = _trainer(batchnorm="precise", precise_bn_batches=3, eval_samples=4, eval_strategy="steps",
                       eval_steps=1, callbacks=[at_evaluation])  # fmt: skip
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, BatchNormCallback)]
    trainer.train()
    assert callback.mode == "precise" and callback.num_batches == 3
    assert callback.num_recomputed == 3 + 1  # three evaluations, the end of training
    assert [step for step, _ in at_evaluation.models] == [1, 2, 3]
    for step, model in at_evaluation.models:
        _assert_precise(model, callback, step)
    _assert_precise(trainer.model, callback, trainer.state.global_step)


@pytest.mark.parametrize("training", [True, False])
def test_update_running_stats_restores_the_mode_and_momentum(training: bool) -> None:
    from hf_gradacc.callbacks.batchnorm import update_running_stats

    model = build_tiny_image_model("resnet").train(training)
    batches = [PaddingCollator()(make_samples("image_classification", 4, seed=s)) for s in range(2)]
    assert update_running_stats(model, batches) == 2
    assert model.training is training
    assert all(layer.training is training and layer.momentum == 0.1 for _, layer in batchnorm_layers(model))
    direct = batchnorm_statistics(model, batches)
    for name, layer in batchnorm_layers(model):
        mean, var = direct[name]
        torch.testing.assert_close(layer.running_mean, mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.running_var, var, rtol=1e-5, atol=1e-6)


def test_precise_statistics_before_each_save(tmp_path) -> None:
    trainer = _trainer(batchnorm="precise", precise_bn_batches=2, max_steps=2, save_strategy="steps", save_steps=1,
                       output_dir=str(tmp_path))  # fmt: skip
    trainer.train()
    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, BatchNormCallback)]
    assert callback.num_recomputed == 2 + 1
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    model_at_1 = build_tiny_image_model("resnet")
    model_at_1.load_state_dict(saved)
    _assert_precise(model_at_1, callback, 1)


def test_precise_leaves_the_training_itself_unchanged() -> None:
    """The precise batches come from a generator of their own: parameters after training are those of the default
    mode (running statistics do not enter a training-mode forward pass)."""
    runs = {}
    for mode in ("per_micro_batch", "precise"):
        trainer = _trainer(batchnorm=mode, precise_bn_batches=2, eval_samples=4, eval_strategy="steps", eval_steps=1)
        trainer.train()
        runs[mode] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(runs["precise"][n], runs["per_micro_batch"][n]) for n in runs["precise"])


# ---------------------------------------------------------------------------------------------- wiring and knobs
def test_the_trainer_adds_the_callback_only_where_it_matters(caplog) -> None:
    args = GradAccConfig("unused", use_cpu=True, report_to=[])
    text = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args)
    assert not any(isinstance(cb, BatchNormCallback) for cb in text.callback_handler.callbacks)
    mine = BatchNormCallback("freeze_stats")
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(callbacks=[mine], batchnorm="precise")
    added = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, BatchNormCallback)]
    assert added == [mine]
    assert "`batchnorm='precise'` is ignored: the BatchNormCallback passed to the trainer has mode 'freeze_stats'" in (
        caplog.text
    )


def test_a_mode_on_a_model_without_batchnorm_is_ignored_with_a_warning(caplog) -> None:
    args = GradAccConfig("unused", use_cpu=True, report_to=[], max_steps=1, batchnorm="freeze_stats",
                         per_device_train_batch_size=2, disable_tqdm=True, save_strategy="no")  # fmt: skip
    trainer = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args, data_collator=PaddingCollator(),
                             train_dataset=ListDataset(make_samples("causal_lm", 4)))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "`batchnorm='freeze_stats'` is ignored: the model has no BatchNorm layer" in caplog.text


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (
            {"batchnorm": "frozen"},
            "`batchnorm` ('frozen') must be one of ('per_micro_batch', 'freeze_stats', 'precise')",
        ),
        ({"batchnorm": "precise", "precise_bn_batches": 0}, "`precise_bn_batches` (0) must be an int >= 1"),
    ],
)
def test_bad_knobs_are_config_errors(knobs, message) -> None:
    with pytest.raises(GradAccConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GradAccConfig("unused", use_cpu=True, report_to=[], **knobs)
    with pytest.raises(GradAccConfigError):
        BatchNormCallback(knobs["batchnorm"], num_batches=knobs.get("precise_bn_batches", 1))


def test_precise_batches_without_precise_is_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        GradAccConfig("unused", use_cpu=True, report_to=[], precise_bn_batches=5)
    assert "`precise_bn_batches` (5) is ignored: it is used only with `batchnorm='precise'`" in caplog.text
