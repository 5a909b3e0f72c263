"""hf_gradacc.trl.GradAccGRPOTrainer: TRL's GRPO with exact accumulation (one process).

Every exactness test runs ONE optimizer step of SGD(lr=1) (the parameter update is minus the accumulated gradient)
of a tiny Llama policy (vocabulary of 8 words: completions of 1 to 8 tokens) generating with plain
``model.generate`` on CPU, 2 completions per prompt, a deterministic reward (``length_reward``), ``beta=0``, batch 2 x
GA 4 (8 completions per step), and compares the update with the float64 full-batch step over the completions the
trainer recorded (``hf_gradacc/testing/grpo_steps.py``: each completion's log-probabilities recomputed on its own,
the loss written out per ``loss_type``; no TRL and no trainer code). At the first step the importance ratio is 1, so
the gradient is ``-sum_i A_i grad log p(completion i) / the step's normaliser``.

``steps_per_generation`` (spg) 2, 4 and 8 against GA 4: two generations per step, one, and half of one.
Tolerance: relative error <= 1e-5. Stock TRL's numbers are printed with ``-s``.

Measured (TRL 1.16, CPU, float32; ``python -m pytest -q -s tests/unit/test_trl_grpo.py`` prints them): hf_gradacc
<= 8.0e-7 for every loss type at every spg; stock TRL ``dapo`` (``cispo``, ``vespo``) 0.10 (spg 2), exact (spg 4),
0.042 (spg 8); ``bnpo`` 0.18 / 0.31 / 0.32; ``grpo``, ``dr_grpo``, ``sapo``, ``luspo`` exact (TRL's slices hold equal
rows); entropy bonus (coef 0.3) 2.6e-3 to 3.6e-3 where the policy term is exact; Mixtral router term (coef 0.5) 0.051;
two ``bnpo`` steps against TRL with the whole step in one micro-batch 0.48 / 0.50 (hf_gradacc 2.1e-7 / 3.5e-7).

Every loss type over two steps, the second off-policy (``num_iterations`` 2, the float64 reference recomputing the old
policy of the generation step): tests/unit/test_grpo_loss_types.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from transformers import HfArgumentParser  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccMixin  # noqa: E402
from hf_gradacc.compat import installed_version, trl_at_least  # noqa: E402
from hf_gradacc.counting import Counter, WindowCounts  # noqa: E402
from hf_gradacc.testing.grpo_steps import (  # noqa: E402
    GRPOStepRecorder,
    build_tiny_moe_policy,
    build_tiny_policy,
    completion_logps_and_entropies,
    grpo_prompts,
    grpo_reference,
    grpo_tokenizer,
    length_reward,
    recorded_sequences,
    step_counts,
)
from hf_gradacc.testing.one_step import one_step_args  # noqa: E402
from hf_gradacc.testing.reference import compare, float64_copy  # noqa: E402
from hf_gradacc.trl import GradAccGRPOConfig, GradAccGRPOTrainer  # noqa: E402

TOL = 1e-5
BS, GA = 2, 4
MAX_COMPLETION_LENGTH = 8
SPGS = (2, 4, 8)  # steps_per_generation below, equal to and above GA
# Loss types whose TRL value at ratio 1 is the reference's (-A per token); cispo, sapo and vespo share the gradient.
SAME_VALUE = ("dapo", "bnpo", "grpo", "dr_grpo", "luspo")
LOSS_CONFIG: dict[str, dict[str, Any]] = {
    "cispo": {"epsilon_high": 5.0},  # TRL's cispo clamps the ratio at epsilon_high (its default 0.28 is for ratios)
    "luspo": {"importance_sampling_level": "sequence"},  # the LUSPO paper's setup (TRL warns otherwise)
}


# What TRL < 1.15 lacks (the fused LM head's per-token entropies and router loss): refused there at construction, by
# test_what_this_trl_cannot_make_exact_is_refused_naming_the_versions below.
NEEDS_FUSED_HEAD = pytest.mark.skipif(
    not trl_at_least("1.15"),
    reason=f"trl {installed_version('trl')}: GRPO's entropy bonus and router term need trl>=1.15 (fused LM head); "
    "refused at construction on this version (test_what_this_trl_cannot_make_exact_is_refused_naming_the_versions)",
)


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    """TRL pings the Hub when a trainer is built; tests run offline."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


