"""The parts of hf_gradacc's axolotl plugin that need no axolotl installed: the ``gradacc:`` YAML block, the
configuration refusals, the packed-row collator wrapper, the class swap around axolotl's ``training_step`` wrappers,
and which class-level `Trainer` patches are axolotl's own. :mod:`hf_gradacc.integrations.axolotl` (the plugin
axolotl loads) imports them from here; what each does and why: that module's docstring and docs/axolotl.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from pydantic import BaseModel, Field, field_validator
from transformers import Trainer

from ..compat import RECOGNISED_TRAINER_PATCHES
from ..config import GRADACC_FIELDS, GradAccArguments, resolve_settings, unknown_knobs_error
from ..errors import GradAccConfigError
from ..exact import make_exact
from ..loss import IGNORE_INDEX

PLUGIN_PATH = "hf_gradacc.integrations.axolotl.GradAccPlugin"

# Knob defaults of the plugin that differ from GradAccArguments': axolotl's `compute_loss` returns the model's mean
# over the micro-batch, which hf_gradacc re-weights exactly; the warning about plain losses would tell an axolotl user
# to change code they do not write.
AXOLOTL_DEFAULTS: dict[str, Any] = {"warn_on_plain_loss": False}

# hf_gradacc knobs that plan micro-batches themselves: with axolotl's multipack sampler there would be two planners.
_PLANNING_KNOBS = ("regroup_micro_batches", "max_tokens_per_micro_batch", "pack_micro_batches")

# axolotl classes whose `training_step` only wraps `super().training_step` in a context manager kept on the instance
# (None: no context, only clean-up after the step that hf_gradacc's step does not need). Keyed by qualified name so
# that this module does not import every trainer axolotl has.
_STEP_WRAPPERS: dict[str, str | None] = {
    "axolotl.core.trainers.mixins.layer_offloading.LayerOffloadingMixin": "_layer_offload_ctx",
    "axolotl.core.trainers.mixins.activation_checkpointing.ActivationOffloadingMixin": "activation_offload_context",
    "axolotl.core.trainers.dpo.trainer.AxolotlDPOTrainer": None,  # gc.collect() and empty_cache() after each step
}

# axolotl 0.19's class-level replacements of `transformers.Trainer` methods ({method: the module that defines the
# replacement}), which compose with hf_gradacc's step: hf_gradacc's construction check does not warn about them
# (it still warns about any other replacement). Read from axolotl's source:
# - `_get_learning_rate` (axolotl/monkeypatch/trainer/lr.py, applied by every trainer builder): the scheduler's last
#   rate, 0 instead of an error while DeepSpeed's fp16 loss scaler skips the first steps; hf_gradacc's step reads it
#   as it reads the stock one.
# - `_maybe_log_save_evaluate` and `evaluation_loop` (axolotl/monkeypatch/transformers/trainer_loss_calc.py, always):
#   transformers' own source, re-executed with the loss averaged over ranks by `nanmean` instead of `mean`: the same
#   number while every rank's loss is finite, which hf_gradacc's `nonfinite_steps: skip` (the default) keeps so.
# - `create_accelerator_and_postprocess` (axolotl/monkeypatch/trainer_accelerator_args.py, fp8 only): transformers'
#   own source with fp8 keyword arguments for the accelerator.
AXOLOTL_TRAINER_PATCHES: dict[str, str] = {
    "_get_learning_rate": "axolotl.monkeypatch.trainer.lr",
    "_maybe_log_save_evaluate": "axolotl.monkeypatch.transformers.trainer_loss_calc",
    "evaluation_loop": "axolotl.monkeypatch.transformers.trainer_loss_calc",
    "create_accelerator_and_postprocess": "axolotl.monkeypatch.trainer_accelerator_args",
}


class GradAccAxolotlArgs(BaseModel):
    """The YAML keys the plugin adds to axolotl's config: ``gradacc``, a mapping of
    :class:`~hf_gradacc.GradAccArguments` fields, validated when axolotl loads the config."""

    gradacc: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={
            "description": "hf_gradacc knobs (GradAccArguments fields, e.g. nonfinite_steps: skip) for the "
            "hf_gradacc.integrations.axolotl.GradAccPlugin plugin"
        },
    )

    @field_validator("gradacc")
    @classmethod
    def _known_knobs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        knobs = dict(value)
        unknown = [name for name in knobs if name not in GRADACC_FIELDS]
        if unknown:  # a GradAccConfigError is a ValueError: pydantic reports it with the key's location
            raise unknown_knobs_error(unknown, where="gradacc")
        resolve_settings(GradAccArguments(**knobs))  # the values, checked as GradAccTrainer checks them
        return knobs


def plugin_knobs(cfg: Any) -> dict[str, Any]:
    """The knobs of an axolotl config: the plugin's defaults (:data:`AXOLOTL_DEFAULTS`) updated by its ``gradacc:``."""
    return {**AXOLOTL_DEFAULTS, **dict(cfg.get("gradacc") or {})}


