"""``total_train_batch_size`` with TRL's GRPO and RLOO (one process).

TRL's ``GRPOConfig`` / ``RLOOConfig`` derive ``steps_per_generation`` (and ``generation_batch_size``) from
``gradient_accumulation_steps`` in ``__post_init__``, before the trainer derives the accumulation from the total.
Measured before the refusal (TRL 1.16, batch 2, ``total_train_batch_size`` 8, no GA and no ``steps_per_generation``
given): GA 4 but ``steps_per_generation`` 1 (generation batch 2), a step exact over its own completions (2.6e-7
against the float64 reference) but 1.6 (relative) off the same run with ``gradient_accumulation_steps=4`` by hand
(another generation cadence: other completions, other advantages). So a derived generation batch is refused, naming
the way out; a generation batch given by hand is kept and the run is the hand-given GA's run.
TRL's distillation derives nothing in its config and reads GA when training: the hand-given GA's run too.
"""

from __future__ import annotations

import copy

import pytest
import torch

# RLOO and Distillation are wrapped from TRL 1.16 on (older TRL: TRLDependencyError at import, as in axolotl's stack).
pytest.importorskip("trl", minversion="1.16")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_gradacc import GradAccConfigError  # noqa: E402
from hf_gradacc.testing.grpo_steps import build_tiny_policy, grpo_prompts, grpo_tokenizer, length_reward  # noqa: E402
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402
from hf_gradacc.trl import (  # noqa: E402
    GradAccDistillationConfig,
    GradAccDistillationTrainer,
    GradAccGRPOConfig,
    GradAccGRPOTrainer,
    GradAccRLOOConfig,
    GradAccRLOOTrainer,
)
from tests.unit.test_trl_grpo import grpo_args, grpo_run, reference_of  # noqa: E402

TOL = 1e-5
PAIRS = {"grpo": (GradAccGRPOTrainer, GradAccGRPOConfig), "rloo": (GradAccRLOOTrainer, GradAccRLOOConfig)}


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


def build(trainer_class: type, args, *, gradacc_args=None):
    return trainer_class(model=build_tiny_policy(), reward_funcs=length_reward, args=args,
                         train_dataset=grpo_prompts(16), processing_class=grpo_tokenizer(),
                         gradacc_args=gradacc_args)  # fmt: skip


@pytest.mark.parametrize("which", ["grpo", "rloo"])
def test_a_generation_batch_derived_from_the_given_accumulation_is_refused(tmp_path, which) -> None:
    trainer_class, config_class = PAIRS[which]
    args = one_step_args(str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                         args_class=config_class, num_generations=2, max_completion_length=8, beta=0.0,
                         total_train_batch_size=8)  # fmt: skip
    assert args.steps_per_generation == 1  # TRL's __post_init__: from the GA given
    with pytest.raises(GradAccConfigError) as error:
        build(trainer_class, args)
    message = str(error.value)
    for part in ("`total_train_batch_size` (8)", trainer_class.__name__, "`gradient_accumulation_steps=4`",
                 "`steps_per_generation`", "`generation_batch_size`"):  # fmt: skip
        assert part in message, message


def test_trl_s_own_config_with_gradacc_args_is_refused_alike(tmp_path) -> None:
    """A plain ``GRPOConfig`` does not record what was given: TRL's default (steps_per_generation = the given GA)."""
    derived = grpo_args(GRPOConfig, tmp_path / "a", split=(2, 1), steps_per_generation=None)
    with pytest.raises(GradAccConfigError, match="total_train_batch_size"):
        build(GradAccGRPOTrainer, derived, gradacc_args={"total_train_batch_size": 8})
    given = grpo_args(GRPOConfig, tmp_path / "b", split=(2, 1), steps_per_generation=4)
    trainer = build(GradAccGRPOTrainer, given, gradacc_args={"total_train_batch_size": 8})
    assert (trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation) == (4, 4)
    assert issubclass(GradAccGRPOTrainer, GRPOTrainer)