def grpo_args(config_class: type, output_dir, *, split: tuple[int, int] = (BS, GA), **config: Any) -> Any:
    batch_size, gas = split
    config = {"loss_type": "dapo", "steps_per_generation": GA, **config}
    return one_step_args(
        str(output_dir), per_device_train_batch_size=batch_size, gradient_accumulation_steps=gas,
        args_class=config_class, bf16=False, num_generations=2, max_completion_length=MAX_COMPLETION_LENGTH,
        beta=0.0, seed=0, **{**LOSS_CONFIG.get(config["loss_type"], {}), **config},
    )  # fmt: skip


def grpo_run(
    trainer_class: type, config_class: type, tmp_path, *, model: torch.nn.Module | None = None, **config: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    """Train a copy of ``model`` (the tiny policy by default); return ``{name: initial - final}`` and the trainer,
    which recorded every micro-batch it trained on (``recorded_micro_batches``)."""
    model = copy.deepcopy(model if model is not None else build_tiny_policy())
    args = grpo_args(config_class, tmp_path / trainer_class.__name__, **config)
    recording = type(f"Recording{trainer_class.__name__}", (GRPOStepRecorder, trainer_class), {})
    trainer = recording(model=model, reward_funcs=length_reward, args=args, train_dataset=grpo_prompts(16),
                        processing_class=grpo_tokenizer())  # fmt: skip
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = dict(trainer.model.named_parameters())
    return {n: initial[n] - final[n].detach() for n in initial}, trainer


def reference_of(model: torch.nn.Module, trainer: Any, *, loss_type: str, entropy_coef: float = 0.0):
    return grpo_reference(model, trainer.recorded_micro_batches, loss_type=loss_type,
                          max_completion_length=MAX_COMPLETION_LENGTH, entropy_coef=entropy_coef)  # fmt: skip


def train_log(trainer: Any) -> dict[str, float]:
    return next(entry for entry in trainer.state.log_history if "loss" in entry)


def every_parameter_moved(update: dict[str, torch.Tensor]) -> bool:
    return all(float(u.abs().max()) > 0 for u in update.values())


# ---------------------------------------------------------------------------------------------- API, config, MRO
def test_grpo_classes_are_exported_documented_and_parse_from_the_command_line(tmp_path) -> None:
    import hf_gradacc.trl as gradacc_trl

    for name in ("GradAccGRPOConfig", "GradAccGRPOTrainer"):
        assert name in gradacc_trl.__all__
        assert "Example" in getattr(gradacc_trl, name).__doc__
    (args,) = HfArgumentParser(GradAccGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--loss_type", "bnpo", "--steps_per_generation", "8",
         "--gradient_accumulation_steps", "4", "--nonfinite_steps", "raise"]
    )  # fmt: skip
    assert isinstance(args, GRPOConfig) and args.loss_type == "bnpo" and args.steps_per_generation == 8
    assert args.nonfinite_steps == "raise"
    wrong = GradAccConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(GradAccConfigError, match="GradAccGRPOConfig"):
        GradAccGRPOTrainer(model=build_tiny_policy(), reward_funcs=length_reward, args=wrong,
                           train_dataset=grpo_prompts(), processing_class=grpo_tokenizer())  # fmt: skip


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "top_entropy_quantile": ({"top_entropy_quantile": 0.5}, "`top_entropy_quantile` \\(0.5\\) < 1"),
    "regroup": ({"regroup_micro_batches": True}, "`regroup_micro_batches`"),
    "pack": ({"pack_micro_batches": True}, "`pack_micro_batches`"),
    "schedule": ({"accumulation_schedule": "2:8"}, "`accumulation_schedule`"),
    "auto_micro_batch": ({"auto_micro_batch": True}, "`auto_micro_batch=True` is not supported"),
    "defer_normalization": ({"defer_normalization": True}, "`defer_normalization=True` is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_that_cannot_be_exact_are_refused_naming_the_field(tmp_path, case: str) -> None:
    config, message = REFUSED[case]
    args = grpo_args(GradAccGRPOConfig, tmp_path, **config)
    with pytest.raises(GradAccConfigError, match=message):
        GradAccGRPOTrainer(model=build_tiny_policy(), reward_funcs=length_reward, args=args,
                           train_dataset=grpo_prompts(), processing_class=grpo_tokenizer())  # fmt: skip


OLD_TRL_REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {  # case: (TRL that has it, config, message)
    "entropy_coef": ("1.15", {"entropy_coef": 0.3}, "entropy bonus"),
    "adaptive_entropy": ("1.15", {"use_adaptive_entropy": True, "entropy_coef": 0.1}, "entropy bonus"),
    "router": ("1.15", {"router_aux_loss_coef": 0.5}, "router loss"),
    "luspo_token_level": ("1.10", {"loss_type": "luspo", "importance_sampling_level": "token"}, "luspo"),
}


@pytest.mark.parametrize("case", list(OLD_TRL_REFUSED))
def test_what_this_trl_cannot_make_exact_is_refused_naming_the_versions(tmp_path, case: str) -> None:
    """On a TRL older than the release that has what hf_gradacc reads, the setting is refused at construction with a
    GradAccConfigError naming the feature, the installed TRL and the version that has it (never a wrong step or an
    AttributeError mid-training). Runs only on such a TRL (1.9 in the compatibility stage)."""
    version, config, feature = OLD_TRL_REFUSED[case]
    if trl_at_least(version):
        pytest.skip(f"trl {installed_version('trl')} has it (>= {version}): exact, tested above")
    model = build_tiny_moe_policy(router_aux_loss_coef=0.5) if case == "router" else build_tiny_policy()
    args = grpo_args(GradAccGRPOConfig, tmp_path, **config)
    message = rf"{feature}.*needs trl>={version} with hf_gradacc \(installed {installed_version('trl')}\)"
    with pytest.raises(GradAccConfigError, match=message):
        GradAccGRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=grpo_prompts(),
                           processing_class=grpo_tokenizer())  # fmt: skip


