"""Faults between 2 CPU ranks (gloo): a frozen, killed or failing peer ends the run within `ddp_timeout` with an
error naming the optimizer step; a NaN on one rank drops the step on both; uneven data is exact (streamed windows) or
the same clear error on every rank (prefetched); the input-token count needs no collective per micro-batch.

Each case is one launch of ``workers/fault_cases.py`` (a fault ends the process group)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from hf_gradacc.checkpoints import latest_complete_checkpoint

from .launcher import run_accelerate, run_workers

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "workers" / "fault_cases.py"
CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "accelerate_configs"
TIMEOUT_S = 10  # workers/fault_cases.py: ddp_timeout of every case
MARGIN_S = 15.0  # the peer's timeout plus this is the most a fault may take to surface
TOLERANCE = 1e-5


def _launch(case: str, backend: str = "ddp", *, expect_failure: bool = False) -> list[dict[str, Any] | None]:
    return _launch_in(case, backend, expect_failure=expect_failure)[1]


def _launch_in(case: str, backend: str = "ddp", *, expect_failure: bool = False) -> tuple[Path, list[dict[str, Any] | None]]:
    """The launch's output folder (the workers' ``out_dir()``) and each rank's result."""
    out = Path(tempfile.mkdtemp(prefix=f"hf_gradacc_fault_{case}_"))
    args = ["--case", case, "--backend", backend]
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
        run_accelerate(CONFIGS / "zero2_cpu.yaml", WORKER, args, cpu_distributed=True, timeout=240, out_dir=out,
                       check=not expect_failure)  # fmt: skip
    else:
        run_workers(WORKER, nproc=2, args=args, timeout=150, out_dir=out, check=not expect_failure,
                    failure_grace=TIMEOUT_S + MARGIN_S)  # fmt: skip
    results = []
    for rank in range(2):
        path = out / f"{case}.rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return out, results


@pytest.mark.parametrize("kind", ["frozen", "killed", "erroring"])
def test_a_peer_fault_ends_the_run_with_the_step_named(kind: str) -> None:
    rank0, rank1 = _launch(kind, expect_failure=True)
    assert rank0 is not None and "crash" not in rank0, rank0
    assert rank0["error_type"] == "GradAccDistributedError", rank0
    assert "Optimizer step 2" in rank0["error"] and "ddp_timeout" in rank0["error"], rank0
    assert rank0["since_fault_s"] <= TIMEOUT_S + MARGIN_S, rank0  # never the 30-minute default
    if kind == "erroring":
        assert rank1 is not None and rank1["error_type"] == "ValueError", rank1  # the failing rank keeps its own error


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "deepspeed"])
def test_nan_on_one_rank_drops_the_step_on_both(backend: str) -> None:
    ranks = _launch("nan_one_rank", backend)
    for result in ranks:
        assert result is not None and "crash" not in result, result
        assert result["skipped"] == 1 and result["global_step"] == 1, result  # step 1 dropped, step 2 taken
        assert result["finite"] and result["relative_error"] <= TOLERANCE, result  # step 2 alone, exactly
        assert result["logs"][0]["nonfinite_skipped"] == 1
    assert "rank 1's micro-batch(es) [1] had a NaN/Inf loss" in ranks[1]["warnings"][0]
    assert "accumulated gradient is not finite" in ranks[0]["warnings"][0]


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "deepspeed"])
def test_nan_written_by_a_hook_on_one_rank_drops_the_step_on_both(backend: str) -> None:
    for result in _launch("hook_nan_one_rank", backend):
        assert result is not None and "crash" not in result, result
        assert result["skipped"] == 1 and result["global_step"] == 1, result  # step 1 dropped on both, step 2 taken
        assert result["finite"] and result["relative_error"] <= TOLERANCE, result
        assert any("not finite" in w for w in result["warnings"]), result


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "deepspeed"])
def test_a_checkpoint_missing_one_ranks_file_is_passed_over_on_both_ranks(backend: str) -> None:
    for result in _launch("save_resume", backend):
        assert result is not None and "crash" not in result, result
        assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(result["listed"]), result
        assert result["global_step"] == 2, result
        assert result["warnings"] and "rng_state_1.pth" in result["warnings"][0], result


@pytest.mark.parametrize(
    "backend, kind",
    [("ddp", "save_killed"), ("ddp", "save_disk_full"), ("fsdp2", "save_killed"), ("fsdp2", "save_disk_full"),
     ("deepspeed", "save_disk_full")],  # ZeRO-2 (zero2_cpu.yaml): the save is the engine's, with its own collectives
)
def test_a_peer_lost_while_saving_is_the_librarys_error_naming_the_checkpoint(backend: str, kind: str) -> None:
    out, (rank0, rank1) = _launch_in(kind, backend, expect_failure=True)
    assert rank0 is not None and "crash" not in rank0, rank0
    assert rank0["error_type"] == "GradAccDistributedError", rank0  # not gloo's "Connection reset by peer"
    folder = str(out / "save_fault" / "checkpoint-2")
    message = rank0["error"]
    assert "optimizer step 2 on rank 0" in message and f"{folder} is left incomplete" in message, message
    assert f"takes the previous complete one, {out / 'save_fault' / 'checkpoint-1'}" in message, message
    if kind == "save_disk_full":
        assert rank1 is not None and rank1["error_type"] == "OSError", rank1  # the failing rank keeps its own error
    assert latest_complete_checkpoint(str(out / "save_fault"), world_size=2) == str(out / "save_fault" / "checkpoint-1")


def test_uneven_data_prefetched_is_the_same_clear_error_on_every_rank() -> None:
    for result in _launch("uneven_prefetched", expect_failure=True):
        assert result is not None and result["error_type"] == "GradAccDataError", result
        assert "different numbers of micro-batches" in result["error"] and "even_batches" in result["error"]


def test_uneven_data_streamed_is_exact() -> None:
    ranks = _launch("uneven_streamed")
    for result in ranks:
        assert result is not None and result["error_type"] is None, result
        assert result["global_step"] == 2 and all(e <= TOLERANCE for e in result["relative_errors"]), result


def test_tokens_seen_with_an_uneven_window() -> None:
    for result in _launch("tokens_seen_uneven"):
        assert result is not None and "crash" not in result, result
        assert result["seen"] == result["expected"] and result["global_step"] == 1, result
