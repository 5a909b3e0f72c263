"""Resuming by samples, not by steps: a checkpoint records where its epoch stands in samples of the epoch's order,
and a resume with another per-device batch, ``gradient_accumulation_steps`` or ``accumulation_schedule`` trains
every remaining sample of that order exactly once, in the same order, re-batched in the new layout.

Every test COUNTS samples: :class:`SampleRecorder` maps each optimizer step's rows back to the run's samples. Run A
is uninterrupted (saving every step); run B resumes from A's ``checkpoint-k`` with a changed setting. The samples of
A's first ``k`` steps plus B's must be every sample of the epoch once, B's in A's order. The same-layout resume keeps
the stock path: B's steps are A's steps after ``k``, its weights A's, bit for bit. World-size changes (2 -> 1,
1 -> 2) are in ``tests/distributed/test_resume_layout.py``.
"""

from __future__ import annotations

import collections
import json
import os
import shutil

import pytest

from hf_gradacc import GradAccConfigError
from hf_gradacc.checkpoints import DATA_NAME, _write_marker
from tests.distributed.workers.resume_layout_cases import NUM_SAMPLES, train_run

LAYOUT_WARNING = "had trained the first"  # the one warning of a resume by samples


def _ids(steps, first: int = 0, end: int | None = None) -> list[int]:
    return [i for step, ids in steps if first <= step and (end is None or step < end) for i in ids]


def _assert_once_each(ids: list[int], num_samples: int = NUM_SAMPLES) -> None:
    counts = collections.Counter(ids)
    assert sorted(counts) == list(range(num_samples)), (
        f"never trained: {sorted(set(range(num_samples)) - set(counts))}"
    )
    assert max(counts.values()) == 1, f"trained twice: {sorted(i for i, n in counts.items() if n > 1)}"


def _one_layout_warning(run: dict) -> str:
    found = [m for m in run["warnings"] if LAYOUT_WARNING in m]
    assert len(found) == 1, run["warnings"]
    return found[0]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> tuple[str, dict]:
    """The uninterrupted run: batch 2, GA 2, 24 samples, 6 steps, a checkpoint after each."""
    out = str(tmp_path_factory.mktemp("a"))
    return out, train_run(out, batch=2, ga=2)


@pytest.mark.parametrize(
    "change, k, skipped, steps_after, named",
    [
        ({"ga": 4}, 2, 8, [8, 8], "gradient_accumulation_steps 2 -> 4"),
        ({"batch": 5}, 3, 12, [10, 2], "per_device_train_batch_size 2 -> 5"),  # 12 left: micro-batches 5, 5, 2
        ({"schedule": "0:1,4:3"}, 1, 4, [2, 2, 2, 6, 6, 2], "accumulation_schedule None -> '0:1,4:3'"),
    ],
    ids=["ga_2_to_4", "batch_2_to_5", "schedule"],
)
def test_a_changed_layout_trains_every_remaining_sample_once(run_a, tmp_path, change, k, skipped, steps_after, named):
    out, a = run_a
    change = {"batch": 2, "ga": 2, **change}
    b = train_run(str(tmp_path), resume=os.path.join(out, f"checkpoint-{k}"), **change)
    _assert_once_each(_ids(a["steps"], end=k) + _ids(b["steps"]))
    assert _ids(b["steps"]) == _ids(a["steps"], first=k), "the rest of the epoch in the checkpoint's order"
    assert [len(ids) for _, ids in b["steps"]] == steps_after
    assert [step for step, _ in b["steps"]] == list(range(k, k + len(steps_after)))
    assert b["global_step"] == k + len(steps_after)
    message = _one_layout_warning(b)
    assert named in message and f"first {skipped} samples of epoch 0" in message, message


