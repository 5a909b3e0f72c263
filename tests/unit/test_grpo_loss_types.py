"""Every GRPO ``loss_type`` of the installed TRL, GradAccGRPOTrainer and stock TRL, against the float64 full-batch
step of the loss as its paper / TRL's docstring defines it (``hf_gradacc/testing/grpo_reference.py``: no TRL code).

The run (``commands/check/grpo_rows.py``, the rows of ``hf-gradacc check --trainer grpo``): the tiny Llama policy
(vocabulary of 8 words: completions of 1 to 8 tokens), 2 completions per prompt, batch 2 x GA 4,
``steps_per_generation`` 8 (half a generation batch per step), ``num_iterations`` 2, ``beta`` 0,
``mask_truncated_completions`` (completions of 0 to 6 tokens in the loss), two SGD(lr=1) steps: step 2 trains on
completions step 1's policy generated, so the importance ratio is not 1 (42 % of its tokens outside PPO's clip range
for ``dapo``) and the reference recomputes the old policy's log-probabilities from the parameters of the generation
step. Every step of every loss type within 1e-5 (relative error of the update).

Measured (TRL 1.16, CPU; ``python -m pytest -q -s tests/unit/test_grpo_loss_types.py`` prints them), worst step:
hf_gradacc 2.0e-7 to 1.0e-6 on all eight; stock TRL ``grpo``, ``dr_grpo``, ``sapo``, ``luspo`` exact (equal rows per
micro-batch), ``dapo`` / ``cispo`` / ``vespo`` 5.5e-2 (the generation batch's tokens rescaled to one step), ``bnpo``
0.31 (per micro-batch, as TRL's docstring defines it: stock TRL is exact against that definition, 5.3e-7).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("trl")

from hf_gradacc.commands.check.grpo_rows import grpo_loss_type_rows, grpo_run  # noqa: E402
from hf_gradacc.counting import WindowCounts  # noqa: E402
from hf_gradacc.testing.grpo_reference import GRPO_LOSS_TYPES, GRPOLossSettings, grpo_step_reference  # noqa: E402
from hf_gradacc.testing.grpo_steps import build_tiny_policy  # noqa: E402
from hf_gradacc.testing.reference import compare  # noqa: E402

TOL = 1e-5
STOCK_EXACT = ("grpo", "dr_grpo", "sapo", "luspo")  # TRL's micro-batches hold equal numbers of completions
TOKEN_FAMILY = ("dapo", "bnpo", "cispo", "vespo")  # the step's completion tokens
SEQUENCE_FAMILY = ("grpo", "dr_grpo", "sapo", "luspo")  # the step's completions


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture(scope="module")
def check():
    """Every loss type, GradAccGRPOTrainer and TRL, two steps each (one run for the module: ~20 s)."""
    return grpo_loss_type_rows(GRPO_LOSS_TYPES, step_kwargs={"use_cpu": True, "report_to": []})


def _row(check, loss_type: str):
    return next(r for r in check.rows if r.loss_type == loss_type)


def test_every_loss_type_of_the_installed_trl_has_a_reference_and_a_normaliser() -> None:
    """The loss types ``GRPOConfig.loss_type`` lists are the reference's and GradAccGRPOTrainer's: a TRL that adds one
    fails here until it has a definition (or a refusal by name)."""
    from trl import GRPOConfig

    from hf_gradacc.trl.grpo import _GRPO_DENOMINATORS

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = re.search(r"Supported values are (.*?)\.", help_text).group(1)
    assert set(re.findall(r"'(\w+)'", listed)) == set(GRPO_LOSS_TYPES) == set(_GRPO_DENOMINATORS)
    assert set(TOKEN_FAMILY) | set(SEQUENCE_FAMILY) == set(GRPO_LOSS_TYPES)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_each_loss_type_is_the_full_batch_step_at_every_step(check, loss_type: str) -> None:
    row = _row(check, loss_type)
    print(
        f"{loss_type}: GradAccGRPOTrainer {', '.join(f'{e:.2g}' for e in row.ours_steps)}; "
        f"stock GRPOTrainer {', '.join(f'{e:.2g}' for e in row.stock_steps)} (relative error, steps 1 and 2); "
        f"{row.clipped_fraction:.0%} of step 2's tokens outside the clip range"
    )
    assert len(row.ours_steps) == 2 and max(row.ours_steps) <= TOL, row
    assert len(set(check.completion_lengths)) > 2, check.completion_lengths  # equal lengths would hide the bug
    assert 0 in check.completion_lengths  # a truncated completion masked out entirely (mask_truncated_completions)
    assert row.clipped_fraction > 0.05  # step 2 trains off-policy (12 % at least): a reference at ratio 1 fails


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_stock_trl_is_off_where_its_normaliser_is_not_the_step(check, loss_type: str) -> None:
    """dapo / cispo / vespo divide by the generation batch's tokens rescaled to one step (two steps per generation
    here), bnpo by each micro-batch's tokens; the per-sequence types are exact (equal rows per micro-batch)."""
    row = _row(check, loss_type)
    if loss_type in STOCK_EXACT:
        assert max(row.stock_steps) <= TOL, row
    else:
        assert min(row.stock_steps) > 1e-2, row


