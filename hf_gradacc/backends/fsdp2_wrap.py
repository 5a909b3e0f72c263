"""Preflight of accelerate's FSDP2 wrapping: predict, when the trainer is created, the model layouts that
``fsdp2_prepare_model`` would reject deep inside torch, and name the setting that avoids them.

Kept apart from the sync logic in ``fsdp2.py``: it reads the model and the FSDP plugin, nothing at run time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ..errors import GradAccConfigError

logger = logging.get_logger(__name__)

# The accelerate release whose FSDP2 wrapping `fsdp2_wrap_problems` mirrors (`fsdp2_prepare_model`): on it a
# predicted problem is an error; on another release it is a warning, since the wrapping may have changed.
WRAPPING_CHECKED_WITH_ACCELERATE = (1, 15)


@dataclass(frozen=True, slots=True, kw_only=True)
class WrapProblem:
    """One reason accelerate's FSDP2 wrapping would fail on a model, with the fix."""

    kind: str  # "nested_embedding" | "tied_across_groups"
    message: str


def _accelerate_version() -> tuple[int, ...]:
    import accelerate

    parts = []
    for piece in accelerate.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _auto_wrap_class_names(model: torch.nn.Module, fsdp_plugin: Any) -> list[str] | None:
    """The class names accelerate's transformer auto-wrap policy wraps, or None for another policy."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = getattr(fsdp_plugin, "auto_wrap_policy", None)
    if isinstance(policy, functools.partial):
        policy = policy.func
    if isinstance(policy, str):  # not yet resolved by the plugin's __post_init__
        if policy.upper() != "TRANSFORMER_BASED_WRAP":
            return [] if policy.upper() == "NO_WRAP" else None
    elif policy is None:
        return []
    elif policy is not transformer_auto_wrap_policy:
        return None  # size-based or custom: not predicted
    names = getattr(fsdp_plugin, "transformer_cls_names_to_wrap", None)
    if isinstance(names, str):
        names = names.split(",")
    if names is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
    return [n.strip() for n in names if n.strip()]


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        from accelerate.utils.fsdp_utils import _find_final_norm
    except ImportError:
        return None
    return _find_final_norm(model)


def fsdp2_wrap_problems(model: torch.nn.Module, fsdp_plugin: Any) -> list[WrapProblem]:
    """Why accelerate's FSDP2 wrapping (``fsdp2_prepare_model``, accelerate 1.15) would fail on ``model``.

    accelerate wraps, in this order: every module of the auto-wrap classes (``transformer_layer_cls_to_wrap``, by
    default the model's ``_no_split_modules``), the input embeddings, a tail group (final norm, output embeddings,
    and the input embeddings when they are tied to the output ones), then the root. Two layouts make torch refuse:

    - ``nested_embedding``: an auto-wrap class contains the input (or output) embeddings, which accelerate then
      wraps a second time (BERT: ``BertEmbeddings`` is in ``_no_split_modules``). torch fails with "Invariant
      encountered: value was None when it should not be".
    - ``tied_across_groups``: one parameter reachable from modules of two different groups (T5's shared embedding,
      BertForMaskedLM's decoder bias). torch fails with "... is shared with a parameter already managed by another
      FSDP group".

    Input and output embeddings tied to each other (``tie_word_embeddings=True``) are fine: they share a group.
    Size-based and custom wrap policies are not predicted (empty list).

    Example:
        ```python
        problems = fsdp2_wrap_problems(model, trainer.accelerator.state.fsdp_plugin)
        for p in problems:
            print(p.kind, p.message)
        ```
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return []  # already sharded (e.g. loaded with a distributed config): accelerate does not wrap it again
    class_names = _auto_wrap_class_names(model, fsdp_plugin)
    if class_names is None:
        return []
    problems: list[WrapProblem] = []
    paths = {id(m): name or "<root>" for name, m in model.named_modules()}
    # accelerate wraps bottom-up (innermost first); a module belongs to the first unit that contains it
    units: list[tuple[str, torch.nn.Module]] = []
    for name, module in reversed(list(model.named_modules())):
        if module is not model and type(module).__name__ in class_names:
            units.append((f"{type(module).__name__} ({name})", module))
    unit_of: dict[int, str] = {}

    def claim(label: str, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            for sub in module.modules():
                unit_of.setdefault(id(sub), label)

    for label, module in units:
        claim(label, [module])

    def embedding(getter: str) -> torch.nn.Module | None:
        fn = getattr(model, getter, None)
        try:
            return fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            return None

    input_embed, output_embed = embedding("get_input_embeddings"), embedding("get_output_embeddings")
    input_weight = getattr(input_embed, "weight", None)
    tied_io = input_weight is not None and input_weight is getattr(output_embed, "weight", None)
    tail = [
        m
        for m in ((_final_norm(model), input_embed, output_embed) if tied_io else (_final_norm(model), output_embed))
        if m is not None
    ]
    extra = ([] if tied_io or input_embed is None else [("input embeddings", [input_embed])]) + (
        [("tail (final norm, output embeddings)", tail)] if tail else []
    )
    for label, modules in extra:
        for module in modules:
            owner = next(
                (lbl for lbl, unit in units if unit is not module and any(s is module for s in unit.modules())), None
            )
            if owner is not None:
                owner_class = owner.split(" ")[0]
                keep = [n for n in class_names if n != owner_class]
                problems.append(
                    WrapProblem(
                        kind="nested_embedding",
                        message=(
                            f"`{paths.get(id(module))}` ({type(module).__name__}, part of the {label}) lies inside "
                            f"the auto-wrapped {owner}; accelerate wraps it a second time and torch fails "
                            "('Invariant encountered: value was None'). Wrap only the layer classes: "
                            f"fsdp_config={{'transformer_layer_cls_to_wrap': {keep}}} in TrainingArguments "
                            "(accelerate "
                            f"config: `fsdp_transformer_layer_cls_to_wrap: {','.join(keep)}`)."
                        ),
                    )
                )
        claim(label, modules)
    claim("root", [model])

    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            owners.setdefault(id(param), []).append((full, unit_of.get(id(module), "root")))
    for entries in owners.values():
        groups = sorted({g for _, g in entries})
        if len(groups) > 1:
            names = sorted({n for n, _ in entries})
            problems.append(
                WrapProblem(
                    kind="tied_across_groups",
                    message=(
                        f"{names} are one tied parameter, but accelerate puts them in different FSDP groups "
                        f"({', '.join(groups)}); torch refuses ('shared with a parameter already managed by another "
                        "FSDP group'). FSDP2 through accelerate cannot shard this model as is: train it with DDP or "
                        "DeepSpeed ZeRO (`distributed_type` in the accelerate config), or untie the weights where "
                        "the model allows it."
                    ),
                )
            )
    return problems


def check_fsdp2_wrapping(model: torch.nn.Module, fsdp_plugin: Any) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError` listing every predicted wrapping problem of ``model`` (a warning
    instead on an accelerate release other than the one the prediction mirrors). No-op without an FSDP plugin.

    Example:
        ```python
        check_fsdp2_wrapping(model, trainer.accelerator.state.fsdp_plugin)
        ```
    """
    if fsdp_plugin is None:
        return
    problems = fsdp2_wrap_problems(model, fsdp_plugin)
    if not problems:
        return
    text = f"{type(model).__name__} cannot be wrapped by accelerate's FSDP2:\n" + "\n".join(
        f"- {p.message}" for p in problems
    )
    if _accelerate_version() == WRAPPING_CHECKED_WITH_ACCELERATE:
        raise GradAccConfigError(text)
    logger.warning(f"{text}\n(predicted from accelerate 1.15's wrapping; this accelerate may differ)")
