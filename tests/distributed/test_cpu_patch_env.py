"""A tensor-parallel script on CPU ranks with ``HF_GRADACC_CPU_DISTRIBUTED=1`` alone, as users run it: the shipped
``ddp_cpu.yaml`` (MULTI_GPU launched, MULTI_CPU on a host without CUDA) and a tiny Llama loaded with
``DistributedConfig(tp_size=2)``, whose ``ParallelismConfig(tp_size=2)`` the Trainer builds itself. accelerate 1.15
refuses that mesh on MULTI_CPU with a raw ValueError ("ParallelismConfig is only compatible ..."); the variable turns
on ``hf_gradacc.patches.parallelism_cpu`` with the rest of the CPU patch set when GradAccTrainer is created, and the
step is exact (relative error <= 1e-5 against the float64 full batch). The unit side: tests/unit/test_cpu_patch_set.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import run_accelerate

pytestmark = [pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "mesh_sharded_cases.py"
TOLERANCE = 1e-5
CASES = [{"name": "causal_lm-tp-env", "model": "llama", "sizes": {"tp_size": 2}}]


def test_a_tensor_parallel_script_trains_under_ddp_cpu_yaml_with_the_variable_alone():
    result = run_accelerate(
        REPO / "examples" / "accelerate_configs" / "ddp_cpu.yaml",
        WORKER,
        ["--cases", json.dumps(CASES), "--patch-from-env"],
        cpu_distributed=True,
        nproc=2,
        timeout=600,
        check=False,  # a rank that crashed reports its traceback in its result: shown below
    )
    ranks = result.load("causal_lm-tp-env")
    for payload in ranks:
        assert "crash" not in payload, payload["crash"][-3000:]
        assert payload["parallelism_patch_on_when_built"] is True  # by the variable: the worker left it off
        assert payload["backend"] == "TP 2, 2 processes, gloo" and payload["dp_world_size"] == 1, payload
        assert payload["update"]["relative_error"] <= TOLERANCE, payload["update"]
        assert payload["unchanged"] == []
