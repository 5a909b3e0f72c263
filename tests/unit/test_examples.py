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
        "--output_dir", str(tmp_path),
        "--task", task,
        "--max_steps", "2",
        "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "4",
        "--report_to", "none",
        "--use_cpu", "true",
        "--save_strategy", "no",
        "--disable_tqdm", "true",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 2 steps" in out.stdout