def test_ga_4_to_2(tmp_path) -> None:
    a = train_run(str(tmp_path / "a"), batch=2, ga=4)  # 3 steps of 8 samples
    b = train_run(str(tmp_path / "b"), batch=2, ga=2, resume=str(tmp_path / "a" / "checkpoint-1"))
    _assert_once_each(_ids(a["steps"], end=1) + _ids(b["steps"]))
    assert [len(ids) for _, ids in b["steps"]] == [4, 4, 4, 4]
    assert "gradient_accumulation_steps 4 -> 2" in _one_layout_warning(b)


def test_the_same_layout_resumes_as_before_bit_for_bit(run_a, tmp_path) -> None:
    out, a = run_a
    b = train_run(str(tmp_path), batch=2, ga=2, resume=os.path.join(out, "checkpoint-2"))
    assert b["steps"] == [s for s in a["steps"] if s[0] >= 2]
    assert b["params"] == a["params"]
    assert not [m for m in b["warnings"] if LAYOUT_WARNING in m]


def test_a_resume_of_a_resumed_run_takes_the_record_not_global_step(run_a, tmp_path) -> None:
    """B (GA 4) saved checkpoint-3 after 16 samples; resumed again with GA 4, the stock arithmetic (step 3 of 3 steps
    per epoch of GA 4: epoch 1) would end the run with 8 samples never trained."""
    out, a = run_a
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, resume=os.path.join(out, "checkpoint-2"))
    c = train_run(str(tmp_path / "c"), batch=2, ga=4, resume=str(tmp_path / "b" / "checkpoint-3"))
    assert [step for step, _ in c["steps"]] == [3]
    _assert_once_each(_ids(a["steps"], end=2) + _ids(b["steps"], end=3) + _ids(c["steps"]))
    assert "first 16 samples of epoch 0" in _one_layout_warning(c)  # no layout change: the record, said once


def test_a_change_in_the_second_epoch(tmp_path) -> None:
    """Two epochs of 6 steps (GA 2); resumed at step 8 (epoch 1, 8 samples in) with GA 4. The stock arithmetic
    (8 // 3 steps per epoch of GA 4) would put it past the last epoch."""
    a = train_run(str(tmp_path / "a"), batch=2, ga=2, epochs=2)
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, epochs=2, resume=str(tmp_path / "a" / "checkpoint-8"))
    assert [step for step, _ in b["steps"]] == [8, 9]
    _assert_once_each(_ids(a["steps"], first=6, end=8) + _ids(b["steps"]))
    assert _ids(b["steps"]) == _ids(a["steps"], first=8), "epoch 1's own order"
    assert "first 8 samples of epoch 1" in _one_layout_warning(b)


def test_a_checkpoint_at_the_end_of_an_epoch_resumes_at_the_next_one(tmp_path) -> None:
    a = train_run(str(tmp_path / "a"), batch=2, ga=2, epochs=2)
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, epochs=2, resume=str(tmp_path / "a" / "checkpoint-6"))
    assert [step for step, _ in b["steps"]] == [6, 7, 8]
    assert _ids(b["steps"]) == _ids(a["steps"], first=6)


def _edited_checkpoint(out: str, folder: str, **changes) -> str:
    shutil.copytree(os.path.join(out, "checkpoint-2"), folder)
    path = os.path.join(folder, DATA_NAME)
    with open(path) as f:
        record = json.load(f)
    for name, value in changes.items():
        if value is None:
            record.pop(name)
        else:
            record[name] = value
    with open(path, "w") as f:
        json.dump(record, f)
    _write_marker(folder)
    return folder


