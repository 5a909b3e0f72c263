"""GradientNoiseScaleCallback on 2 CPU ranks (gloo): DDP (prefetched and streamed steps), FSDP2 (``deferred`` and
``every_micro_batch``) and DeepSpeed ZeRO-1/2/3 (``per_micro_batch`` and ``per_window``), on a problem whose noise
scale is known (`hf_gradacc.testing.noise_problems`: B_simple = 16 samples).

One launch per backend runs its cases (``workers/noise_scale_cases.py``): DDP and FSDP2 through ``torchrun``,
DeepSpeed through ``accelerate launch --config_file examples/accelerate_configs/zero<N>_cpu.yaml`` with
``HF_GRADACC_CPU_DISTRIBUTED=1``. Each case trains 120 steps of per-device batch 4 x GA 4 x 2 ranks. Asserted:

- the two squared norms the callback reads, as MEAN gradients, against float64 references over the same samples
  (relative error <= 1e-5): the first micro-batch (this rank's, or both ranks' where the backend reduces every
  micro-batch: the small batch is then 8 samples, not 4) and the step (32 samples);
- the estimate over the run (mean tr(S) / mean |G|^2) within 10 % of the truth, the smoothed ``gns`` within 20 %
  (the bands of tests/unit/test_noise_scale.py, from the spread over 12 seeds in docs/callbacks.md);
- both ranks log the same values.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from .launcher import run_accelerate, run_workers

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "noise_scale_cases.py"
CONFIGS = REPO / "examples" / "accelerate_configs"
NPROC, STEPS, LOGGING_STEPS = 2, 120, 10  # noise_scale_cases.STEPS / logging_steps
EXACT = 1e-5
ESTIMATE_TOLERANCE = 0.20  # the smoothed per-step gns and the two components (docs/callbacks.md: gns up to 16 %)
RUN_ESTIMATE_TOLERANCE = 0.10  # the estimate over the run; tests/unit/test_noise_scale.py's band (measured <= 6.4 %)
LAUNCH_TIMEOUT_S = 420.0

# (launch, case, whether the small batch is reduced over ranks)
CASES: dict[str, list[tuple[dict[str, Any], bool]]] = {
    "ddp": [({"name": "ddp"}, False), ({"name": "ddp_streamed", "defer_normalization": True}, False)],
    "fsdp2": [
        ({"name": "fsdp2_deferred", "fsdp_sync": "deferred"}, False),
        ({"name": "fsdp2_every_micro_batch", "fsdp_sync": "every_micro_batch"}, True),
    ],
    "zero1": [({"name": "zero1", "zero_reduction": "per_micro_batch"}, False)],
    "zero2": [
        ({"name": "zero2_per_micro_batch", "zero_reduction": "per_micro_batch"}, True),
        ({"name": "zero2_per_window", "zero_reduction": "per_window"}, False),
    ],
    "zero3": [
        ({"name": "zero3_per_micro_batch", "zero_reduction": "per_micro_batch"}, True),
        ({"name": "zero3_per_window", "zero_reduction": "per_window"}, False),
    ],
}
PARAMS = [(launch, case["name"], reduced) for launch, cases in CASES.items() for case, reduced in cases]

_RESULTS: dict[str, dict[str, list[dict[str, Any]]]] = {}


def results_for(launch: str) -> dict[str, list[dict[str, Any]]]:
    """Every case of one launch (one per backend and test session), by case name, indexed by rank."""
    if launch in _RESULTS:
        return _RESULTS[launch]
    cases = [case for case, _ in CASES[launch]]
    worker_args = ["--cases", json.dumps(cases)]
    if launch in ("ddp", "fsdp2"):
        result = run_workers(
            WORKER, nproc=NPROC, args=["--backend", launch, *worker_args], timeout=LAUNCH_TIMEOUT_S, method="torchrun"
        )
    else:
        pytest.importorskip("deepspeed")
        result = run_accelerate(
            CONFIGS / f"{launch}_cpu.yaml",
            WORKER,
            ["--backend", "deepspeed", *worker_args],
            nproc=NPROC,
            cpu_distributed=True,
            timeout=LAUNCH_TIMEOUT_S,
            out_dir=tempfile.mkdtemp(prefix=f"hf_gradacc_gns_{launch}_"),
        )
    _RESULTS[launch] = {case["name"]: result.load(case["name"]) for case in cases}
    return _RESULTS[launch]


def _ranks(launch: str, name: str) -> list[dict[str, Any]]:
    ranks = results_for(launch)[name]
    for r, payload in enumerate(ranks):
        assert "crash" not in payload, payload.get("crash")
        assert payload["num_processes"] == NPROC, f"{name}, rank {r}: {payload['num_processes']} processes"
        if launch.startswith("zero"):
            assert payload["distributed_type"].endswith("DEEPSPEED") and payload["zero_stage"] == int(launch[-1])
            if launch == "zero3":
                assert payload["zero3_partitioned"], f"{name}: ZeRO-3 left a parameter whole on rank {r}"
        elif launch == "fsdp2":
            assert payload["distributed_type"].endswith("FSDP") and payload["param_types"] == ["DTensor"]
        else:
            assert payload["distributed_type"].endswith("MULTI_CPU")
        assert payload["global_step"] == STEPS
    return ranks


@pytest.mark.parametrize(("launch", "name", "reduced"), PARAMS, ids=[p[1] for p in PARAMS])
def test_the_two_norms_are_the_mean_gradients_of_the_right_samples(launch, name, reduced):
    for r, payload in enumerate(_ranks(launch, name)):
        assert payload["disabled_reason"] is None and payload["warnings"] == [], payload
        assert len(payload["checked"]) == 3
        for k, step in enumerate(payload["checked"]):
            where = f"{name}, rank {r}, step {k + 1}: {step}"
            assert step["reduced"] is reduced, where
            # the small batch: 4 samples of this rank, or 8 = both ranks' first micro-batch when reduced
            assert step["small_batch"] == step["small_rows"] == (8 if reduced else 4), where
            assert step["big_batch"] == step["big_rows"] == 32, where
            assert step["small_rel"] <= EXACT, where
            assert step["big_rel"] <= EXACT, where


@pytest.mark.parametrize(("launch", "name", "reduced"), PARAMS, ids=[p[1] for p in PARAMS])
def test_the_estimate_is_within_20_percent_of_the_known_noise_scale(launch, name, reduced):
    ranks = _ranks(launch, name)
    for r, payload in enumerate(ranks):
        truth = payload["truth"]["noise_scale"]
        where = (
            f"{name}, rank {r}: run {payload['run_estimate']:.3f}, ema {payload['ema_noise_scale']:.3f}, truth {truth}"
        )
        assert payload["num_estimates"] == STEPS, where
        assert abs(payload["run_estimate"] / truth - 1) <= RUN_ESTIMATE_TOLERANCE, where
        assert abs(payload["ema_noise_scale"] / truth - 1) <= ESTIMATE_TOLERANCE, where
        # the components too: |G|^2 and tr(S) are each unbiased
        assert abs(payload["mean_grad_sq"] / payload["truth"]["grad_sq"] - 1) <= ESTIMATE_TOLERANCE, where
        assert abs(payload["mean_trace"] / payload["truth"]["trace"] - 1) <= ESTIMATE_TOLERANCE, where
        logged = payload["logged"]
        assert len(logged) == STEPS // LOGGING_STEPS, where
        assert logged[-1]["gns"] == pytest.approx(payload["ema_noise_scale"], rel=1e-12), where
        assert {"gns", "gns/grad_sq", "gns/trace", "gns/batch_size"} <= set(logged[-1]), where
        assert logged[-1]["gns/batch_size"] == 32, where
    assert ranks[0]["logged"] == ranks[1]["logged"], f"{name}: the ranks logged different values"
