"""Regrouped micro-batches under DDP on 2 CPU ranks (gloo): same windows, same update as the plain GradAccTrainer.

``run_workers`` starts ``workers/regroup_cases.py`` on 2 ranks; each rank trains the plain GradAccTrainer, the
regrouped one and the token-budget one from the same model and seed (the stock seeded random order, so the ranks
agree on the windows without talking), records what it saw, and writes one JSON result.
Tolerance: relative L2 difference 1e-5 of the parameter update (SGD one step, and 3 AdamW steps whose last window
is short), and 1e-5 of the one-step update against the float64 full-batch reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TOLERANCE = 1e-5
NPROC = 2
BS, GA = 2, 4
BUDGET = 40  # workers/regroup_cases.py
MODES = ("plain", "regroup", "budget", "pack")


# ---------------------------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from tests.distributed.launcher import run_workers

    worker = Path(__file__).resolve().parent / "workers" / "regroup_cases.py"
    launch = run_workers(worker, nproc=NPROC, timeout=300, out_dir=tmp_path_factory.mktemp("regroup"))
    ranks = launch.load("regroup")
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


def merged_windows(ranks: list[dict], run: str) -> list[list[int]]:
    """Sorted sample ids of each optimizer step, over both ranks."""
    per_rank = [r[run]["windows"] for r in ranks]
    assert len({len(w) for w in per_rank}) == 1
    return [sorted(i for w in windows for batch in w for i in batch) for windows in zip(*per_rank)]


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["sgd", "adamw"])
def test_regrouped_ddp_equals_plain(results, run):
    plain = merged_windows(results, f"{run}_plain")
    for mode in ("regroup", "budget", "pack"):
        assert merged_windows(results, f"{run}_{mode}") == plain  # the same samples in every optimizer step
        for rank in results:
            out = rank[f"{run}_{mode}"]
            assert out["relative_difference_vs_plain"] <= TOLERANCE
            assert out["max_abs_diff_vs_rank0"] == 0.0  # the replicas agree
            assert out["padded_tokens"] < rank[f"{run}_plain"]["padded_tokens"]
            counts = [len(w) for w in out["windows"]]
            assert counts == [len(w) for w in results[0][f"{run}_{mode}"]["windows"]]  # every rank alike
            # one gradient reduction per optimizer step, on its last micro-batch, as in the plain run
            assert out["reductions_per_step"] == rank[f"{run}_plain"]["reductions_per_step"]
            assert all(mb == count - 1 for mb, count in zip(out["reduced_on_micro_batch"], counts))
    budget = [r[f"{run}_budget"] for r in results]
    assert all(size <= BUDGET for r in budget for size in r["padded_per_micro_batch"])
    for rank in results:  # packed: one row per micro-batch, every computed position a real token
        assert rank[f"{run}_pack"]["padded_per_micro_batch"] == rank[f"{run}_pack"]["real_per_micro_batch"]
    if run == "sgd":
        for rank in results:
            for mode in MODES:
                assert rank[f"sgd_{mode}"]["relative_error_vs_reference"] <= TOLERANCE
    else:
        assert [len(w) for w in results[0]["adamw_plain"]["windows"]] == [GA, GA, 1]  # a short last window
        assert max(len(w) for w in budget[0]["windows"]) > GA  # the budget needed more micro-batches somewhere
