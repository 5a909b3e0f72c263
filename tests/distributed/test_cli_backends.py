"""`hf-gradacc check` under `accelerate launch` with every CPU config of ``examples/accelerate_configs``.

One launch per config, as users run it (``ddp_cpu.yaml`` is covered by ``test_cli_distributed.py``):

    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \\
        -m hf_gradacc check --task sequence_classification

The ZeRO configs check sequence classification, where the stock Trainer is 8x off on 2 ranks (4 micro-batch means
added up x 2 ranks averaged) and GradAccTrainer is exact. The FSDP2 config checks the tiny Llama: accelerate's
default FSDP2 wrapping cannot shard the tiny BERT (see `fsdp2_wrap_problems`), and the point here is that both
trainers run and are measured under FSDP2. Exact: relative gradient error <= 1e-5 against the float64 full-batch
reference over the 16 samples of both ranks. GPUs are hidden so the ranks stay on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import AccelerateResult, run_accelerate

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "examples" / "accelerate_configs"
# The first DeepSpeed launch on a machine builds DeepSpeed's shm op (about 100 s, then cached).
TIMEOUT_S = 300


def _accelerate_launch(config: Path, check_args: list[str], cwd: Path) -> AccelerateResult:
    """``accelerate launch --config_file config -m hf_gradacc check *check_args`` on its 2 CPU ranks."""
    return run_accelerate(
        config,
        "hf_gradacc",
        ["check", *check_args],
        module=True,
        cpu_distributed=True,
        timeout=TIMEOUT_S,
        out_dir=cwd / "launch",
        cwd=cwd,
        check=False,
    )


@pytest.mark.parametrize(
    ("config", "task", "backend"),
    [
        ("zero1_cpu.yaml", "sequence_classification", "DeepSpeed ZeRO-1"),
        ("zero2_cpu.yaml", "sequence_classification", "DeepSpeed ZeRO-2"),
        ("zero3_cpu.yaml", "sequence_classification", "DeepSpeed ZeRO-3"),
        ("fsdp2_cpu.yaml", "causal_lm", "FSDP2"),
    ],
)
def test_check_exits_0_under_each_cpu_config(tmp_path, config, task, backend):
    if backend.startswith("DeepSpeed"):
        pytest.importorskip("deepspeed")
    report = tmp_path / "check.json"
    proc = _accelerate_launch(CONFIGS / config, ["--task", task, "--json", str(report)], cwd=tmp_path)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output

    # Only the main process prints; the verdict is the last line.
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-1].startswith("hf-gradacc check: GradAccTrainer is exact"), output
    assert proc.stdout.count("hf-gradacc check: GradAccTrainer is exact") == 1, output

    data = json.loads(report.read_text())
    setup = data["setup"]
    assert setup["world_size"] == 2 and setup["num_samples"] == 16, setup
    assert setup["backend"] == f"{backend}, 2 processes, gloo", setup
    ours, stock = data["results"]["GradAccTrainer"], data["results"]["Trainer"]
    assert ours["relative_error"] <= TOLERANCE and ours["is_exact"] is True and data["is_exact"] is True
    if task == "sequence_classification":
        # GA 4 micro-batch means added up, then averaged over 2 ranks: 8 times the full-batch step
        assert stock["is_exact"] is False and stock["norm_ratio"] == pytest.approx(8.0, rel=1e-3), stock
    else:
        # the tiny Llama consumes num_items_in_batch: the stock Trainer is exact too, and was measured under FSDP2
        assert stock["relative_error"] <= TOLERANCE, stock


def test_check_names_the_fsdp2_wrap_setting_for_bert(tmp_path):
    """The tiny BERT under the stock FSDP2 config: GradAccTrainer's preflight error, not torch's deep failure."""
    proc = _accelerate_launch(CONFIGS / "fsdp2_cpu.yaml", ["--task", "sequence_classification"], cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert proc.stderr.count("hf-gradacc check: error: BertForSequenceClassification cannot be wrapped") == 1
    assert "fsdp_transformer_layer_cls_to_wrap: BertLayer" in proc.stderr, proc.stderr[-4000:]
    assert "TypeError: Invariant encountered" not in proc.stderr, proc.stderr[-4000:]  # torch's own failure
