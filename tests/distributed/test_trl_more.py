"""TRL's KTO, RLOO and Distillation trainers on 2 CPU ranks (gloo, DDP), hf_gradacc's and stock, in ONE launch
(``workers/trl_more_cases.py``): each case is one SGD(lr=1) step against the float64 full batch over both ranks'
samples, written from the loss's definition (``hf_gradacc/testing/trl_more_steps.py``).

- ``kto``: 14 unpaired samples, micro-batches of 2 + 2 + 2 + 1 on each rank, beta 0.5, a freshly initialised reference
  model; KTO's KL estimate over every mismatched pair of the step on both ranks (one all-gather);
- ``rloo``: 16 completions (2 per prompt) of the built-in tiny policy, batch 2 x GA 4 on each rank;
- ``distillation``: 16 completions distilled from a teacher (generalized JSD, beta 0.5).

Tolerance: relative error <= 1e-5. Measured (2 ranks): see the numbers in docs/preference.md and docs/distillation.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.distributed.launcher import run_workers  # noqa: E402

pytestmark = [pytest.mark.distributed]
WORKER = Path(__file__).resolve().parent / "workers" / "trl_more_cases.py"
CASES = ("kto", "rloo", "distillation")
TOLERANCE = 1e-5
_RESULTS: dict[str, list[dict]] = {}


def results(case: str) -> list[dict]:
    if not _RESULTS:
        launch = run_workers(WORKER, nproc=2, args=["--cases", ",".join(CASES)], timeout=400, method="torchrun")
        _RESULTS.update({name: launch.load(name) for name in CASES})
    return _RESULTS[case]


@pytest.mark.parametrize("case", CASES)
def test_hf_gradacc_is_the_full_batch_step_on_two_ranks(case: str) -> None:
    ranks = results(case)
    for r, payload in enumerate(ranks):
        assert "error" not in payload, payload.get("error")
        where = f"{case}, rank {r}: {payload}"
        assert payload["num_processes"] == 2 and payload["distributed_type"].endswith("MULTI_CPU"), where
        assert payload["num_samples"] == (14 if case == "kto" else 16), where
        assert payload["relative_error"] <= TOLERANCE, where
        print(f"{case} rank {r}: hf_gradacc {payload['relative_error']:.3g}, stock {payload['stock_relative_error']:.3g}")
    assert ranks[0]["relative_error"] == pytest.approx(ranks[1]["relative_error"], rel=1e-6)
    if case == "kto":  # TRL's KL estimate per micro-batch and rank, its mean of micro-batch means
        assert all(payload["stock_relative_error"] > 0.05 for payload in ranks)
