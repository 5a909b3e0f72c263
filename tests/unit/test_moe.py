"""Mixture-of-experts models keep their router load-balancing loss: the step's router term is
sum over micro-batches of (routed tokens of the micro-batch / routed tokens of the step) x coef x aux(micro-batch),
exact against the float64 reference (tiny Mixtral and Qwen3-MoE, eager experts in float64), logged as `loss/aux`.
And a model whose own loss holds a term the library does not model is stopped on the first micro-batch."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, Trainer

from hf_gradacc import GradAccConfig, GradAccLossError, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import (
    MOE_FAMILIES,
    ListDataset,
    PaddingCollator,
    build_tiny_model,
    build_tiny_moe,
    make_samples,
)

TOLERANCE = 1e-5  # the whole update, float32 against float64
# The router weights alone: a small-norm slice of the gradient, so float32 rounding weighs more (measured up to
# 1.0e-5); a 1 % error in any denominator is still 1e-2.
ROUTER_TOLERANCE = 5e-5
BS = 3


def _router(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g for n, g in update.items() if n.endswith("mlp.gate.weight")}


def _run(trainer_class, family: str, ga: int, **overrides):
    model = build_tiny_moe(family)
    samples = make_samples("causal_lm", BS * ga - 1 if ga > 1 else BS, seed=ga)  # a short last micro-batch
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=ga, **overrides)
    micro_batches: list = []
    update, trainer = one_step_update(trainer_class, model, samples, args, micro_batches=micro_batches)
    reference = reference_gradients(model, samples, "causal_lm", PaddingCollator(), micro_batches=micro_batches)
    return update, reference, trainer, micro_batches


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("ga", [1, 4, 8])
def test_router_term_is_exact(family: str, ga: int) -> None:
    update, reference, trainer, micro_batches = _run(GradAccTrainer, family, ga)
    assert [len(mb) for mb in micro_batches] == ([BS] * (ga - 1) + [BS - 1] if ga > 1 else [BS])
    assert compare(update, reference).relative_error <= TOLERANCE
    router = compare(_router(update), _router(reference))
    assert router.relative_error <= ROUTER_TOLERANCE, router
    logs = trainer.state.log_history[0]
    assert logs["loss"] == pytest.approx(logs["loss/main"] + logs["loss/aux"], rel=1e-6) and logs["loss/aux"] > 0


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_term_carries_weight(family: str) -> None:
    """Dropping the router term (what 0.1 did) moves the router update far from the reference: the test can fail."""
    update, reference, _, _ = _run(GradAccTrainer, family, 4)
    model = build_tiny_moe(family)
    model.config.output_router_logits = False
    samples = make_samples("causal_lm", BS * 4 - 1, seed=4)
    without = reference_gradients(model, samples, "causal_lm", PaddingCollator())
    assert compare(_router(without), _router(reference)).relative_error > 0.5
    assert compare(_router(update), _router(reference)).relative_error <= ROUTER_TOLERANCE


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_stock_trainer_router_term_is_right_at_ga1_only(family: str) -> None:
    one, reference_one, _, _ = _run(Trainer, family, 1)
    assert compare(_router(one), _router(reference_one)).relative_error <= 1e-4
    four, reference_four, _, _ = _run(Trainer, family, 4)
    assert compare(_router(four), _router(reference_four)).relative_error > 0.5


class ExtraTermLlama(LlamaForCausalLM):
    """A model whose own loss adds a term no head family knows about (a logit-size penalty)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        if labels is not None:
            outputs.loss = outputs.loss + 10.0 * outputs.logits.float().pow(2).mean()  # ~2 % of the loss
        return outputs


def test_an_unmodelled_term_is_stopped_at_the_first_micro_batch() -> None:
    base = build_tiny_model("causal_lm")
    model = ExtraTermLlama(base.config)
    model.load_state_dict(base.state_dict())
    samples = make_samples("causal_lm", 8, seed=3)
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig)
    with pytest.raises(GradAccLossError, match=r"differs from the model's own loss .*check_loss_at_start=False") as info:
        one_step_update(GradAccTrainer, model, samples, args)
    assert "rank 0, first micro-batch" in str(info.value)
    off = one_step_args(
        per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig, check_loss_at_start=False
    )
    update, _ = one_step_update(GradAccTrainer, model, samples, off)  # trains the head's loss, as asked
    assert compare_with_reference(update, base, samples, "causal_lm").relative_error <= TOLERANCE


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_evaluate_keeps_the_router_term(family: str) -> None:
    """`evaluate()` on one batch gives the model's own loss, router term included (coef x aux: ~0.9 % of it)."""
    model = build_tiny_moe(family)
    samples = make_samples("causal_lm", BS + 2, seed=31)
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=1,
                         per_device_eval_batch_size=len(samples))  # fmt: skip
    trainer = GradAccTrainer(model=model, args=args, eval_dataset=ListDataset(samples), data_collator=PaddingCollator())
    eval_loss = trainer.evaluate()["eval_loss"]
    model.eval()
    with torch.no_grad():
        own = model(**PaddingCollator()(samples))
    assert own.aux_loss is not None
    router = float(model.config.router_aux_loss_coef * own.aux_loss)
    assert router > 1e-3 * float(own.loss)  # leaving the router term out (~0.9 %) is far beyond the tolerance
    assert eval_loss == pytest.approx(float(own.loss), rel=1e-5)