def test_top_entropy_quantile_is_allowed_with_one_micro_batch_per_step(tmp_path) -> None:
    """With GA 1 the quantile is over the step's tokens (TRL gathers them over processes): nothing to refuse."""
    args = grpo_args(GradAccGRPOConfig, tmp_path, split=(8, 1), steps_per_generation=1, top_entropy_quantile=0.5)
    trainer = GradAccGRPOTrainer(model=build_tiny_policy(), reward_funcs=length_reward, args=args,
                                 train_dataset=grpo_prompts(), processing_class=grpo_tokenizer())  # fmt: skip
    assert trainer.top_entropy_quantile == 0.5


def test_processes_with_different_numbers_of_micro_batches_stop_before_generating() -> None:
    """TRL's generation gathers rewards across processes: a step in which the processes fetched different numbers of
    micro-batches stops every process (one small collective before generating), instead of leaving one waiting."""
    from types import SimpleNamespace

    from hf_gradacc import GradAccDataError
    from hf_gradacc.trl._common import agree_on_micro_batches as _agree_on_micro_batches

    def trainer(per_rank):
        gather = lambda local: torch.tensor(per_rank)  # noqa: E731 - every rank's count, as all_gather returns them
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=len(per_rank)), args=SimpleNamespace(device="cpu"),
                               backend=SimpleNamespace(all_gather=gather))  # fmt: skip

    with pytest.raises(GradAccDataError, match=r"\[4, 3\]"):
        _agree_on_micro_batches(trainer([4, 3]), 4)
    _agree_on_micro_batches(trainer([4, 4]), 4)