def test_bnpo_is_defined_per_micro_batch_and_stock_trl_follows_that_definition(check) -> None:
    """TRL's docstring normalises bnpo "over the local batch only": the definition depends on the split. Taken
    literally (the mean of the micro-batches' token means) stock TRL is exact to it; GradAccGRPOTrainer takes the
    whole step over every process as the batch, which makes bnpo's step dapo's."""
    bnpo, dapo = _row(check, "bnpo"), _row(check, "dapo")
    assert bnpo.stock_to_per_micro_batch is not None and bnpo.stock_to_per_micro_batch <= TOL
    assert bnpo.ours_steps[0] == pytest.approx(dapo.ours_steps[0], rel=1e-3)  # the same first step


@pytest.mark.parametrize(
    ("loss_type", "kind"), [("dapo", "tokens"), ("grpo", "samples")], ids=["token-family", "sequence-family"]
)
def test_one_count_off_by_one_fails(tmp_path, monkeypatch, loss_type: str, kind: str) -> None:
    """The step's count of completion tokens (token family) or completions (sequence family) one too many: the
    update is outside the tolerance against the same reference."""
    true_count = WindowCounts.global_count
    monkeypatch.setattr(WindowCounts, "global_count", lambda self, k: true_count(self, k) + (k == kind))
    from hf_gradacc.trl import GradAccGRPOConfig, GradAccGRPOTrainer

    policy = build_tiny_policy(0)
    trainer, updates, steps = grpo_run(
        GradAccGRPOTrainer, GradAccGRPOConfig, policy, loss_type=loss_type, per_device_train_batch_size=2,
        gradient_accumulation_steps=4, seed=0, step_kwargs={"use_cpu": True, "report_to": [], "max_steps": 1},
    )  # fmt: skip
    ((step, micro_batches),) = steps
    reference = grpo_step_reference(policy, micro_batches, trainer.policies_at_step, step,
                                    GRPOLossSettings.from_args(trainer.args))  # fmt: skip
    error = compare(updates[step], reference.grads).relative_error
    print(f"{loss_type}, {kind} + 1: relative error {error:.2g}")
    assert error > 100 * TOL, error


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_tool_tokens_are_left_out_of_the_policy_sum_its_normaliser_and_the_entropy_bonus(loss_type: str) -> None:
    """A micro-batch whose completions hold tool-result tokens (``tool_mask`` 0): TRL's loss leaves them out
    (``completion_mask x tool_mask``), so GradAccGRPOTrainer's terms do too: the policy term's token sum (for bnpo
    through TRL's per-micro-batch normaliser, undone with the tool-masked token count), and the entropy bonus's sum.
    Written out here at ratio 1 (no old log-probabilities: the per-token loss is ``-A``) and from a float64 copy of
    the policy (positions from 0, no padding)."""
    import torch

    from hf_gradacc.counting import MicroBatchCounts
    from hf_gradacc.step.window import Window
    from hf_gradacc.testing.grpo_steps import (
        completion_logps_and_entropies,
        grpo_prompts,
        grpo_tokenizer,
        length_reward,
    )
    from hf_gradacc.testing.one_step import one_step_args
    from hf_gradacc.testing.reference import float64_copy
    from hf_gradacc.trl import GradAccGRPOConfig, GradAccGRPOTrainer

    coef, steps = 0.1, 2
    policy = build_tiny_policy(0)
    reference = float64_copy(policy)  # before a trainer replaces the policy's forward (TRL's fused head)
    args = one_step_args(args_class=GradAccGRPOConfig, per_device_train_batch_size=2, gradient_accumulation_steps=steps,
                         num_generations=2, max_completion_length=4, loss_type=loss_type, entropy_coef=coef, beta=0.0,
                         bf16=False, use_cpu=True, report_to=[])  # fmt: skip
    trainer = GradAccGRPOTrainer(model=policy, reward_funcs=length_reward, args=args, train_dataset=grpo_prompts(8),
                                 processing_class=grpo_tokenizer())  # fmt: skip
    prompts, completions = [[5, 6], [4, 4, 7]], [[3, 1], [5, 6, 7, 1]]
    inputs = {
        "prompt_ids": torch.tensor([[0, 5, 6], [4, 4, 7]]),  # left-padded, as TRL's generation pads them
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[3, 1, 0, 0], [5, 6, 7, 1]]),
        "completion_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
        "tool_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 1]]),  # row 1: a tool's result at positions 1 and 2
        "advantages": torch.tensor([0.5, -1.0]),
        "num_items_in_batch": torch.tensor(4.0 * steps),  # dapo: the generation batch's tokens (2 steps per generation)
    }
    loss_mask = (inputs["completion_mask"] * inputs["tool_mask"]).double()
    window = Window.prefetched([inputs], count=lambda _b: MicroBatchCounts(num_tokens=4, num_samples=2),
                               all_gather=lambda t: t.unsqueeze(0), device="cpu", dp_world_size=1)  # fmt: skip
    window.index = 0
    trainer.step_engine.window, trainer.current_gradient_accumulation_steps = window, steps
    trainer.model.train()
    terms = trainer.compute_loss(trainer.model, inputs)
    policy_sum = -(inputs["advantages"].double().unsqueeze(1) * loss_mask).sum()
    with torch.no_grad():
        entropies = [completion_logps_and_entropies(reference, p, c)[1] for p, c in zip(prompts, completions)]
    entropy_sum = sum((e * loss_mask[i, : len(e)]).sum() for i, e in enumerate(entropies))
    assert float(loss_mask.sum()) == 4 < float(inputs["completion_mask"].sum())  # tool tokens would make it 6
    assert float(terms["policy"].total.detach()) == pytest.approx(float(policy_sum), rel=1e-5)
    assert float(terms["entropy"].total.detach()) == pytest.approx(float(-coef * entropy_sum), rel=1e-5)


