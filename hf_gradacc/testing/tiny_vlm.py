"""Tiny vision-language models, built from their configs (no download), and synthetic image + text samples for them.

Four real architectures of transformers, each with its own image inputs:

- ``llava``: ``LlavaForConditionalGeneration`` (CLIP vision tower + Llama), ``pixel_values`` ``[batch, 3, H, W]``;
- ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration``, ``pixel_values`` as flattened patches ``[patches, dim]``
  and ``image_grid_thw`` ``[images, 3]``; it declares ``accepts_loss_kwargs = False``;
- ``gemma3``: ``Gemma3ForConditionalGeneration`` (SigLIP + Gemma 3), ``pixel_values`` and ``token_type_ids`` (1 on
  image tokens: bidirectional attention over the image in training);
- ``qwen3_vl``: ``Qwen3VLForConditionalGeneration`` (``accepts_loss_kwargs = False`` too), patches and
  ``image_grid_thw`` like Qwen2.5-VL and ``mm_token_type_ids`` (1 on image tokens, for its M-RoPE positions).

Every sample is ``<prompt tokens> <image placeholder tokens> <prompt tokens> <answer tokens>``: the labels keep only
the answer (prompt and image tokens are ``-100``); lengths and answer sizes vary a lot, and some samples have no
answer at all (nothing counted), as in :func:`hf_gradacc.testing.tiny.make_samples`.

Example:
    ```python
    from hf_gradacc.testing.tiny_vlm import VLMCollator, build_tiny_vlm, make_vlm_samples

    model = build_tiny_vlm("qwen2_5_vl")
    samples = make_vlm_samples(model, 8)
    batch = VLMCollator(model)(samples)          # input_ids, attention_mask, labels, pixel_values, image_grid_thw
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GradAccConfigError
from ..loss import IGNORE_INDEX

VLM_FAMILIES: tuple[str, ...] = ("llava", "qwen2_5_vl", "gemma3", "qwen3_vl")
VOCAB = 128
PAD, BOS = 0, 1
IMAGE_TOKEN = VOCAB - 1  # the placeholder every image token of the text is
VISION_START, VISION_END = VOCAB - 3, VOCAB - 2  # Qwen's <|vision_start|> / <|vision_end|>; Gemma 3's boi / eoi
FIRST_TEXT_ID = 2  # text ids are drawn from [FIRST_TEXT_ID, VOCAB - 3)
_TYPE_KEY = {"gemma3": "token_type_ids", "qwen3_vl": "mm_token_type_ids"}  # 1 on image tokens
IMAGE_SIZE = 16  # pixels per side (Qwen: 2 x 2 merged patches of 4 pixels -> 4 image tokens per image)


def build_tiny_vlm(family: str = "llava", *, seed: int = 0, hidden_size: int = 32) -> torch.nn.Module:
    """A randomly initialised vision-language model of ``family`` (one of :data:`VLM_FAMILIES`), a few ten thousand
    parameters, eager attention, no dropout.

    Example:
        ```python
        model = build_tiny_vlm("gemma3")
        ```
    """
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
    )
    vision = dict(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1, num_attention_heads=4
    )
    if family == "llava":
        config = tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(
                image_size=IMAGE_SIZE, patch_size=8, projection_dim=hidden_size, **vision
            ),
            text_config=tf.LlamaConfig(**text),
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",  # the CLS token dropped: (16 / 8)^2 = 4 image tokens
            image_seq_length=4,
        )
        model = tf.LlavaForConditionalGeneration(config)
    elif family in ("qwen2_5_vl", "qwen3_vl"):
        head_dim = hidden_size // 4
        rope = {"rope_type": "default", "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]}
        if family == "qwen2_5_vl":
            rope["type"] = "mrope"
            vision_config = dict(
                depth=1,
                hidden_size=hidden_size,
                intermediate_size=2 * hidden_size,
                num_heads=4,
                out_hidden_size=hidden_size,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=8,
                fullatt_block_indexes=[0],
            )
            config = tf.Qwen2_5_VLConfig(
                text_config={**text, "rope_parameters": rope, "model_type": "qwen2_5_vl_text"},
                vision_config=vision_config,
                image_token_id=IMAGE_TOKEN,
                video_token_id=VOCAB - 4,
                vision_start_token_id=VISION_START,
                vision_end_token_id=VISION_END,
            )
            model = tf.Qwen2_5_VLForConditionalGeneration(config)
        else:
            rope["mrope_interleaved"] = True
            vision_config = dict(
                depth=1,
                hidden_size=hidden_size,
                intermediate_size=2 * hidden_size,
                num_heads=4,
                out_hidden_size=hidden_size,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0],
            )
            config = tf.Qwen3VLConfig(
                text_config={**text, "head_dim": head_dim, "rope_parameters": rope},
                vision_config=vision_config,
                image_token_id=IMAGE_TOKEN,
                video_token_id=VOCAB - 4,
                vision_start_token_id=VISION_START,
                vision_end_token_id=VISION_END,
            )
            model = tf.Qwen3VLForConditionalGeneration(config)
    elif family == "gemma3":
        config = tf.Gemma3Config(
            text_config=tf.Gemma3TextConfig(**text, head_dim=hidden_size // 4, sliding_window=64),
            vision_config=tf.SiglipVisionConfig(image_size=IMAGE_SIZE, patch_size=4, **vision),
            mm_tokens_per_image=4,  # 4 x 4 patches pooled to 2 x 2
            image_token_index=IMAGE_TOKEN,
            boi_token_index=VISION_START,
            eoi_token_index=VISION_END,
        )
        model = tf.Gemma3ForConditionalGeneration(config)
        # Gemma 3 starts its image projection at zero: the image path would get no gradient in a one-step check.
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    else:
        raise GradAccConfigError(f"`family` ({family!r}) must be one of {VLM_FAMILIES}")
    model.config._attn_implementation = "eager"
    for sub in (getattr(model.config, "text_config", None), getattr(model.config, "vision_config", None)):
        if sub is not None:
            sub._attn_implementation = "eager"
    return model.eval().train()


def family_of(model: torch.nn.Module) -> str:
    """The :data:`VLM_FAMILIES` name of a model built by :func:`build_tiny_vlm`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in VLM_FAMILIES:
        raise GradAccConfigError(f"not a tiny VLM of {VLM_FAMILIES}: model_type {model_type!r}")
    return model_type


