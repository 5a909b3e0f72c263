"""GradAccTrainer under DDP on 2 CPU ranks (gloo): one optimizer step equals the full-batch step.

Every case runs in ``workers/ddp_cases.py``; one launch runs all of them (process start-up is most of the cost)
and each case leaves one JSON result per rank. The core assertion: the SGD(lr=1) update of one step, on BOTH
ranks, is within relative error 1e-5 of the float64 gradient over ALL samples of both ranks
(:mod:`hf_gradacc.testing.reference`). Data: mixed lengths, heavy padding, many ignored labels; each rank holds
``per_device_train_batch_size`` 2 x ``gradient_accumulation_steps`` 4 samples per step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .launcher import LaunchResult, WorkerError, run_workers

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5  # relative L2 error of the gradient (and of the logged loss / grad norm) vs float64
NPROC = 2
BS, GA = 2, 4  # workers/ddp_cases.py
LAUNCH_TIMEOUT_S = 420
WORKER = Path(__file__).parent / "workers" / "ddp_cases.py"
PROBE = Path(__file__).parent / "workers" / "launcher_probe.py"
CASES = (
    "exact_causal_lm",
    "exact_sequence_classification",
    "exact_masked_lm",
    "imbalanced_causal_lm",
    "zero_rank_causal_lm",
    "zero_rank_masked_lm",
    "zero_rank_sequence_classification",
    "custom_step_causal_lm",
    "defer_normalization_causal_lm",
    "auto_micro_batch_causal_lm",
    "skip_window",
    "comm_hook",
    "moe_mixtral",
    "moe_qwen3_moe",
    *(f"moe_{family}_ga{ga}" for family in ("mixtral", "qwen3_moe") for ga in (1, 8)),
)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    return run_workers(
        WORKER,
        nproc=NPROC,
        args=["--cases", ",".join(CASES)],
        timeout=LAUNCH_TIMEOUT_S,
        out_dir=tmp_path_factory.mktemp("ddp"),
        check=False,
    )


def load_case(launch: LaunchResult, name: str) -> list[dict]:
    """Both ranks' results of case ``name``; fails the test with the worker's traceback or output."""
    try:
        ranks = launch.load(name)
    except WorkerError as err:
        pytest.fail(str(err), pytrace=False)
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed in case {name!r}:\n{payload['error']}", pytrace=False)
    return ranks


def assert_exact(run: dict, what: str) -> None:
    assert run["update_is_finite"], f"{what}: the update holds NaN or inf"
    assert run["relative_error"] <= TOLERANCE, (
        f"{what}: relative error {run['relative_error']:.3g} > {TOLERANCE} "
        f"(cosine {run['cosine']:.6f}, norm ratio {run['norm_ratio']:.4f})"
    )
    assert run["unchanged_params"] == [], f"{what}: parameters the step did not change: {run['unchanged_params']}"
    assert run["max_abs_diff_vs_rank0"] == 0.0, f"{what}: the ranks' updates differ"


def assert_close(value: float, reference: float, what: str) -> None:
    assert abs(value - reference) <= TOLERANCE * abs(reference), f"{what}: {value!r} vs reference {reference!r}"


def test_every_rank_finished(ddp_run: LaunchResult) -> None:
    assert ddp_run.ok, ddp_run.describe()


@pytest.mark.parametrize("name", [c for c in CASES if not c.startswith("moe_")])
def test_ranks_are_two_process_multi_cpu_ddp(ddp_run: LaunchResult, name: str) -> None:
    for r, payload in enumerate(load_case(ddp_run, name)):
        run = payload["gradacc"]
        assert run["num_processes"] == NPROC, f"rank {r}"
        assert run["distributed_type"] == "DistributedType.MULTI_CPU", f"rank {r}"
        assert run["model_wrapped"] == "DistributedDataParallel", f"rank {r}"
        assert run["backend"] == "ddp" and run["dp_world_size"] == NPROC, f"rank {r}"


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification", "masked_lm"])
def test_step_equals_full_batch_step(ddp_run: LaunchResult, task: str) -> None:
    ranks = load_case(ddp_run, f"exact_{task}")
    expected_global = sum(sum(p["expected_micro_batch_counts"]) for p in ranks)
    for r, payload in enumerate(ranks):
        run = payload["gradacc"]
        assert_exact(run, f"{task}, rank {r}")
        # the window really held this rank's share, counted over both ranks
        (window,) = run["windows"]
        assert window["micro_batch_tokens"] == payload["expected_micro_batch_counts"], f"rank {r}"
        denominator = "global_samples" if task == "sequence_classification" else "global_tokens"
        assert window[denominator] == expected_global
        assert window["num_micro_batches_per_rank"] == [4, 4]


@pytest.mark.parametrize(
    ("task", "min_factor", "max_factor"),
    [
        # causal LM: the stock Trainer passes num_items_in_batch gathered over ranks to the model's loss: exact
        ("causal_lm", None, None),
        # heads whose loss ignores num_items_in_batch: the mean of each micro-batch, times GA, times world size
        ("sequence_classification", 7.0, 9.0),
        ("masked_lm", 3.0, None),
    ],
)
def test_stock_trainer_on_two_ranks(ddp_run: LaunchResult, task: str, min_factor, max_factor) -> None:
    for r, payload in enumerate(load_case(ddp_run, f"exact_{task}")):
        stock = payload["stock"]
        assert stock["num_processes"] == NPROC
        if min_factor is None:
            assert stock["relative_error"] <= TOLERANCE, f"rank {r}: stock causal LM is exact on DDP"
        else:
            assert stock["relative_error"] > 1.0, f"rank {r}: the stock Trainer was expected to fail"
            assert stock["norm_ratio"] >= min_factor, f"rank {r}: norm ratio {stock['norm_ratio']:.3f}"
            if max_factor is not None:
                assert stock["norm_ratio"] <= max_factor, f"rank {r}: norm ratio {stock['norm_ratio']:.3f}"


@pytest.mark.parametrize("ga", [1, GA, 8])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_router_term_on_two_ranks(ddp_run: LaunchResult, family: str, ga: int) -> None:
    for payload in load_case(ddp_run, f"moe_{family}" if ga == GA else f"moe_{family}_ga{ga}"):
        assert sorted(payload["micro_batch_sizes"]) == [BS - 1] + [BS] * (ga * NPROC - 1), payload  # both ranks'
        assert payload["relative_error"] <= TOLERANCE and payload["router_relative_error"] <= 5e-5, payload
        assert payload["model_wrapped"] == "DistributedDataParallel" and payload["num_processes"] == NPROC
        assert payload["loss"] == pytest.approx(payload["main"] + payload["aux"], rel=1e-6) and payload["aux"] > 0


def test_rank_imbalanced_token_counts(ddp_run: LaunchResult) -> None:
    ranks = load_case(ddp_run, "imbalanced_causal_lm")
    local = [p["gradacc"]["windows"][0]["local_tokens"] for p in ranks]
    assert local == [sum(p["expected_micro_batch_counts"]) for p in ranks]
    assert local[1] > 0 and local[0] >= 20 * local[1], f"counted tokens per rank {local}: not imbalanced enough"
    for r, payload in enumerate(ranks):
        assert_exact(payload["gradacc"], f"rank {r}")


@pytest.mark.parametrize("task", ["causal_lm", "masked_lm", "sequence_classification"])
def test_rank_without_counted_items_in_the_window(ddp_run: LaunchResult, task: str) -> None:
    ranks = load_case(ddp_run, f"zero_rank_{task}")
    denominator = "local_samples" if task == "sequence_classification" else "local_tokens"
    local = [p["gradacc"]["windows"][0][denominator] for p in ranks]
    assert local[0] > 0 and local[1] == 0, f"counted items per rank {local}"
    for r, payload in enumerate(ranks):
        run = payload["gradacc"]
        assert_exact(run, f"{task}, rank {r}")
        assert run["global_step"] == 1 and run["num_skipped_windows"] == 0


def test_window_without_counted_tokens_is_skipped_on_every_rank(ddp_run: LaunchResult) -> None:
    for r, payload in enumerate(load_case(ddp_run, "skip_window")):
        run = payload["gradacc"]
        empty, normal = run["windows"]
        assert empty["global_tokens"] == 0 and normal["global_tokens"] > 0, f"rank {r}"
        assert run["num_skipped_windows"] == 1, f"rank {r}"
        assert run["global_step"] == 1 and len(run["logs"]) == 1, f"rank {r}: the next window must still step"
        assert payload["max_param_change_before_first_step"] == 0.0, f"rank {r}: the skipped window moved weights"
        assert any("skipped" in m for m in payload["warnings"]), f"rank {r}: no warning in {payload['warnings']}"
        # the only step is exactly the second window's full-batch step
        assert_exact(run, f"rank {r}")


@pytest.mark.parametrize(
    "name",
    [
        "exact_causal_lm",
        "exact_sequence_classification",
        "exact_masked_lm",
        "imbalanced_causal_lm",
        "zero_rank_causal_lm",
        "skip_window",
    ],
)
def test_logged_loss_and_grad_norm_are_the_global_ones(ddp_run: LaunchResult, name: str) -> None:
    run = load_case(ddp_run, name)[0]["gradacc"]  # rank 0 is the one that reports
    (log,) = run["logs"]
    assert_close(log["loss"], run["reference_loss"], f"{name}: logged loss")
    assert_close(log["grad_norm"], run["reference_grad_norm"], f"{name}: logged grad_norm")


def test_one_gradient_all_reduce_per_window(ddp_run: LaunchResult) -> None:
    for r, payload in enumerate(load_case(ddp_run, "comm_hook")):
        assert payload["registered_on"] == "DistributedDataParallel"
        calls, ga = payload["calls"], payload["ga"]
        assert payload["gradacc"]["global_step"] == 2
        assert {c["step"] for c in calls} == {0, 1}, f"rank {r}: {calls}"
        assert all(c["micro_batch"] == ga - 1 for c in calls), f"rank {r}: reduction before the last micro-batch"
        for step in (0, 1):
            buckets = sorted(c["bucket"] for c in calls if c["step"] == step)
            assert buckets == list(range(len(buckets))), f"rank {r}, step {step}: bucket reductions {buckets}"
            assert len(buckets) >= 2, "the model is meant to span several DDP buckets"
        # the first step's reported norm is the reference norm of that window
        assert_close(payload["gradacc"]["logs"][0]["grad_norm"], payload["gradacc"]["reference_grad_norm"], "norm")


@pytest.mark.parametrize(
    "name", ["custom_step_causal_lm", "defer_normalization_causal_lm", "auto_micro_batch_causal_lm"]
)
def test_re_armed_reducer_with_default_ddp_settings(ddp_run: LaunchResult, name: str) -> None:
    # A training_step override, `defer_normalization` and `auto_micro_batch` run their forwards under no_sync and
    # re-arm DDP's reducer for one final backward pass; that must work with the Trainer's DDP default
    # find_unused_parameters=True (accelerate's trigger_sync_in_backward alone fails there).
    for r, payload in enumerate(load_case(ddp_run, name)):
        run = payload["gradacc"]
        assert run["find_unused_parameters"] is True
        assert_exact(run, f"{name}, rank {r}")


def test_torchrun_launch(tmp_path: Path) -> None:
    launch = run_workers(
        WORKER,
        nproc=NPROC,
        args=["--cases", "exact_causal_lm"],
        timeout=LAUNCH_TIMEOUT_S,
        method="torchrun",
        out_dir=tmp_path,
    )
    for r, payload in enumerate(load_case(launch, "exact_causal_lm")):
        assert payload["gradacc"]["num_processes"] == NPROC
        assert_exact(payload["gradacc"], f"torchrun, rank {r}")
        assert f"[rank {r}] case exact_causal_lm done" in launch.ranks[r].stdout  # per-rank logs of torchrun


# ---------------------------------------------------------------------------------------------- the launcher
def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a killed orphan may stay a zombie where nothing reaps it


def test_launcher_gives_each_rank_its_env_and_output(tmp_path: Path) -> None:
    launch = run_workers(PROBE, nproc=NPROC, env={"PROBE_EXTRA": "x"}, timeout=120, out_dir=tmp_path)
    envs = [p["env"] for p in launch.load("probe")]
    assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"} and {e["PROBE_EXTRA"] for e in envs} == {"x"}
    for r, out in enumerate(launch.ranks):
        assert f"hello from rank {r}" in out.stdout and f"stderr of rank {r}" in out.stderr


@pytest.mark.parametrize(("method", "timeout"), [("subprocess", 8.0), ("torchrun", 20.0)])
def test_launcher_timeout_stops_every_rank(tmp_path: Path, method: str, timeout: float) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out"):
        run_workers(PROBE, nproc=NPROC, args=["--sleep", "600"], timeout=timeout, method=method, out_dir=tmp_path)
    assert time.monotonic() - start < timeout + 15
    pids = [json.loads(p.read_text())["pid"] for p in sorted(tmp_path.glob("probe.rank*.json"))]
    assert len(pids) == NPROC, "the ranks did not start within the timeout"
    time.sleep(0.5)
    assert not [pid for pid in pids if _is_running(pid)], "a rank outlived the launcher's timeout"


def test_launcher_stops_the_other_ranks_when_one_fails(tmp_path: Path) -> None:
    start = time.monotonic()
    launch = run_workers(
        PROBE, nproc=NPROC, args=["--sleep", "600", "--fail-rank", "1"], timeout=120, out_dir=tmp_path, check=False
    )
    assert time.monotonic() - start < 30
    assert not launch.ok and not launch.timed_out
    assert [r.returncode for r in launch.ranks] == [None, 3]  # rank 0 was stopped, rank 1 failed
    assert not _is_running(launch.load("probe")[0]["pid"])
