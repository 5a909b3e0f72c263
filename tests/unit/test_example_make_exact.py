"""examples/make_exact.py, unchanged: the framework's trainer made exact equals the float64 full-batch step; without
make_exact (the stock step, same data) it does not.

16 synthetic documents (long-tailed lengths, an ignored prompt on each: mixed lengths, heavy padding, ignored targets)
at batch 2 x GA 8, one SGD(lr=1) step: the update is minus the accumulated gradient (relative error <= 1e-5), the
logged loss the step's mean over all target tokens.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hf_gradacc.testing.reference import compare, float64_copy, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import PaddingCollator

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5


def _load_example():
    spec = importlib.util.spec_from_file_location("make_exact_example", ROOT / "examples" / "make_exact.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _one_step(tmp_path: Path, monkeypatch, *extra: str):
    module = _load_example()
    captured: dict = {}
    build = module.build_framework_trainer

    def capturing(model, args, train_dataset):
        import copy

        captured["model"] = copy.deepcopy(model)  # the initial weights, before the step
        captured["trainer"] = trainer = build(model, args, train_dataset)
        return trainer

    monkeypatch.setattr(module, "build_framework_trainer", capturing)
    summary = module.main([
        "--output_dir", str(tmp_path), "--num_samples", "16", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "8", "--max_steps", "1", "--optim", "sgd", "--learning_rate", "1",
        "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0", "--use_cpu", "true",
        "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true", *extra,
    ])  # fmt: skip
    initial, trainer = captured["model"], captured["trainer"]
    update = {n: p0.detach() - p.detach() for (n, p0), p in zip(initial.named_parameters(), trainer.model.parameters())}
    samples = [dict(row) for row in trainer.train_dataset]
    assert len(samples) == 16
    return summary, update, initial, samples


def test_made_exact_framework_trainer_is_the_full_batch_step(tmp_path: Path, monkeypatch) -> None:
    summary, update, initial, samples = _one_step(tmp_path, monkeypatch)
    assert summary["steps"] == 1 and summary["trainer"] == "GradAccFrameworkTrainer"
    reference = reference_gradients(initial, samples, "causal_lm", PaddingCollator())
    assert compare(update, reference).relative_error <= TOLERANCE
    assert all(float(u.abs().max()) > 0 for n, u in update.items() if n in reference)
    full_mean = full_batch_loss(float64_copy(initial), PaddingCollator()(samples), "causal_lm").item()
    assert summary["loss"] == pytest.approx(full_mean, rel=TOLERANCE)


def test_the_same_trainer_without_make_exact_is_off(tmp_path: Path, monkeypatch) -> None:
    summary, update, initial, samples = _one_step(tmp_path, monkeypatch, "--make_exact", "false")
    assert summary["trainer"] == "FrameworkTrainer"
    reference = reference_gradients(initial, samples, "causal_lm", PaddingCollator())
    assert compare(update, reference).relative_error > 1.0  # the sum of 8 micro-batch means
