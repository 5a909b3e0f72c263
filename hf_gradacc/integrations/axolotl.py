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

Refused, with the reason, before the model is loaded (``pre_model_load``; checked again on the built trainer): packing
with an attention that lets packed samples see each other; packing for a reward / process-reward / preference trainer
(their counts are per sample, and axolotl's packed rows do not carry the sample boundaries hf_gradacc counts samples
from); packing together with hf_gradacc's own ``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` /
``pack_micro_batches`` (axolotl's multipack sampler already forms the micro-batches); context or tensor parallelism
(ranks that share samples are not data-parallel ranks); every trainer :func:`hf_gradacc.make_exact` refuses (TRL
trainers hf_gradacc.trl does not cover: ORPO, KTO, CPO, PRM; an unknown ``training_step`` override).

Axolotl hard-codes ``average_tokens_across_devices=False``; hf_gradacc counts the step's denominator over every
micro-batch and rank itself, so that setting no longer matters (a warning says it is ignored) and the plugin leaves
it as it is: turning it on would make transformers multiply a ``compute_loss_func`` loss (axolotl's ``use_eaft``) by
the number of processes.

The parts that need no axolotl (the ``gradacc:`` block, the refusals, the collator wrapper, the class swap) live in
:mod:`hf_gradacc.integrations.axolotl_core`; this module adds the plugin class axolotl loads.
"""

from __future__ import annotations

from typing import Any

from axolotl.integrations.base import BasePlugin
from axolotl.utils.logging import get_logger
from transformers import Trainer

from ..data.pack_check import check_packing_support
from ..loss import IGNORE_INDEX
from .axolotl_core import (
    AXOLOTL_DEFAULTS,
    PLUGIN_PATH,
    GradAccAxolotlArgs,
    SampleStartMasked,
    check_axolotl_config,
    make_exact_with_step_contexts,
    plugin_knobs,
)

__all__ = [
    "AXOLOTL_DEFAULTS",
    "PLUGIN_PATH",
    "GradAccAxolotlArgs",
    "GradAccPlugin",
    "SampleStartMasked",
    "check_axolotl_config",
    "make_exact_with_step_contexts",
]

# axolotl shows INFO records of its own loggers only ("axolotl*"); the line saying hf_gradacc is active must show.
LOG = get_logger("axolotl.integrations.hf_gradacc")


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
        check_axolotl_config(cfg, plugin_knobs(cfg))  # refuse before the model is loaded; checked again on the trainer

    def post_trainer_create(self, cfg: Any, trainer: Trainer) -> None:
        knobs = plugin_knobs(cfg)
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
