"""`make_exact` on 2 DDP CPU ranks (gloo): a framework's sequence-classification Trainer subclass and subclasses whose
compute_loss returns the model's per-micro-batch mean (directly, or through the stock compute_loss, which multiplies by
the number of processes when the model accepts loss kwargs), made exact after construction; and
`compute_loss_func` = 3 x cross-entropy trains a 3 x update on 2 ranks; and a framework's `outputs.loss` on tiny
Mixtral / Qwen3-MoE made exact (router term by routed tokens).

The cases run in ``workers/make_exact_cases.py`` (one launch; each rank leaves one JSON result per case). Core
assertion: the SGD(lr=1) update of one step, on BOTH ranks, within relative error 1e-5 of the float64 gradient over
ALL samples of both ranks; per-device batch 2 x GA 4, mixed lengths, heavy padding, ignored targets. The same class
without make_exact is measured on the same data, so that each exactness assertion can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .launcher import LaunchResult, run_workers
from .test_ddp import NPROC, TOLERANCE, assert_exact, load_case

pytestmark = pytest.mark.distributed

LAUNCH_TIMEOUT_S = 420
MOE_FAMILIES = ("mixtral", "qwen3_moe")
WORKER = Path(__file__).parent / "workers" / "make_exact_cases.py"
MADE_EXACT = (
    # case, the stock class's relative error is at least
    ("make_exact_sequence_classification", 1.0),  # 8x: GA x world size
    ("make_exact_mean_causal_lm", 1.0),
    ("make_exact_mean_sequence_classification", 1.0),
    ("make_exact_super_causal_lm", None),  # the stock causal LM through super() is exact on DDP
)


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    cases = [name for name, _ in MADE_EXACT] + ["compute_loss_func", *(f"make_exact_moe_{f}" for f in MOE_FAMILIES)]
    return run_workers(
        WORKER,
        nproc=NPROC,
        args=["--cases", ",".join(cases)],
        timeout=LAUNCH_TIMEOUT_S,
        out_dir=tmp_path_factory.mktemp("make_exact"),
        check=False,
    )


def test_every_rank_finished(launch: LaunchResult) -> None:
    assert launch.ok, launch.describe()


@pytest.mark.parametrize(("name", "stock_error_above"), MADE_EXACT)
def test_made_exact_equals_the_full_batch_step(launch: LaunchResult, name: str, stock_error_above) -> None:
    for r, payload in enumerate(load_case(launch, name)):
        run = payload["exact"]
        assert run["num_processes"] == NPROC and run["model_wrapped"] == "DistributedDataParallel", f"rank {r}"
        assert run["is_mixin"] and run["class_name"].startswith("GradAccFramework"), f"rank {r}"
        assert run["backend"] == "ddp" and run["dp_world_size"] == NPROC, f"rank {r}"
        assert_exact(run, f"{name}, rank {r}")
        (log,) = run["logs"]
        assert abs(log["loss"] - run["reference_loss"]) <= TOLERANCE * run["reference_loss"], f"rank {r}: logged loss"
        stock = payload["stock"]
        if stock_error_above is not None:
            assert stock["relative_error"] > stock_error_above, f"rank {r}: the stock class was expected to be off"
    if name == "make_exact_sequence_classification":
        (log,) = load_case(launch, name)[0]["exact"]["logs"]
        assert log["framework_marker"] == 1.0  # the framework's own log override still runs


def test_compute_loss_func_three_times_trains_three_times_on_two_ranks(launch: LaunchResult) -> None:
    for r, payload in enumerate(load_case(launch, "compute_loss_func")):
        assert payload["num_processes"] == NPROC and payload["model_wrapped"] == "DistributedDataParallel"
        assert payload["norm_ratio_unscaled"] == pytest.approx(3.0, rel=1e-4), f"rank {r}"
        assert payload["relative_error"] <= TOLERANCE, f"rank {r}: {payload['relative_error']:.3g}"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_made_exact_moe_outputs_loss_on_two_ranks(launch: LaunchResult, family: str) -> None:
    """A framework's `outputs.loss` on a mixture-of-experts model: CE by target tokens, router term by routed tokens
    over both ranks (unequal micro-batches), against the float64 reference of the same micro-batches."""
    for r, payload in enumerate(load_case(launch, f"make_exact_moe_{family}")):
        assert sorted(payload["micro_batch_sizes"]) == [1] + [2] * (4 * NPROC - 1), f"rank {r}: {payload}"
        assert payload["model_wrapped"] == "DistributedDataParallel" and payload["num_processes"] == NPROC
        assert payload["relative_error"] <= TOLERANCE and payload["router_relative_error"] <= 5e-5, f"rank {r}: {payload}"
        assert payload["loss"] == pytest.approx(payload["main"] + payload["aux"], rel=1e-6) and payload["aux"] > 0
