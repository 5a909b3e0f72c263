"""The TRL-first mix on 2 ranks: ``class T(SFTTrainer, GradAccTrainer)`` puts TRL's ``compute_loss`` (which divides by
the global count and multiplies by the number of processes) in front of the mixin's. On one process that loss is the
micro-batch's mean and the step is exact (tests/unit/test_trl.py); on 2 ranks it is not a mean any more, and the
mixin's start-up check must refuse it on both ranks, naming the fix (GradAccSFTTrainer), instead of training a
gradient 2x too large. ``workers/trl_mix_cases.py`` runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.distributed.launcher import run_workers  # noqa: E402

pytestmark = [pytest.mark.distributed]
WORKER = Path(__file__).resolve().parent / "workers" / "trl_mix_cases.py"


def test_the_trl_first_mix_is_refused_on_both_ranks(tmp_path) -> None:
    ranks = run_workers(WORKER, nproc=2, timeout=240, out_dir=tmp_path).load("trl_mix")
    for payload in ranks:
        assert "crash" not in payload, payload.get("crash")
        assert payload.get("error_type") == "GradAccLossError", payload
        assert "GradAccError" in payload["bases"]
        message = payload["message"]
        assert "times the 2 processes" in message and "GradAccSFTTrainer" in message
