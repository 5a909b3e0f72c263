"""``total_train_batch_size``: the accumulation derived from the data ranks present, the errors, and a resume that
keeps the global batch on one process (another per-device batch: GA derived again, the same samples per step, the
uninterrupted run's weights). The world-size changes (2 -> 1, 2 -> 3) are in
``tests/distributed/test_total_train_batch_size.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer
from hf_gradacc.backends.mesh import Mesh
from hf_gradacc.config import accumulation_for_total, hold_total_train_batch_size, resolve_settings
from hf_gradacc.log import active_line
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers.resume_layout_cases import train_run


@pytest.mark.parametrize(
    "total, micro, ranks, ga", [(16, 2, 2, 4), (16, 2, 1, 8), (16, 4, 4, 1), (48, 2, 3, 8), (1, 1, 1, 1)]
)
def test_the_accumulation_is_total_over_micro_batch_times_data_ranks(total, micro, ranks, ga) -> None:
    assert accumulation_for_total(total, micro_batch=micro, data_ranks=ranks) == ga


@pytest.mark.parametrize(
    "total, micro, ranks, named",
    [
        (16, 2, 3, ["(16)", "2 x 3 = 6", "12 (GA 2) or 18 (GA 3)", "1, 2, 4 or 8 data ranks"]),
        (20, 4, 2, ["(20)", "4 x 2 = 8", "16 (GA 2) or 24 (GA 3)", "1 or 5 data ranks"]),
        (4, 2, 4, ["(4)", "2 x 4 = 8", "nearest totals that fit are 8 (GA 1)", "1 or 2 data ranks"]),
        (7, 2, 1, ["(7)", "2 x 1 = 2", "6 (GA 3) or 8 (GA 4)"]),
    ],
)
def test_a_total_that_is_not_a_multiple_is_refused_naming_the_totals_that_fit(total, micro, ranks, named) -> None:
    with pytest.raises(GradAccConfigError, match="`total_train_batch_size`") as error:
        accumulation_for_total(total, micro_batch=micro, data_ranks=ranks)
    message = str(error.value)
    for part in named:
        assert part in message, message
    assert "per_device_train_batch_size" in message and "number of processes" in message, message
    if total % micro:
        assert "data ranks at this per-device batch" not in message, message


@pytest.mark.parametrize("value", [0, -8, 2.5, "16", True])
def test_a_total_that_is_no_whole_number_is_refused(tmp_path, value) -> None:
    with pytest.raises(GradAccConfigError, match=rf"`total_train_batch_size` \({value!r}\) must be None or an int"):
        GradAccConfig(str(tmp_path), total_train_batch_size=value)


def test_the_combinations_that_cannot_hold_the_total_are_refused(tmp_path) -> None:
    with pytest.raises(GradAccConfigError, match="cannot be combined with `accumulation_schedule`"):
        GradAccConfig(str(tmp_path), total_train_batch_size=8, accumulation_schedule="0:1,2:4")
    with pytest.raises(GradAccConfigError, match="cannot be combined with `auto_find_batch_size=True`"):
        GradAccConfig(str(tmp_path), total_train_batch_size=8, auto_find_batch_size=True)


def test_the_field_is_on_the_command_line_and_in_gradacc_args(tmp_path) -> None:
    (args,) = HfArgumentParser(GradAccConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--total_train_batch_size", "16", "--per_device_train_batch_size", "2"]
    )
    assert args.total_train_batch_size == 16 and resolve_settings(args).total_train_batch_size == 16
    plain = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[])
    assert resolve_settings(plain, {"total_train_batch_size": 12}).total_train_batch_size == 12


def test_gradient_accumulation_steps_is_derived_from_the_data_ranks_only(tmp_path) -> None:
    """tp, cp and sp ranks hold no other samples: on tp 2 x cp 2 x dp 2 (8 processes), 2 data ranks."""
    mesh = Mesh.of({"dp_shard": 2, "tp": 2, "cp": 2}, backend="FSDP2")
    assert (mesh.world_size, mesh.count_group_size, mesh.data_parallel_size) == (8, 4, 2)
    args = GradAccConfig(str(tmp_path), per_device_train_batch_size=2, total_train_batch_size=16, use_cpu=True)
    held = hold_total_train_batch_size(args, resolve_settings(args), data_ranks=mesh.data_parallel_size)
    assert (held.accumulation, args.gradient_accumulation_steps, held.given) == (4, 4, 1)
    assert held.describe() == "total_train_batch_size 16 = 2 per device x GA 4 x 2 data ranks"
    # a restart with the same arguments on 1 data rank derives again from the GA they were given
    held = hold_total_train_batch_size(args, resolve_settings(args), data_ranks=1)
    assert (held.accumulation, args.gradient_accumulation_steps, held.given) == (8, 8, 1)


def _trainer(tmp_path, **fields) -> GradAccTrainer:
    args = GradAccConfig(
        str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[], max_steps=1, **fields
    )
    return GradAccTrainer(
        model=build_tiny_model("causal_lm", seed=0),
        args=args,
        train_dataset=ListDataset(make_samples("causal_lm", 8, seed=1)),
        data_collator=PaddingCollator(),
    )


def test_the_trainer_derives_it_from_its_mesh_and_says_so(tmp_path, monkeypatch, caplog) -> None:
    """The trainer asks the mesh for its data ranks (here a simulated tp 2 x dp 2 mesh of 4 processes), sets
    `gradient_accumulation_steps` before anything reads it, and the active line names the total."""
    import hf_gradacc.mixin as mixin

    monkeypatch.setattr(mixin, "mesh_from_accelerator", lambda *a, **k: Mesh.of({"dp_replicate": 2, "tp": 2}))
    with caplog.at_level(logging.INFO, logger="hf_gradacc"):
        trainer = _trainer(tmp_path, total_train_batch_size=16, log_level="info")
    assert trainer.args.gradient_accumulation_steps == 4
    assert trainer.global_batch.data_ranks == 2
    assert "total_train_batch_size 16 = 2 per device x GA 4 x 2 data ranks" in caplog.text
    assert "GA 4 (total_train_batch_size 16 over 2 data ranks)" in active_line(trainer)


def test_a_conflicting_gradient_accumulation_steps_is_replaced_with_a_warning(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_gradacc"):
        trainer = _trainer(tmp_path, total_train_batch_size=8, gradient_accumulation_steps=2)
    assert trainer.args.gradient_accumulation_steps == 4
    found = [r.getMessage() for r in caplog.records if "is replaced by" in r.getMessage()]
    assert len(found) == 1, caplog.text
    assert "`gradient_accumulation_steps` (2) is replaced by 4" in found[0]
    assert "`total_train_batch_size` (8)" in found[0], found[0]


def test_gradacc_args_on_plain_training_arguments_derive_it_too(tmp_path) -> None:
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[], max_steps=1)
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm", seed=0),
        args=args,
        train_dataset=ListDataset(make_samples("causal_lm", 8, seed=1)),
        data_collator=PaddingCollator(),
        gradacc_args={"total_train_batch_size": 8},
    )
    assert trainer.args.gradient_accumulation_steps == 4 and trainer.global_batch.total == 8


def test_the_trainer_refuses_a_total_its_world_cannot_hold(tmp_path) -> None:
    with pytest.raises(GradAccConfigError, match=r"`total_train_batch_size` \(7\) is not a multiple"):
        _trainer(tmp_path, total_train_batch_size=7)


def _relative(a: dict, b: dict, start: dict) -> float:
    num = sum(((torch.tensor(a[n]) - torch.tensor(b[n])) ** 2).sum() for n in a)
    den = sum(((torch.tensor(b[n]) - torch.tensor(start[n])) ** 2).sum() for n in b)
    return float((num / den).sqrt())


def test_a_resume_with_another_micro_batch_keeps_the_total_and_the_uninterrupted_weights(tmp_path) -> None:
    """Run A: 24 samples, per-device batch 2, total 8 (GA 4): 3 steps, linear decay. B resumes A's checkpoint-1
    with per-device batch 4 and the same total (GA 2): the same 3 steps, A's final weights (to float32 rounding)."""
    run = dict(ga=1, total_train_batch_size=8, lr_scheduler_type="linear")
    a = train_run(str(tmp_path / "a"), batch=2, **run)
    b = train_run(str(tmp_path / "b"), batch=4, resume=str(tmp_path / "a" / "checkpoint-1"), **run)
    assert (a["gradient_accumulation_steps"], b["gradient_accumulation_steps"]) == (4, 2)
    assert a["max_steps"] == b["max_steps"] == 3 and b["global_step"] == 3
    assert [len(ids) for _, ids in a["steps"]] == [8, 8, 8] and [len(ids) for _, ids in b["steps"]] == [8, 8]
    assert b["steps"] == [s for s in a["steps"] if s[0] >= 1]
    assert b["learning_rates"] == pytest.approx(a["learning_rates"], rel=1e-7)  # the log history includes step 1
    start = {n: p.detach().tolist() for n, p in build_tiny_model("causal_lm", seed=0).named_parameters()}
    assert _relative(b["params"], a["params"], start) <= 1e-5


