"""Every example runs for a couple of optimizer steps on the tiny model (single process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_train_tiny_example_runs(tmp_path: Path, task: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_tiny.py"),
        "--output_dir",
        str(tmp_path),
        "--task",
        task,
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--report_to",
        "none",
        "--use_cpu",
        "true",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 2 steps" in out.stdout


def test_vae_example_runs_in_process_with_two_logged_terms(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vae_example", ROOT / "examples" / "vae_adaptive_loss.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vae_example"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    summary = module.main(
        [
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "4",
            "--report_to",
            "none",
            "--use_cpu",
            "true",
            "--save_strategy",
            "no",
            "--logging_steps",
            "1",
            "--disable_tqdm",
            "true",
        ]
    )
    assert summary["steps"] == 3
    assert summary["loss"] == pytest.approx(summary["loss/reconstruction"] + summary["loss/adversarial"], rel=1e-5)
    # GradNormCallback reads the gradient before clipping: its global norm is the logged (pre-clip) grad_norm.
    assert summary["grad_norm/global"] == pytest.approx(summary["grad_norm"], rel=1e-4)
