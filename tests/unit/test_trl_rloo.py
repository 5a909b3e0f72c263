"""hf_gradacc.trl.GradAccRLOOTrainer: TRL's RLOO with exact accumulation (one process).

ONE SGD(lr=1) step of the tiny Llama policy of tests/unit/test_trl_grpo.py (vocabulary of 8 words, completions of 1
to 8 tokens, plain ``model.generate`` on CPU), 2 completions per prompt, the deterministic ``length_reward``,
``beta=0``, batch 2 x GA 4 (8 completions per step), against the float64 full-batch step over the completions the
trainer recorded (``hf_gradacc/testing/trl_more_steps.py``: the mean over ALL the step's completions of ``-A rho``,
ratio 1 at the first step). The leave-one-out advantages TRL computed are checked against the definition (reward
minus the mean reward of the prompt's other completions) where the step holds whole prompt groups.
``steps_per_generation`` 2 and 8 against GA 4. Tolerance: relative error <= 1e-5.

Measured (TRL 1.16, CPU, float32): GradAccRLOOTrainer 1.6e-07 (spg 2), 1.7e-07 (spg 4, 8); stock RLOOTrainer exact
too (the same numbers): its loss is per sequence and TRL slices its generation buffer into micro-batches of equal
rows, so the mean of micro-batch means over GA is the step's mean.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

# hf_gradacc covers TRL's KTO, RLOO and Distillation trainers from TRL 1.16 on (older TRL: TRLDependencyError).
pytest.importorskip("trl", minversion="1.16")

from transformers import HfArgumentParser  # noqa: E402
from trl import RLOOConfig, RLOOTrainer  # noqa: E402

from hf_gradacc import GradAccConfigError  # noqa: E402
from hf_gradacc.counting import WindowCounts  # noqa: E402
from hf_gradacc.exact import exact_class  # noqa: E402
from hf_gradacc.testing.grpo_steps import (  # noqa: E402
    build_tiny_policy,
    grpo_prompts,
    grpo_tokenizer,
    length_reward,
)
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402
from hf_gradacc.testing.trl_more_steps import (  # noqa: E402
    CompletionRecorder,
    recorded_completions,
    rloo_advantages_by_prompt,
    rloo_reference,
)
from hf_gradacc.testing.trl_steps import word  # noqa: E402
from hf_gradacc.trl import GradAccRLOOConfig, GradAccRLOOTrainer  # noqa: E402

TOL = 1e-5
NUM_GENERATIONS = 2


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


def rloo_args(config_class: type, output_dir, **config: Any) -> Any:
    return one_step_args(
        str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=config_class,
        bf16=False, max_completion_length=8, beta=0.0, seed=0,
        **{"steps_per_generation": 4, "num_generations": NUM_GENERATIONS, **config},
    )  # fmt: skip


def rloo_run(trainer_class, config_class, tmp_path, **config):
    policy = build_tiny_policy()
    cls = type(f"Recording{trainer_class.__name__}", (CompletionRecorder, trainer_class), {})
    trainer = cls(model=copy.deepcopy(policy), reward_funcs=length_reward,
                  args=rloo_args(config_class, tmp_path / trainer_class.__name__, **config),
                  train_dataset=grpo_prompts(16), processing_class=grpo_tokenizer())  # fmt: skip
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = dict(trainer.model.named_parameters())
    return {n: initial[n] - final[n].detach() for n in initial}, trainer, policy


def rows_of(trainer) -> list[tuple[list[int], list[int], float]]:
    advantages = [float(a) for mb in trainer.recorded_micro_batches for a in mb["advantages"]]
    return [
        (p, c, a) for (p, c), a in zip(recorded_completions(trainer.recorded_micro_batches), advantages, strict=True)
    ]


def reward_of_ids(completion: list[int]) -> float:
    """``length_reward`` of the completion TRL decodes (special tokens skipped)."""
    return length_reward([" ".join(word(i) for i in completion if i > 2)])[0]


@pytest.mark.parametrize("spg", [2, 8])
def test_rloo_step_equals_the_full_batch(tmp_path, spg) -> None:
    update, trainer, policy = rloo_run(GradAccRLOOTrainer, GradAccRLOOConfig, tmp_path, steps_per_generation=spg)
    rows = rows_of(trainer)
    assert len(rows) == 8 and len({len(c) for _, c, _ in rows}) > 2  # mixed completion lengths
    error = compare(update, rloo_reference(policy, rows).grads).relative_error
    print(f"GradAccRLOOTrainer 2 x GA 4, spg {spg}: relative error {error:.3g}")
    assert error <= TOL
    assert all(float(u.abs().max()) > 0 for u in update.values())
    if spg <= 4:  # whole prompt groups in the step: the leave-one-out baseline from its definition
        expected = rloo_advantages_by_prompt([(p, c) for p, c, _ in rows], reward_of_ids, NUM_GENERATIONS)
        assert [a for _, _, a in rows] == pytest.approx(expected, abs=1e-6)
        assert any(abs(a) > 0.1 for a in expected)


def test_stock_rloo_is_exact_with_its_equal_slices(tmp_path) -> None:
    update, trainer, policy = rloo_run(RLOOTrainer, RLOOConfig, tmp_path)
    error = compare(update, rloo_reference(policy, rows_of(trainer)).grads).relative_error
    print(f"stock RLOOTrainer 2 x GA 4, spg 4: relative error {error:.3g}")
    assert error <= TOL
    assert exact_class(RLOOTrainer) is GradAccRLOOTrainer


def test_a_sequence_count_one_off_fails_the_check(tmp_path, monkeypatch) -> None:
    true_count = WindowCounts.global_count
    monkeypatch.setattr(WindowCounts, "global_count",
                        lambda self, kind: true_count(self, kind) + (kind == "samples"))  # fmt: skip
    update, trainer, policy = rloo_run(GradAccRLOOTrainer, GradAccRLOOConfig, tmp_path)
    error = compare(update, rloo_reference(policy, rows_of(trainer)).grads).relative_error
    assert error == pytest.approx(1 / 9, rel=1e-3)  # 8 completions counted as 9


def test_what_rloo_cannot_make_exact_is_refused(tmp_path) -> None:
    args = rloo_args(GradAccRLOOConfig, tmp_path, regroup_micro_batches=True)
    with pytest.raises(GradAccConfigError, match="regroup_micro_batches.*generation batches of prompts"):
        GradAccRLOOTrainer(model=build_tiny_policy(), reward_funcs=length_reward, args=args,
                           train_dataset=grpo_prompts(16), processing_class=grpo_tokenizer())  # fmt: skip
    assert "Example" in GradAccRLOOTrainer.__doc__ and "Example" in GradAccRLOOConfig.__doc__


@pytest.mark.parametrize("num_generations", [1, 0])
def test_fewer_than_two_generations_are_refused_naming_the_field(tmp_path, num_generations) -> None:
    """Issue 36: TRL's RLOOConfig refuses 1 without naming the field and divides by 0 (ZeroDivisionError);
    GradAccRLOOConfig refuses both first, with a GradAccConfigError (a ValueError) naming `num_generations`."""
    with pytest.raises(GradAccConfigError) as caught:
        rloo_args(GradAccRLOOConfig, tmp_path, num_generations=num_generations)
    assert isinstance(caught.value, ValueError)
    assert f"`num_generations` is {num_generations}" in str(caught.value)
    assert "Set `num_generations` to 2 or more" in str(caught.value)
    with pytest.raises(GradAccConfigError, match="`num_generations` is 1"):  # the command line too
        HfArgumentParser(GradAccRLOOConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", "true", "--num_generations", "1"]
        )
    assert rloo_args(GradAccRLOOConfig, tmp_path).num_generations == NUM_GENERATIONS  # 2 is accepted
