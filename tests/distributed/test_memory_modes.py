"""Memory modes and regrouped micro-batches on 2 CPU ranks (gloo): the same update as the plain step.

One launch per backend (process start-up is most of the cost), each running several cases of
``workers/memory_cases.py``:

* DDP: ``auto_micro_batch`` with an out-of-memory error injected on ONE rank only (every rank must split together,
  nothing may hang, the size found is kept for later steps, and out of memory on one sample is a clear error on
  every rank); ``defer_normalization`` on a streamed ``IterableDataset`` whose last window is short, and with a
  ``LossTerm`` count of the user's own.
* DeepSpeed ZeRO-2 (``TrainingArguments(deepspeed=...)``) and FSDP2: ``regroup_micro_batches``,
  ``max_tokens_per_micro_batch`` and ``pack_micro_batches`` give the update of the plain GradAccTrainer on the same backend, with the same
  samples in every optimizer step; ``auto_micro_batch`` and ``defer_normalization`` are refused with a clear error
  there (a rank that fails mid-window, or a gradient reduced while it is produced, cannot be handled).

Tolerance: relative L2 difference 1e-5 of the parameter update, against the float64 full-batch reference
(:mod:`hf_gradacc.testing.reference`) and against the plain run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .launcher import LaunchResult, WorkerError, run_workers

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
NPROC = 2
LAUNCH_TIMEOUT_S = 300
WORKER = Path(__file__).parent / "workers" / "memory_cases.py"
# as in the worker
AUTO_ROWS_PER_STEP = 4 * 2  # rows per rank per optimizer step of the auto_micro_batch cases (bs 4 x GA 2)
BS, GA = 2, 4
BUDGET = 40
COLLECTIVE_TIMEOUT_S = 60

CASES = {
    "ddp": (
        "auto_oom_one_rank",
        "auto_two_steps",
        "auto_two_steps_static_buckets",
        "defer_stream",
        "defer_custom_count",
        "auto_oom_one_sample",  # last: the trainer of this case ends in an error
    ),
    "zero2": ("unsupported_modes", "regroup_one_step", "regroup_windows"),
    "fsdp2": ("unsupported_modes", "regroup_one_step", "regroup_windows"),
}
SHARDED = ("zero2", "fsdp2")


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory):
    done: dict[str, LaunchResult] = {}

    def launch(backend: str) -> LaunchResult:
        if backend not in done:
            if backend == "zero2":
                pytest.importorskip("deepspeed")
            done[backend] = run_workers(
                WORKER,
                nproc=NPROC,
                args=["--backend", backend, "--cases", ",".join(CASES[backend])],
                timeout=LAUNCH_TIMEOUT_S,
                out_dir=tmp_path_factory.mktemp(f"memory_{backend}"),
                check=False,
            )
        return done[backend]

    return launch


def load_case(launch: LaunchResult, name: str) -> list[dict]:
    """Both ranks' results of case ``name``; fails the test with the worker's traceback or output."""
    try:
        ranks = launch.load(name)
    except WorkerError as err:
        pytest.fail(str(err), pytrace=False)
    for r, payload in enumerate(ranks):
        if "worker_error" in payload:
            pytest.fail(f"rank {r} failed in case {name!r}:\n{payload['worker_error']}", pytrace=False)
    return ranks


def assert_close(value: float, reference: float, what: str) -> None:
    assert abs(value - reference) <= TOLERANCE * abs(reference), f"{what}: {value!r} vs {reference!r}"


@pytest.mark.parametrize("backend", ["ddp", *SHARDED])
def test_every_rank_finished_within_the_timeout(launches, backend: str) -> None:
    launch = launches(backend)
    assert not launch.timed_out, launch.describe()
    assert launch.ok, launch.describe()


# ---------------------------------------------------------------------------------------------- auto_micro_batch
def oom_rows(forward_log: list) -> list[int]:
    return [rows for rows, out_of_memory in forward_log if out_of_memory]


def test_auto_micro_batch_out_of_memory_on_one_rank_splits_every_rank(launches) -> None:
    rank0, rank1 = load_case(launches("ddp"), "auto_oom_one_rank")
    # only rank 1 ran out of memory (on 4 rows, then on 2), yet both ranks split, to the same size
    assert oom_rows(rank1["forward_log"]) == [4, 2] and oom_rows(rank0["forward_log"]) == []
    assert rank0["auto_rows"] == rank1["auto_rows"] == 1
    for r, run in enumerate((rank0, rank1)):
        rows = [rows for rows, _ in run["forward_log"]]
        assert rows[-AUTO_ROWS_PER_STEP:] == [1] * AUTO_ROWS_PER_STEP, f"rank {r}: the step's last try: {rows}"
        where = "another" if r == 0 else "this"
        assert len(run["warnings"]) == 2, f"rank {r}: {run['warnings']}"
        assert all(f"out of memory on {where} rank" in w for w in run["warnings"]), run["warnings"]
        assert "at most 2 row(s) (were 4)" in run["warnings"][0] and "at most 1 row(s) (were 2)" in run["warnings"][1]
        (log,) = run["logs"]
        assert log["auto_micro_batch_rows"] == 1, f"rank {r}: the size found is logged"
        assert run["relative_error_vs_reference"] <= TOLERANCE, f"rank {r}: {run['relative_error_vs_reference']}"
        assert run["relative_difference_vs_plain"] <= TOLERANCE, f"rank {r}: {run['relative_difference_vs_plain']}"
        assert run["max_abs_diff_vs_rank0"] == 0.0, f"rank {r}: the replicas differ"
        (plain_log,) = run["plain_logs"]
        assert_close(log["loss"], plain_log["loss"], f"rank {r}: logged loss")
        assert_close(log["grad_norm"], plain_log["grad_norm"], f"rank {r}: logged grad_norm")


@pytest.mark.parametrize(
    ("case", "find_unused_parameters"),
    [("auto_two_steps", True), ("auto_two_steps_static_buckets", False)],
)
def test_auto_micro_batch_keeps_the_size_found_for_later_steps(launches, case: str, find_unused_parameters) -> None:
    ranks = load_case(launches("ddp"), case)
    for r, run in enumerate(ranks):
        assert run["find_unused_parameters"] is find_unused_parameters
        assert run["global_step"] == 2 and run["auto_rows"] == 1
        first, second = run["step_marks"]
        step1, step2 = run["forward_log"][:first], run["forward_log"][first:second]
        assert oom_rows(step1) == ([4, 2] if r == 1 else [])
        # step 2 starts with one-row micro-batches: no new out-of-memory error, no new warning
        assert step2 == [[1, False]] * AUTO_ROWS_PER_STEP, f"rank {r}: {step2}"
        assert len(run["warnings"]) == 2, f"rank {r}: {run['warnings']}"
        assert run["logs"][0]["auto_micro_batch_rows"] == 1 and "auto_micro_batch_rows" not in run["logs"][1]
        assert run["relative_difference_vs_plain"] <= TOLERANCE, f"rank {r}: {run['relative_difference_vs_plain']}"
        assert run["max_abs_diff_vs_rank0"] == 0.0
        for log, plain_log in zip(run["logs"], run["plain_logs"], strict=True):
            assert_close(log["loss"], plain_log["loss"], f"rank {r}, step {log['step']}: logged loss")


def test_auto_micro_batch_out_of_memory_on_one_sample_raises_on_every_rank(launches) -> None:
    launch = launches("ddp")
    for r, run in enumerate(load_case(launch, "auto_oom_one_sample")):
        assert run["is_data_error"], f"rank {r}: {run['error_type']}: {run['error']}"
        assert "ONE sample" in run["error"] and "max_length" in run["error"]
        # both ranks raised at once, without waiting out a collective's timeout
        assert run["seconds"] < COLLECTIVE_TIMEOUT_S / 2, f"rank {r}: {run['seconds']:.1f}s"
    assert not launch.timed_out


# ---------------------------------------------------------------------------------------------- defer_normalization
def test_deferred_normalization_streams_a_short_last_window(launches) -> None:
    ranks = load_case(launches("ddp"), "defer_stream")
    # what each rank read from the stream: GA micro-batches for step 1, GA - 1 for the short step 2
    for run in ranks:
        assert len(run["collated"]) == 2 * GA - 1 and run["collated"] == run["plain_collated"]
    step1 = sorted(i for run in ranks for batch in run["collated"][:GA] for i in batch)
    step2 = sorted(i for run in ranks for batch in run["collated"][GA:] for i in batch)
    assert step1 == list(range(16)) and step2 == list(range(16, ranks[0]["num_samples"]))
    for r, run in enumerate(ranks):
        # against two float64 full-batch SGD steps over exactly those windows
        assert run["relative_error_vs_reference"] <= TOLERANCE, f"rank {r}: {run['relative_error_vs_reference']}"
        assert run["relative_difference_vs_plain"] <= TOLERANCE, f"rank {r}: {run['relative_difference_vs_plain']}"
        assert run["max_abs_diff_vs_rank0"] == 0.0
        assert len(run["logs"]) == 2
        for log, plain_log in zip(run["logs"], run["plain_logs"], strict=True):
            assert_close(log["loss"], plain_log["loss"], f"rank {r}, step {log['step']}: logged loss")
            assert_close(log["grad_norm"], plain_log["grad_norm"], f"rank {r}, step {log['step']}: grad_norm")


def test_deferred_normalization_sums_a_custom_count_over_ranks(launches) -> None:
    ranks = load_case(launches("ddp"), "defer_custom_count")
    for r, run in enumerate(ranks):
        # the count (rows with a counted target) is neither the tokens nor the samples: a mix-up would show
        assert run["learnable_rows"] not in (run["tokens"], run["num_samples"])
        assert run["global_step"] == 1
        assert run["relative_error_vs_reference"] <= TOLERANCE, f"rank {r}: {run['relative_error_vs_reference']}"
        assert run["max_abs_diff_vs_rank0"] == 0.0


# ---------------------------------------------------------------------------------------------- ZeRO-2 and FSDP2
def merged_windows(ranks: list[dict], mode: str) -> list[list[int]]:
    """Sorted sample ids of each optimizer step, over both ranks."""
    per_rank = [r[mode]["windows"] for r in ranks]
    assert len({len(w) for w in per_rank}) == 1
    return [sorted(i for w in windows for batch in w for i in batch) for windows in zip(*per_rank)]


@pytest.mark.parametrize("backend", SHARDED)
def test_runs_are_on_the_sharded_backend(launches, backend: str) -> None:
    for case in ("regroup_one_step", "regroup_windows"):
        for run in load_case(launches(backend), case):
            for mode in ("plain", "regroup", "budget", "pack"):
                out = run[mode]
                assert out["num_processes"] == NPROC
                if backend == "zero2":
                    assert out["distributed_type"] == "DistributedType.DEEPSPEED" and out["zero_stage"] == 2
                    assert out["backend"] == "deepspeed" and out["model_wrapped"] == "DeepSpeedEngine"
                else:
                    assert out["distributed_type"] == "DistributedType.FSDP" and out["backend"] == "fsdp2"
                    assert out["param_types"] == ["DTensor"]  # sharded parameters


@pytest.mark.parametrize("backend", SHARDED)
def test_regrouped_step_equals_the_plain_step(launches, backend: str) -> None:
    ranks = load_case(launches(backend), "regroup_one_step")
    assert merged_windows(ranks, "regroup") == merged_windows(ranks, "plain")
    plain_padded = sum(r["plain"]["padded_tokens"] for r in ranks)
    for mode in ("regroup", "budget"):
        assert sum(r[mode]["padded_tokens"] for r in ranks) < plain_padded, f"{mode}: no padding saved"
    for r, run in enumerate(ranks):
        for mode in ("plain", "regroup", "budget", "pack"):
            out = run[mode]
            assert out["relative_error_vs_reference"] <= TOLERANCE, f"{mode}, rank {r}: {out}"
            assert out["relative_difference_vs_plain"] <= TOLERANCE, f"{mode}, rank {r}: {out}"
            assert out["unchanged_params"] == [] and out["max_abs_diff_vs_rank0"] == 0.0
            assert out["global_step"] == 1
            assert all(size <= BUDGET for size in run["budget"]["padded_per_micro_batch"])


@pytest.mark.parametrize("backend", SHARDED)
def test_regrouped_steps_keep_each_steps_samples(launches, backend: str) -> None:
    ranks = load_case(launches(backend), "regroup_windows")
    plain = merged_windows(ranks, "plain")
    assert [len(w) for w in ranks[0]["plain"]["windows"]] == [GA, GA, 1]  # the last window is short
    for mode in ("regroup", "budget"):
        assert merged_windows(ranks, mode) == plain, f"{mode}: a sample changed optimizer step"
        counts = [[len(w) for w in r[mode]["windows"]] for r in ranks]
        assert counts[0] == counts[1], f"{mode}: ranks hold different numbers of micro-batches {counts}"
        for r, run in enumerate(ranks):
            out = run[mode]
            assert out["global_step"] == 3
            assert out["relative_difference_vs_plain"] <= TOLERANCE, f"{mode}, rank {r}: {out}"
            assert out["max_abs_diff_vs_rank0"] == 0.0 and out["unchanged_params"] == []
    budget = ranks[0]["budget"]
    assert all(size <= BUDGET for r in ranks for size in r["budget"]["padded_per_micro_batch"])
    assert max(len(w) for w in budget["windows"]) > GA  # the budget needed more micro-batches somewhere
    # packed rows: the same three steps, the same number of rows on both ranks, the plain update
    assert ranks[0]["pack"]["window_sizes"] == ranks[1]["pack"]["window_sizes"]
    assert len(ranks[0]["pack"]["window_sizes"]) == 3
    assert all(r["pack"]["rows_per_micro_batch"] == [1] for r in ranks)  # every micro-batch one packed row
    assert all(r["plain"]["rows_per_micro_batch"] == [BS] for r in ranks)
    for r, run in enumerate(ranks):
        out = run["pack"]
        assert out["global_step"] == 3
        assert out["relative_difference_vs_plain"] <= TOLERANCE, f"pack, rank {r}: {out}"
        assert out["max_abs_diff_vs_rank0"] == 0.0 and out["unchanged_params"] == []


@pytest.mark.parametrize("backend", SHARDED)
def test_memory_modes_are_refused_with_a_clear_error(launches, backend: str) -> None:
    name = {"zero2": "deepspeed", "fsdp2": "fsdp2"}[backend]
    for run in load_case(launches(backend), "unsupported_modes"):
        for flag in ("auto_micro_batch", "defer_normalization"):
            result = run[flag]
            assert result["error_type"] == "UnsupportedBackendError", result
            assert f"`{flag}=True`" in result["error"] and f"the {name} backend" in result["error"]
            assert "Supported: single process and DDP" in result["error"]
