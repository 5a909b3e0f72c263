"""TokenStatsCallback and precise BatchNorm on 2 DDP CPU ranks (gloo), from ``workers/ddp_cases.py``.

TokenStatsCallback: the logged numbers of every step are equal on both ranks and equal to the SUM over ranks of each
rank's direct count of its own batches (they come from the step's one collective). Precise BatchNorm: after training,
both ranks hold the same running statistics, the mean over ranks of the statistics of each rank's precise batches.
Frozen BatchNorm: one accumulated step over both ranks equals the float64 full-batch step with fixed statistics,
and no running statistic moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .launcher import LaunchResult, run_workers
from .test_ddp import load_case

pytestmark = pytest.mark.distributed

NPROC = 2
WORKER = Path(__file__).parent / "workers" / "ddp_cases.py"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    return run_workers(
        WORKER,
        nproc=NPROC,
        args=["--cases", "token_stats,batchnorm_precise,batchnorm_freeze"],
        timeout=300,
        out_dir=tmp_path_factory.mktemp("ddp_callbacks"),
        check=False,
    )


def test_token_stats_are_global_and_equal_on_every_rank(ddp_run: LaunchResult) -> None:
    ranks = load_case(ddp_run, "token_stats")
    assert [r["num_processes"] for r in ranks] == [NPROC, NPROC]
    logs0, logs1 = ranks[0]["logs"], ranks[1]["logs"]
    assert len(logs0) == len(logs1) == 2
    for step in range(2):
        summed = {key: sum(r["direct"][step][key] for r in ranks) for key in ranks[0]["direct"][step]}
        assert ranks[0]["direct"][step] != ranks[1]["direct"][step]  # the ranks saw different batches
        for key, value in summed.items():
            assert logs0[step][key] == logs1[step][key] == pytest.approx(value), (step, key)
        padding = 1 - summed["tokens/real"] / summed["tokens/computed"]
        assert logs0[step]["tokens/padding_ratio"] == logs1[step]["tokens/padding_ratio"] == pytest.approx(padding)
        assert logs0[step]["tokens/per_second"] > 0 and logs1[step]["tokens/per_second"] > 0


def test_precise_batchnorm_statistics_are_averaged_over_ranks(ddp_run: LaunchResult) -> None:
    ranks = load_case(ddp_run, "batchnorm_precise")
    assert [r["num_processes"] for r in ranks] == [NPROC, NPROC]
    assert all(r["num_recomputed"] == 1 for r in ranks)
    assert len(ranks[0]["running"]) == 6
    for name in ranks[0]["running"]:
        for stat in ("mean", "var"):
            per_rank = [torch.tensor(r["direct"][name][stat]) for r in ranks]
            assert not torch.allclose(per_rank[0], per_rank[1])  # each rank drew its own batches
            expected = torch.stack(per_rank).mean(0)
            for r in ranks:
                torch.testing.assert_close(torch.tensor(r["running"][name][stat]), expected, rtol=1e-5, atol=1e-6)


def test_frozen_batchnorm_step_is_exact_and_keeps_the_statistics(ddp_run: LaunchResult) -> None:
    for payload in load_case(ddp_run, "batchnorm_freeze"):
        assert payload["num_processes"] == NPROC and payload["num_layers"] == 6
        assert payload["moved"] == []
        assert payload["relative_error"] <= 1e-5, payload
