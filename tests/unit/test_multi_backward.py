"""Several loss terms (one backward pass per term or one joint pass), accumulated-gradient hooks, `trainer.grads`,
GradNormCallback and the low-level `trainer.backward` — single process, against the float64 reference."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hf_gradacc import GradAccConfig, GradAccLossError, GradAccTrainer, LossTerm
from hf_gradacc.callbacks import GradAccCallback, GradNormCallback
from hf_gradacc.grads import GradientsNotReadyError
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, two_term_reference
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples, two_term_loss

TOL = 1e-5
REG_WEIGHT = 0.01


def _args(**overrides):
    return one_step_args(
        per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig, **overrides
    )


class TwoTermTrainer(GradAccTrainer):
    """Token cross-entropy ('tokens') plus a logit-size penalty averaged per sample ('samples')."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        terms, outputs = two_term_loss(model, inputs, reg_weight=REG_WEIGHT)
        return (terms, outputs) if return_outputs else terms


@pytest.fixture(scope="module")
def causal_setup():
    samples = make_samples("causal_lm", 8, seed=3)
    model = build_tiny_model("causal_lm")
    reference, ce, reg = two_term_reference(model, samples, PaddingCollator(), REG_WEIGHT)
    return model, samples, reference, ce, reg


@pytest.mark.parametrize("backward_per_term", [False, True], ids=["joint_backward", "backward_per_term"])
def test_two_terms_exact_hooks_and_grads(causal_setup, backward_per_term):
    model, samples, reference, ce, reg = causal_setup
    calls: dict[str, int] = {}
    hook_grads: dict[str, torch.Tensor] = {}
    seen: dict[str, object] = {}

    def hook(name, grad):
        calls[name] = calls.get(name, 0) + 1
        hook_grads[name] = grad.detach().clone()

    class Reader(GradAccCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen["norm"] = self.trainer.grads.norm()
            seen["full"] = self.trainer.grads.full("lm_head.weight").detach().clone()
            seen["named"] = self.trainer.grads.named_norms()

    grad_norms = GradNormCallback(depth=2)

    class HookedTrainer(TwoTermTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.register_accumulated_grad_hook(hook)

    upd, trainer = one_step_update(
        HookedTrainer,
        model,
        samples,
        _args(backward_per_term=backward_per_term),
        trainer_kwargs={"callbacks": [Reader(), grad_norms]},
    )
    assert compare(upd, reference).relative_error <= TOL
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert set(calls) == set(trainable) and set(calls.values()) == {1}
    assert compare(hook_grads, reference).relative_error <= TOL
    ref_norm = float(torch.cat([g.reshape(-1) for g in reference.values()]).norm())
    assert seen["norm"] == pytest.approx(ref_norm, rel=TOL)
    assert compare({"w": seen["full"]}, {"w": reference["lm_head.weight"]}).relative_error <= TOL
    assert seen["named"]["lm_head.weight"] == pytest.approx(float(reference["lm_head.weight"].norm()), rel=TOL)
    log = trainer.state.log_history[0]
    assert log["loss/ce"] == pytest.approx(ce, rel=1e-5)
    assert log["loss/reg"] == pytest.approx(REG_WEIGHT * reg, rel=1e-4)
    assert log["loss"] == pytest.approx(ce + REG_WEIGHT * reg, rel=1e-5)
    assert log["grad_norm/global"] == pytest.approx(ref_norm, rel=TOL)
    assert "grad_norm/model.layers" in log


def test_hook_may_modify_gradient_in_place(causal_setup):
    model, samples, reference, _, _ = causal_setup

    class ZeroHead(TwoTermTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.register_accumulated_grad_hook(lambda name, grad: grad.zero_() if name == "lm_head.weight" else None)

    upd, _ = one_step_update(ZeroHead, model, samples, _args())
    assert float(upd["lm_head.weight"].abs().max()) == 0.0
    others = {n: g for n, g in reference.items() if n != "lm_head.weight"}
    assert compare({n: upd[n] for n in others}, others).relative_error <= TOL


def test_hook_registration_errors(causal_setup):
    model, samples, _, _, _ = causal_setup
    _, trainer = one_step_update(TwoTermTrainer, model, samples, _args())
    with pytest.raises(RuntimeError, match="before `train\\(\\)`"):
        trainer.register_accumulated_grad_hook(lambda n, g: None)
    with pytest.raises(GradientsNotReadyError):
        trainer.grads.norm()


def test_low_level_backward_twice_final_is_an_error(causal_setup):
    model, samples, _, _, _ = causal_setup

    class TwiceFinal(GradAccTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            inputs = self._prepare_inputs(inputs)
            term = self.compute_loss(model, inputs)
            loss = term.total / 1000.0
            self.backward(loss, final=self.is_last_micro_batch, retain_graph=True)
            self.backward(loss, final=self.is_last_micro_batch)
            return loss.detach()

    with pytest.raises(RuntimeError, match="already called"):
        one_step_update(TwiceFinal, model, samples, _args())


def test_custom_training_step_with_low_level_backward_is_exact():
    samples = make_samples("sequence_classification", 8, seed=9)
    model = build_tiny_model("sequence_classification")

    class Manual(GradAccTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            inputs = self._prepare_inputs(inputs)
            labels = inputs.pop("labels")
            logits = model(**inputs).logits.float()
            ce = F.cross_entropy(logits, labels, reduction="none")
            count = self.current_window.global_count("samples")
            half = labels.shape[0] // 2
            first = ce[:half].sum() / count
            second = ce[half:].sum() / count
            self.backward(first, final=False, retain_graph=True)
            self.backward(second, final=self.is_last_micro_batch)
            return (first + second).detach()

    upd, _ = one_step_update(Manual, model, samples, _args())
    assert compare_with_reference(upd, model, samples, "sequence_classification").relative_error <= TOL


def test_zero_denominator_term_is_left_out_with_a_warning(caplog):
    from hf_gradacc.counting import MicroBatchCounts, WindowCounts
    from hf_gradacc.loss import parse_loss_output
    from hf_gradacc.step.window import Window

    window = Window(
        micro_batches=[{}],
        counts=WindowCounts(
            micro_batches=(MicroBatchCounts(num_tokens=0, num_samples=2),),
            global_tokens=0,
            global_samples=4,
            num_micro_batches_per_rank=(1,),
        ),
        index=0,
    )
    caplog.set_level(logging.WARNING)
    x = torch.tensor(3.0, requires_grad=True)
    raw = {"tok": LossTerm(x * 2, "tokens"), "row": LossTerm(x * 4, "samples")}
    parts = dict(window.normalized_terms(parse_loss_output(raw), primary="tokens"))
    assert float(parts["tok"]) == 0.0 and float(parts["row"]) == pytest.approx(3.0)
    (parts["tok"] + parts["row"]).backward()
    assert torch.isfinite(x.grad) and float(x.grad) == pytest.approx(1.0)
    assert "'tok' has no counted tokens" in caplog.text


def test_loss_term_validation():
    with pytest.raises(ValueError, match="scalar"):
        LossTerm(torch.ones(3), "tokens")
    with pytest.raises(ValueError, match="normalize_by"):
        LossTerm(torch.ones(()), "rows")
    with pytest.raises(TypeError):
        LossTerm(torch.ones(()), 1.5)  # type: ignore[arg-type]


def test_custom_count_without_deferred_normalisation_is_a_clear_error():
    samples = make_samples("causal_lm", 8, seed=3)
    model = build_tiny_model("causal_lm")

    class CustomCount(GradAccTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            term = super().compute_loss(model, inputs)
            return LossTerm(term.total, 7)

    with pytest.raises(GradAccLossError, match="custom count"):
        one_step_update(CustomCount, model, samples, _args())
