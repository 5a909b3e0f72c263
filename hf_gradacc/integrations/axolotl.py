"""The axolotl plugin: exact gradient accumulation for whatever trainer axolotl builds from its YAML.

List it under ``plugins:``; hf_gradacc's knobs (the :class:`~hf_gradacc.GradAccArguments` fields) go in a
``gradacc:`` mapping of the same YAML::

    plugins:
      - hf_gradacc.integrations.axolotl.GradAccPlugin
    gradacc:                        # optional
      nonfinite_steps: skip

How it composes with axolotl and its other plugins: it claims nothing (no trainer class, no collator class, no
optimizer). Axolotl builds its trainer as usual (``AxolotlTrainer``, ``AxolotlRewardTrainer``,
``AxolotlDPOTrainer``, or a class another plugin or ``trainer_cls`` chose), then ``post_trainer_create`` hands it
to :func:`hf_gradacc.make_exact`, which swaps the instance's class for ``GradAcc<class>`` with hf_gradacc's step in
front, keeping the class's own overrides. Two things are axolotl-specific:

- axolotl's trainers wrap ``training_step`` in context managers (activation offloading, layer offloading) or add
  memory clean-up after it (DPO). ``make_exact`` refuses any class that overrides ``training_step``, because
  hf_gradacc's step replaces it; for these KNOWN wrappers the plugin gives hf_gradacc's step the same contexts
  (``training_step_context``, entered around each micro-batch's forward and backward) instead. A ``training_step``
  the plugin does not know is refused by ``make_exact`` with the way out.
- ``sample_packing: true`` (multipack): each packed sample must see only itself, and the loss must count the same
  targets as the samples unpacked. The attention is axolotl's business (its ``attn_decontaminates_packing``: the
  flash / flex kernels read the sequence boundaries, sdpa and eager get a block-diagonal mask from the restarting
  ``position_ids``); a setup where it is not is refused, and so is a model hf_gradacc's probe finds mixing the
  samples. Axolotl concatenates the labels of a packed row as they are, so the last token of one sample is trained
  to predict the FIRST token of the next one, a target that does not exist without packing: the plugin's collator
  wrapper sets the label at every sample start (``position_ids == 0``) to the ignore index, as transformers'
  ``DataCollatorWithFlattening`` and hf_gradacc's own packing do. Then the tokens counted are those of the samples
  trained unpacked, and a packed step equals the unpacked one.

Refused, with the reason, before the model is loaded (``pre_model_load``; checked again on the built trainer): packing with an attention that lets packed samples
see each other; packing for a reward / process-reward / preference trainer (their counts are per sample, and
axolotl's packed rows do not carry the sample boundaries hf_gradacc counts samples from); packing together with
hf_gradacc's own ``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` / ``pack_micro_batches`` (axolotl's
multipack sampler already forms the micro-batches); context or tensor parallelism (ranks that share samples are
not data-parallel ranks); every trainer :func:`hf_gradacc.make_exact` refuses (TRL trainers hf_gradacc.trl does not
cover: ORPO, KTO, CPO, PRM; an unknown ``training_step`` override).

Axolotl hard-codes ``average_tokens_across_devices=False``; hf_gradacc counts the step's denominator over every
micro-batch and rank itself, so that setting no longer matters (a warning says it is ignored) and the plugin leaves
it as it is: turning it on would make transformers multiply a ``compute_loss_func`` loss (axolotl's ``use_eaft``) by
the number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from axolotl.integrations.base import BasePlugin
from axolotl.utils.logging import get_logger
from pydantic import BaseModel, Field, field_validator
from transformers import Trainer

from ..config import GradAccArguments, resolve_settings
from ..data.pack_check import check_packing_support
from ..errors import GradAccConfigError
from ..exact import make_exact
from ..loss import IGNORE_INDEX

# axolotl shows INFO records of its own loggers only ("axolotl*"); the line saying hf_gradacc is active must show.
LOG = get_logger("axolotl.integrations.hf_gradacc")

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
        known = {f.name for f in dataclasses.fields(GradAccArguments)}
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise ValueError(
                f"`gradacc` has unknown keys {unknown}; hf_gradacc's knobs are {sorted(known)} (see docs/api.md)."
            )
        resolve_settings(GradAccArguments(**knobs))  # the values, checked as GradAccTrainer checks them
        return knobs


class GradAccPlugin(BasePlugin):
    """Exact gradient accumulation for axolotl: ``plugins: [hf_gradacc.integrations.axolotl.GradAccPlugin]``.

    After axolotl built its trainer (any class), :func:`hf_gradacc.make_exact` makes it exact in place: one optimizer
    step over ``gradient_accumulation_steps`` micro-batches on every rank equals one full-batch step over the same
    samples. Knobs: the ``gradacc:`` mapping of the YAML. What is refused, and why: the module docstring and
    docs/axolotl.md.

    Example:
        ```yaml
        base_model: ./tiny-llama
        plugins:
          - hf_gradacc.integrations.axolotl.GradAccPlugin
        gradacc:
          nonfinite_steps: skip
        micro_batch_size: 2
        gradient_accumulation_steps: 4
        ```
    """

    def get_input_args(self) -> str:
        return f"{__name__}.GradAccAxolotlArgs"

    def pre_model_load(self, cfg: Any) -> None:
        check_axolotl_config(cfg, _knobs(cfg))  # refuse before the model is loaded; checked again on the trainer

    def post_trainer_create(self, cfg: Any, trainer: Trainer) -> None:
        knobs = _knobs(cfg)
        check_axolotl_config(cfg, knobs)
        if cfg.get("sample_packing"):
            check_packing_support(trainer.model)  # the attention keeps packed samples apart, or the reason
            trainer.data_collator = SampleStartMasked(trainer.data_collator, knobs.get("ignore_index", IGNORE_INDEX))
        built = type(trainer)
        make_exact_with_step_contexts(trainer, knobs)
        LOG.info(
            f"hf_gradacc: exact gradient accumulation is active on axolotl's {built.__name__} (now "
            f"{type(trainer).__name__}); knobs {knobs}"
            + ("; packed rows: the label at each sample start is ignored" if cfg.get("sample_packing") else "")
        )


def _knobs(cfg: Any) -> dict[str, Any]:
    return {**AXOLOTL_DEFAULTS, **dict(cfg.get("gradacc") or {})}


def check_axolotl_config(cfg: Mapping[str, Any], knobs: Mapping[str, Any]) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError` for an axolotl setup the plugin cannot make exact, with the key
    to change."""
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
            f"`sample_packing: true` with `attn_implementation: {cfg.get('attn_implementation')!r}`: axolotl says this "
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
    each micro-batch's forward and backward: the order axolotl nests them in, outermost first."""
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
