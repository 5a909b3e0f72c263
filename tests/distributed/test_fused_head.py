"""`fused_lm_head=True` on 2 CPU ranks (gloo) under DDP, DeepSpeed ZeRO-1/2/3 and FSDP2: one optimizer step equals the
float64 full-batch step (relative error <= 1e-5) on mixed lengths, heavy padding and masked prompts, for a causal LM,
packed micro-batches and a mixture of experts (its router term beside the fused loss); a 1 % denominator error is
seen; a rank whose first micro-batch has no counted target still runs the start-up check's forwards (no rank
waits); one rank's failed check stops every rank. One torchrun launch per backend (workers/fused_head_cases.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).resolve().parent / "workers" / "fused_head_cases.py"
TOLERANCE = 1e-5
BACKENDS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
CASES = [
    {"name": "exact"},
    {"name": "off_by_one_percent", "off_by": 1.01},
    {"name": "moe", "moe": "mixtral"},
    {"name": "packed", "packed": True},
    {"name": "empty_first", "empty_first": True},
    {"name": "wrong_transform_on_rank1", "wrong_transform_on": 1, "expect_error": True},  # last: it stops training
]


@pytest.fixture(scope="module", params=BACKENDS)
def launch(request) -> tuple[str, dict[str, list[dict]]]:
    backend = request.param
    result = run_workers(WORKER, nproc=2, method="torchrun", timeout=480,
                         args=["--backend", backend, "--cases", json.dumps(CASES)])  # fmt: skip
    return backend, {case["name"]: result.load(case["name"]) for case in CASES}


def test_one_step_is_exact_and_every_counted_target_goes_through_the_fused_head(launch):
    backend, results = launch
    rank0 = results["exact"][0]
    assert rank0["relative_error"] <= TOLERANCE and not rank0["missing"], (backend, rank0)
    for result in results["exact"]:  # the fused head ran on every micro-batch, on exactly its counted targets
        assert result["fused_rows"] == result["counted"] and len(result["counted"]) == 4, (backend, result)
        assert sum(result["counted"]) > 0
        # the head's gradient straight into .grad: DDP's micro-batches 2 and 3 of 4 (inside no_sync, .grad there);
        # never the first (no .grad), the synchronising last one, nor under DeepSpeed / FSDP2
        assert result["into_grad_written"] == (2 if backend == "ddp" else 0), (backend, result)


def test_a_one_percent_denominator_error_is_outside_the_tolerance(launch):
    backend, results = launch
    assert results["off_by_one_percent"][0]["relative_error"] > 5e-3, backend


def test_packed_micro_batches_are_exact(launch):
    """Rows holding several documents (shift_labels, position_ids): every counted target of the step goes through
    the fused head once, on some rank, and the step is exact."""
    backend, results = launch
    rank0, rank1 = results["packed"]
    assert rank0["relative_error"] <= TOLERANCE, (backend, rank0)
    assert sum(rank0["fused_rows"]) + sum(rank1["fused_rows"]) == rank0["step_counted"], (backend, rank0, rank1)


def test_the_router_term_of_a_mixture_of_experts_is_exact(launch):
    backend, results = launch
    rank0 = results["moe"][0]
    assert rank0["relative_error"] <= TOLERANCE and rank0["num_router"] == 2, (backend, rank0)
    assert rank0["router_relative_error"] <= 5e-5, (backend, rank0)  # a small share of the update: as test_ddp.py
    assert all(r["fused_rows"] == r["counted"] for r in results["moe"]), backend


def test_a_rank_without_a_counted_target_in_its_first_micro_batch_still_checks(launch):
    backend, results = launch
    rank0, rank1 = results["empty_first"]
    assert rank1["counted"][0] == 0 and rank1["fused_rows"][0] == 0, (backend, rank1)
    assert rank0["relative_error"] <= TOLERANCE, (backend, rank0)


def test_one_ranks_failed_start_up_check_stops_every_rank(launch):
    backend, results = launch
    for result in results["wrong_transform_on_rank1"]:
        assert result["error_type"] == "GradAccLossError", (backend, result)
        assert "rank 1" in result["error"] and "fused_lm_head" in result["error"], (backend, result["error"])