def image_tokens_per_image(family: str) -> int:
    """Placeholder tokens one :data:`IMAGE_SIZE` image takes in the text: 4 in every family here."""
    return 4


def make_vlm_samples(
    model_or_family: Any, num_samples: int = 8, *, seed: int = 0, max_answer: int = 24
) -> list[dict[str, Any]]:
    """Samples of one image each: ``input_ids`` ``[BOS, prompt..., (start), image x 4, (end), prompt..., answer...]``,
    ``labels`` the answer only (every 5th sample, index 2, 7, ..., no answer: nothing counted), ``pixel_values``
    (``[3, 16, 16]`` as nested lists; each image its own brightness) and, for Gemma 3 / Qwen3-VL, ``token_type_ids`` /
    ``mm_token_type_ids`` (1 on image tokens).

    Example:
        ```python
        samples = make_vlm_samples("llava", 4)
        ```
    """
    family = model_or_family if isinstance(model_or_family, str) else family_of(model_or_family)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        before = torch.randint(FIRST_TEXT_ID, VOCAB - 4, (int(torch.randint(1, 6, (), generator=g)),), generator=g)
        after = torch.randint(FIRST_TEXT_ID, VOCAB - 4, (int(torch.randint(1, 8, (), generator=g)),), generator=g)
        n_answer = 0 if i % 5 == 2 else int(1 + (max_answer - 1) * float(torch.rand((), generator=g)) ** 2)
        answer = torch.randint(FIRST_TEXT_ID, VOCAB - 4, (n_answer,), generator=g).tolist()
        image = [IMAGE_TOKEN] * image_tokens_per_image(family)
        if family != "llava":
            image = [VISION_START, *image, VISION_END]
        prompt = [BOS, *before.tolist(), *image, *after.tolist()]
        ids = prompt + answer
        scale, shift = 0.5 + float(torch.rand((), generator=g)), float(torch.randn((), generator=g))
        pixels = torch.randn((3, IMAGE_SIZE, IMAGE_SIZE), generator=g) * scale + shift
        sample = {"input_ids": ids, "labels": [IGNORE_INDEX] * len(prompt) + answer, "pixel_values": pixels.tolist()}
        if family in ("gemma3", "qwen3_vl"):  # Qwen3-VL's M-RoPE reads image positions from `mm_token_type_ids`
            sample[_TYPE_KEY[family]] = [int(t == IMAGE_TOKEN) for t in ids]
        samples.append(sample)
    return samples


