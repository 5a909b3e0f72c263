"""The image-classification head family: detected from the class, normalised by samples, exact under accumulation.

Per-device batch 2 x GA 4 over 7 images (micro-batches of 2, 2, 2 and 1), one of them labelled -100: one SGD(lr=1)
step against the float64 full-batch reference (relative error <= 1e-5). What the stock `Trainer` does depends on
the model class (measured here): ViT passes ``num_items_in_batch`` to its loss (exact), ConvNeXt declares
``accepts_loss_kwargs = False`` (mean of micro-batch means: wrong with unequal micro-batches), ResNet's loss takes no
``num_items_in_batch`` (4x, as sequence classification).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from hf_gradacc import GradAccTrainer
from hf_gradacc.counting import Counter
from hf_gradacc.heads import Head, detect_head_type
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import (
    IMAGE_SIZE,
    NUM_CHANNELS,
    NUM_LABELS,
    ImageCollator,
    PaddingCollator,
    build_tiny_image_model,
    make_samples,
)

TOLERANCE = 1e-5
BATCH_SIZE, GA = 2, 4


def _step(trainer_class, model, samples, **gradacc_args):
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    kwargs = {"gradacc_args": gradacc_args} if gradacc_args else None
    return one_step_update(trainer_class, model, samples, args, trainer_kwargs=kwargs)


@pytest.mark.parametrize("architecture", ["convnext", "vit", "resnet"])
def test_image_classifiers_are_detected_and_counted_by_samples(architecture: str) -> None:
    model = build_tiny_image_model(architecture)
    assert detect_head_type(model) == "image_classification"
    head = Head.for_model(model)
    assert head.denominator() == "samples" and head.num_classes == NUM_LABELS
    batch = ImageCollator()(make_samples("image_classification", 8))
    assert batch["pixel_values"].shape == (8, NUM_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    counts = Counter(head).count_batch(batch)
    assert (counts.num_samples, counts.num_tokens) == (7, 7)  # sample 3 is labelled -100
    assert model(pixel_values=batch["pixel_values"]).logits.shape == (8, NUM_LABELS)


def test_image_labels_out_of_range_are_refused() -> None:
    from hf_gradacc import GradAccDataError

    batch = ImageCollator()(make_samples("image_classification", 2))
    batch["labels"][0] = NUM_LABELS
    with pytest.raises(GradAccDataError, match=f"outside \\[0, {NUM_LABELS}\\)"):
        Counter(Head.for_model(build_tiny_image_model("vit"))).count_batch(batch)


@pytest.mark.parametrize("architecture", ["convnext", "vit"])
def test_unequal_micro_batches_are_exact(architecture: str) -> None:
    model = build_tiny_image_model(architecture)
    samples = make_samples("image_classification", 2 * GA - 1, seed=1)
    micro_batches: list = []
    args = one_step_args(per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GA)
    update, trainer = one_step_update(GradAccTrainer, model, samples, args, micro_batches=micro_batches)
    assert [len(mb) for mb in micro_batches] == [2, 2, 2, 1]
    assert trainer.head.type == "image_classification"
    comparison = compare_with_reference(update, model, samples, "image_classification")
    assert comparison.relative_error <= TOLERANCE, comparison
    assert all(bool(u.abs().max() > 0) for u in update.values())
    logged = trainer.state.log_history[0]
    assert logged["loss"] > 0 and logged["grad_norm"] > 0


def test_stock_trainer_depends_on_the_model_class() -> None:
    samples = make_samples("image_classification", 2 * GA - 1, seed=1)
    vit, convnext = build_tiny_image_model("vit"), build_tiny_image_model("convnext")
    vit_stock = compare_with_reference(_step(Trainer, vit, samples)[0], vit, samples, "image_classification")
    assert vit_stock.relative_error <= TOLERANCE, vit_stock  # ViT's loss divides by num_items_in_batch
    convnext_stock = compare_with_reference(
        _step(Trainer, convnext, samples)[0], convnext, samples, "image_classification"
    )
    assert convnext_stock.relative_error > 0.1 and convnext_stock.cosine < 0.99, convnext_stock


def test_stock_trainer_is_4x_on_resnet() -> None:
    """Both trainers normalise each micro-batch by its own BatchNorm statistics; the stock one also counts every
    micro-batch's mean fully (ResNet's loss ignores num_items_in_batch), so its update is 4x GradAccTrainer's."""
    samples = make_samples("image_classification", BATCH_SIZE * GA, seed=1)
    samples[3] = {**samples[3], "labels": 0}  # equal counted samples per micro-batch
    model = build_tiny_image_model("resnet")
    ours, _ = _step(GradAccTrainer, model, samples)
    stock, _ = _step(Trainer, model, samples)
    ratio = compare(stock, ours)
    assert ratio.norm_ratio == pytest.approx(4.0, rel=1e-4) and ratio.cosine > 1 - 1e-8, ratio


def test_resnet_with_frozen_batchnorm_statistics_is_exact() -> None:
    """``batchnorm="freeze_stats"`` normalises by the running statistics, as the float64 reference (eval mode) does."""
    model = build_tiny_image_model("resnet")
    samples = make_samples("image_classification", 2 * GA - 1, seed=2)
    update, _ = _step(GradAccTrainer, model, samples, batchnorm="freeze_stats")
    comparison = compare_with_reference(update, model, samples, "image_classification")
    assert comparison.relative_error <= TOLERANCE, comparison
    per_micro_batch, _ = _step(GradAccTrainer, model, samples)
    assert compare_with_reference(per_micro_batch, model, samples, "image_classification").relative_error > 0.1


def test_padding_collator_stacks_images() -> None:
    samples = make_samples("image_classification", 3)
    batch = PaddingCollator()(samples)
    assert set(batch) == {"pixel_values", "labels"}
    assert torch.equal(batch["pixel_values"][1], torch.tensor(samples[1]["pixel_values"]))
    assert batch["labels"].dtype == torch.long


# ---------------------------------------------------------------------------------------------- hf-gradacc check
def test_check_task_image_classification(capsys) -> None:
    from hf_gradacc.commands.hf_gradacc_cli import main

    assert main(["check", "--task", "image_classification"]) == 0
    out = capsys.readouterr().out
    assert "task      image_classification" in out and "ConvNextForImageClassification" in out
    table = [line.split() for line in out.splitlines()]
    rows = {cells[0]: cells for cells in table if cells[:1] in (["Trainer"], ["GradAccTrainer"])}
    assert float(rows["GradAccTrainer"][1]) <= TOLERANCE and rows["GradAccTrainer"][-1] == "exact"
    assert rows["Trainer"][-1] == "WRONG"


def test_check_image_checkpoint_in_its_own_size(tmp_path, capsys) -> None:
    """A saved ViT with 5 classes on 1-channel 8x8 images and dropout on: the task is read from `architectures`, the
    synthetic images follow the config, dropout is switched off, the step is exact."""
    import json

    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=5, hidden_dropout_prob=0.1,
    )  # fmt: skip
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    from hf_gradacc.commands.hf_gradacc_cli import main

    assert main(["check", "--model", str(tmp_path / "vit"), "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["setup"]["task"] == "image_classification"
    assert data["setup"]["model_class"] == "ViTForImageClassification"
    assert data["results"]["GradAccTrainer"]["relative_error"] <= TOLERANCE
    capsys.readouterr()
