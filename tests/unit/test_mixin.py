"""`GradAccMixin` composes with any Trainer subclass: the shipped Seq2Seq pair, a user's own subclass, knobs given
without a GradAcc config, and the 0.1 import paths that keep working for one release."""

from __future__ import annotations

import copy
import importlib

import pytest
from transformers import HfArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

from hf_gradacc import (
    GradAccArguments,
    GradAccConfigError,
    GradAccMixin,
    GradAccSeq2SeqConfig,
    GradAccSeq2SeqTrainer,
    GradAccTrainer,
    gradacc_config_class,
)
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
BS, GA = 2, 4


class OwnTrainer(Trainer):
    """A user's Trainer subclass with behaviour of its own (a log field and a counter of its hook)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logged_steps = 0

    def log(self, logs, start_time=None):
        if "loss" in logs:
            self.logged_steps += 1
            logs["own_field"] = 1.0
        super().log(logs, start_time)


class MixedOwnTrainer(GradAccMixin, OwnTrainer):
    pass


class MixedSeq2SeqTrainer(GradAccMixin, Seq2SeqTrainer):
    pass


def test_seq2seq_pair_is_exact_and_stock_seq2seq_trainer_is_not():
    model, samples = build_tiny_model("seq2seq"), make_samples("seq2seq", BS * GA, seed=3)
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, args_class=GradAccSeq2SeqConfig)
    update, trainer = one_step_update(GradAccSeq2SeqTrainer, model, samples, args)
    assert isinstance(trainer, Seq2SeqTrainer) and trainer.head.type == "seq2seq"
    assert compare_with_reference(update, model, samples, "seq2seq").relative_error <= TOLERANCE
    stock_args = one_step_args(
        per_device_train_batch_size=BS, gradient_accumulation_steps=GA, args_class=Seq2SeqTrainingArguments
    )
    stock, _ = one_step_update(Seq2SeqTrainer, model, samples, stock_args)
    assert compare_with_reference(stock, model, samples, "seq2seq").relative_error > 0.1


def test_seq2seq_predict_with_generate_evaluation_matches_the_stock_trainer(helpers):
    model = build_tiny_model("seq2seq")
    samples = make_samples("seq2seq", 4, seed=4)
    seen: dict[str, list] = {"ours": [], "stock": []}

    def evaluate(trainer_class, args_class, key):
        def compute_metrics(prediction):
            seen[key].append(prediction.predictions)
            return {"num_predictions": float(len(prediction.predictions))}

        args = helpers.make_args(
            args_class=args_class, predict_with_generate=True, generation_max_length=5, per_device_eval_batch_size=2
        )
        trainer = trainer_class(
            model=copy.deepcopy(model),
            args=args,
            eval_dataset=ListDataset(samples),
            data_collator=PaddingCollator(),
            compute_metrics=compute_metrics,
        )
        return trainer.evaluate()

    ours = evaluate(GradAccSeq2SeqTrainer, GradAccSeq2SeqConfig, "ours")
    stock = evaluate(Seq2SeqTrainer, Seq2SeqTrainingArguments, "stock")
    assert ours["eval_num_predictions"] == 4.0 and ours["eval_loss"] == pytest.approx(stock["eval_loss"], rel=1e-6)
    (predictions,), (stock_predictions,) = seen["ours"], seen["stock"]
    assert predictions.shape[0] == 4 and predictions.shape == stock_predictions.shape
    assert (predictions == stock_predictions).all()


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"gradacc_args": {"head_type": "sequence_classification"}},
        {"gradacc_args": GradAccArguments(regroup_micro_batches=True)},
    ],
    ids=["defaults", "dict", "arguments"],
)
def test_own_trainer_subclass_is_exact_and_keeps_its_behaviour(knobs):
    task = "sequence_classification"  # the stock Trainer is 4x off here
    model, samples = build_tiny_model(task), make_samples(task, BS * GA, seed=5)
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA)
    update, trainer = one_step_update(MixedOwnTrainer, model, samples, args, trainer_kwargs=knobs)
    assert compare_with_reference(update, model, samples, task).relative_error <= TOLERANCE
    assert trainer.logged_steps == 1 and trainer.state.log_history[0]["own_field"] == 1.0
    if knobs:
        value = knobs["gradacc_args"]
        expected = value if isinstance(value, dict) else {"regroup_micro_batches": True}
        assert all(getattr(trainer.gradacc, k) == v for k, v in expected.items())
    stock, _ = one_step_update(OwnTrainer, model, samples, args)
    assert compare_with_reference(stock, model, samples, task).norm_ratio == pytest.approx(GA, rel=1e-3)


def test_mixin_on_stock_seq2seq_trainer_with_plain_arguments():
    model, samples = build_tiny_model("seq2seq"), make_samples("seq2seq", BS * GA, seed=6)
    args = one_step_args(
        per_device_train_batch_size=BS, gradient_accumulation_steps=GA, args_class=Seq2SeqTrainingArguments
    )
    update, _ = one_step_update(
        MixedSeq2SeqTrainer, model, samples, args, trainer_kwargs={"gradacc_args": {"head_type": "seq2seq"}}
    )
    assert compare_with_reference(update, model, samples, "seq2seq").relative_error <= TOLERANCE


def test_knobs_in_two_places_or_unknown_are_refused():
    model = build_tiny_model("causal_lm")
    config = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, args_class=GradAccSeq2SeqConfig)
    with pytest.raises(GradAccConfigError, match="given twice"):
        GradAccTrainer(model=copy.deepcopy(model), args=config, gradacc_args={"head_type": "causal_lm"})
    plain = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA)
    with pytest.raises(GradAccConfigError, match=r"unknown field `head_typ` \(did you mean `head_type`\?\)"):
        GradAccTrainer(model=copy.deepcopy(model), args=plain, gradacc_args={"head_typ": "causal_lm"})
    with pytest.raises(GradAccConfigError, match="`zero_reduction` \\('sometimes'\\)"):
        GradAccTrainer(model=copy.deepcopy(model), args=plain, gradacc_args={"zero_reduction": "sometimes"})


def test_gradacc_config_class_parses_both_argument_sets():
    config_class = gradacc_config_class(Seq2SeqTrainingArguments)
    assert issubclass(config_class, (GradAccArguments, Seq2SeqTrainingArguments))
    assert gradacc_config_class(GradAccSeq2SeqConfig) is GradAccSeq2SeqConfig
    (args,) = HfArgumentParser(config_class).parse_args_into_dataclasses(
        ["--output_dir", "out", "--predict_with_generate", "true", "--head_type", "seq2seq", "--fsdp_sync",
         "every_micro_batch", "--gradient_accumulation_steps", "4"]
    )  # fmt: skip
    assert (args.predict_with_generate, args.head_type, args.fsdp_sync, args.gradient_accumulation_steps) == (
        True, "seq2seq", "every_micro_batch", 4,
    )  # fmt: skip
    with pytest.raises(GradAccConfigError, match="`head_type` \\('decoder'\\)"):
        config_class(output_dir="out", head_type="decoder")
    with pytest.raises(GradAccConfigError, match="TrainingArguments subclass"):
        gradacc_config_class(dict)  # type: ignore[arg-type]


@pytest.mark.parametrize("old", ["tiny", "reference", "check", "plot", "bench", "regroup", "cli", "_deprecated"])
def test_the_0_1_module_paths_are_gone(old):
    # Removed in 0.2 (CHANGELOG.md names the new paths): hf_gradacc.testing.*, hf_gradacc.data, hf_gradacc.commands.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"hf_gradacc.{old}")


def test_training_arguments_are_not_changed_by_the_mixin():
    args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[])
    before = args.to_dict()
    GradAccTrainer(model=build_tiny_model("causal_lm"), args=args)
    assert args.to_dict() == before


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_model_under_sharded_fsdp_warns_that_nothing_was_written(tmp_path, monkeypatch, caplog, state_dict_type):
    """transformers 5.23 writes no model from save_model under FSDP with a sharded state dict, without an error:
    GradAccTrainer warns (the FSDP plugin is faked here; tests/distributed/test_recipes.py runs the real one)."""
    from types import SimpleNamespace

    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    from hf_gradacc import GradAccTrainer
    from hf_gradacc.testing.one_step import one_step_args
    from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=one_step_args(str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2),
        train_dataset=ListDataset(make_samples("causal_lm", 4)),
        data_collator=PaddingCollator(),
    )
    monkeypatch.setattr(Trainer, "save_model", lambda self, output_dir=None, _internal_call=False: None)
    trainer.is_fsdp_enabled = True
    monkeypatch.setattr(type(trainer.accelerator.state), "fsdp_plugin", SimpleNamespace(state_dict_type=state_dict_type), raising=False)
    hf_logging.enable_propagation()
    with caplog.at_level("WARNING"):
        trainer.save_model(str(tmp_path / "model"))
        trainer.save_model(str(tmp_path / "ckpt"), _internal_call=True)  # checkpoints save FSDP shards: no warning
    warned = [r.getMessage() for r in caplog.records if "wrote no model" in r.getMessage()]
    assert len(warned) == (state_dict_type == "SHARDED_STATE_DICT")
    if warned:
        assert "SHARDED_STATE_DICT" in warned[0] and "FULL_STATE_DICT" in warned[0] and "model" in warned[0]