def test_the_window_counts_exactly_the_completion_tokens_of_the_loss() -> None:
    """The ``labels`` handed to the window mark the loss mask (``completion_mask x tool_mask``): the causal count (after
    its shift) is the mask's sum, every row a sequence, and the attention mask is the forward pass's."""
    from hf_gradacc.heads import Head
    from hf_gradacc.trl._common import with_completion_labels as _with_completion_labels

    inputs = {
        "prompt_ids": torch.tensor([[0, 5, 6], [4, 4, 7]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[3, 1, 0, 0], [5, 6, 7, 1]]),
        "completion_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
        "tool_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 1]]),
    }
    batch = _with_completion_labels(inputs, ignore_index=-100)
    counts = Counter(Head.for_model(build_tiny_policy(), custom_loss=True)).count_batch(batch)
    assert counts.num_tokens == 4 and counts.num_samples == 2 and counts.num_input_tokens == 11
    assert batch["labels"][1].tolist() == [-100, 5, -100, -100, 1]


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("spg", SPGS, ids=lambda s: f"spg{s}")
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"])
def test_grpo_step_is_the_full_batch_step(tmp_path, loss_type: str, spg: int) -> None:
    model = build_tiny_policy()
    update, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path, model=model, loss_type=loss_type,
                               steps_per_generation=spg)  # fmt: skip
    assert GradAccGRPOTrainer.training_step is GradAccMixin.training_step and not trainer.backend.multi_backward
    micro_batches = trainer.recorded_micro_batches
    assert [int(mb["completion_ids"].shape[0]) for mb in micro_batches] == [BS] * GA
    lengths = [len(c) for _, c, _ in recorded_sequences(micro_batches)]
    assert len(set(lengths)) > 2, lengths  # completions of many lengths: equal lengths would hide the bug
    reference = reference_of(model, trainer, loss_type=loss_type)
    error = compare(update, reference.grads).relative_error
    print(f"GradAccGRPOTrainer, {loss_type}, 2 x GA 4, steps_per_generation {spg}: relative error {error:.3g}")
    assert error <= TOL
    assert every_parameter_moved(update)
    log = train_log(trainer)
    assert log["grad_norm"] == pytest.approx(reference.norm, rel=TOL)
    if loss_type in SAME_VALUE:
        assert log["loss"] == pytest.approx(reference.loss, rel=TOL, abs=1e-6)


STOCK_VERDICTS = {  # (loss_type, spg): exact?
    ("dapo", 2): False, ("dapo", 4): True, ("dapo", 8): False,
    ("bnpo", 2): False, ("bnpo", 4): False, ("bnpo", 8): False,
    ("grpo", 2): True, ("grpo", 4): True, ("grpo", 8): True,
    ("dr_grpo", 2): True, ("dr_grpo", 4): True, ("dr_grpo", 8): True,
    ("cispo", 2): False, ("vespo", 2): False, ("sapo", 2): True, ("luspo", 2): True,
}  # fmt: skip


@pytest.mark.parametrize(("loss_type", "spg"), list(STOCK_VERDICTS), ids=[f"{lt}-spg{s}" for lt, s in STOCK_VERDICTS])
def test_stock_grpo_where_it_is_off(tmp_path, loss_type: str, spg: int) -> None:
    """docs/trl.md's table: stock TRL's ``dapo`` (and ``cispo``, ``vespo``) divides by the generation batch's tokens
    rescaled to one step (exact only when spg == GA), ``bnpo`` averages micro-batch token means (never exact with
    unequal lengths); ``grpo``, ``dr_grpo``, ``sapo`` and ``luspo`` are exact because TRL's slices hold equal rows.
    Printed with ``-s``."""
    model = build_tiny_policy()
    update, trainer = grpo_run(GRPOTrainer, GRPOConfig, tmp_path, model=model, loss_type=loss_type,
                               steps_per_generation=spg)  # fmt: skip
    error = compare(update, reference_of(model, trainer, loss_type=loss_type).grads).relative_error
    print(f"stock GRPOTrainer, {loss_type}, 2 x GA 4, steps_per_generation {spg}: relative error {error:.3g}")
    assert error <= TOL if STOCK_VERDICTS[loss_type, spg] else error > 1e-2, error


