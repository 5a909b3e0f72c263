"""Memory modes on one process: automatic micro-batch sizing (`auto_micro_batch`) and streamed windows
(`defer_normalization`) give the same update as the default path, against the float64 reference."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from hf_gradacc import GradAccConfig, GradAccDataError, GradAccLossError, GradAccTrainer, LossTerm
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import build_tiny_model, make_samples
from tests.unit.test_multi_backward import TwoTermTrainer, _args

TOL = 1e-5


class FragileLlama(LlamaForCausalLM):
    """Raises an out-of-memory error for micro-batches with more rows than `max_rows` (injected OOM)."""

    max_rows = 1

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if self.training and input_ids.shape[0] > self.max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected by the test)")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


def test_auto_micro_batch_recovers_from_oom_with_the_same_update(caplog):
    samples = make_samples("causal_lm", 16, seed=4)
    model = build_tiny_model("causal_lm")
    fragile = copy.deepcopy(model)
    fragile.__class__ = FragileLlama
    caplog.set_level(logging.WARNING)
    args = one_step_args(
        per_device_train_batch_size=4, gradient_accumulation_steps=4, args_class=GradAccConfig, auto_micro_batch=True
    )
    upd, trainer = one_step_update(GradAccTrainer, fragile, samples, args)
    assert trainer.step_engine.auto_rows == 1
    assert "auto_micro_batch" in caplog.text
    assert trainer.state.log_history[0]["auto_micro_batch_rows"] == 1
    assert compare_with_reference(upd, model, samples, "causal_lm").relative_error <= TOL
    fitting, _ = one_step_update(GradAccTrainer, model, samples, args)
    assert compare(upd, fitting).relative_error <= TOL


def test_auto_micro_batch_oom_on_one_sample_is_a_clear_error():
    samples = make_samples("causal_lm", 8, seed=4)
    fragile = build_tiny_model("causal_lm")
    fragile.__class__ = FragileLlama
    fragile.max_rows = 0
    with pytest.raises(GradAccDataError, match="ONE sample"):
        one_step_update(GradAccTrainer, fragile, samples, _args(auto_micro_batch=True))


def test_oom_without_auto_micro_batch_propagates():
    samples = make_samples("causal_lm", 8, seed=4)
    fragile = build_tiny_model("causal_lm")
    fragile.__class__ = FragileLlama
    with pytest.raises(torch.OutOfMemoryError):
        one_step_update(GradAccTrainer, fragile, samples, _args())


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_deferred_normalisation_is_exact(task):
    samples = make_samples(task, 8, seed=5)
    model = build_tiny_model(task)
    upd, trainer = one_step_update(GradAccTrainer, model, samples, _args(defer_normalization=True))
    assert compare_with_reference(upd, model, samples, task).relative_error <= TOL
    plain, plain_trainer = one_step_update(GradAccTrainer, model, samples, _args())
    assert trainer.state.log_history[0]["loss"] == pytest.approx(plain_trainer.state.log_history[0]["loss"], rel=1e-6)


def test_deferred_normalisation_allows_custom_counts():
    samples = make_samples("causal_lm", 8, seed=6)
    model = build_tiny_model("causal_lm")

    class CustomCount(GradAccTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits.float()
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
            return LossTerm(total, int((targets != -100).sum()))

    upd, _ = one_step_update(CustomCount, model, samples, _args(defer_normalization=True))
    assert compare_with_reference(upd, model, samples, "causal_lm").relative_error <= TOL


def test_deferred_normalisation_rejects_mixed_denominators():
    model, samples = build_tiny_model("causal_lm"), make_samples("causal_lm", 8, seed=2)
    with pytest.raises(GradAccLossError, match="share one denominator"):
        one_step_update(TwoTermTrainer, model, samples, _args(defer_normalization=True))