@pytest.mark.parametrize(
    "edit, run, named",
    [
        ({}, {"seed": 1}, "seed=0 (this run: 1)"),
        ({}, {"num_samples": 20}, "num_train_samples=24 (this run: 20)"),
        ({"position": None}, {"ga": 4}, "did not record its position in samples"),  # a record of an older hf_gradacc
        ({"regroup_micro_batches": True}, {"regroup_micro_batches": False}, "regroup_micro_batches=True"),
        (
            {"train_sampling_strategy": "group_by_length"},
            {"ga": 4, "train_sampling_strategy": "group_by_length"},
            "orders the epoch by batches of this run's size",
        ),
    ],
    ids=["seed", "dataset_length", "no_position", "regrouping_changed", "group_by_length"],
)
def test_what_cannot_be_carried_over_is_refused_with_the_way_out(run_a, tmp_path, edit, run, named) -> None:
    out, _ = run_a
    folder = _edited_checkpoint(out, str(tmp_path / "checkpoint-2"), **edit)
    with pytest.raises(GradAccConfigError) as info:
        train_run(str(tmp_path / "b"), **{"batch": 2, "ga": 2, **run}, resume=folder)
    message = str(info.value)
    assert named in message and "resume_data_mismatch='accept'" in message and folder in message, message


def test_accept_resumes_with_a_warning(run_a, tmp_path) -> None:
    out, a = run_a
    b = train_run(str(tmp_path), batch=2, ga=2, seed=1, mismatch="accept", resume=os.path.join(out, "checkpoint-2"))
    assert b["global_step"] == a["global_step"]
    assert any("seed=0 (this run: 1)" in m and "resume_data_mismatch='accept'" in m for m in b["warnings"])


def test_max_steps_set_by_the_user_runs_on_into_the_next_epoch(tmp_path) -> None:
    """``max_steps=7`` with GA 4 after a checkpoint at step 2 of GA 2: 2 steps finish epoch 0 (16 samples), 3 more
    take the whole of epoch 1, and the run stops at step 7."""
    a = train_run(str(tmp_path / "a"), batch=2, ga=2, epochs=2)
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, max_steps=7, resume=str(tmp_path / "a" / "checkpoint-2"))
    assert [(step, len(ids)) for step, ids in b["steps"]] == [(2, 8), (3, 8), (4, 8), (5, 8), (6, 8)]
    _assert_once_each(_ids(a["steps"], end=2) + _ids(b["steps"], end=4))
    _assert_once_each(_ids(b["steps"], first=4))
    assert b["global_step"] == 7
    assert "7 optimizer steps in all (5 more), as `max_steps` (7) sets" in _one_layout_warning(b)


def test_ignore_data_skip_starts_the_recorded_epoch_from_its_first_sample(tmp_path) -> None:
    a = train_run(str(tmp_path / "a"), batch=2, ga=2, epochs=2)
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, epochs=2, ignore_data_skip=True,
                  resume=str(tmp_path / "a" / "checkpoint-8"))  # fmt: skip
    assert [step for step, _ in b["steps"]] == [8, 9, 10]
    assert _ids(b["steps"]) == _ids(a["steps"], first=6), "all of epoch 1, in its order"
    assert "no sample is skipped" in _one_layout_warning(b)


@pytest.mark.parametrize(
    "setting",
    [{"regroup_micro_batches": True}, {"max_tokens_per_micro_batch": 40}, {"pack_micro_batches": True}],
    ids=["regroup", "token_budget", "packed"],
)
def test_regrouped_and_packed_windows_resume_by_samples(tmp_path, setting) -> None:
    """Each regrouped or packed window keeps its stock window's samples (GA x batch of the order), so what a
    checkpoint trained is a prefix of the order, counted in windows; GA 2 -> 4 from step 2 trains the rest once."""
    a = train_run(str(tmp_path / "a"), batch=2, ga=2, **setting)
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, resume=str(tmp_path / "a" / "checkpoint-2"), **setting)
    assert [(step, len(ids)) for step, ids in b["steps"]] == [(2, 8), (3, 8)]
    _assert_once_each(_ids(a["steps"], end=2) + _ids(b["steps"]))
    assert sorted(_ids(b["steps"])) == sorted(_ids(a["steps"], first=2))
    assert "first 8 samples of epoch 0" in _one_layout_warning(b)


