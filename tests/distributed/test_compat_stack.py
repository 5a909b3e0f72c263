"""The 2-rank part of the compatibility subset (``-m compat``): one small launch per backend, so that the oldest stacks
CI installs (axolotl 0.19's pins, LLaMA-Factory 0.9.5's ceiling) run DDP, FSDP2 and DeepSpeed ZeRO-2 in a few
minutes. The full files (test_ddp.py, test_fsdp2.py, test_deepspeed.py) run the same workers with every case on
the newest stack; these reuse their workers and assertions unchanged: the SGD(lr=1) update of one optimizer step
(per-device batch 2 x GA 4 x 2 ranks, mixed lengths, ignored targets) within relative error 1e-5 of the float64
full-batch gradient over both ranks' samples.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launcher import run_workers
from tests.distributed.test_ddp import WORKER as DDP_WORKER
from tests.distributed.test_ddp import assert_exact, load_case
from tests.distributed.test_fsdp2 import CASES as FSDP2_CASES
from tests.distributed.test_fsdp2 import WORKER as FSDP2_WORKER
from tests.distributed.test_fsdp2 import _assert_exact

pytestmark = [pytest.mark.distributed, pytest.mark.compat]


DDP_TASKS = ("sequence_classification", "causal_lm")
ZERO2_TASKS = ("causal_lm", "sequence_classification")


@pytest.fixture(scope="module")
def ddp_launch(tmp_path_factory):
    cases = ",".join(f"exact_{task}" for task in DDP_TASKS)
    return run_workers(
        DDP_WORKER, nproc=2, args=["--cases", cases], timeout=300, out_dir=tmp_path_factory.mktemp("ddp"), check=False
    )


@pytest.fixture(scope="module")
def zero2_results():
    pytest.importorskip("deepspeed")
    from tests.distributed.test_deepspeed import CONFIGS, launch_accelerate

    # the default reduction: `per_window` needs DeepSpeed's coalesce_grad_reduction, absent from 0.18.6 (refused)
    cases = [{"name": f"{task}-per_micro_batch", "task": task} for task in ZERO2_TASKS]
    return launch_accelerate(CONFIGS / "zero2_cpu.yaml", cases)


@pytest.mark.parametrize("task", DDP_TASKS)
def test_ddp_step_equals_full_batch_step(ddp_launch, task):
    for r, payload in enumerate(load_case(ddp_launch, f"exact_{task}")):
        assert_exact(payload["gradacc"], f"DDP {task}, rank {r}")


def test_fsdp2_step_equals_full_batch_step():
    cases = [c for c in FSDP2_CASES if c["name"] == "causal_lm-deferred"]
    launch = run_workers(FSDP2_WORKER, nproc=2, args=["--cases", json.dumps(cases)], timeout=300)
    rank0, rank1 = launch.load("causal_lm-deferred")
    assert rank0["distributed_type"].endswith("FSDP") and rank0["param_types"] == ["DTensor"]
    _assert_exact(rank0["update"], "FSDP2 SGD(lr=1) update")
    assert rank0["unchanged"] == [] and rank0["missing"] == []
    assert rank1["grads_norm"] == pytest.approx(rank0["grads_norm"], rel=1e-12)


@pytest.mark.parametrize("task", ZERO2_TASKS)
def test_zero2_step_equals_full_batch_step(zero2_results, task):
    from tests.distributed.test_deepspeed import TOLERANCE

    rank0, rank1 = zero2_results[f"{task}-per_micro_batch"]
    assert rank0["zero_stage"] == 2 and rank0["distributed_type"] == "DistributedType.DEEPSPEED"
    assert rank0["global_step"] == 1 and rank0["engine_global_steps"] == 1
    assert rank0["relative_error"] <= TOLERANCE, rank0
    assert rank0["num_unchanged"] == 0
    assert rank1["relative_error"] == pytest.approx(rank0["relative_error"], rel=1e-6, abs=1e-12)
