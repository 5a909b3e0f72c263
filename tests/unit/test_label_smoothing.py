"""`label_smoothing_factor` on every head whose loss is a cross-entropy: one SGD(lr=1) step of batch 2 x GA 4 (mixed
lengths, heavy padding) equals the float64 gradient of the full batch's SMOOTHED mean loss, written out by hand:
per counted item ``(1 - eps) * nll + eps * mean over classes of -log p``, averaged over every counted item of the
step (the stock Trainer's `LabelSmoother`, and what `torch.nn.functional.cross_entropy(label_smoothing=eps)` means)."""

from __future__ import annotations

import pytest
import torch

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, float64_copy
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
EPS = 0.2
BS, GA = 2, 4
IGNORE = -100
HEADS = ("causal_lm", "seq2seq", "masked_lm", "token_classification", "sequence_classification")


def _smoothed_reference(model: torch.nn.Module, samples: list[dict], task: str) -> dict[str, torch.Tensor]:
    ref = float64_copy(model)
    batch = PaddingCollator()(samples)
    labels = batch.pop("labels")
    if task == "seq2seq":  # decoder inputs: the labels shifted right behind the start token, pads for ignored ids
        decoder = torch.full_like(labels, ref.config.decoder_start_token_id)
        decoder[:, 1:] = labels[:, :-1]
        batch["decoder_input_ids"] = decoder.masked_fill(decoder == IGNORE, ref.config.pad_token_id)
    logits = ref(**batch).logits.double()
    if task == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    counted = labels != IGNORE
    log_p = torch.log_softmax(logits[counted], dim=-1)
    nll = -log_p.gather(1, labels[counted].unsqueeze(1)).squeeze(1)
    smooth = -log_p.mean(dim=-1)
    ((1 - EPS) * nll + EPS * smooth).mean().backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("task", HEADS)
def test_label_smoothing_is_exact_per_head(task: str) -> None:
    model = build_tiny_model(task)
    samples = make_samples(task, BS * GA - 1, seed=41)  # a short last micro-batch
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, label_smoothing_factor=EPS)
    update, _ = one_step_update(GradAccTrainer, model, samples, args)
    reference = _smoothed_reference(model, samples, task)
    error = compare(update, reference).relative_error
    assert error <= TOLERANCE, (task, error)
