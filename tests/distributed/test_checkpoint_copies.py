"""Checkpoints that callbacks copy on every rank, and resumes from per-rank copies (what Ray Train does).

:mod:`workers.checkpoint_copy_cases`, one launch of 2 ranks: a callback's ``on_save`` copies the newest checkpoint on
every rank while rank 0's marker finish is delayed; every copy must be complete (the finish is agreed by every rank
before the Trainer calls ``on_save``). Each rank then resumes from its own copy (two paths, one checkpoint) and ends
where the uninterrupted run ends; copies of two different steps are refused on both ranks, naming both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_gradacc.checkpoints import COMPLETE_NAME, SAVING_NAME
from tests.distributed.launcher import run_workers

WORKER = Path(__file__).resolve().parent / "workers" / "checkpoint_copy_cases.py"

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("copies")
    result = run_workers(WORKER, nproc=2, args=["--out", str(tmp / "runs")], timeout=300, out_dir=tmp / "results")
    ranks = result.load("copies")
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


def _relative_error(params: dict, reference: dict) -> float:
    diff = sum(float((torch.tensor(params[n]) - torch.tensor(v)).norm() ** 2) for n, v in reference.items())
    norm = sum(float(torch.tensor(v).norm() ** 2) for v in reference.values())
    return (diff / norm) ** 0.5


def test_on_save_copies_a_complete_checkpoint_on_every_rank(ranks) -> None:
    """Rank 0 finishes each checkpoint 1.5 s late; every rank's ``on_save`` still copies it complete (the marker
    there, ``hf_gradacc_saving`` gone), at every one of the 3 steps."""
    for r, payload in enumerate(ranks):
        seen = payload["copies"]
        assert [c["step"] for c in seen] == [1, 2, 3], (r, seen)
        for copy in seen:
            assert copy["source"] == f"checkpoint-{copy['step']}", (r, copy)
            assert "error" not in copy and copy["complete"], (r, copy, COMPLETE_NAME)
            assert not copy["saving"], (r, copy, SAVING_NAME)


def test_each_rank_resumes_its_own_copy_exactly(ranks) -> None:
    """Rank r resumes ``copies/rank<r>/step1/checkpoint`` (its own path): the ranks agree (same step, same trainer
    state) and the resumed run ends where the uninterrupted one ends."""
    for r, payload in enumerate(ranks):
        a, b = payload["a"], payload["b"]
        assert "error" not in b, (r, b)
        assert b["global_step"] == 3 and b["steps"] == [s for s in a["steps"] if s[0] >= 1], (r, b["steps"])
        assert _relative_error(b["params"], a["params"]) <= 1e-5, r


def test_copies_of_two_steps_are_refused_by_name_on_every_rank(ranks) -> None:
    """Rank 0 resumes its copy of checkpoint 1, rank 1 its copy of checkpoint 2: both ranks refuse, naming each
    rank's folder and step (no hang: the launch ended)."""
    for r, payload in enumerate(ranks):
        mixed = payload["mixed"]
        assert mixed.get("error_type") == "GradAccConfigError", (r, mixed)
        message = mixed["error"]
        assert "the ranks' folders hold different checkpoints" in message, message
        assert "rank 0's" in message and "step1/checkpoint': global step 1" in message, message
        assert "rank 1's" in message and "step2/checkpoint': global step 2" in message, message
