"""`hf-gradacc check` under `accelerate launch` on 2 CPU processes (gloo), as users run it.

One launch of ``examples/accelerate_configs/ddp_cpu.yaml`` checks the one-step comparison AND the --plot runs:
the step covers batch 2 x GA 4 x 2 processes = 16 samples, the reference uses all of them, only the main process
prints and writes files, and every process exits 0. GPUs are hidden so the processes stay on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import run_accelerate

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "examples" / "accelerate_configs" / "ddp_cpu.yaml"
TIMEOUT_S = 420


def test_check_and_plot_on_two_cpu_processes(tmp_path):
    report, image = tmp_path / "check.json", tmp_path / "curves.png"
    proc = run_accelerate(
        CONFIG,
        "hf_gradacc",
        [
            "check",
            "--task", "sequence_classification",
            "--json", str(report),
            "--plot", str(image),
            "--steps", "2",
            "--optimizer", "sgd",
            "--learning_rate", "0.1",
        ],
        module=True,
        timeout=TIMEOUT_S,
        out_dir=tmp_path / "launch",
        cwd=tmp_path,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    # Only the main process prints the report.
    assert proc.stdout.count("hf-gradacc check: GradAccTrainer is exact") == 1, proc.stdout
    assert "x 2 processes = 16 samples per step" in proc.stdout
    assert "MULTI_CPU, 2 processes, gloo" in proc.stdout

    data = json.loads(report.read_text())
    assert data["setup"]["world_size"] == 2 and data["setup"]["num_samples"] == 16
    ours, stock = data["results"]["GradAccTrainer"], data["results"]["Trainer"]
    assert ours["relative_error"] <= TOLERANCE and ours["is_exact"] is True
    # The stock step on 2 ranks: GA 4 x 2 ranks = 8 times the full-batch step.
    assert stock["is_exact"] is False and abs(stock["norm_ratio"] - 8.0) < 1e-3

    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = data["loss_curves"]
    truth = curves["one full batch per step (ground truth)"]["loss"]
    assert len(truth) == 2
    assert max(abs(a - b) for a, b in zip(curves["GradAccTrainer, GA 4"]["loss"], truth)) < 1e-5
    # With SGD the 8x step shows in the loss after the first step.
    assert abs(curves["stock Trainer, GA 4"]["loss"][1] - truth[1]) > 1e-4