@NEEDS_FUSED_HEAD
@pytest.mark.parametrize("spg", (4, 8), ids=lambda s: f"spg{s}")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus_is_a_mean_over_the_step_completion_tokens(tmp_path, loss_type: str, spg: int) -> None:
    model, coef = build_tiny_policy(), 0.3
    update, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path, model=model, loss_type=loss_type,
                               steps_per_generation=spg, entropy_coef=coef)  # fmt: skip
    reference = reference_of(model, trainer, loss_type=loss_type, entropy_coef=coef)
    ours = compare(update, reference.grads).relative_error
    print(f"GradAccGRPOTrainer, {loss_type} + entropy bonus {coef}, spg {spg}: relative error {ours:.3g}")
    assert ours <= TOL
    log = train_log(trainer)
    assert log["loss"] == pytest.approx(reference.loss, rel=TOL)
    assert log["loss"] == pytest.approx(log["loss/policy"] + log["loss/entropy"], rel=TOL) and log["loss/entropy"] < 0
    stock, stock_trainer = grpo_run(GRPOTrainer, GRPOConfig, tmp_path / "stock", model=model, loss_type=loss_type,
                                    steps_per_generation=spg, entropy_coef=coef)  # fmt: skip
    error = compare(stock, reference_of(model, stock_trainer, loss_type=loss_type, entropy_coef=coef).grads)
    print(
        f"stock GRPOTrainer, {loss_type} + entropy bonus {coef}, spg {spg}: relative error {error.relative_error:.3g}"
    )
    assert error.relative_error > 1e-3, error  # TRL: the micro-batch's token mean of the entropy / GA


@NEEDS_FUSED_HEAD
def test_adaptive_entropy_controller_measures_the_step(tmp_path) -> None:
    """TRL's adaptive controller accumulates the entropy of every micro-batch and reduces it at the step's boundary
    (``sync_gradients``, which the mixin sets on the last micro-batch): it must see the step's exact token mean. The
    first step applies no bonus (the controller starts from an infinite entropy)."""
    model = build_tiny_policy()
    update, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path, model=model, use_adaptive_entropy=True,
                               entropy_coef=0.1, entropy_target=100.0, entropy_coef_delta=0.05)  # fmt: skip
    assert compare(update, reference_of(model, trainer, loss_type="dapo").grads).relative_error <= TOL
    policy = float64_copy(model)
    entropies = [completion_logps_and_entropies(policy, p, c)[1] for p, c, _ in
                 recorded_sequences(trainer.recorded_micro_batches) if c]  # fmt: skip
    exact = float(torch.cat(entropies).detach().mean())
    assert trainer._last_world_entropy == pytest.approx(exact, rel=TOL)
    assert trainer.entropy_coef == pytest.approx(0.15)  # below the target: raised once, at the step's end


@NEEDS_FUSED_HEAD
def test_moe_router_term_is_weighted_by_routed_tokens(tmp_path) -> None:
    model = build_tiny_moe_policy(router_aux_loss_coef=0.5)
    update, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path, model=model)
    reference = reference_of(model, trainer, loss_type="dapo")
    ours = compare(update, reference.grads).relative_error
    print(f"GradAccGRPOTrainer, Mixtral (router coef 0.5), dapo, spg 4: relative error {ours:.3g}")
    assert ours <= TOL
    log = train_log(trainer)
    assert log["loss"] == pytest.approx(log["loss/policy"] + log["loss/aux"], rel=TOL) and log["loss/aux"] > 0
    stock, stock_trainer = grpo_run(GRPOTrainer, GRPOConfig, tmp_path / "stock", model=model)
    error = compare(stock, reference_of(model, stock_trainer, loss_type="dapo").grads).relative_error
    print(f"stock GRPOTrainer, Mixtral (router coef 0.5), dapo, spg 4: relative error {error:.3g}")
    assert error > 1e-2, error  # TRL: coef x aux / GA per micro-batch, whatever its routed tokens


