"""``total_train_batch_size`` across a change of world size: a run stopped on 2 processes and resumed on 1 and on 3,
with the same arguments, trains the samples the uninterrupted 2-process run trained in each step and ends on its
weights (relative to the parameter change, <= 1e-5), with its ``max_steps`` and learning rates.

Run A: 2 DDP ranks, 36 samples, per-device batch 2, ``total_train_batch_size=12`` (GA 3), linear decay, 3 steps, a
checkpoint after each; a causal LM and a sequence classifier (one launch, a run per head:
:mod:`workers.resume_layout_cases`). Its checkpoint-1 is resumed with the same arguments on 1 process (GA 6, in the
test's own process) and on 3 ranks (GA 2). A total the new world cannot hold (12 on 5 data ranks of 2) is refused at
construction, naming the totals that fit (``tests/unit/test_total_train_batch_size.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_gradacc.testing.tiny import build_tiny_model
from tests.distributed.launcher import run_workers
from tests.distributed.workers.resume_layout_cases import train_run

WORKER = Path(__file__).resolve().parent / "workers" / "resume_layout_cases.py"
TASKS = ("causal_lm", "sequence_classification")
TOTAL, BATCH, NUM_SAMPLES = 12, 2, 36  # 12 = 2 x GA 6 x 1 = 2 x 3 x 2 = 2 x 2 x 3: 3 steps

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch(tmp: Path, name: str, nproc: int, *args: str) -> list[dict]:
    result = run_workers(
        WORKER,
        nproc=nproc,
        args=["--name", name, "--batch", str(BATCH), "--ga", "1", "--total", str(TOTAL), "--tasks", ",".join(TASKS),
              "--num-samples", str(NUM_SAMPLES), *args],
        timeout=300,
        out_dir=tmp / "results",
    )  # fmt: skip
    ranks = result.load(name)
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted 2-process run, one per head (rank 0's result)."""
    tmp = tmp_path_factory.mktemp("a")
    return tmp, _launch(tmp, "a", 2, "--out", str(tmp / "a"))[0]


def relative_change_error(params: dict, reference: dict, task: str) -> float:
    """|params - reference| / |reference - initial|: the error relative to the uninterrupted run's update."""
    start = dict(build_tiny_model(task, seed=0).named_parameters())
    num = sum(((torch.tensor(params[n]) - torch.tensor(reference[n])) ** 2).sum() for n in reference)
    den = sum(((torch.tensor(reference[n]) - start[n].detach()) ** 2).sum() for n in reference)
    return float((num / den).sqrt())


def _assert_like_a(a: dict, b: dict, task: str, accumulation: int) -> float:
    assert a["gradient_accumulation_steps"] == 3 and b["gradient_accumulation_steps"] == accumulation
    assert a["max_steps"] == b["max_steps"] == 3 and b["global_step"] == 3
    assert [len(ids) for _, ids in a["steps"]] == [TOTAL] * 3
    assert [(step, sorted(ids)) for step, ids in b["steps"]] == [(s, sorted(i)) for s, i in a["steps"] if s >= 1]
    assert b["learning_rates"] == pytest.approx(a["learning_rates"], rel=1e-7)  # the history holds step 1 too
    error = relative_change_error(b["params"], a["params"], task)
    assert error <= 1e-5, (task, error)
    return error


@pytest.mark.parametrize("task", TASKS)
def test_resumed_on_1_process_equals_the_2_process_run(run_a, task, tmp_path) -> None:
    tmp, a = run_a
    b = train_run(
        str(tmp_path / task), batch=BATCH, ga=1, task=task, num_samples=NUM_SAMPLES, total_train_batch_size=TOTAL,
        lr_scheduler_type="linear", resume=str(tmp / "a" / task / "checkpoint-1"),
    )  # fmt: skip
    print(f"\n{task} 2 -> 1: {_assert_like_a(a[task], b, task, accumulation=6):.2e}")
    found = [m for m in b["warnings"] if "world_size 2 -> 1" in m]
    assert len(found) == 1 and "gradient_accumulation_steps 3 -> 6" in found[0], b["warnings"]


def test_resumed_on_3_processes_equals_the_2_process_run(run_a, tmp_path) -> None:
    tmp, a = run_a
    ranks = _launch(
        tmp_path, "c", 3, "--out", str(tmp_path / "c"), "--resume", str(tmp / "a" / "{task}" / "checkpoint-1")
    )
    for c in ranks:
        for task in TASKS:
            print(f"\n{task} 2 -> 3: {_assert_like_a(a[task], c[task], task, accumulation=2):.2e}")
