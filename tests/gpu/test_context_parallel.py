"""GPU tier: context parallelism end to end (torch ``context_parallel`` through accelerate's ``cp_size``), 2 GPUs.

``accelerate launch --config_file examples/accelerate_configs/cp_fsdp2.yaml`` (cp 2 x FSDP2, 2 processes) runs
tests/distributed/workers/context_parallel_cases.py: a tiny Llama (SDPA), mixed lengths, heavy padding, masked
prompts, one SGD(lr=1) step of GA 4, compared with the float64 full batch (hf_gradacc/testing/reference.py).

torch 2.13 cannot shard attention on CPU ("aten._scaled_dot_product_flash_attention_for_cpu ... does not have a
sharding strategy registered"): on CPU the same step is simulated in one process (tests/unit/test_context_parallel.py).
Skipped without 2 CUDA devices (a lent machine with ONE GPU cannot hold a context-parallel group: the skip says so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import find_free_port

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NUM_GPUS < 2,
        reason=f"GPU tier: context parallelism (cp 2) needs 2 CUDA devices, found {NUM_GPUS}; the CPU simulation is "
        "tests/unit/test_context_parallel.py",
    ),
]

TOLERANCE = 1e-5  # float32, TF32 off
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "accelerate_configs" / "cp_fsdp2.yaml"
WORKER = REPO / "tests" / "distributed" / "workers" / "context_parallel_cases.py"


def _launch(trainer: str) -> dict:
    out = tempfile.mkdtemp(prefix="cp_")
    env = {**os.environ, "HF_GRADACC_TEST_OUT": out, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--main_process_port", str(find_free_port()), str(WORKER), "--trainer", trainer]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((Path(out) / f"{trainer}.rank0.json").read_text())


def test_gradacc_context_parallel_step_is_the_full_batch_step():
    """cp 2 x FSDP2: each rank counts its chunks' targets, the loss is scaled by the 2 ranks FSDP2 averages over;
    the update equals the float64 full-batch gradient, every parameter moved; ``eval_loss`` after the step is the
    float64 one of the unsharded batches."""
    result = _launch("gradacc")
    assert result["cp_size"] == 2, result
    assert result["update"]["relative_error"] <= TOLERANCE, result
    assert result["num_updated"] == result["num_parameters"], result
    # evaluation after the step: eval_loss of the batches cut over both ranks is the unsharded float64 one
    assert abs(result["eval_loss"] / result["eval_reference"] - 1) <= TOLERANCE, result
    print("gradacc context parallel:", result["update"], result["eval_loss"], result["device"], result["versions"])


def test_stock_trainer_on_context_parallelism():
    """Recorded, not a goal: the stock Trainer's update on the same run against the float64 full batch."""
    result = _launch("stock")
    assert result["cp_size"] == 2 and result["num_updated"] > 0
    print("stock context parallel:", result["update"], result["device"], result["versions"])


def test_hf_gradacc_check_on_context_parallelism():
    """`accelerate launch --config_file cp_fsdp2.yaml -m hf_gradacc check` with torch's own ring attention: the header
    names the mesh and 1 data rank (of 2 processes), both causal LM rows exact for GradAccTrainer (the stock Trainer's
    numbers printed beside them), every other head a row refusing it under context parallelism."""
    report = Path(tempfile.mkdtemp(prefix="cp_check_")) / "check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--main_process_port", str(find_free_port()), "-m", "hf_gradacc", "check", "--json", str(report)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    payload = json.loads(report.read_text())
    assert payload["setup"]["mesh"].startswith("CP 2") and payload["setup"]["data_ranks"] == 1, payload["setup"]
    assert "x 1 data rank (of 2 processes)" in done.stdout, done.stdout
    heads = payload["heads"]
    for key in ("causal_lm", "causal_lm_no_loss_kwargs"):
        assert heads[key]["results"]["GradAccTrainer"]["relative_error"] <= TOLERANCE, heads[key]
        assert heads[key]["results"]["Trainer"]["relative_error"] >= 0, heads[key]
    refused = {k: h["skipped"] for k, h in heads.items() if not k.startswith("causal_lm")}
    assert refused and all("under context parallelism" in why for why in refused.values()), refused
    print("hf-gradacc check, context parallel:", {k: heads[k]["results"] for k in ("causal_lm", "causal_lm_no_loss_kwargs")})