def _zero_checkpoint(folder, ranks: int, universal: bool = False):
    (folder / "global_step3").mkdir(parents=True)
    (folder / "latest").write_text("global_step3")
    for r in range(ranks):
        (folder / "global_step3" / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    if universal:
        (folder / "latest_universal").write_text("global_step3_universal")
    return str(folder)


def test_a_zero_checkpoint_on_another_world_is_refused_naming_the_universal_checkpoint(tmp_path) -> None:
    """DeepSpeed loads a ZeRO optimizer state only on the number of ranks that saved it: refused before loading,
    naming ds_to_universal (as a command to run) and `checkpoint.load_universal`; the same world, a universal
    checkpoint asked for and present, or no DeepSpeed state at all pass."""
    from hf_gradacc.backends.deepspeed import zero_resume_problem

    stage2 = {"zero_optimization": {"stage": 2}}
    universal = {**stage2, "checkpoint": {"load_universal": True}}
    folder = _zero_checkpoint(tmp_path / "checkpoint-3", ranks=2)
    assert zero_resume_problem(folder, data_ranks=2, config=stage2) is None
    message = zero_resume_problem(folder, data_ranks=1, config=stage2)
    assert (
        message is not None and "on 1 data rank: its DeepSpeed ZeRO optimizer state is partitioned over 2" in message
    )
    step = f"{folder}/global_step3"
    command = f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {step} --output_folder {step}_universal"
    assert f"`{command} --inject_missing_state`" in message, message
    assert '`"checkpoint": {"load_universal": true}`' in message and "or resume on 2 data ranks" in message, message
    assert zero_resume_problem(folder, data_ranks=3, config=stage2) is not None
    missing = zero_resume_problem(folder, data_ranks=1, config=universal)
    assert missing is not None and "holds no universal checkpoint (no `latest_universal`)" in missing, missing
    converted = _zero_checkpoint(tmp_path / "converted", ranks=2, universal=True)
    assert zero_resume_problem(converted, data_ranks=1, config=universal) is None
    assert zero_resume_problem(str(tmp_path), data_ranks=1, config=stage2) is None  # no DeepSpeed state
    stage3 = zero_resume_problem(folder, data_ranks=3, config={"zero_optimization": {"stage": 3}})
    assert stage3 is not None and "its DeepSpeed ZeRO-3 parameters and optimizer state are partitioned" in stage3


def test_a_step_counter_shared_by_two_parameters_is_copied() -> None:
    """DeepSpeed 0.19.8's ZeRO-3 universal load puts one ``step`` tensor into every sub-group's state; torch's AdamW
    adds 1 to it in place per parameter. After the repair each parameter counts its own steps."""
    from hf_gradacc.backends.deepspeed import unshare_step_counters

    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([{"params": [p]}, {"params": [q], "weight_decay": 0.0}], lr=0.1)
    optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    optimizer.state[q] = {"step": optimizer.state[p]["step"], "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    assert unshare_step_counters(optimizer) == 1
    assert unshare_step_counters(optimizer) == 0  # idempotent
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    optimizer.step()
    assert [float(optimizer.state[x]["step"]) for x in (p, q)] == [2.0, 2.0]
