"""Accumulation schedules on 2 CPU ranks: DDP (gloo), DeepSpeed ZeRO-2 and FSDP2, the last two launched as users
launch them (``accelerate launch --config_file examples/accelerate_configs/<backend>_cpu.yaml``).

One launch per backend runs ``workers/schedule_cases.py``: two epochs under ``accumulation_schedule="0:1,2:3,4:2"``
with ``lr_scaling="linear"`` and SGD at rate 1, every step recorded. Exact means each step's gradient is within
1e-5 (relative) of the float64 full-batch gradient over that step's own samples on both ranks, and each update is
``-GA/base x`` that gradient (the scaled rate reached the optimizer, DeepSpeed's engine included).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.distributed.launcher import run_accelerate, run_workers

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "schedule_cases.py"
CONFIGS = REPO / "examples" / "accelerate_configs"
TOLERANCE = 1e-5
WINDOWS = [1, 1, 3, 3, 2, 1, 2, 2, 2, 2, 2, 1]  # per rank: 11 micro-batches per epoch, see the worker
SCHEDULED = [1, 1, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2]  # what the schedule asks for each step
BS, BASE_GA, NPROC = 2, 2, 2

pytestmark = [pytest.mark.distributed]


def _launch(backend: str) -> list[dict]:
    out = tempfile.mkdtemp(prefix=f"hf_gradacc_schedule_{backend}_")
    args = ["--backend", backend]
    if backend == "ddp":
        result = run_workers(WORKER, nproc=NPROC, args=args, timeout=300, out_dir=out)
    else:
        config = CONFIGS / f"{backend}_cpu.yaml"
        result = run_accelerate(config, WORKER, args, cpu_distributed=True, timeout=360, out_dir=out)
    ranks = result.load("schedule")
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


@pytest.mark.parametrize(
    "backend",
    ["ddp", pytest.param("zero2", marks=pytest.mark.slow), pytest.param("fsdp2", marks=pytest.mark.slow)],
)
def test_every_scheduled_step_is_exact(backend: str) -> None:
    if backend == "zero2":
        pytest.importorskip("deepspeed")
    ranks = _launch(backend)
    expected_backend = {"ddp": "ddp", "zero2": "deepspeed", "fsdp2": "fsdp2"}[backend]
    for payload in ranks:
        assert payload["backend"] == expected_backend
        assert payload["global_step"] == len(WINDOWS)
        assert payload["micro_batches"] == WINDOWS  # every rank alike
        assert payload["logged_accumulation"] == SCHEDULED
        assert payload["logged_effective_batch"] == [NPROC * BS * w for w in WINDOWS]
        assert payload["step_samples"] == [NPROC * BS * w for w in WINDOWS]
        assert payload["learning_rates"] == pytest.approx([w / BASE_GA for w in SCHEDULED])
    assert ranks[0]["epoch_one_samples"] == list(range(NPROC * BS * 11))  # the first epoch saw every sample once
    errors = ranks[0]["relative_errors"]
    assert len(errors) == len(WINDOWS) and max(errors) <= TOLERANCE, errors
    assert max(ranks[0]["update_errors"]) <= TOLERANCE, ranks[0]["update_errors"]