@pytest.mark.parametrize(("loss_type", "denominator"), [("dapo", "tokens"), ("grpo", "samples")])
def test_a_one_percent_error_in_the_step_denominator_fails_the_check(tmp_path, monkeypatch, loss_type, denominator):
    """The exactness check can fail: the same run with the step's count off by 1 % (at least one item) is outside
    the tolerance."""
    true_count = WindowCounts.global_count

    def off_by_one_percent(self, kind):
        count = true_count(self, kind)
        return count + max(1, round(count / 100)) if kind == denominator else count

    monkeypatch.setattr(WindowCounts, "global_count", off_by_one_percent)
    model = build_tiny_policy()
    update, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path, model=model, loss_type=loss_type,
                               steps_per_generation=8)  # fmt: skip
    tokens, sequences = step_counts(trainer.recorded_micro_batches)
    count = tokens if denominator == "tokens" else sequences
    error = compare(update, reference_of(model, trainer, loss_type=loss_type).grads).relative_error
    shift = max(1, round(count / 100)) / (count + max(1, round(count / 100)))
    assert error > TOL and error == pytest.approx(shift, rel=1e-3), (error, count)


# ---------------------------------------------------------------------------------------------- later steps
LATER_STEPS = {  # ours at 2 x GA 4 and TRL at 8 x GA 1 generate the same completions (same generation batches)
    "spg_above_ga": dict(ours=dict(steps_per_generation=8), whole=dict(steps_per_generation=2)),
    "num_iterations_2": dict(ours=dict(steps_per_generation=4, num_iterations=2),
                             whole=dict(steps_per_generation=1, num_iterations=2)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LATER_STEPS))
def test_two_steps_equal_trl_with_the_whole_step_in_one_micro_batch(tmp_path, case: str) -> None:
    """Beyond the first step the policy has moved: TRL's importance ratio (against the generation-time
    log-probabilities) and its clipping act. Two steps of ``bnpo`` (a token mean, which TRL computes exactly when the
    step is ONE micro-batch) at 2 x GA 4 equal TRL's at 8 x GA 1 on the same completions; stock 2 x GA 4 does not."""
    model, config = build_tiny_policy(), LATER_STEPS[case]
    ours, trainer = grpo_run(GradAccGRPOTrainer, GradAccGRPOConfig, tmp_path / "ours", model=model, loss_type="bnpo",
                             max_steps=2, **config["ours"])  # fmt: skip
    whole, _ = grpo_run(GRPOTrainer, GRPOConfig, tmp_path / "whole", model=model, loss_type="bnpo", max_steps=2,
                        split=(8, 1), **config["whole"])  # fmt: skip
    assert trainer.state.global_step == 2
    assert any(h.get("clip_ratio/region_mean", 0) > 0 for h in trainer.state.log_history)  # clipping acted
    error = compare(ours, whole).relative_error
    print(f"GradAccGRPOTrainer, bnpo, 2 steps, {case}, 2 x GA 4 vs 8 x 1: relative error {error:.3g}")
    assert error <= TOL
    stock, _ = grpo_run(GRPOTrainer, GRPOConfig, tmp_path / "stock", model=model, loss_type="bnpo", max_steps=2,
                        **config["ours"])  # fmt: skip
    error = compare(stock, whole).relative_error
    print(f"stock GRPOTrainer, bnpo, 2 steps, {case}, 2 x GA 4 vs 8 x 1: relative error {error:.3g}")
    assert error > 1e-2, error


