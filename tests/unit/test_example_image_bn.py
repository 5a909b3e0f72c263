"""examples/image_classification_bn.py: a tiny ResNet with ``--batchnorm precise``, its numbers checked independently.

After training, the running statistics are those of the callback's precise batches (a direct computation from the
layers' inputs), and the example's reported eval loss and accuracy are those of a float64 eval-mode forward pass of
the final model over the evaluation images (one evaluation batch).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hf_gradacc.callbacks import BatchNormCallback
from hf_gradacc.callbacks.batchnorm import batchnorm_layers
from hf_gradacc.testing.reference import batchnorm_statistics
from hf_gradacc.testing.tiny import ImageCollator, make_image_samples

ROOT = Path(__file__).resolve().parents[2]
NUM_EVAL = 16


def _example():
    path = ROOT / "examples" / "image_classification_bn.py"
    spec = importlib.util.spec_from_file_location("image_classification_bn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["image_classification_bn"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_precise_batchnorm_example_numbers(tmp_path: Path) -> None:
    summary, trainer = _example().train(
        [
            "--output_dir", str(tmp_path), "--batchnorm", "precise", "--precise_bn_batches", "4",
            "--max_steps", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
            "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", str(NUM_EVAL),
            "--num_samples", "64", "--num_eval_samples", str(NUM_EVAL), "--learning_rate", "0.05",
            "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--logging_steps", "1",
            "--disable_tqdm", "true",
        ]
    )  # fmt: skip
    assert summary["steps"] == 4
    assert summary["batchnorm_recomputed"] == 2 + 1  # before the evaluations at steps 2 and 4, at the end
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # one epoch of 64 images in 4 steps: every counted image (label not -100) in exactly one step
    counted_images = sum(s["labels"] != -100 for s in make_image_samples(64, seed=trainer.args.seed))
    assert sum(h["effective_batch_size"] for h in logs) == counted_images == 55

    (callback,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, BatchNormCallback)]
    model = trainer.model
    direct = batchnorm_statistics(model, list(callback.precise_batches(trainer.state)))
    for name, layer in batchnorm_layers(model):
        torch.testing.assert_close(layer.running_mean, direct[name][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.running_var, direct[name][1], rtol=1e-5, atol=1e-6)

    batch = ImageCollator()(make_image_samples(NUM_EVAL, seed=trainer.args.seed + 1))
    ref = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = ref(pixel_values=batch["pixel_values"].double()).logits
    counted = batch["labels"] != -100
    loss = torch.nn.functional.cross_entropy(logits[counted], batch["labels"][counted])
    accuracy = (logits.argmax(-1)[counted] == batch["labels"][counted]).double().mean()
    assert summary["eval_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert summary["eval_accuracy"] == pytest.approx(float(accuracy), abs=1e-12)