def test_a_derived_accumulation_equal_to_the_given_one_is_kept(tmp_path) -> None:
    args = grpo_args(GradAccGRPOConfig, tmp_path, steps_per_generation=None, total_train_batch_size=8)  # GA 4 given
    trainer = build(GradAccGRPOTrainer, args)
    assert (trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation) == (4, 4)


def rloo_update(tmp_path, policy, **config):
    args = one_step_args(str(tmp_path), per_device_train_batch_size=2, args_class=GradAccRLOOConfig, num_generations=2,
                         max_completion_length=8, beta=0.0, seed=0, steps_per_generation=4, **config)  # fmt: skip
    trainer = GradAccRLOOTrainer(model=copy.deepcopy(policy), reward_funcs=length_reward, args=args,
                                 train_dataset=grpo_prompts(16), processing_class=grpo_tokenizer())  # fmt: skip
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: initial[n] - p.detach() for n, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize("which", ["grpo", "rloo"])
def test_with_steps_per_generation_given_the_run_is_the_hand_given_accumulation_s(tmp_path, which) -> None:
    """``steps_per_generation`` 4 given, batch 2: ``total_train_batch_size`` 8 derives GA 4 and trains the step of
    ``gradient_accumulation_steps=4`` by hand (same completions, same update)."""
    model = build_tiny_policy()
    if which == "grpo":
        by_hand, _ = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path / "hand", model=model)
        held, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path / "total", model=model,
                                 split=(2, 1), total_train_batch_size=8)  # fmt: skip
        reference = compare(held, reference_of(model, trainer, loss_type="dapo").grads).relative_error
    else:
        by_hand, _ = rloo_update(tmp_path / "hand", model, gradient_accumulation_steps=4)
        held, trainer = rloo_update(tmp_path / "total", model, gradient_accumulation_steps=1, total_train_batch_size=8)
        reference = 0.0  # RLOO's float64 reference: tests/unit/test_trl_rloo.py (same step as by hand)
    assert (trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation) == (4, 4)
    assert trainer.global_batch.given == 1
    assert all(float(u.abs().max()) > 0 for u in held.values())
    error = compare(held, by_hand).relative_error
    print(f"{which}: total_train_batch_size 8 (batch 2, spg 4) against GA 4 by hand: {error:.3g}; "
          f"float64 reference {reference:.3g}")  # fmt: skip
    assert error <= TOL and reference <= TOL


def test_distillation_follows_the_derived_accumulation(tmp_path) -> None:
    """TRL's DistillationConfig derives nothing from GA; its trainer reads it when training (sampler, generation):
    ``total_train_batch_size`` 8 at batch 2 trains the step of ``gradient_accumulation_steps=4`` by hand."""
    from tests.unit.test_trl_distillation import TEACHER_HEAD_SCALE, distill, error_of  # noqa: PLC0415

    teacher = build_tiny_policy(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(TEACHER_HEAD_SCALE)  # the pair of test_trl_distillation.py
    pair = (build_tiny_policy(0), teacher)
    by_hand, _ = distill(GradAccDistillationTrainer, GradAccDistillationConfig, pair, tmp_path / "hand")
    held, trainer = distill(GradAccDistillationTrainer, GradAccDistillationConfig, pair, tmp_path / "total",
                            split=(2, 1), total_train_batch_size=8)  # fmt: skip
    assert trainer.args.gradient_accumulation_steps == 4 and len(trainer.recorded_micro_batches) == 4
    assert trainer._logs["completion"].maxlen == 8  # TRL sized its completion log from the given GA (2)
    error, reference = compare(held, by_hand).relative_error, error_of(pair, held, trainer)
    print(f"distillation: total_train_batch_size 8 (batch 2) against GA 4 by hand: {error:.3g}; float64 {reference:.3g}")
    assert error <= TOL and reference <= TOL