# ---------------------------------------------------------------------------------------------- metrics, evaluation
def test_logged_metrics_and_evaluation_are_trl_s(tmp_path) -> None:
    """Where stock TRL is exact (dapo, spg == GA) both trainers generate the same completions: every metric TRL logs
    (rewards, completion lengths, entropy, clip ratios, num_tokens, loss, grad_norm) is the same, ``step_time`` is
    logged, and ``evaluate()`` runs TRL's generation and loss."""
    runs = {}
    for name, (trainer_class, config_class) in {"ours": (GradAccGRPOTrainer, GradAccGRPOConfig),
                                                 "stock": (GRPOTrainer, GRPOConfig)}.items():  # fmt: skip
        _, trainer = grpo_run(trainer_class, config_class, tmp_path / name)
        trainer.eval_dataset = grpo_prompts(4, seed=9)
        runs[name] = (train_log(trainer), trainer.evaluate())
    (ours, ours_eval), (stock, stock_eval) = runs["ours"], runs["stock"]
    assert set(ours) == set(stock) and "step_time" in ours and "rewards/length_reward/mean" in ours
    for key in sorted(set(ours) - {"step_time"}):
        assert ours[key] == pytest.approx(stock[key], rel=1e-5, abs=1e-7), key
    assert set(ours_eval) == set(stock_eval) and torch.isfinite(torch.tensor(ours_eval["eval_loss"]))
    assert ours_eval["eval_loss"] == pytest.approx(stock_eval["eval_loss"], rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------------- the example
def test_grpo_example_step_is_the_float64_full_batch_step(tmp_path, monkeypatch) -> None:
    """examples/grpo.py, unchanged, on its tiny checkpoint (saved, then loaded by TRL from the path): ``bnpo`` at batch
    2 x GA 4 with ``steps_per_generation=8`` (half a generation batch per step), one SGD(lr=1) step. The update is
    minus the float64 gradient of the mean over ALL the step's completion tokens, and the printed loss and grad_norm
    are the step's."""
    import importlib.util
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    captured: dict[str, Any] = {"micro_batches": []}
    build_trainer = module.build_trainer

    def capturing(argv):
        trainer = build_trainer(argv)
        captured["trainer"] = trainer
        captured["initial"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trl_compute_loss = trainer.compute_loss

        def recording(model, inputs, return_outputs=False, num_items_in_batch=None):
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
            captured["micro_batches"].append({k: inputs[k].detach().clone() for k in keys})
            return trl_compute_loss(model, inputs, return_outputs, num_items_in_batch)

        trainer.compute_loss = recording
        return trainer

    monkeypatch.setattr(module, "build_trainer", capturing)
    run = tmp_path / "run"
    summary = module.main([
        "--output_dir", str(run), "--use_cpu", "true", "--bf16", "false", "--max_steps", "1", "--seed", "0",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4", "--num_generations", "2",
        "--steps_per_generation", "8", "--max_completion_length", "8", "--loss_type", "bnpo", "--optim", "sgd",
        "--learning_rate", "1", "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--report_to", "none",
        "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
    ])  # fmt: skip
    trainer, micro_batches = captured["trainer"], captured["micro_batches"]
    assert summary["steps"] == 1 and len(micro_batches) == GA
    _, sequences = step_counts(micro_batches)
    assert sequences == BS * GA and len({len(c) for _, c, _ in recorded_sequences(micro_batches)}) > 2
    update = {n: captured["initial"][n] - p.detach() for n, p in trainer.model.named_parameters()}
    initial = AutoModelForCausalLM.from_pretrained(run / "tiny-model")  # the checkpoint TRL loaded, apart from TRL
    reference = grpo_reference(initial, micro_batches, loss_type="bnpo", max_completion_length=MAX_COMPLETION_LENGTH)
    assert compare(update, reference.grads).relative_error <= TOL
    assert every_parameter_moved(update)
    assert summary["grad_norm"] == pytest.approx(reference.norm, rel=TOL)
    assert summary["loss"] == pytest.approx(reference.loss, rel=TOL, abs=1e-6)
    assert summary["rewards/length_reward/mean"] <= 0  # -|words - 4| / 4
