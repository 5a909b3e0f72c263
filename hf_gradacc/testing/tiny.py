"""Built-in tiny models and synthetic mixed-length data, for `hf-gradacc check`, examples and tests.

Everything is built from configs (no download) and seeded. The data is deliberately hostile to naive
accumulation: lengths vary a lot, and a large share of each row's labels is ``ignore_index`` (prompt tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import GradAccConfigError, GradAccUsageError  # noqa: F401
from ..loss import IGNORE_INDEX

TASKS: tuple[str, ...] = (
    "causal_lm",
    "seq2seq",
    "masked_lm",
    "token_classification",
    "sequence_classification",
    "regression",
    "multi_label_classification",
    "image_classification",
)
VOCAB_SIZE = 96
PAD_TOKEN_ID = 0
NUM_LABELS = 3
IMAGE_SIZE = 16
NUM_CHANNELS = 3
# Tiny image classifiers: ConvNeXt and ViT have no BatchNorm (LayerNorm), ResNet has BatchNorm in every block.
IMAGE_ARCHITECTURES: tuple[str, ...] = ("convnext", "vit", "resnet")


def build_tiny_model(task: str = "causal_lm", *, seed: int = 0, hidden_size: int = 32) -> torch.nn.Module:
    """A randomly initialised model of a few thousand parameters for ``task`` (one of :data:`TASKS`).

    Dropout is off so that two runs over the same samples are comparable.

    Example:
        ```python
        from hf_gradacc.testing.tiny import build_tiny_model
        model = build_tiny_model("sequence_classification")
        ```
    """
    import transformers as tf

    torch.manual_seed(seed)
    if task == "causal_lm":
        config = tf.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=PAD_TOKEN_ID,
            tie_word_embeddings=False,
        )
        return tf.LlamaForCausalLM(config)
    if task == "seq2seq":
        config = tf.T5Config(
            vocab_size=VOCAB_SIZE,
            d_model=hidden_size,
            d_kv=8,
            d_ff=2 * hidden_size,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            pad_token_id=PAD_TOKEN_ID,
            decoder_start_token_id=PAD_TOKEN_ID,
            eos_token_id=1,
        )
        return tf.T5ForConditionalGeneration(config)
    bert_kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD_TOKEN_ID,
    )
    if task == "masked_lm":
        return tf.BertForMaskedLM(tf.BertConfig(**bert_kwargs))
    if task == "token_classification":
        return tf.BertForTokenClassification(tf.BertConfig(num_labels=NUM_LABELS, **bert_kwargs))
    if task == "sequence_classification":
        config = tf.BertConfig(num_labels=NUM_LABELS, problem_type="single_label_classification", **bert_kwargs)
        return tf.BertForSequenceClassification(config)
    if task == "regression":
        return tf.BertForSequenceClassification(tf.BertConfig(num_labels=1, problem_type="regression", **bert_kwargs))
    if task == "multi_label_classification":
        config = tf.BertConfig(num_labels=NUM_LABELS, problem_type="multi_label_classification", **bert_kwargs)
        return tf.BertForSequenceClassification(config)
    if task == "image_classification":
        return build_tiny_image_model("convnext", seed=seed, hidden_size=hidden_size)
    raise GradAccConfigError(f"`task` ({task!r}) must be one of {TASKS}")


def build_tiny_image_model(architecture: str = "convnext", *, seed: int = 0, hidden_size: int = 16) -> torch.nn.Module:
    """A tiny, randomly initialised ``*ForImageClassification`` model on :data:`IMAGE_SIZE` x :data:`IMAGE_SIZE`
    images with :data:`NUM_CHANNELS` channels and :data:`NUM_LABELS` classes, dropout and drop-path off.

    ``architecture``: ``"convnext"`` (LayerNorm; the ``image_classification`` task's model), ``"vit"`` (LayerNorm) or
    ``"resnet"`` (a BatchNorm layer after every convolution: its training forward normalises by the micro-batch's
    statistics, see :class:`~hf_gradacc.callbacks.BatchNormCallback`).

    Example:
        ```python
        from hf_gradacc.testing.tiny import build_tiny_image_model, make_samples, PaddingCollator
        model = build_tiny_image_model("resnet")
        logits = model(**PaddingCollator()(make_samples("image_classification", 4))).logits   # [4, NUM_LABELS]
        ```
    """
    import transformers as tf

    torch.manual_seed(seed)
    if architecture == "convnext":
        config = tf.ConvNextConfig(
            num_channels=NUM_CHANNELS,
            patch_size=4,
            num_stages=2,
            hidden_sizes=[hidden_size // 2, hidden_size],
            depths=[1, 1],
            drop_path_rate=0.0,
            layer_scale_init_value=1.0,  # the default 1e-6 leaves the blocks' gradients below float32 resolution
            image_size=IMAGE_SIZE,
            num_labels=NUM_LABELS,
        )
        return tf.ConvNextForImageClassification(config)
    if architecture == "vit":
        config = tf.ViTConfig(
            image_size=IMAGE_SIZE,
            patch_size=4,
            num_channels=NUM_CHANNELS,
            hidden_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=4 * hidden_size,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=NUM_LABELS,
        )
        return tf.ViTForImageClassification(config)
    if architecture == "resnet":
        config = tf.ResNetConfig(
            num_channels=NUM_CHANNELS,
            embedding_size=hidden_size // 2,
            hidden_sizes=[hidden_size // 2, hidden_size],
            depths=[1, 1],
            layer_type="basic",
            num_labels=NUM_LABELS,
        )
        return tf.ResNetForImageClassification(config)
    raise GradAccConfigError(f"`architecture` ({architecture!r}) must be one of {IMAGE_ARCHITECTURES}")


MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen3_moe")


def build_tiny_moe(
    family: str = "mixtral", *, seed: int = 0, hidden_size: int = 16, router_aux_loss_coef: float = 0.02
) -> torch.nn.Module:
    """A tiny mixture-of-experts causal LM (2 layers, 4 experts, top-2) that returns its router load-balancing loss
    (``output_router_logits=True``) and adds ``router_aux_loss_coef * aux_loss`` to its own loss.

    Example:
        ```python
        from hf_gradacc.testing.tiny import build_tiny_moe
        model = build_tiny_moe("qwen3_moe")
        ```
    """
    import transformers as tf

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        router_aux_loss_coef=router_aux_loss_coef,
        output_router_logits=True,
        tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID,
    )
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, **common))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=2 * hidden_size, **common)
        )
    raise GradAccConfigError(f"`family` ({family!r}) must be one of {MOE_FAMILIES}")


def synthetic_clm_dataset(
    num_samples: int,
    *,
    prompt_fraction: float = 0.3,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
    mean_log_words: float = 2.5,
) -> Any:
    """Long-tailed synthetic documents as a `datasets.Dataset`, tokenized with `datasets.map` the way run_clm does:
    a byte-level "tokenizer" (ids from 2 to ``vocab_size - 1``, offline), the first ``prompt_fraction`` of each
    document labelled -100. The examples train on it; swap in ``load_dataset(...)`` and your tokenizer.

    Example:
        ```python
        train_dataset = synthetic_clm_dataset(96, prompt_fraction=0.3, seed=42)
        assert set(train_dataset.column_names) == {"input_ids", "labels"}
        ```
    """
    import random

    import datasets

    rng = random.Random(seed)
    words = ["grad", "acc", "exact", "token", "step", "batch", "row", "pack", "loss", "sum", "ramp", "warm"]
    texts = [
        " ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(mean_log_words, 0.9)) + 2))
        for _ in range(num_samples)
    ]

    def tokenize(example: dict[str, Any]) -> dict[str, list[int]]:
        ids = [2 + (b % (vocab_size - 2)) for b in example["text"].encode()]
        prompt = int(len(ids) * prompt_fraction)
        return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}

    return datasets.Dataset.from_dict({"text": texts}).map(tokenize, remove_columns=["text"])


def make_samples(
    task: str = "causal_lm",
    num_samples: int = 32,
    *,
    seed: int = 0,
    min_length: int = 3,
    max_length: int = 40,
    ignore_fraction: float = 0.5,
) -> list[dict[str, Any]]:
    """Synthetic samples (lists, unpadded) with mixed lengths and many ignored labels.

    Lengths are drawn from a long-tailed distribution between ``min_length`` and ``max_length``; for token-level
    tasks a random prefix of each row (about ``ignore_fraction`` of it on average) is labelled ``-100``, and a few
    rows have no counted label at all. ``image_classification`` samples are images (see :func:`make_image_samples`).
    """
    if task not in TASKS:
        raise GradAccConfigError(f"`task` ({task!r}) must be one of {TASKS}")
    if task == "image_classification":
        return make_image_samples(num_samples, seed=seed)
    g = torch.Generator().manual_seed(seed)
    samples: list[dict[str, Any]] = []
    for i in range(num_samples):
        u = float(torch.rand((), generator=g))
        length = int(min_length + (max_length - min_length) * u**3)
        ids = torch.randint(2, VOCAB_SIZE, (length,), generator=g).tolist()
        sample: dict[str, Any] = {"input_ids": ids}
        if task in ("causal_lm", "masked_lm", "token_classification"):
            if task == "token_classification":
                labels = torch.randint(0, NUM_LABELS, (length,), generator=g).tolist()
            else:
                labels = list(ids)
            cut = int(length * min(1.0, 2 * ignore_fraction * float(torch.rand((), generator=g))))
            if i % 7 == 3:
                cut = length  # a row with nothing to learn
            labels = [IGNORE_INDEX] * cut + labels[cut:]
            sample["labels"] = labels
        elif task == "seq2seq":
            target_len = int(1 + (max_length // 2 - 1) * float(torch.rand((), generator=g)) ** 2)
            sample["labels"] = torch.randint(2, VOCAB_SIZE, (target_len,), generator=g).tolist()
        elif task == "sequence_classification":
            sample["labels"] = int(torch.randint(0, NUM_LABELS, (), generator=g))
        elif task == "regression":
            sample["labels"] = float(torch.randn((), generator=g))
        else:
            sample["labels"] = [float(x) for x in torch.randint(0, 2, (NUM_LABELS,), generator=g)]
        samples.append(sample)
    return samples


def make_image_samples(
    num_samples: int = 32,
    *,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    num_channels: int = NUM_CHANNELS,
    num_labels: int = NUM_LABELS,
) -> list[dict[str, Any]]:
    """Synthetic image-classification samples: ``pixel_values`` (nested lists, ``num_channels`` x ``image_size`` x
    ``image_size``, each image with its own brightness and contrast so that batch statistics differ) and an integer
    ``labels``; every 7th sample (index 3, 10, ...) is labelled ``-100`` (not counted).

    Example:
        ```python
        from hf_gradacc.testing.tiny import make_image_samples
        samples = make_image_samples(8)          # [{"pixel_values": [[[...]]], "labels": 2}, ...]
        ```
    """
    g = torch.Generator().manual_seed(seed)
    samples: list[dict[str, Any]] = []
    for i in range(num_samples):
        scale, shift = 0.5 + 1.5 * float(torch.rand((), generator=g)), float(torch.randn((), generator=g))
        pixels = torch.randn((num_channels, image_size, image_size), generator=g) * scale + shift
        label = int(torch.randint(0, num_labels, (), generator=g))
        samples.append({"pixel_values": pixels.tolist(), "labels": IGNORE_INDEX if i % 7 == 3 else label})
    return samples


def make_image_samples_for(model: torch.nn.Module, num_samples: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`make_image_samples` in ``model``'s image size, channels and classes (its config's ``image_size``,
    ``num_channels``, ``num_labels``; the tiny defaults where the config has none)."""
    config = model.config
    size = getattr(config, "image_size", None) or IMAGE_SIZE
    size = int(size[0] if isinstance(size, (list, tuple)) else size)
    channels = int(getattr(config, "num_channels", None) or NUM_CHANNELS)
    num_labels = int(getattr(config, "num_labels", None) or NUM_LABELS)
    return make_image_samples(num_samples, seed=seed, image_size=size, num_channels=channels, num_labels=num_labels)


@dataclass
class ImageCollator:
    """Stacks ``pixel_values`` into a float32 ``[batch, channels, height, width]`` tensor and ``labels`` into
    ``[batch]`` (int64).

    Example:
        ```python
        from hf_gradacc.testing.tiny import ImageCollator, make_image_samples
        batch = ImageCollator()(make_image_samples(4))   # {"pixel_values": [4, 3, 16, 16], "labels": [4]}
        ```
    """

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pixels = [torch.as_tensor(s["pixel_values"], dtype=torch.float32) for s in samples]
        batch = {"pixel_values": torch.stack(pixels)}
        if "labels" in samples[0]:
            batch["labels"] = torch.tensor([s["labels"] for s in samples], dtype=torch.long)
        return batch


@dataclass
class PaddingCollator:
    """Right-pads ``input_ids`` (and token-level ``labels`` with ``ignore_index``) to the longest row; image samples
    (``pixel_values``, no ``input_ids``) are stacked by :class:`ImageCollator`.

    Example:
        ```python
        from hf_gradacc.testing.tiny import PaddingCollator, make_samples
        batch = PaddingCollator()(make_samples("causal_lm", 4))
        ```
    """

    pad_token_id: int = PAD_TOKEN_ID
    ignore_index: int = IGNORE_INDEX
    only_pads: ClassVar[bool] = True  # nothing but padding: packing may replace it without a warning

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "input_ids" not in samples[0] and "pixel_values" in samples[0]:
            return ImageCollator()(samples)
        width = max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            input_ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
            attention_mask[row, : len(s["input_ids"])] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        first = samples[0]["labels"]
        if isinstance(first, list) and first and isinstance(first[0], int):
            label_width = max(len(s["labels"]) for s in samples)
            labels = torch.full((len(samples), label_width), self.ignore_index, dtype=torch.long)
            for row, s in enumerate(samples):
                labels[row, : len(s["labels"])] = torch.tensor(s["labels"], dtype=torch.long)
        elif isinstance(first, list):
            labels = torch.tensor([s["labels"] for s in samples], dtype=torch.float32)
        elif isinstance(first, float):
            labels = torch.tensor([s["labels"] for s in samples], dtype=torch.float32)
        else:
            labels = torch.tensor([s["labels"] for s in samples], dtype=torch.long)
        batch["labels"] = labels
        return batch


class ListDataset(torch.utils.data.Dataset):
    """A map-style dataset over a list of samples."""

    def __init__(self, samples: Sequence[dict[str, Any]]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


class ListIterableDataset(torch.utils.data.IterableDataset):
    """An iterable dataset over a list of samples (no ``__len__``)."""

    def __init__(self, samples: Sequence[dict[str, Any]]) -> None:
        self.samples = list(samples)

    def __iter__(self):
        return iter(self.samples)


def two_term_loss(model: torch.nn.Module, inputs: dict[str, Any], reg_weight: float) -> tuple[dict[str, Any], Any]:
    """A causal-LM loss with two denominators, for tests of loss terms: the token cross-entropy summed over the
    micro-batch (normalised by ``"tokens"``) and ``reg_weight`` x the mean squared logit of each row, summed over
    rows (normalised by ``"samples"``). Returns ``(terms, outputs)``; ``inputs`` is not modified.

    Example:
        ```python
        class TwoTerms(GradAccTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                terms, outputs = two_term_loss(model, inputs, reg_weight=0.01)
                return (terms, outputs) if return_outputs else terms
        ```
    """
    import torch.nn.functional as F

    from ..loss import LossTerm

    inputs = dict(inputs)
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits = outputs.logits.float()
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    per_row = ((logits**2).mean(-1, keepdim=True) * mask).sum(dim=(1, 2)) / mask.sum(dim=(1, 2))
    return {"ce": LossTerm(ce, "tokens"), "reg": LossTerm(reg_weight * per_row.sum(), "samples")}, outputs
