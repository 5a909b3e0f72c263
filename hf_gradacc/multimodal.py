"""Vision-language models: what of the library's batch layouts they can take, and the refusals by name where not.

Measured on tiny LLaVA, Qwen2.5-VL, Gemma 3 and Qwen3-VL (docs/multimodal.md): the built-in loss and regrouped
micro-batches are exact on all four (each sample is kept whole); packing cannot carry image inputs; the layouts
that cut a micro-batch into rows (the fused LM head's start-up row check, ``auto_micro_batch``'s resplit) cannot cut
Qwen-VL images, whose ``pixel_values`` are the patches of every image of the batch concatenated (rows of patches, not
of samples) and ``image_grid_thw`` says how many belong to each image. The fused head is exact on LLaVA and Gemma 3
(one image per row).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Keys of image / video inputs laid out as patches of the whole batch, not one row per sample (Qwen2-VL family).
PATCH_GRID_KEYS: tuple[str, ...] = ("image_grid_thw", "video_grid_thw")


def is_vision_language(model: torch.nn.Module) -> bool:
    """True for a model with a vision tower (its config has a ``vision_config``)."""
    from .heads import unwrap_model

    return getattr(getattr(unwrap_model(model), "config", None), "vision_config", None) is not None


def takes_patch_grids(model: torch.nn.Module) -> bool:
    """True when the model's forward takes ``image_grid_thw``: its images come as patches of the whole batch."""
    import inspect

    from .heads import unwrap_model

    try:
        parameters = inspect.signature(unwrap_model(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(key in parameters for key in PATCH_GRID_KEYS)


def row_split_problem(model: torch.nn.Module) -> str | None:
    """Why a micro-batch of ``model`` cannot be cut into rows (None: it can)."""
    if not takes_patch_grids(model):
        return None
    name = type(getattr(model, "module", model)).__name__
    return (
        f"{name} takes its images as `pixel_values` patches of the whole batch with `image_grid_thw` (not one row per "
        "sample), which the row cut would tear apart"
    )


def fused_head_problem(model: torch.nn.Module) -> str | None:
    """Why ``fused_lm_head`` cannot run on ``model`` for multimodal reasons (None: none): patch-layout images
    (Qwen-VL's ``pixel_values`` are the patches of the whole batch) cannot be cut into the start-up check's row.
    LLaVA and Gemma 3, one image per row, run the fused head exactly (tests/unit/test_vlm.py, with the start-up check
    on and off)."""
    return row_split_problem(model)


def check_batch_rows(batch: Mapping[str, Any], what: str) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError` naming ``what`` (the setting that cuts rows) when ``batch`` holds
    patch-grid images (:data:`PATCH_GRID_KEYS`)."""
    from .errors import GradAccConfigError

    found = [key for key in PATCH_GRID_KEYS if key in batch]
    if found:
        raise GradAccConfigError(
            f"{what} cannot cut this micro-batch into rows: it holds `{found[0]}` (its `pixel_values` are the patches "
            f"of every image of the batch, concatenated). Set {what} off for this model."
        )


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why ``pack_micro_batches`` cannot train ``model`` (None: nothing multimodal stands in the way)."""
    if not is_vision_language(model):
        return None
    from .heads import unwrap_model

    return (
        f"{type(unwrap_model(model)).__name__} is a vision-language model: a packed row concatenates token ids only; "
        "its image inputs (`pixel_values`, `image_grid_thw`, `token_type_ids`, ...) and image positions are not "
        "packed. "
        "Set `pack_micro_batches=False`; `regroup_micro_batches=True` (less padding, each sample whole) is exact"
    )