def qwen_patches(pixels: torch.Tensor, *, patch_size: int = 4, temporal: int = 2, merge: int = 2) -> torch.Tensor:
    """One ``[3, H, W]`` image as the Qwen-VL image processor lays it out: the frame repeated ``temporal`` times, cut
    into ``patch_size`` patches, ordered by ``merge x merge`` blocks, each flattened to ``3 * temporal * p * p``."""
    channels, height, width = pixels.shape
    frames = pixels.unsqueeze(0).expand(temporal, -1, -1, -1)
    gh, gw = height // patch_size, width // patch_size
    x = frames.reshape(1, temporal, channels, gh // merge, merge, patch_size, gw // merge, merge, patch_size)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gh * gw, channels * temporal * patch_size * patch_size)


class VLMCollator:
    """Right-pads ``input_ids`` / ``labels`` / ``token_type_ids`` to the longest sample, with an ``attention_mask``;
    images as the family's model takes them (stacked ``pixel_values``; Qwen: concatenated patches and
    ``image_grid_thw``).

    Example:
        ```python
        batch = VLMCollator("llava")(make_vlm_samples("llava", 2))
        ```
    """

    only_pads = True

    def __init__(self, model_or_family: Any) -> None:
        self.family = model_or_family if isinstance(model_or_family, str) else family_of(model_or_family)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(s["input_ids"]) for s in samples)
        rows = len(samples)
        batch = {
            "input_ids": torch.full((rows, width), PAD, dtype=torch.long),
            "attention_mask": torch.zeros((rows, width), dtype=torch.long),
            "labels": torch.full((rows, width), IGNORE_INDEX, dtype=torch.long),
        }
        type_key = _TYPE_KEY.get(self.family)
        if type_key:
            batch[type_key] = torch.zeros((rows, width), dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            batch["input_ids"][row, :n] = torch.tensor(s["input_ids"])
            batch["attention_mask"][row, :n] = 1
            batch["labels"][row, :n] = torch.tensor(s["labels"])
            if type_key:
                batch[type_key][row, :n] = torch.tensor(s[type_key])
        pixels = [torch.as_tensor(s["pixel_values"], dtype=torch.float32) for s in samples]
        if self.family in ("qwen2_5_vl", "qwen3_vl"):
            batch["pixel_values"] = torch.cat([qwen_patches(p) for p in pixels])
            side = IMAGE_SIZE // 4
            batch["image_grid_thw"] = torch.tensor([[1, side, side]] * rows, dtype=torch.long)
        else:
            batch["pixel_values"] = torch.stack(pixels)
        return batch


def build_tiny_llava_processor(path: str) -> Any:
    """A ``LlavaProcessor`` for :func:`build_tiny_vlm` ``("llava")``, built locally (no Hub): a word-level tokenizer
    (``<pad>`` 0, ``<s>`` 1, ``w2`` ... ``w126``, ``<image>`` 127) and a CLIP image processor for 16 x 16 images,
    saved with ``save_pretrained`` to ``path`` and loaded back with ``AutoProcessor.from_pretrained`` (what TRL's
    vision SFT path takes as ``processing_class``). One ``<image>`` in a text becomes the 4 image tokens.

    Example:
        ```python
        processor = build_tiny_llava_processor(tempfile.mkdtemp())
        processor(images=[image], text=["w5 <image> w7"], return_tensors="pt")
        ```
    """
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = {PAD: "<pad>", BOS: "<s>", IMAGE_TOKEN: "<image>"}
    backend = Tokenizer(models.WordLevel(vocab={specials.get(i, f"w{i}"): i for i in range(VOCAB)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<s>",
        bos_token="<s>",
        extra_special_tokens={"image_token": "<image>"},
    )
    images = tf.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = tf.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    processor.save_pretrained(path)
    return tf.AutoProcessor.from_pretrained(path)


def vision_sft_rows(num_samples: int = 8, *, seed: int = 0) -> list[dict[str, Any]]:
    """TRL prompt-completion vision rows: ``images`` (one 16 x 16 PIL image), ``prompt`` (words around ``<image>``),
    ``completion`` (0 to 19 words; every 5th row none)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    rows = []
    for i in range(num_samples):
        image = Image.fromarray((rng.rand(IMAGE_SIZE, IMAGE_SIZE, 3) * 255).astype("uint8"))
        words = lambda n: " ".join(f"w{x}" for x in rng.randint(FIRST_TEXT_ID, VOCAB - 4, n))  # noqa: E731
        prompt = f"{words(rng.randint(1, 6))} <image> {words(rng.randint(1, 5))}"
        completion = "" if i % 5 == 2 else words(rng.randint(1, 20))
        rows.append({"images": [image], "prompt": prompt, "completion": completion})
    return rows


def processed_samples(processor: Any, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each vision row on its own (no padding), as :class:`VLMCollator` samples: the processed prompt (image tokens
    expanded) then the completion's ids, labels on the completion only."""
    samples = []
    for row in rows:
        prompt = processor(images=row["images"], text=[row["prompt"]], return_tensors="pt")
        answer = (
            processor.tokenizer(row["completion"], add_special_tokens=False)["input_ids"] if row["completion"] else []
        )
        ids = prompt["input_ids"][0].tolist()
        samples.append(
            {
                "input_ids": ids + answer,
                "labels": [IGNORE_INDEX] * len(ids) + answer,
                "pixel_values": prompt["pixel_values"][0].tolist(),
            }
        )
    return samples
