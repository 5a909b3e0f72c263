"""`hf-gradacc check --trainer grpo` on 2 CPU processes (gloo, ``examples/accelerate_configs/ddp_cpu.yaml``): GRPO
loss types of both families on one launch, TRL's GRPOTrainer and GradAccGRPOTrainer, each step against the float64
full-batch step over the completions of BOTH processes (``hf_gradacc/testing/grpo_reference.py``).

Each process: batch 2 x GA 4, ``steps_per_generation`` 8, ``num_iterations`` 2, two SGD(lr=1) steps (step 2 trains
on step 1's policy's completions), 16 completions per step over the two processes. Measured (TRL 1.16): hf_gradacc
6.1e-7 (``dapo``, ``bnpo``), 7.1e-7 (``grpo``), worst step; stock TRL ``dapo`` 0.26 (the generation batch's tokens
rescaled to one step), ``bnpo`` 0.39 (per micro-batch of one process; exact, 6.0e-7, against that definition),
``grpo`` exact; 9 % (dapo) to 29 % (grpo) of step 2's tokens outside the clip range. The single-process rows of all
eight loss types: tests/unit/test_grpo_loss_types.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import run_accelerate

pytestmark = pytest.mark.distributed
pytest.importorskip("trl")

TOLERANCE = 1e-5
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "examples" / "accelerate_configs" / "ddp_cpu.yaml"
TIMEOUT_S = 420
# tokens normalised by the generation batch (dapo), per micro-batch (bnpo); sequences (grpo)
LOSS_TYPES = ("dapo", "bnpo", "grpo")
STOCK_EXACT = ("grpo",)


def test_check_trainer_grpo_on_two_cpu_processes(tmp_path) -> None:
    report = tmp_path / "grpo.json"
    launch = run_accelerate(
        CONFIG, "hf_gradacc", ["check", "--trainer", "grpo", "--loss-type", *LOSS_TYPES, "--json", str(report)],
        module=True, timeout=TIMEOUT_S, out_dir=tmp_path / "launch", cwd=tmp_path, check=False,
    )  # fmt: skip
    assert launch.returncode == 0, launch.stdout[-4000:] + launch.stderr[-4000:]
    print(launch.stdout)
    assert launch.stdout.count("GradAccGRPOTrainer is exact on all 3 loss types") == 1, launch.stdout  # main only
    data = json.loads(report.read_text())
    assert data["setup"]["world_size"] == 2 and data["setup"]["num_samples"] == 16  # completions of both processes
    assert "MULTI_CPU, 2 processes" in data["setup"]["backend"]
    assert list(data["loss_types"]) == list(LOSS_TYPES)
    for loss_type, row in data["loss_types"].items():
        ours = row["relative_error_per_step"]["GradAccGRPOTrainer"]
        stock = row["relative_error_per_step"]["GRPOTrainer"]
        assert len(ours) == 2 and max(ours) <= TOLERANCE, (loss_type, row)
        assert row["clipped_token_fraction"] > 0.05, (loss_type, row)  # step 2 off-policy (9 % at least here)
        if loss_type in STOCK_EXACT:
            assert max(stock) <= TOLERANCE, (loss_type, row)
        else:
            assert min(stock) > 1e-2, (loss_type, row)
    # bnpo taken literally (per micro-batch of one process): stock TRL follows that definition on 2 ranks too.
    assert data["loss_types"]["bnpo"]["stock_vs_per_micro_batch_definition"] <= TOLERANCE
