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


def _load_example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_sft_lora_example_step_is_the_float64_full_batch_step(tmp_path: Path, monkeypatch) -> None:
    """examples/sft_lora.py, unchanged, on a tiny checkpoint loaded from a temp dir: 7 prompt-completion rows at batch
    2 x GA 4 (micro-batches of 2 + 2 + 2 + 1), one SGD(lr=1) step. The LoRA update is minus the float64 gradient of the
    mean over ALL completion tokens (relative error <= 1e-5), and the logged grad_norm is its norm."""
    import torch
    from transformers import AutoModelForCausalLM

    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from hf_gradacc.testing.reference import compare
    from hf_gradacc.testing.trl_steps import save_tiny_checkpoint, sft_reference

    module = _load_example("sft_lora")
    texts = [row["prompt"] + " " + row["completion"] for row in module.TOY_DATA]
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", texts)
    captured: dict = {}
    build_trainer = module.build_trainer

    def capturing(argv):
        trainer = build_trainer(argv)
        # the values only: a copy of TRL's model would run the original's forward (TRL patches it with a closure)
        captured["trainer"] = trainer
        captured["initial"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer

    monkeypatch.setattr(module, "build_trainer", capturing)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    summary = module.main([
        "--model_name_or_path", str(checkpoint), "--output_dir", str(tmp_path / "run"), "--max_train_samples", "7",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4", "--max_steps", "1",
        "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--optim", "sgd", "--learning_rate", "1",
        "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--use_cpu", "true", "--bf16", "false",
        "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
    ])  # fmt: skip
    trainer, values = captured["trainer"], captured["initial"]
    assert summary["steps"] == 1 and (tmp_path / "run" / "adapter_model.safetensors").is_file()
    # TRL's tokenized rows: its labels are the completion tokens (prompt positions -100)
    rows = [{"input_ids": r["input_ids"], "completion_mask": [int(label != -100) for label in r["labels"]]}
            for r in trainer.train_dataset]  # fmt: skip
    assert len(rows) == 7 and all(r["input_ids"][-1] == 1 for r in rows)  # TRL appended </s> to every completion
    assert all(2 not in r["input_ids"] for r in rows)  # no <unk>: the tokenizer covers the data
    assert all(0 < sum(r["completion_mask"]) < len(r["input_ids"]) for r in rows)  # prompts are not trained on
    update = {n: values[n] - p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert update and all("lora_" in n for n in update)  # only the adapter trains
    # the initial model, rebuilt apart from TRL: the checkpoint, the same adapter, its initial values
    initial = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), trainer.model.peft_config["default"])
    initial.load_state_dict(values)
    reference = sft_reference(initial, rows)
    assert compare(update, reference.grads).relative_error <= 1e-5
    assert summary["grad_norm"] == pytest.approx(reference.norm, rel=1e-5)
    assert summary["loss"] == pytest.approx(reference.loss, rel=1e-5)
    # LoRA starts with B = 0, so A's gradient is exactly 0 in the first step and every B moves
    assert all(float(u.abs().max()) == 0 for n, u in update.items() if "lora_A" in n)
    assert all(float(u.abs().max()) > 0 for n, u in update.items() if "lora_B" in n)
    assert torch.isfinite(torch.tensor(summary["loss"]))


def test_fused_lm_head_example_gives_the_full_logits_update_on_counted_rows_only(tmp_path: Path) -> None:
    import torch

    module = _load_example("fused_lm_head")
    runs = {}
    for fused in ("true", "false"):
        runs[fused] = module.main(
            ["--output_dir", str(tmp_path / fused), "--fused_lm_head", fused, "--max_steps", "2",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--vocab_size", "4000",
             "--num_samples", "16", "--optim", "sgd", "--learning_rate", "1.0", "--max_grad_norm", "0",
             "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]
        )  # fmt: skip
    fused, full = runs["true"], runs["false"]
    assert fused["global_step"] == full["global_step"] == 2
    # half of each document is prompt, plus the padding: the full logits project more than two rows per target
    assert full["head_rows_per_target"] > 2.0 and fused["head_rows_per_target"] == pytest.approx(1.0)
    assert fused["train_loss"] == pytest.approx(full["train_loss"], rel=1e-6)
    # GA 2 x 2 steps: micro-batch 2 of each window adds into .grad; window 2's first reuses window 1's buffer
    assert (fused["into_grad_writes"], fused["kept_buffer_reused"]) == (2, 1), fused
    assert (full["into_grad_writes"], full["kept_buffer_reused"]) == (0, 0), full
    initial = module.build_model(module.ScriptArguments(vocab_size=4000), seed=42)
    start = torch.cat([p.detach().reshape(-1) for p in initial.parameters()])
    update_fused, update_full = fused["parameters"] - start, full["parameters"] - start
    assert float(update_full.norm()) > 0
    assert float((update_fused - update_full).norm() / update_full.norm()) <= 1e-5


def _train_tiny(output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--output_dir", str(output_dir),
           "--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size", "2",
           "--gradient_accumulation_steps", "4", "--learning_rate", "0.01", "--report_to", "none", "--use_cpu", "true",
           "--disable_tqdm", "true", *extra]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_train_tiny_resumes_from_its_resume_from_checkpoint_flag(tmp_path: Path) -> None:
    """`--resume_from_checkpoint` reaches `trainer.train` (as run_clm.py passes it; the Trainer itself never reads the
    field): resumed from checkpoint-2, the run trains steps 3 and 4 only and ends on the uninterrupted run's weights."""
    from safetensors.torch import load_file

    from hf_gradacc.testing.tiny import build_tiny_model

    _train_tiny(tmp_path / "a")
    out = _train_tiny(tmp_path / "b", "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2"))
    assert "training starts from the beginning" not in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "b" / "checkpoint-2").exists()  # steps 1 and 2 were not trained again
    a = load_file(str(tmp_path / "a" / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint-4" / "model.safetensors"))
    start = build_tiny_model("causal_lm").state_dict()
    num = sum(float((b[n] - a[n]).pow(2).sum()) for n in a)
    den = sum(float((a[n] - start[n]).pow(2).sum()) for n in a)
    assert den > 0 and (num / den) ** 0.5 <= 1e-5, (num / den) ** 0.5
