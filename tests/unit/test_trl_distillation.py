"""hf_gradacc.trl.GradAccDistillationTrainer: TRL's on-policy distillation with exact accumulation (one process).

ONE SGD(lr=1) step of a tiny Llama student (vocabulary of 8 words) that generates 8 completions of 1 to 8 tokens
(``max_completion_length=8``, prompts of 1-5 words, not trained on) with plain ``model.generate`` on CPU, distilled
from another tiny Llama whose LM head is scaled by 30 (a teacher far from the student: with an untouched one the loss
is 1e-3 and TRL's float32 kernel rounds the gradient by 1.1e-5, stock and ours alike). The update is compared with
the float64 full-batch step over the completions the trainer recorded (``hf_gradacc/testing/trl_more_steps.py``: the
generalized JSD written from its definition, summed over every completion token, over their number). Whole step in
one micro-batch (8 x GA 1) and 2 x GA 4; ``beta`` 0 (forward KL), 0.5 (JSD), 1 (reverse KL). Tolerance: relative
error <= 1e-5.

Measured (TRL 1.16, CPU, float32): GradAccDistillationTrainer 2.8e-07 (beta 0), 1.1e-06 (0.5), 2.1e-07 (1). Stock TRL
is exact here too (1.1e-06 at beta 0.5): it generates once per step and divides by the generation batch's tokens over
every process, which IS the step's count.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

# hf_gradacc covers TRL's KTO, RLOO and Distillation trainers from TRL 1.16 on (older TRL: TRLDependencyError).
pytest.importorskip("trl", minversion="1.16")

from transformers import HfArgumentParser  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402

from hf_gradacc import GradAccConfigError, make_exact  # noqa: E402
from hf_gradacc.counting import WindowCounts  # noqa: E402
from hf_gradacc.testing.grpo_steps import build_tiny_policy, grpo_prompts, grpo_tokenizer  # noqa: E402
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402
from hf_gradacc.testing.trl_more_steps import (  # noqa: E402
    CompletionRecorder,
    distillation_reference,
    recorded_completions,
)
from hf_gradacc.trl import GradAccDistillationConfig, GradAccDistillationTrainer  # noqa: E402

TOL = 1e-5
TEACHER_HEAD_SCALE = 30.0


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    teacher = build_tiny_policy(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(TEACHER_HEAD_SCALE)
    return build_tiny_policy(0), teacher


def distillation_args(config_class: type, output_dir, split: tuple[int, int], **config: Any) -> Any:
    return one_step_args(
        str(output_dir), per_device_train_batch_size=split[0], gradient_accumulation_steps=split[1],
        args_class=config_class, bf16=False, max_completion_length=8, seed=0, gradient_checkpointing=False,
        **{"beta": 0.5, **config},
    )  # fmt: skip


def distill(trainer_class, config_class, models, tmp_path, *, split=(2, 4), exact=False, **config):
    """One step of a copy of the student; returns ``{name: initial - final}`` and the trainer (which recorded its
    micro-batches, unless it is made exact: ``make_exact`` refuses a class that overrides TRL's ``compute_loss``)."""
    student, teacher = models
    cls = (
        trainer_class if exact else type(f"Recording{trainer_class.__name__}", (CompletionRecorder, trainer_class), {})
    )
    args = distillation_args(
        config_class, tmp_path / f"{trainer_class.__name__}-{split[0]}x{split[1]}", split, **config
    )
    trainer = cls(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=args,
                  train_dataset=grpo_prompts(16), processing_class=grpo_tokenizer())  # fmt: skip
    if exact:
        make_exact(trainer)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = dict(trainer.model.named_parameters())
    return {n: initial[n] - final[n].detach() for n in initial}, trainer


def error_of(models, update, trainer, beta: float = 0.5) -> float:
    reference = distillation_reference(*models, recorded_completions(trainer.recorded_micro_batches), beta=beta)
    return compare(update, reference.grads).relative_error


@pytest.mark.parametrize(("split", "beta"), [((8, 1), 0.5), ((2, 4), 0.5), ((2, 4), 0.0), ((2, 4), 1.0)])
def test_distillation_step_equals_the_full_batch(tmp_path, models, split, beta) -> None:
    update, trainer = distill(GradAccDistillationTrainer, GradAccDistillationConfig, models, tmp_path, split=split,
                              beta=beta)  # fmt: skip
    lengths = [len(c) for _, c in recorded_completions(trainer.recorded_micro_batches)]
    assert len(lengths) == 8 and len(set(lengths)) > 3  # mixed completion lengths
    error = error_of(models, update, trainer, beta)
    print(f"GradAccDistillationTrainer {split[0]} x GA {split[1]}, beta {beta}: relative error {error:.3g}")
    assert error <= TOL
    assert all(float(u.abs().max()) > 0 for u in update.values())


def test_stock_distillation_is_exact_too_and_make_exact_maps_it(tmp_path, models) -> None:
    update, trainer = distill(DistillationTrainer, DistillationConfig, models, tmp_path / "stock")
    error = error_of(models, update, trainer)
    print(f"stock DistillationTrainer 2 x GA 4, beta 0.5: relative error {error:.3g}")
    assert error <= TOL
    # Made exact (not recorded): the same seed generates the same completions as the stock run above.
    made, made_trainer = distill(DistillationTrainer, DistillationConfig, models, tmp_path / "made", exact=True)
    assert isinstance(made_trainer, GradAccDistillationTrainer)
    assert error_of(models, made, trainer) <= TOL


def test_a_token_count_one_off_fails_the_check(tmp_path, models, monkeypatch) -> None:
    true_count = WindowCounts.global_count
    monkeypatch.setattr(WindowCounts, "global_count",
                        lambda self, kind: true_count(self, kind) + (kind == "tokens"))  # fmt: skip
    update, trainer = distill(GradAccDistillationTrainer, GradAccDistillationConfig, models, tmp_path)
    tokens = sum(len(c) for _, c in recorded_completions(trainer.recorded_micro_batches))
    error = error_of(models, update, trainer)
    assert error == pytest.approx(1 / (tokens + 1), rel=1e-3), (error, tokens)


def test_distillation_classes_are_exported_documented_and_parse(tmp_path) -> None:
    import hf_gradacc.trl as gradacc_trl

    for name in ("GradAccDistillationConfig", "GradAccDistillationTrainer"):
        assert name in gradacc_trl.__all__ and "Example" in getattr(gradacc_trl, name).__doc__
    (args,) = HfArgumentParser(GradAccDistillationConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--beta", "0.25", "--nonfinite_steps", "raise"]
    )
    assert isinstance(args, DistillationConfig) and args.beta == 0.25 and args.nonfinite_steps == "raise"


@pytest.mark.parametrize(("knob", "value", "match"), [
    ("regroup_micro_batches", True, "regroup_micro_batches.*generation batches of prompts"),
    ("accumulation_schedule", "0:2", "accumulation_schedule` is not supported by GradAccDistillationTrainer"),
])  # fmt: skip
def test_what_distillation_cannot_make_exact_is_refused(tmp_path, models, knob, value, match) -> None:
    args = distillation_args(GradAccDistillationConfig, tmp_path, (2, 4), **{knob: value})
    with pytest.raises(GradAccConfigError, match=match):
        GradAccDistillationTrainer(model=copy.deepcopy(models[0]), teacher_model=models[1], args=args,
                                   train_dataset=grpo_prompts(16), processing_class=grpo_tokenizer())  # fmt: skip


@pytest.mark.parametrize("positional", [False, True])
def test_a_teacher_of_another_vocabulary_is_refused_before_trl_builds_anything(tmp_path, models, monkeypatch,
                                                                               positional) -> None:  # fmt: skip
    """Issue 36: TRL's own ValueError comes after `Trainer.__init__` (the student prepared, the accelerator built);
    here a GradAccConfigError (a ValueError) naming both sizes and `teacher_model`, before TRL's __init__ runs."""

    def trl_init(*args, **kwargs):
        raise AssertionError("TRL's DistillationTrainer.__init__ ran before the refusal")

    monkeypatch.setattr(DistillationTrainer, "__init__", trl_init)
    student, teacher = copy.deepcopy(models[0]), build_tiny_policy(1, vocab_size=12)
    args = distillation_args(GradAccDistillationConfig, tmp_path, (2, 4))
    extra = {"args": args, "train_dataset": grpo_prompts(16), "processing_class": grpo_tokenizer()}
    with pytest.raises(GradAccConfigError) as caught:
        if positional:
            GradAccDistillationTrainer(student, teacher, **extra)
        else:
            GradAccDistillationTrainer(model=student, teacher_model=teacher, **extra)
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert "`teacher_model` has vocab_size 12 and the student (`model`) 8" in message
    assert "Pass a `teacher_model` with the student's vocabulary (vocab_size 8" in message


def test_a_teacher_given_as_a_path_is_left_to_trl(models) -> None:
    """A model given as a path is loaded by TRL, which compares the sizes itself (docs/distillation.md)."""
    from hf_gradacc.trl.distillation import refuse_other_vocabulary

    refuse_other_vocabulary(models[0], "some-org/a-teacher")  # nothing loaded, nothing refused
    refuse_other_vocabulary(models[0], build_tiny_policy(1))  # the same vocabulary
