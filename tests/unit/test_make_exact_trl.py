"""`make_exact` on TRL trainers someone else built: TRL's DPO / SFT trainers (and a subclass that only adds logging)
become hf_gradacc.trl's trainers in place; a subclass that changes TRL's loss, and TRL trainers hf_gradacc.trl does not
cover, are refused with the class to construct instead.

One SGD(lr=1) step over 7 samples at batch 2 x GA 4 (micro-batches 2+2+2+1) against the float64 references of
hf_gradacc.testing.trl_steps (relative error <= 1e-5); stock TRL DPO is 0.30 off on the same data (tests/unit/test_trl.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import Trainer  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from hf_gradacc import make_exact  # noqa: E402
from hf_gradacc.errors import GradAccTypeError  # noqa: E402
from hf_gradacc.exact import exact_class  # noqa: E402
from hf_gradacc.testing import trl_steps  # noqa: E402
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402
from hf_gradacc.testing.tiny import build_tiny_model  # noqa: E402
from hf_gradacc.trl import GradAccDPOTrainer, GradAccSFTTrainer  # noqa: E402

TOL = 1e-5
SPLIT = (2, 4)


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


class FrameworkDPOTrainer(DPOTrainer):
    """A framework's DPO trainer that only adds a log key."""

    def log(self, logs, start_time=None):
        logs["framework_marker"] = 1.0
        super().log(logs, start_time)


class LossChangingDPOTrainer(DPOTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs)


def _args(tmp_path, config_class, **config):
    return one_step_args(
        str(tmp_path / "out"), per_device_train_batch_size=SPLIT[0], gradient_accumulation_steps=SPLIT[1],
        args_class=config_class, **trl_steps.cpu_config_flags(config_class), **config,
    )  # fmt: skip


def _train(trainer) -> dict[str, torch.Tensor]:
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = dict(trainer.model.named_parameters())
    return {n: initial[n] - final[n].detach() for n in initial}


@pytest.mark.parametrize("trainer_class", [DPOTrainer, FrameworkDPOTrainer])
def test_a_built_dpo_trainer_is_made_exact(tmp_path, trainer_class) -> None:
    model, pairs = build_tiny_model("causal_lm"), trl_steps.dpo_pairs()
    trainer = trainer_class(
        model=copy.deepcopy(model), ref_model=copy.deepcopy(model), args=_args(tmp_path, DPOConfig, beta=0.1),
        train_dataset=trl_steps.dpo_dataset(pairs), processing_class=trl_steps.word_tokenizer(),
    )  # fmt: skip
    assert make_exact(trainer) is trainer and isinstance(trainer, GradAccDPOTrainer)
    update = _train(trainer)
    assert compare(update, trl_steps.dpo_reference(model, pairs, beta=0.1).grads).relative_error <= TOL
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert "rewards/chosen" in log  # TRL's metrics
    if trainer_class is FrameworkDPOTrainer:
        assert log["framework_marker"] == 1.0


def test_a_built_sft_trainer_is_made_exact(tmp_path) -> None:
    model, rows = build_tiny_model("causal_lm"), trl_steps.sft_rows()
    trainer = SFTTrainer(
        model=copy.deepcopy(model), args=_args(tmp_path, SFTConfig, completion_only_loss=True, max_length=None),
        train_dataset=Dataset.from_list(rows), processing_class=trl_steps.word_tokenizer(),
    )  # fmt: skip
    assert type(make_exact(trainer)) is GradAccSFTTrainer
    update = _train(trainer)
    assert compare(update, trl_steps.sft_reference(model, rows).grads).relative_error <= TOL


def test_a_subclass_that_changes_trls_loss_is_refused(tmp_path) -> None:
    with pytest.raises(GradAccTypeError, match=r"overrides \['compute_loss'\].*hf_gradacc.trl.GradAccDPOTrainer"):
        exact_class(LossChangingDPOTrainer)


def test_a_trl_trainer_hf_gradacc_does_not_cover_is_refused() -> None:
    # TRL 1.16's online DPO lives in trl.experimental (importing it takes seconds): a class of that module stands in.
    online_dpo = type("OnlineDPOTrainer", (Trainer,), {"__module__": "trl.experimental.online_dpo.online_dpo_trainer"})
    with pytest.raises(GradAccTypeError, match=r"TRL's OnlineDPOTrainer.*does not make exact.*GradAccKTOTrainer"):
        exact_class(online_dpo)


def test_kto_rloo_and_distillation_are_mapped() -> None:
    pytest.importorskip("trl", minversion="1.16", reason="GradAccKTO/RLOO/DistillationTrainer need TRL >= 1.16")
    from trl import DistillationTrainer, KTOTrainer, RLOOTrainer

    from hf_gradacc.trl import GradAccDistillationTrainer, GradAccKTOTrainer, GradAccRLOOTrainer

    assert exact_class(KTOTrainer) is GradAccKTOTrainer
    assert exact_class(RLOOTrainer) is GradAccRLOOTrainer
    assert exact_class(DistillationTrainer) is GradAccDistillationTrainer