# ---------------------------------------------------------------------------------------------- the command
def test_check_trainer_grpo_prints_one_row_per_loss_type(tmp_path, capsys) -> None:
    """``hf-gradacc check --trainer grpo --loss-type dapo luspo`` (GA 2, so steps_per_generation 4): one row each,
    stock and ours, JSON with every step; exit 0 (GradAccGRPOTrainer exact on both)."""
    import json

    from hf_gradacc.commands.hf_gradacc_cli import main

    report = tmp_path / "grpo.json"
    argv = ["--trainer", "grpo", "--loss-type", "dapo", "luspo", "--gradient_accumulation_steps", "2"]
    status = main(["check", *argv, "--json", str(report)])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0] in GRPO_LOSS_TYPES]
    assert [r[0] for r in rows] == ["dapo", "luspo"], out
    assert rows[0][-5] == "WRONG" and rows[0][-3] == "exact", rows[0]  # stock dapo off, ours exact
    assert "GradAccGRPOTrainer is exact on all 2 loss types" in out
    data = json.loads(report.read_text())
    assert set(data["loss_types"]) == {"dapo", "luspo"} and data["is_exact"]
    assert data["setup"]["gradient_accumulation_steps"] == 2 and data["setup"]["num_samples"] == 4
    steps = data["loss_types"]["dapo"]["relative_error_per_step"]["GradAccGRPOTrainer"]
    assert len(steps) == 2 and max(steps) <= TOL


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainer", "dpo", "--loss-type", "dapo"], "`--loss-type` is for `--trainer grpo`"),
        (["--trainer", "grpo", "--loss-type", "ppo"], "'ppo' is not a GRPO loss type"),
        (["--trainer", "grpo", "--task", "masked_lm"], "trains a causal LM"),
        (["--trainer", "grpo", "--model", "some/path"], "built-in tiny policy"),
    ],
)
def test_check_trainer_grpo_refuses_what_it_cannot_run(capsys, argv, message) -> None:
    from hf_gradacc.commands.hf_gradacc_cli import main

    assert main(["check", *argv]) == 2
    assert message in capsys.readouterr().err


def test_check_trainer_grpo_refuses_sharded_backends(capsys, monkeypatch) -> None:
    """The reference reads the full parameters at every step: under a DeepSpeed or FSDP2 launch it would read shards."""
    from hf_gradacc.commands.hf_gradacc_cli import main

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert main(["check", "--trainer", "grpo"]) == 2
    assert "runs on one process or DDP (ACCELERATE_USE_DEEPSPEED is set)" in capsys.readouterr().err