def refuse_total_train_batch_size(cfg: Mapping[str, Any], knobs: Mapping[str, Any]) -> None:
    """``gradacc: {total_train_batch_size: ...}`` is refused: axolotl derives ``batch_size`` (``micro_batch_size`` x
    ``gradient_accumulation_steps`` x processes) and from it the run's total steps, its multipack batches and its
    schedule when it loads the config, before the trainer exists; an accumulation derived afterwards by the trainer
    would leave them planned for the old one. The way out, named with the values: axolotl's own keys."""
    total = knobs.get("total_train_batch_size")
    if total is None:
        return
    micro, world = cfg.get("micro_batch_size") or 1, cfg.get("world_size") or 1
    fits = total % (micro * world) == 0
    hint = f" (here {total} // ({micro} x {world}) = {total // (micro * world)})" if fits else ""
    raise GradAccConfigError(
        f"`gradacc: {{total_train_batch_size: {total}}}` is not supported by hf_gradacc's axolotl plugin: axolotl "
        "computes `batch_size` (`micro_batch_size` x `gradient_accumulation_steps` x processes) and from it the "
        "run's total steps, its sample-packing batches and its schedule when it loads the config, before the trainer "
        "that would derive the accumulation exists. Drop `total_train_batch_size` from `gradacc` and set axolotl's "
        f"`micro_batch_size` and `gradient_accumulation_steps` = total / (`micro_batch_size` x processes){hint}."
    )


