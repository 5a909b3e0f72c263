"""``save_on_preemption`` on 2 gloo CPU ranks: SIGTERM to rank 1 ONLY, mid-window (micro-batch 2 of 4 of optimizer
step 3), stops BOTH ranks after step 3 with one complete checkpoint-3 saved together (both ranks' RNG states in
it), both exit 0, and the run resumed from it ends equal to the uninterrupted run. A rank that decided alone would
leave the other waiting in a collective: the launch would fail within ``ddp_timeout`` (20 s) or its timeout.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .launcher import run_workers

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "workers" / "preemption_cases.py"
TOLERANCE = 1e-5


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint() -> None:
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_preemption_"))
    result = run_workers(WORKER, nproc=2, timeout=150, out_dir=out)  # check: every rank exits 0
    stopped = result.load("stopped")
    assert [r["sent"] for r in stopped] == [False, True]  # the signal reached rank 1 only
    for r in stopped:
        assert r["preempted"] and r["global_step"] == 3, r
        assert r["folders"] == ["checkpoint-3"] and r["complete"] == "checkpoint-3", r
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(r["files"]), r
        assert r["handler_restored"], r
    for r in result.load("resumed"):
        assert r["global_step"] == 5 and r["relative_error"] <= TOLERANCE, r