def test_the_first_resumed_step_takes_the_new_schedules_learning_rate(tmp_path) -> None:
    """The checkpoint's optimizer holds the rate the OLD schedule (6 steps) set for step 3; the resumed run (GA 4:
    2 more steps, 4 in all) must use its own linear schedule from its first step: 0.1 x (1 - 2/4), then 0.1 x (1 -
    3/4); the old schedule's 0.1 x (1 - 2/6) on step 3 is a step off the run's schedule."""
    a = train_run(str(tmp_path / "a"), batch=2, ga=2, lr_scheduler_type="linear")
    assert a["learning_rates"][:3] == pytest.approx([0.1, 0.1 * 5 / 6, 0.1 * 4 / 6])
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, lr_scheduler_type="linear",
                  resume=str(tmp_path / "a" / "checkpoint-2"))  # fmt: skip
    assert b["global_step"] == 4
    assert b["learning_rates"][-2:] == pytest.approx([0.1 * 2 / 4, 0.1 * 1 / 4])  # the history holds A's first 2


@pytest.mark.parametrize("max_steps, ga", [(2, 2), (4, 2), (2, 4)], ids=["below", "equal", "below_ga_changed"])
def test_max_steps_at_or_below_the_checkpoint_takes_no_step(run_a, tmp_path, max_steps, ga) -> None:
    """A checkpoint at step 4 resumed with ``max_steps`` 2 or 4 (GA kept or changed): no optimizer step (the stock
    Trainer runs one, global step 5), the checkpoint's weights, one warning naming both numbers."""
    from safetensors.torch import load_file

    out, _ = run_a
    folder = os.path.join(out, "checkpoint-4")
    b = train_run(str(tmp_path), batch=2, ga=ga, max_steps=max_steps, resume=folder)
    assert b["steps"] == [] and b["global_step"] == 4, b["steps"]
    saved = load_file(os.path.join(folder, "model.safetensors"))
    assert saved and set(saved) <= set(b["params"])
    for name, value in saved.items():
        assert value.tolist() == b["params"][name], f"{name} moved"
    found = [m for m in b["warnings"] if "no optimizer step is taken" in m]
    assert len(found) == 1 and f"`max_steps` ({max_steps})" in found[0] and "checkpoint's step (4)" in found[0], found
    assert not [m for m in b["warnings"] if LAYOUT_WARNING in m], b["warnings"]


def test_an_ignore_data_skip_resume_records_only_the_samples_it_trained(run_a, tmp_path) -> None:
    """B (GA 4, ``ignore_data_skip=True``) retrains epoch 0 from its first sample; its checkpoint-3 (one step, 8
    samples) must record 8 samples trained, not the 8 it did not skip plus 8: C, resumed from it, trains the other
    16 (a record of 16 would lose 8 of the 24)."""
    out, _ = run_a
    b = train_run(str(tmp_path / "b"), batch=2, ga=4, ignore_data_skip=True, resume=os.path.join(out, "checkpoint-2"))
    assert [(step, len(ids)) for step, ids in b["steps"]] == [(2, 8), (3, 8), (4, 8)]
    c = train_run(str(tmp_path / "c"), batch=2, ga=4, resume=str(tmp_path / "b" / "checkpoint-3"))
    _assert_once_each(_ids(b["steps"], end=3) + _ids(c["steps"]))
    assert "first 8 samples of epoch 0" in _one_layout_warning(c)


def test_a_fractional_last_epoch_after_a_layout_change_takes_its_share_rounded_up(run_a, tmp_path) -> None:
    """``num_train_epochs=1.5`` resumed at step 2 of GA 2 with GA 4: 2 steps finish epoch 0, and half of epoch 1's 3
    steps is 1.5, rounded up as the stock Trainer rounds a run's length: 2 steps (not 1)."""
    out, _ = run_a
    b = train_run(str(tmp_path), batch=2, ga=4, epochs=1.5, resume=os.path.join(out, "checkpoint-2"))
    assert [(step, len(ids)) for step, ids in b["steps"]] == [(2, 8), (3, 8), (4, 8), (5, 8)]
    assert b["global_step"] == 6
    assert "6 optimizer steps in all (4 more)" in _one_layout_warning(b)
