"""A framework-style ``compute_loss`` returning ``outputs.loss`` on a mixture-of-experts model (tiny Mixtral and
Qwen3-MoE, ``output_router_logits=True``): the model's loss is CE mean + coef x aux, and read whole as a mean over target
tokens its router part would be weighted by target tokens instead of routed tokens (1.29e-4 off, the issue). The mixin
recognises the model's own loss (equal in value to a forward pass's ``outputs.loss``) and splits its router term out:
exact against the float64 reference, through GradAccMixin and through make_exact, and `hf-gradacc check --scenario
plain_compute_loss` on a saved Mixtral checkpoint exits 0.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import Trainer

from hf_gradacc import GradAccTrainer, make_exact
from hf_gradacc.commands.hf_gradacc_cli import main
from hf_gradacc.step import engine as engine_module
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import MOE_FAMILIES, PaddingCollator, build_tiny_moe, make_samples

TOLERANCE = 1e-5
ROUTER_TOLERANCE = 5e-5  # the router weights alone (see tests/unit/test_moe.py)
BS, GA = 3, 4


def _outputs_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    outputs = model(**inputs)
    return (outputs.loss, outputs) if return_outputs else outputs.loss


class PlainMoETrainer(GradAccTrainer):
    compute_loss = _outputs_loss


class FrameworkMoETrainer(Trainer):
    compute_loss = _outputs_loss


def _made_exact(**kwargs):
    return make_exact(FrameworkMoETrainer(**kwargs))


def _router(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g for n, g in update.items() if n.endswith("mlp.gate.weight")}


def _run(trainer_class, family: str):
    model = build_tiny_moe(family)
    samples = make_samples("causal_lm", BS * GA - 1, seed=GA)  # a short last micro-batch
    micro_batches: list = []
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA)
    update, trainer = one_step_update(trainer_class, model, samples, args, micro_batches=micro_batches)
    reference = reference_gradients(model, samples, "causal_lm", PaddingCollator(), micro_batches=micro_batches)
    return update, reference, trainer


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("trainer_class", [PlainMoETrainer, _made_exact], ids=["mixin", "make_exact"])
def test_outputs_loss_of_a_moe_model_is_exact(trainer_class, family: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        update, reference, trainer = _run(trainer_class, family)
    assert not [r for r in caplog.records if "not the model's own loss" in r.getMessage()]
    assert compare(update, reference).relative_error <= TOLERANCE
    router = compare(_router(update), _router(reference))
    assert router.relative_error <= ROUTER_TOLERANCE, router
    logs = trainer.state.log_history[0]
    assert logs["loss/aux"] > 0 and logs["loss"] == pytest.approx(logs["loss/main"] + logs["loss/aux"], rel=1e-6)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_reading_it_whole_as_a_token_mean_is_off(family: str, monkeypatch) -> None:
    """Without the split (what the mixin did before), the router weights' update is off: the test above can fail."""
    monkeypatch.setattr(engine_module, "split_model_loss", lambda *args, **kwargs: None)
    update, reference, _ = _run(PlainMoETrainer, family)
    assert compare(_router(update), _router(reference)).relative_error > 10 * ROUTER_TOLERANCE


class OwnCrossEntropyPlusAuxTrainer(GradAccTrainer):
    """A plain value that is NOT the model's loss (its own CE mean + coef x aux, in another order): not split."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return self.model.config.router_aux_loss_coef * outputs.aux_loss + ce


def test_a_plain_value_with_a_router_term_of_its_own_is_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        _run(OwnCrossEntropyPlusAuxTrainer, "mixtral")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hf_gradacc")]
    assert any("not the model's own loss" in m and "routed tokens" in m for m in messages), messages


def test_check_plain_compute_loss_on_a_saved_mixtral_exits_0(tmp_path, capsys) -> None:
    build_tiny_moe("mixtral").save_pretrained(tmp_path / "mixtral")
    report = tmp_path / "check.json"
    argv = ["check", "--model", str(tmp_path / "mixtral"), "--scenario", "plain_compute_loss", "--json", str(report)]
    assert main(argv) == 0
    data = json.loads(report.read_text())
    assert data["results"]["GradAccTrainer"]["relative_error"] <= TOLERANCE
    assert "router" in capsys.readouterr().out