def check_axolotl_config(cfg: Mapping[str, Any], knobs: Mapping[str, Any]) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError` for an axolotl setup the plugin cannot make exact, with the key
    to change."""
    refuse_total_train_batch_size(cfg, knobs)
    for key in ("context_parallel_size", "sequence_parallel_degree", "tensor_parallel_size"):
        if (cfg.get(key) or 1) > 1:
            raise GradAccConfigError(
                f"hf_gradacc's axolotl plugin does not support `{key}: {cfg.get(key)}`: the ranks that split one "
                "sample are not data-parallel ranks, and hf_gradacc would count them as such. Remove the plugin or "
                f"set `{key}: 1`."
            )
    if not cfg.get("sample_packing"):
        return
    if not cfg.get("attn_decontaminates_packing", False):
        raise GradAccConfigError(
            f"`sample_packing: true` with `attn_implementation: {cfg.get('attn_implementation')!r}`: axolotl says "
            "this "
            "attention does not keep packed samples apart, so every sample would attend to the ones packed before it "
            "and no accumulation can equal the unpacked step. Set `attn_implementation` to flash_attention_2, "
            "flex_attention, sdpa or eager, or `sample_packing: false`."
        )
    kind = next((key for key in ("reward_model", "process_reward_model", "rl") if cfg.get(key)), None)
    if kind is not None:
        raise GradAccConfigError(
            f"`sample_packing: true` with `{kind}: {cfg.get(kind)}`: this trainer's loss is a mean over samples (or "
            "pairs), and axolotl's packed rows do not carry the sample boundaries hf_gradacc counts samples from. "
            "Set `sample_packing: false` (hf_gradacc's `regroup_micro_batches` cuts the padding instead)."
        )
    planners = [k for k in _PLANNING_KNOBS if knobs.get(k)]
    if planners:
        raise GradAccConfigError(
            f"`gradacc: {{{', '.join(f'{k}: {knobs[k]}' for k in planners)}}}` with `sample_packing: true`: axolotl's "
            "multipack sampler already forms the micro-batches, and two planners cannot both decide them. Drop "
            f"{planners} from `gradacc`, or set `sample_packing: false`."
        )


class SampleStartMasked:
    """A collator wrapper: the collator's batch with ``labels`` set to ``ignore_index`` where ``position_ids`` is 0.

    In a packed row that position is a sample's first token; its label is the target of the PREVIOUS sample's last
    token, which without packing predicts nothing. In a padded, unpacked row it is the row's first label, which the
    causal shift never uses. Batches without ``position_ids`` pass unchanged. Other attributes are the collator's.

    Example:
        ```python
        collate = SampleStartMasked(axolotl_collator)
        batch = collate(features)  # labels [[-100, 6, 7, 8, 9]] for position_ids [[0, 1, 2, 0, 1]], labels 5 ... 9
        ```
    """

    def __init__(self, collator: Callable[..., Any], ignore_index: int = IGNORE_INDEX) -> None:
        self.collator = collator
        self.ignore_index = ignore_index

    def __call__(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.collator(features, *args, **kwargs)
        positions, labels = batch.get("position_ids"), batch.get("labels")
        if torch.is_tensor(positions) and torch.is_tensor(labels) and positions.shape == labels.shape:
            batch["labels"] = labels.masked_fill(positions == 0, self.ignore_index)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name == "collator":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.collator, name)


# ---------------------------------------------------------------------------------------------- the class swap
def make_exact_with_step_contexts(trainer: Trainer, knobs: Mapping[str, Any]) -> Trainer:
    """:func:`hf_gradacc.make_exact`, for a class whose ``training_step`` overrides are axolotl's known wrappers.

    The wrappers are taken off (an intermediate class whose ``training_step`` is the first one below them), the
    instance made exact, and its contexts moved to ``training_step_context``, which hf_gradacc's step enters around
    each micro-batch's forward and backward: the order axolotl nests them in, outermost first. axolotl's own
    class-level `Trainer` patches (:data:`AXOLOTL_TRAINER_PATCHES`) are recognised: no warning names them."""
    RECOGNISED_TRAINER_PATCHES.update(AXOLOTL_TRAINER_PATCHES)  # axolotl's own patches: no warning at make_exact
    original = type(trainer)
    unwrapped, contexts = _without_step_wrappers(original)
    trainer.__class__ = unwrapped
    try:
        make_exact(trainer, **knobs)
    except BaseException:
        trainer.__class__ = original
        raise
    if contexts:
        trainer.__class__ = _with_step_contexts(type(trainer), tuple(contexts))
    return trainer


_UNWRAPPED: dict[type, tuple[type, list[str]]] = {}
_WITH_CONTEXTS: dict[tuple[type, tuple[str, ...]], type] = {}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _without_step_wrappers(cls: type) -> tuple[type, list[str]]:
    """``cls`` with its known ``training_step`` wrappers skipped, and the instance attributes of their contexts."""
    if cls in _UNWRAPPED:
        return _UNWRAPPED[cls]
    contexts: list[str] = []
    wrapped = False
    step = None
    for klass in cls.__mro__:
        if "training_step" not in vars(klass):
            continue
        name = _qualified(klass)
        if name not in _STEP_WRAPPERS:
            step = vars(klass)["training_step"]
            break
        wrapped = True
        if _STEP_WRAPPERS[name] is not None:
            contexts.append(_STEP_WRAPPERS[name])
    if not wrapped or step is None:
        result: tuple[type, list[str]] = (cls, [])
    else:
        namespace = {"training_step": step, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        result = (type(cls.__name__, (cls,), namespace), contexts)
    _UNWRAPPED[cls] = result
    return result


def _with_step_contexts(cls: type, contexts: tuple[str, ...]) -> type:
    key = (cls, contexts)
    if key not in _WITH_CONTEXTS:

        def training_step_context(self: Any) -> contextlib.AbstractContextManager:
            return _entered(self, super(made, self).training_step_context(), contexts)

        namespace = {"training_step_context": training_step_context, "__module__": cls.__module__}
        made = type(cls.__name__, (cls,), namespace)
        _WITH_CONTEXTS[key] = made
    return _WITH_CONTEXTS[key]


@contextlib.contextmanager
def _entered(trainer: Any, inner: contextlib.AbstractContextManager, contexts: tuple[str, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for attribute in contexts:
            stack.enter_context(getattr(trainer, attribute, None) or contextlib.nullcontext())
        stack.enter_context(inner)
        yield
