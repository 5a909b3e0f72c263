"""Resuming by samples across a change of world size, and the final ``train_loss`` on 2 ranks.

A checkpoint of 2 DDP ranks resumed on 1 process, and one of 1 process resumed on 2 ranks: the samples trained before
the checkpoint (the first ``k x batch x world size`` of the epoch's order: rank r takes every 2nd micro-batch of the
order) plus those trained after it are every sample of the epoch once (:mod:`workers.resume_layout_cases` records
each step's samples on every rank). One process runs in the test itself, the 2-rank run through the launcher.

The same layout on 2 ranks resumes through the stock path, bit for bit, with no layout warning. Node-local disks
(each rank its own ``output_dir``, :mod:`workers.node_local_cases`): the ranks agree on the checkpoint and resume at
rank 0's data record when rank 1's disk differs; ``save_on_each_node=True`` leaves rank 1 without the weights, one
clear error.

``train_loss`` on 2 ranks with no step logged during training (``logging_steps=500``, 2 steps) is the mean of the
step losses logged by the same run with ``logging_steps=1``, on both ranks: the loss accumulated since the last log
is reduced over ranks before `Trainer` adds it to the total.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from hf_gradacc.checkpoints import COMPLETE_NAME, DATA_NAME
from tests.distributed.launcher import run_workers
from tests.distributed.workers.resume_layout_cases import NUM_SAMPLES, train_run

WORKER = Path(__file__).resolve().parent / "workers" / "resume_layout_cases.py"
NODE_LOCAL = Path(__file__).resolve().parent / "workers" / "node_local_cases.py"
LAYOUT_WARNING = "had trained the first"  # the one warning of a resume by samples (RunPlan.resumed_start)

pytestmark = [pytest.mark.distributed]


def _launch(tmp: Path, name: str, *args: str, worker: Path = WORKER) -> list[dict]:
    result = run_workers(worker, nproc=2, args=["--name", name, *args], timeout=300, out_dir=tmp / "results")
    ranks = result.load(name)
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


def _ids(steps, first: int = 0, end: int | None = None) -> list[int]:
    return [i for step, ids in steps if first <= step and (end is None or step < end) for i in ids]


def _assert_once_each(ids: list[int]) -> None:
    counts = collections.Counter(ids)
    assert sorted(counts) == list(range(NUM_SAMPLES)) and max(counts.values()) == 1, sorted(counts.items())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Run A on 2 ranks (batch 2, GA 2: 3 steps of 8 samples), then the two runs of the train_loss check."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    return tmp, _launch(tmp, "a", "--out", str(tmp / "a"), "--batch", "2", "--ga", "2", "--loss-check")


def test_world_size_2_to_1(two_ranks, tmp_path) -> None:
    tmp, (a, _) = two_ranks
    b = train_run(str(tmp_path), batch=2, ga=2, resume=str(tmp / "a" / "checkpoint-1"))
    assert [len(ids) for _, ids in a["steps"]] == [8, 8, 8]
    assert [(step, len(ids)) for step, ids in b["steps"]] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    _assert_once_each(_ids(a["steps"], end=1) + _ids(b["steps"]))
    assert sorted(_ids(b["steps"])) == sorted(_ids(a["steps"], first=1))
    found = [m for m in b["warnings"] if "world_size 2 -> 1" in m]
    assert len(found) == 1 and "first 8 samples of epoch 0" in found[0], b["warnings"]


def test_world_size_1_to_2(tmp_path) -> None:
    a = train_run(str(tmp_path / "a"), batch=2, ga=2)  # one process: 6 steps of 4 samples
    ranks = _launch(tmp_path, "b", "--out", str(tmp_path / "b"), "--batch", "2", "--ga", "2",
                    "--resume", str(tmp_path / "a" / "checkpoint-2"))  # fmt: skip
    for b in ranks:
        assert [(step, len(ids)) for step, ids in b["steps"]] == [(2, 8), (3, 8)]
        _assert_once_each(_ids(a["steps"], end=2) + _ids(b["steps"]))
        assert sorted(_ids(b["steps"])) == sorted(_ids(a["steps"], first=2))
    found = [m for m in ranks[0]["warnings"] if "world_size 1 -> 2" in m]
    assert len(found) == 1 and "first 8 samples of epoch 0" in found[0], ranks[0]["warnings"]


def test_train_loss_is_the_mean_of_the_step_losses_on_every_rank(two_ranks) -> None:
    _, ranks = two_ranks
    every_step = ranks[0]["loss_check"]["logging_steps_1"]
    assert len(every_step["step_losses"]) == 2
    mean = sum(every_step["step_losses"]) / 2
    for payload in ranks:
        unlogged = payload["loss_check"]["logging_steps_500"]
        assert unlogged["step_losses"] == []
        assert unlogged["train_loss"] == pytest.approx(mean, rel=1e-6), (unlogged["train_loss"], mean)
        assert payload["loss_check"]["logging_steps_1"]["train_loss"] == pytest.approx(mean, rel=1e-6)


def test_the_same_layout_on_2_ranks_resumes_as_before_bit_for_bit(two_ranks, tmp_path) -> None:
    """Run A's checkpoint-1 (2 ranks) resumed on 2 ranks with A's layout: the stock path, no layout warning, A's
    steps after step 1 and A's final weights, bit for bit (a comparison that left the world size out of the samples
    the stock skip lands on would take the resume-by-samples path with a false warning)."""
    tmp, (a, _) = two_ranks
    ranks = _launch(tmp_path, "b", "--out", str(tmp_path / "b"), "--batch", "2", "--ga", "2",
                    "--resume", str(tmp / "a" / "checkpoint-1"))  # fmt: skip
    for b in ranks:
        assert not [m for m in b["warnings"] if LAYOUT_WARNING in m], b["warnings"]
        assert b["steps"] == [s for s in a["steps"] if s[0] >= 1]
        assert b["params"] == a["params"]


def _node_local(tmp: Path, case: str) -> list[dict]:
    result = run_workers(NODE_LOCAL, nproc=2, args=["--case", case, "--out", str(tmp / "disks")], timeout=300,
                         out_dir=tmp / "results")  # fmt: skip
    ranks = result.load(case)
    for r, payload in enumerate(ranks):
        if "error" in payload and "error_type" not in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


def test_node_local_disks_resume_one_agreed_checkpoint_at_rank_0s_position(tmp_path) -> None:
    """Each rank its own output_dir (no shared file system), holding copies of one run's checkpoints; rank 1's newest
    lost its completion marker and its checkpoint-2 holds another data record (workers/node_local_cases.py): both
    ranks resume checkpoint-2 at rank 0's position, A's steps and weights bit for bit."""
    ranks = _node_local(tmp_path, "agree")
    for r, payload in enumerate(ranks):
        a, b = payload["a"], payload["b"]
        assert b["steps"] == [s for s in a["steps"] if s[0] >= 2], (r, b["steps"])  # from checkpoint-2, 16 samples in
        assert b["global_step"] == 3 and b["params"] == a["params"], r
        passed_over = [m for m in b["warnings"] if "the newer ['checkpoint-3'] cannot be resumed" in m]
        assert len(passed_over) == 1 and "the save never finished" in passed_over[0], b["warnings"]
        assert "(rank 1)" in passed_over[0], passed_over
        assert not [m for m in b["warnings"] if LAYOUT_WARNING in m], b["warnings"]
        differs = [m for m in b["warnings"] if f"rank 1's {DATA_NAME} differs from rank 0's" in m]
        assert len(differs) == 1 and "['position']" in differs[0], b["warnings"]


def test_node_local_disks_with_save_on_each_node_are_one_clear_error(tmp_path) -> None:
    """``save_on_each_node=True`` on node-local disks: rank 1's folder has the optimizer and trainer state but no
    model weights (transformers' ``save_pretrained`` writes on global rank 0 only), so the resume (which loads the
    weights on every rank) cannot work there; both ranks refuse it, saying what to copy."""
    ranks = _node_local(tmp_path, "save_on_each_node")
    assert {"optimizer.pt", "trainer_state.json", "rng_state_1.pth", COMPLETE_NAME} <= set(ranks[1]["files"])
    assert "model.safetensors" in ranks[0]["files"] and "model.safetensors" not in ranks[1]["files"], ranks
    for payload in ranks:
        assert payload["error_type"] == "GradAccConfigError", payload
        message = payload["error"]
        assert "found no complete checkpoint" in message and "the model weights are missing" in message, message
        assert "copy rank 0's checkpoint folders into every node's `output_dir`" in message, message
