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
# bf16 autocast rounds every matmul input to 8 mantissa bits (unit roundoff 3.9e-3): the update cannot match the
# float64 reference to float32 rounding. The bands are tests/distributed/test_bf16.py's (measured there on CPU ranks):
# relative error 3e-2 (~8 rounding units), and the norm ratio within 5e-3 of 1, which is what catches a count error:
# rounding errors point every way and cancel in the norm (measured |ratio - 1| <= 1.3e-3), while a denominator 1 %
# off scales the WHOLE update by 0.99 with cosine 1.0, inside any relative band.
BF16_TOL = 3e-2
BF16_NORM_RATIO_TOL = 5e-3
BF16_MIN_COSINE = 0.999


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
    assert result.cosine >= BF16_MIN_COSINE
    assert abs(result.norm_ratio - 1.0) <= BF16_NORM_RATIO_TOL, result
    # The same run in float32 (TF32 off) is exact; the bf16 run's norm must agree with it as tightly.
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32_update, _ = one_step_update(GradAccTrainer, model, samples, _args())
    fp32 = compare_with_reference(fp32_update, model, samples, task)
    assert fp32.relative_error <= FP32_TOL
    assert abs(result.norm_ratio - fp32.norm_ratio) <= BF16_NORM_RATIO_TOL, (result, fp32)
