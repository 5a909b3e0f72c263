"""GPU tier: the exactness checks on CUDA (skipped on machines without a GPU; run them whenever one is there)."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import build_tiny_model, make_samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs a CUDA device"),
]

FP32_TOL = 1e-5
# bf16 autocast rounds every matmul input to 8 mantissa bits: the update stays within a few percent of the float64
# reference, and the stock Trainer's GA-sized errors (>= 300 %) remain far outside this band.
BF16_TOL = 5e-2


def _args(**overrides):
    return one_step_args(
        per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig, **overrides
    )


@pytest.mark.parametrize(
    "task", ["causal_lm", "seq2seq", "masked_lm", "token_classification", "sequence_classification"]
)
def test_gpu_fp32_exact(task):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    samples = make_samples(task, 8, seed=11)
    model = build_tiny_model(task)
    update, trainer = one_step_update(GradAccTrainer, model, samples, _args())
    assert trainer.args.device.type == "cuda"
    assert compare_with_reference(update, model, samples, task).relative_error <= FP32_TOL


def test_gpu_stock_classification_is_wrong():
    samples = make_samples("sequence_classification", 8, seed=11)
    model = build_tiny_model("sequence_classification")
    update, _ = one_step_update(Trainer, model, samples, _args())
    result = compare_with_reference(update, model, samples, "sequence_classification")
    assert result.norm_ratio == pytest.approx(4.0, rel=1e-3)


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_gpu_bf16_within_bf16_tolerance(task):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    samples = make_samples(task, 8, seed=11)
    model = build_tiny_model(task)
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(bf16=True))
    result = compare_with_reference(update, model, samples, task)
    assert result.relative_error <= BF16_TOL
    assert result.cosine >= 0.999
