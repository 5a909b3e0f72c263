"""TRL's trainers with :class:`~hf_gradacc.GradAccMixin` in front: exact accumulation for SFT, DPO and reward models.

Each trainer keeps TRL's own loss (its fused LM head: no full-vocabulary logits per micro-batch), its data
preparation, collators, reference model and logged metrics; only the normalisation over the optimizer step changes:

- ``GradAccSFTTrainer``: TRL's ``compute_loss`` is called with ``num_items_in_batch`` = the step's target tokens
  counted over every micro-batch and rank (completion-only and assistant-only masks, padding-free batches), so the
  micro-batch's token sum comes back divided by the step's count; it is handed to the mixin as that sum
  (``LossTerm(..., "tokens")``). The loss of the step is the mean over ALL its target tokens.
- ``GradAccDPOTrainer`` / ``GradAccRewardTrainer``: TRL returns the mean over the micro-batch's pairs; it is weighted
  by the micro-batch's share of the step's pairs (``LossTerm(mean x rows, "samples")``; a preference batch holds two
  rows per pair, chosen then rejected, in every micro-batch alike). The loss of the step is the mean over ALL its pairs,
  not the mean of micro-batch means.
- ``GradAccGRPOTrainer``: completions are generated, scored and sliced when the step's micro-batches are fetched
  (TRL's ``_prepare_inputs``, in order), so the step's completion tokens and sequences are counted over every rank
  before the first forward pass; TRL's normaliser of each ``loss_type`` is undone and the micro-batch's sum is divided
  by the step's tokens (``dapo``, ``bnpo``, ``cispo``, ``vespo``) or sequences (``grpo``, ``dr_grpo``, ``sapo``,
  ``luspo``), whatever ``steps_per_generation`` and ``num_iterations``; the entropy bonus is its own term by tokens.
- A mixture-of-experts model's router load-balancing term (SFT, DPO, GRPO) is taken out of TRL's loss and kept as its
  own term weighted by the micro-batch's routed tokens (:mod:`hf_gradacc.auxiliary`), logged as ``loss/aux``.

DPO's ``loss_type="sft"`` (a token mean per micro-batch in TRL) is kept apart, normalised by the step's chosen
completion tokens; ``"aot"`` / ``"aot_unpaired"`` (which sort the pairs of a micro-batch) are refused with accumulation.

``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` / ``pack_micro_batches``: ``GradAccSFTTrainer`` plans from
TRL's tokenized rows and collates each packed row with TRL's own collator in its padding-free mode (TRL's labels, its
``seq_lengths``); DPO and reward models regroup whole pairs, each counted as its two padded rows (one process), and
refuse packing (a preference batch is chosen rows then rejected rows, never one row).

TRL gathers its metrics across ranks INSIDE ``compute_loss``, once per micro-batch (``entropy``,
``mean_token_accuracy``, rewards, ...): every rank must run the same micro-batches, row for row. The modes in which ranks
may run different numbers (or sizes) of micro-batches are refused at construction: ``auto_micro_batch``,
``defer_normalization``, and for DPO / reward models regrouping on several processes; a step in which the ranks hold
different numbers of micro-batches stops every rank before TRL's first gather. See docs/trl.md.

``pip install "hf_gradacc[trl]"`` installs TRL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .config import GradAccArguments, resolve_settings
from .data.loader import build_train_dataloader, check_train_dataset
from .errors import GradAccConfigError, GradAccDataError, GradAccError
from .loss import LossTerm
from .mixin import GradAccMixin


class TRLDependencyError(GradAccError, ImportError):
    """``hf_gradacc.trl`` was imported but TRL is not installed (or too old to provide its trainers)."""


try:
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
except ImportError as _error:  # pragma: no cover - exercised with trl hidden from sys.modules
    raise TRLDependencyError(
        f"hf_gradacc.trl needs TRL's trainers, which could not be imported ({_error}). Install the extra: "
        'pip install "hf_gradacc[trl]"'
    ) from _error

import trl as _trl  # noqa: E402

from .compat import SUPPORTED_VERSIONS, installed_version, is_supported, trl_at_least  # noqa: E402

if not is_supported("trl", _trl.__version__):
    raise TRLDependencyError(
        f"hf_gradacc.trl supports trl{SUPPORTED_VERSIONS['trl']}, and trl {_trl.__version__} is installed. Install a "
        f"supported version with the extra: pip install \"hf_gradacc[trl]\" (or pip install 'trl{SUPPORTED_VERSIONS['trl']}')."
    )

__all__ = [
    "GradAccDPOConfig",
    "GradAccDPOTrainer",
    "GradAccGRPOConfig",
    "GradAccGRPOTrainer",
    "GradAccRewardConfig",
    "GradAccRewardTrainer",
    "GradAccSFTConfig",
    "GradAccSFTTrainer",
    "TRLDependencyError",
]

# What hf_gradacc's trainers read from TRL, by the first release that has it (docs/compatibility.md, "What depends on
# the version"). Older releases in the supported range take the other branch where it exists, or are refused at
# construction naming the feature (:func:`_refuse_before`).
# TRL's fused LM head (`model(..., fused_lm_head=True)`: per-token log-probabilities and entropies, no full logits) in
# SFT, DPO and GRPO. Before it, SFT's default `chunked_nll` patches the model's forward, whose loss holds the router
# term; DPO reads the full logits; GRPO computes entropies from the logits inside TRL.
_TRL_FUSED_LM_HEAD = "1.15"
# GRPO: `dapo` / `cispo` / `vespo` divided by the generation batch's tokens rescaled to one accumulation window, the
# entropy bonus a token mean / GA for every loss type, `luspo` masked before its per-sequence sum. Before it (1.9) the
# generation batch's tokens are not rescaled and `luspo` with token-level importance sampling sums padded positions.
_TRL_GRPO_STEP_NORMALISED = "1.10"


def _refuse_before(version: str, feature: str, why: str, way_out: str) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError` when the installed TRL is older than ``version``: ``feature``
    (the setting, by its field) cannot be made exact there."""
    if not trl_at_least(version):
        raise GradAccConfigError(
            f"{feature} needs trl>={version} with hf_gradacc (installed {installed_version('trl')}): {why}. "
            f"{way_out}, or upgrade TRL (pip install 'trl>={version},<2')."
        )


# TRL's DPO losses that are not a mean of per-pair values: they sort the log-ratios of the micro-batch, so the step
# depends on how pairs are grouped. Exact only when the whole step is one micro-batch on one process.
_BATCH_LEVEL_DPO_LOSSES = frozenset({"aot", "aot_unpaired"})
# TRL's DPO loss that is a token mean over the micro-batch's chosen completions (RPO's NLL term).
_TOKEN_MEAN_DPO_LOSS = "sft"


# ---------------------------------------------------------------------------------------------- configs
@dataclass
class GradAccSFTConfig(GradAccArguments, SFTConfig):
    """TRL's `SFTConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccSFTTrainer`;
    every field is a flag with `HfArgumentParser`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccSFTConfig

        args = GradAccSFTConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
                                completion_only_loss=True)
        ```
    """


@dataclass
class GradAccDPOConfig(GradAccArguments, DPOConfig):
    """TRL's `DPOConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccDPOTrainer`.

    Example:
        ```python
        from transformers import HfArgumentParser
        from hf_gradacc.trl import GradAccDPOConfig

        (args,) = HfArgumentParser(GradAccDPOConfig).parse_args_into_dataclasses(
            ["--output_dir", "out", "--beta", "0.1", "--gradient_accumulation_steps", "8"]
        )
        ```
    """


@dataclass
class GradAccRewardConfig(GradAccArguments, RewardConfig):
    """TRL's `RewardConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccRewardTrainer`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccRewardConfig

        args = GradAccRewardConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8)
        ```
    """


# ---------------------------------------------------------------------------------------------- shared pieces
def _check_args_class(args: Any, trl_config: type, ours: type) -> None:
    """TRL converts a `TrainingArguments` that is not its own config with ``to_dict()``, which the GradAcc fields do
    not survive: name the config class to use instead."""
    if isinstance(args, GradAccArguments) and not isinstance(args, trl_config):
        raise GradAccConfigError(
            f"`args` is a {type(args).__name__}, which TRL would rebuild as a {trl_config.__name__} without the "
            f"hf_gradacc fields. Use hf_gradacc.trl.{ours.__name__} (a {trl_config.__name__} with the knobs), or a "
            f"{trl_config.__name__} with `gradacc_args=`."
        )


def _refuse_uneven_micro_batches(trainer: GradAccMixin, *, rows_gathered: bool) -> None:
    """TRL gathers its metrics across ranks inside ``compute_loss``, once per micro-batch; DPO and the reward trainer
    also gather per-row tensors. Refuse the modes in which ranks may run different numbers of micro-batches (a gather
    would wait forever for a rank that has none left) or micro-batches of different sizes (``rows_gathered``)."""
    settings, name = trainer.gradacc, type(trainer).__name__
    why = (
        "TRL gathers its logged metrics across processes inside `compute_loss`, once per micro-batch, so every process "
        "must run the same micro-batches"
    )
    if settings.auto_micro_batch:
        raise GradAccConfigError(
            f"`auto_micro_batch=True` is not supported by {name}: {why}, and after an out-of-memory error the processes "
            "split their micro-batches independently. Turn `auto_micro_batch` off."
        )
    if settings.defer_normalization:
        raise GradAccConfigError(
            f"`defer_normalization=True` is not supported by {name}: {why}, and streamed optimizer steps may hold "
            "different numbers of micro-batches per process. Turn `defer_normalization` off."
        )
    if rows_gathered and settings.regroups and trainer.accelerator.num_processes > 1:
        raise GradAccConfigError(
            f"`regroup_micro_batches` / `max_tokens_per_micro_batch` is not supported by {name} on several processes: "
            f"{why} with the same number of pairs (per-pair rewards and log-probabilities are gathered), and "
            "regrouping gives the processes micro-batches of different sizes. Turn regrouping off."
        )


def _planned_train_dataloader(trainer: GradAccMixin, **planning: Any) -> Any:
    """The regrouping / packing training dataloader built with the trainer's own ``planning`` inputs (see
    :func:`~hf_gradacc.data.loader.build_train_dataloader`), or None where the mixin's stock path applies."""
    if not trainer.gradacc.regroups:
        return None
    check_train_dataset(trainer.train_dataset)
    return build_train_dataloader(trainer, trainer.gradacc, **planning)


def _refuse_packed_pairs(name: str, args: Any, gradacc_args: Any) -> None:
    """Preference batches cannot be packed; refused before TRL builds anything (a reward model would otherwise fail
    the causal-LM check of packing first, without the reason that matters here)."""
    if args is not None and not isinstance(args, GradAccArguments):
        args = None  # TRL's own config: the knobs come from `gradacc_args` only
    if resolve_settings(args, gradacc_args).pack_micro_batches:
        raise GradAccConfigError(
            f"`pack_micro_batches=True` is not supported by {name}: a preference micro-batch is its pairs' chosen "
            "rows followed by their rejected rows, which TRL's loss splits in halves and compares row by row, and a "
            "packed micro-batch is ONE row of concatenated samples. Turn `pack_micro_batches` off; "
            "`regroup_micro_batches` / `max_tokens_per_micro_batch` keep every pair whole (one process)."
        )


def _column(dataset: Any, name: str, trainer_name: str) -> list[Any]:
    """One column of a map-style training dataset (a `datasets.Dataset` or any dataset of dicts)."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        if name in columns:
            return list(dataset[name])
    else:
        samples = [dataset[i] for i in range(len(dataset))]
        if all(isinstance(s, Mapping) and name in s for s in samples):
            return [s[name] for s in samples]
    raise GradAccConfigError(
        f"`regroup_micro_batches` / `max_tokens_per_micro_batch` with {trainer_name} plan micro-batches from each "
        f"pair's tokenized lengths, but the training dataset has no `{name}` column (TRL writes it when it tokenizes "
        "the dataset; vision datasets are tokenized per batch). Turn regrouping off."
    )


def _pair_lengths(trainer: GradAccMixin, dataset: Any, *, prompt: str | None, max_length: int | None) -> list[int]:
    """The padded footprint of every preference pair for the planner: TRL pads the chosen AND rejected rows of a
    micro-batch to its longest sequence, so a micro-batch of P pairs computes ``2 P x longest`` token positions. Each
    pair counts as ``2 x`` its longer sequence (``prompt`` ids + completion ids, cut at ``max_length``), so the
    planner's rows x longest row is exactly the micro-batch's padded tokens, and ``max_tokens_per_micro_batch`` caps
    what the forward pass computes."""
    name = type(trainer).__name__
    prompts = _column(dataset, prompt, name) if prompt else None
    chosen, rejected = _column(dataset, "chosen_ids", name), _column(dataset, "rejected_ids", name)
    lengths = []
    for index, (c, r) in enumerate(zip(chosen, rejected, strict=True)):
        extra = len(prompts[index]) if prompts is not None else 0
        longest = max(extra + len(c), extra + len(r))
        lengths.append(2 * (longest if max_length is None else min(longest, max_length)))
    budget = trainer.gradacc.max_tokens_per_micro_batch
    if budget is not None and lengths:
        widest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
        if lengths[widest] > budget:
            raise GradAccConfigError(
                f"Preference pair {widest} needs {lengths[widest]} padded tokens in any micro-batch (its chosen and "
                f"rejected rows, {lengths[widest] // 2} tokens each), more than `max_tokens_per_micro_batch` "
                f"({budget}). Raise `max_tokens_per_micro_batch` to at least {lengths[widest]} or shorten the data "
                "(`max_length`)."
            )
    return lengths


class _ForwardRecorder:
    """Stands for the model inside TRL's ``compute_loss`` and keeps the outputs of the policy's forward pass, for the
    router term: the first one that uses the fused LM head (TRL >= 1.15), or the first one at all (older TRL, whose
    SFT and DPO losses run the policy through this model once, and the reference elsewhere). Everything else is the
    model's."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._fused = trl_at_least(_TRL_FUSED_LM_HEAD)
        self.outputs: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._model(*args, **kwargs)
        if self.outputs is None and (kwargs.get("fused_lm_head") or not self._fused):
            self.outputs = outputs
        return outputs

    def __getattr__(self, name: str) -> Any:
        if name == "_model":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self._model, name)


def _training_window(trainer: GradAccMixin) -> Any:
    """The window of the micro-batch running now, or None (evaluation, prediction).

    Every process must run as many micro-batches as the others (TRL gathers inside ``compute_loss``): a step in which
    they differ (an IterableDataset that runs out sooner on one process) stops every process here, from the counts
    they all gathered, instead of leaving one waiting in TRL's gather."""
    window = trainer.current_window
    if window is None or window.index is None:
        return None
    per_rank = window.counts.num_micro_batches_per_rank
    if len(set(per_rank)) > 1:
        raise GradAccDataError(
            f"The processes hold different numbers of micro-batches in this optimizer step ({list(per_rank)}). "
            f"{type(trainer).__name__} runs TRL's compute_loss, which gathers its metrics across processes once per "
            "micro-batch, so a process with more micro-batches would wait forever. Use a map-style dataset (accelerate "
            "gives every process the same number of batches) or an IterableDataset that yields as many batches on "
            "every process."
        )
    return window


def _router_term(trainer: Any, recorder: _ForwardRecorder | None, window: Any) -> tuple[torch.Tensor, LossTerm] | None:
    """``(what TRL added to its loss, the exact term)`` for the router load-balancing loss of the policy forward, or
    None when the trainer has none. The exact term weights ``coef x aux`` by the micro-batch's routed tokens
    (``"input_tokens"``), the rule of :mod:`hf_gradacc.auxiliary`."""
    if recorder is None or not trainer.aux_loss_enabled:
        return None
    aux = getattr(recorder.outputs, "aux_loss", None)
    if not torch.is_tensor(aux):
        return None
    coef = getattr(trainer, "router_aux_loss_coef", None)  # TRL < 1.15's SFTTrainer keeps it in its args only
    weighted = (trainer.args.router_aux_loss_coef if coef is None else coef) * aux.reshape(())
    routed = window.current_counts.num_input_tokens
    return weighted, LossTerm(total=weighted * routed, normalize_by="input_tokens")


def _with_outputs(result: Any, return_outputs: bool, outputs: Any) -> Any:
    return (result, outputs) if return_outputs else result


def _split(out: Any, return_outputs: bool) -> tuple[torch.Tensor, Any]:
    return (out[0], out[1]) if return_outputs else (out, None)


# ---------------------------------------------------------------------------------------------- SFT
class GradAccSFTTrainer(GradAccMixin, SFTTrainer):
    """TRL's `SFTTrainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step: the loss of
    a step is the mean over ALL its target tokens (completion-only / assistant-only masks, padding-free and packed
    batches), whatever the micro-batches hold.

    TRL's loss path is kept: its fused LM head (no full-vocabulary logits), ``loss_type="dft"``, its logged
    ``entropy``, ``mean_token_accuracy`` and ``num_tokens``, activation offloading. Takes `SFTTrainer`'s arguments plus
    ``gradacc_args=``; ``args`` is a :class:`GradAccSFTConfig` or an `SFTConfig`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccSFTConfig, GradAccSFTTrainer

        args = GradAccSFTConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8)
        trainer = GradAccSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        _check_args_class(kwargs.get("args", args[1] if len(args) > 1 else None), SFTConfig, GradAccSFTConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then what TRL's SFT cannot do exactly (also run by :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        _refuse_uneven_micro_batches(self, rows_gathered=False)
        if self.gradacc.pack_micro_batches and self._is_vision_dataset:
            raise GradAccConfigError(
                "`pack_micro_batches=True` is not supported for a vision dataset: TRL's vision collator turns images "
                "and text into padded batches itself (TRL refuses its own `packing` and `padding_free` for them), so "
                "there are no token rows to pack. Turn `pack_micro_batches` off."
            )

    def get_train_dataloader(self):
        """With ``pack_micro_batches``, every packed micro-batch is collated by TRL's own collator in its padding-free
        mode: the row TRL's ``padding_free=True`` builds (labels as TRL's dataset preparation made them, completion-
        and assistant-only masks included; the first label of every sequence masked; positions restarting per
        sequence, per packed document with ``packing=True``; ``pad_to_multiple_of`` honoured). The planner reads the
        lengths of TRL's tokenized ``input_ids``."""
        collator = self.data_collator
        if self.gradacc.pack_micro_batches and isinstance(collator, DataCollatorForLanguageModeling):
            padding_free = dataclasses.replace(collator, padding_free=True)
            dataloader = _planned_train_dataloader(self, packing_collator=padding_free)
            if dataloader is not None:
                return dataloader
        return super().get_train_dataloader()

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and backward."""
        return self.maybe_activation_offload_context

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch, as its token SUM over the step's global count (``LossTerm(..., "tokens")``),
        plus the router term of a mixture-of-experts model. Outside training: TRL's batch mean, unchanged."""
        window = _training_window(self)
        if window is None:
            return SFTTrainer.compute_loss(
                self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        num_tokens = window.global_count("tokens")
        recorder = _ForwardRecorder(model) if self._trl_adds_router_loss() else None
        out = SFTTrainer.compute_loss(
            self,
            recorder or model,
            inputs,
            return_outputs=return_outputs,
            num_items_in_batch=torch.tensor(num_tokens, device=self.args.device),
        )
        loss, outputs = _split(out, return_outputs)
        router = _router_term(self, recorder, window)
        if router is not None and trl_at_least(_TRL_FUSED_LM_HEAD):
            # TRL adds coef x aux / (micro-batches of the step); the router term is kept apart, by routed tokens.
            loss = loss - router[0] / self.current_gradient_accumulation_steps
        elif router is not None:
            # TRL < 1.15: the model's own loss (its patched `chunked_nll` forward or its stock one) holds coef x aux,
            # scaled with the token loss by the process factor; kept apart, by routed tokens.
            loss = loss - router[0] * self._trl_loss_scale()
        # TRL returned sum / num_tokens, times the number of processes when `average_tokens_across_devices`: undo both
        # to hand the mixin the micro-batch's sum (it divides by the same count and multiplies by the world size).
        main = LossTerm(total=loss * (num_tokens / self._trl_loss_scale()), normalize_by="tokens")
        if router is None:
            return _with_outputs(main, return_outputs, outputs)
        return _with_outputs({"main": main, "aux": router[1]}, return_outputs, outputs)

    def _trl_adds_router_loss(self) -> bool:
        """Whether TRL's ``compute_loss`` adds ``coef x aux / GA`` to its loss: on its fused path only (label smoothing
        and ``compute_loss_func`` leave the router loss out; DeepSpeed sequence parallelism is not data parallelism,
        which is all hf_gradacc's backends do)."""
        if not self.aux_loss_enabled or self.compute_loss_func is not None:
            return False
        if not trl_at_least(_TRL_FUSED_LM_HEAD):
            return self.label_smoother is None  # TRL < 1.15 takes the labels away from the model for label smoothing
        return not (self.label_smoother is not None and self.args.loss_type == "nll")

    def _trl_loss_scale(self) -> int:
        """The factor SFTTrainer multiplies its loss by when given ``num_items_in_batch``."""
        if not self.args.average_tokens_across_devices:
            return 1
        return self.accelerator.num_processes // self.get_tp_size()


# ---------------------------------------------------------------------------------------------- DPO
class GradAccDPOTrainer(GradAccMixin, DPOTrainer):
    """TRL's `DPOTrainer` whose optimizer step is the mean over ALL the step's preference pairs, on every process count
    and micro-batch split (stock TRL averages micro-batch means, then divides by the accumulation steps).

    The reference model (``ref_model``, a PEFT adapter switched off, or ``precompute_ref_log_probs=True``), the fused
    LM head, every per-pair ``loss_type`` and their weights, ``ld_alpha``, ``use_weighting`` and TRL's logged rewards
    and log-probabilities are TRL's. ``loss_type="sft"`` (RPO's NLL term) is a mean over the step's chosen completion
    tokens. ``"aot"`` / ``"aot_unpaired"`` sort the pairs of a micro-batch, so they are refused unless the whole step is
    one micro-batch on one process.

    Example:
        ```python
        from hf_gradacc.trl import GradAccDPOConfig, GradAccDPOTrainer

        args = GradAccDPOConfig(output_dir="out", per_device_train_batch_size=2, gradient_accumulation_steps=8, beta=0.1)
        trainer = GradAccDPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=pairs,
                                    processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        _check_args_class(config, DPOConfig, GradAccDPOConfig)
        _refuse_packed_pairs(type(self).__name__, config, gradacc_args)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then what TRL's DPO cannot do exactly (also run by :func:`~hf_gradacc.make_exact`)."""
        _refuse_packed_pairs(type(self).__name__, self.args, gradacc_args)
        super()._setup_gradacc(gradacc_args)
        _refuse_uneven_micro_batches(self, rows_gathered=True)
        batch_level = sorted(set(self.loss_types) & _BATCH_LEVEL_DPO_LOSSES)
        if batch_level and (self.args.gradient_accumulation_steps > 1 or self.accelerator.num_processes > 1):
            raise GradAccConfigError(
                f"`loss_type` {batch_level} sorts the log-ratios of the pairs within each micro-batch, so the step "
                "depends on how pairs are grouped and cannot equal the full-batch step with "
                f"gradient_accumulation_steps={self.args.gradient_accumulation_steps} on "
                f"{self.accelerator.num_processes} process(es). Use a per-pair loss type, or one micro-batch per step "
                "on one process."
            )
        self._sft_weight = sum(
            w for t, w in zip(self.loss_types, self.loss_weights, strict=True) if t == _TOKEN_MEAN_DPO_LOSS
        )
        if self._sft_weight and self.use_weighting:
            # TRL multiplies the micro-batch's token mean by the mean of the pairs' WPO weights: a product of two
            # micro-batch means, which no split of the step into sums can reproduce.
            raise GradAccConfigError(
                '`loss_type` "sft" with `use_weighting=True` weighs each micro-batch\'s token mean by the mean weight '
                "of its pairs, which depends on how pairs are grouped; hf_gradacc cannot make it equal the full-batch "
                "step. "
                'Turn `use_weighting` off, or drop "sft" from `loss_type`.'
            )

    def get_train_dataloader(self):
        """With regrouping (one process), the planner reads each pair's padded footprint: twice its longer sequence
        (``prompt_ids`` + ``chosen_ids`` or ``rejected_ids``, cut at ``max_length``), as TRL's collator pads both
        rows of the pair."""
        dataloader = _planned_train_dataloader(
            self,
            lengths_of=lambda dataset: _pair_lengths(
                self, dataset, prompt="prompt_ids", max_length=self.args.max_length
            ),
        )
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and backward."""
        return self.maybe_activation_offload_context

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches; with ``loss_type`` "sft" each gets ``labels`` marking its chosen completion
        tokens, so that the step's count of them is gathered with the other counts (one collective)."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._sft_weight:
            batches = [_with_chosen_labels(batch) for batch in batches]
        return batches, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch (the mean over its pairs), weighted by its share of the step's pairs; the
        "sft" term by its share of the step's chosen tokens; the router term by routed tokens."""
        window = _training_window(self)
        if window is None:
            return DPOTrainer.compute_loss(self, model, _without_labels(inputs), return_outputs=return_outputs)
        needs_outputs = self.aux_loss_enabled or bool(self._sft_weight)
        recorder = _ForwardRecorder(model) if needs_outputs else None
        out = DPOTrainer.compute_loss(self, recorder or model, _without_labels(inputs), return_outputs=return_outputs)
        loss, outputs = _split(out, return_outputs)
        terms: dict[str, LossTerm] = {}
        router = _router_term(self, recorder, window)
        if router is not None:
            loss = loss - router[0]  # TRL adds coef x aux of the micro-batch; kept apart, by routed tokens
            terms["aux"] = router[1]
        if self._sft_weight:
            nll_sum, nll_mean = _chosen_nll(recorder.outputs, inputs)
            loss = loss - self._sft_weight * nll_mean  # TRL's token mean of this micro-batch, replaced below
            terms["sft"] = LossTerm(total=self._sft_weight * nll_sum, normalize_by="tokens")
        # A preference batch is [chosen; rejected]: counted rows are twice the pairs in every micro-batch alike.
        pairs = LossTerm(total=loss * window.current_counts.num_samples, normalize_by="samples")
        if not terms:
            return _with_outputs(pairs, return_outputs, outputs)
        return _with_outputs({"pairs": pairs, **terms}, return_outputs, outputs)


def _with_chosen_labels(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``labels``: the input ids of the chosen completions (first half of the rows), ``-100`` elsewhere, so that the
    causal count (``labels[..., 1:] != -100``) is TRL's chosen completion mask, shifted as TRL shifts it."""
    input_ids, completion_mask = batch["input_ids"], batch["completion_mask"]
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    labels[labels.shape[0] // 2 :] = -100
    return {**batch, "labels": labels}


def _without_labels(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """TRL's DPO passes every key but its own to the model, and ``labels`` separately: drop the counting labels."""
    return {k: v for k, v in inputs.items() if k != "labels"} if "labels" in inputs else inputs


def _chosen_nll(outputs: Any, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen completions' negative log-likelihood of the micro-batch: its sum, and TRL's "sft" value (the mean
    over the micro-batch's chosen tokens), from the policy forward's per-token log-probabilities (TRL >= 1.15's fused
    head), or from its full logits (older TRL, whose "sft" term is the cross-entropy of those logits)."""
    shift_mask = inputs["completion_mask"][..., 1:]
    log_probs = getattr(outputs, "log_probs", None)
    if log_probs is None:
        logits = outputs.logits[:, -inputs["input_ids"].size(1) :][:, :-1]
        targets = inputs["input_ids"][..., 1:]
        log_probs = torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)
    per_token = log_probs[:, -shift_mask.size(1) :]
    chosen_logps, _ = per_token.chunk(2, dim=0)
    chosen_mask, _ = shift_mask.chunk(2, dim=0)
    picked = chosen_logps[chosen_mask.bool()]
    return -picked.sum(), -picked.mean()


# ---------------------------------------------------------------------------------------------- reward model
class GradAccRewardTrainer(GradAccMixin, RewardTrainer):
    """TRL's `RewardTrainer` whose optimizer step is the mean over ALL the step's preference pairs (the Bradley-Terry
    loss, with ``margin`` and ``center_rewards_coefficient``), on every process count and micro-batch split.

    Example:
        ```python
        from hf_gradacc.trl import GradAccRewardConfig, GradAccRewardTrainer

        args = GradAccRewardConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8)
        trainer = GradAccRewardTrainer(model=reward_model, args=args, train_dataset=pairs, processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        _check_args_class(config, RewardConfig, GradAccRewardConfig)
        _refuse_packed_pairs(type(self).__name__, config, gradacc_args)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then the reward trainer's refusals (also run by :func:`~hf_gradacc.make_exact`)."""
        _refuse_packed_pairs(type(self).__name__, self.args, gradacc_args)
        super()._setup_gradacc(gradacc_args)
        _refuse_uneven_micro_batches(self, rows_gathered=True)

    def get_train_dataloader(self):
        """With regrouping (one process), the planner reads each pair's padded footprint: twice the longer of its
        ``chosen_ids`` and ``rejected_ids``, as TRL's collator pads both rows."""
        dataloader = _planned_train_dataloader(
            self, lengths_of=lambda dataset: _pair_lengths(self, dataset, prompt=None, max_length=None)
        )
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and backward."""
        return self.maybe_activation_offload_context

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch (the mean over its pairs), weighted by its share of the step's pairs."""
        window = _training_window(self)
        out = RewardTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)
        if window is None:
            return out
        loss, outputs = _split(out, return_outputs)
        # A preference batch is [chosen; rejected]: counted rows are twice the pairs in every micro-batch alike.
        pairs = LossTerm(total=loss * window.current_counts.num_samples, normalize_by="samples")
        return _with_outputs(pairs, return_outputs, outputs)


# ---------------------------------------------------------------------------------------------- GRPO
# What each TRL `loss_type` is a mean over, in the full-batch step: the step's completion tokens, or its sequences
# (`dr_grpo`: its sequences times `max_completion_length`, a constant folded into the micro-batch's sum).
_GRPO_DENOMINATORS: dict[str, str] = {
    "dapo": "tokens",
    "bnpo": "tokens",
    "cispo": "tokens",
    "vespo": "tokens",
    "grpo": "samples",
    "dr_grpo": "samples",
    "sapo": "samples",
    "luspo": "samples",
}
# The loss types TRL divides by the generation batch's completion tokens rescaled to one step (N / W x GA /
# steps_per_generation: the step's count only when a generation batch is exactly one step); the others divide by the
# micro-batch's own tokens or rows, and by GA.
_GRPO_GENERATION_NORMALISED = frozenset({"dapo", "cispo", "vespo"})


@dataclass
class GradAccGRPOConfig(GradAccArguments, GRPOConfig):
    """TRL's `GRPOConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccGRPOTrainer`;
    every field is a flag with `HfArgumentParser`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccGRPOConfig

        args = GradAccGRPOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                                 num_generations=4, steps_per_generation=8, loss_type="dapo")
        ```
    """


class GradAccGRPOTrainer(GradAccMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step over the
    same completions: each ``loss_type`` is a mean over ALL the step's completion tokens (``dapo``, ``bnpo``,
    ``cispo``, ``vespo``) or sequences (``grpo``, ``dr_grpo``, ``sapo``, ``luspo``), whatever
    ``steps_per_generation`` (below, equal to or above ``gradient_accumulation_steps``) and ``num_iterations``.

    The step's micro-batches are generated, scored and sliced by TRL's own ``_prepare_inputs`` when they are fetched,
    in order, before the first forward pass (the policy has not moved yet within a step, so the completions are the
    ones stock TRL would generate), so that the window counts their completion tokens and sequences over every rank in
    its one collective. ``compute_loss`` runs TRL's loss and undoes TRL's normaliser: the entropy bonus
    (``entropy_coef``, adaptive or not) becomes its own term over the step's completion tokens, and a
    mixture-of-experts router term one weighted by routed tokens. Generation (transformers or vLLM), reward functions,
    advantages, the KL term, clipping, importance sampling and TRL's logged metrics are TRL's.

    Refused, with the field to change: ``top_entropy_quantile < 1`` with accumulation or with an entropy bonus (TRL's
    entropy threshold is a quantile over ONE micro-batch's tokens), regrouping and packing (GRPO's dataloader yields
    prompts, not sequences), ``accumulation_schedule`` (TRL's generation cadence assumes a fixed number of
    micro-batches per step), ``auto_micro_batch`` and ``defer_normalization``, and loss types this version does not
    know. On TRL < 1.15 (no fused LM head) also the entropy bonus and a mixture-of-experts router term, and on TRL 1.9
    ``luspo`` with a per-token loss, each naming the installed TRL and the version that has it (docs/trl.md).

    Example:
        ```python
        from hf_gradacc.trl import GradAccGRPOConfig, GradAccGRPOTrainer

        def reward_len(completions, **kwargs):
            return [-abs(20 - len(c)) for c in completions]

        args = GradAccGRPOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                                 num_generations=4, loss_type="bnpo")
        trainer = GradAccGRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=prompts,
                                     processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        _check_args_class(kwargs.get("args", args[2] if len(args) > 2 else None), GRPOConfig, GradAccGRPOConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then GRPO's refusals (also run by :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        _refuse_grpo_settings(self)
        _refuse_uneven_micro_batches(self, rows_gathered=True)

    # ------------------------------------------------------------------ fetch: generate before counting
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, each generated, scored and sliced by TRL's ``_prepare_inputs`` in order (TRL
        generates once every ``steps_per_generation x num_iterations`` micro-batches and serves slices of its buffer in
        between), with ``labels`` marking the completion tokens of the loss (``completion_mask x tool_mask``) and the
        ``attention_mask`` of the forward pass, so that the window counts them."""
        generation_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        _agree_on_micro_batches(self, len(generation_batches))
        self.model.train()  # TRL keys generation, its buffer and its metrics on `model.training`
        start = time.perf_counter()
        batches = []
        for generation_batch in generation_batches:
            inputs = GRPOTrainer._prepare_inputs(self, generation_batch)
            self._step += 1  # TRL advances its micro-batch counter in its training_step, which the mixin replaces
            batches.append(_with_completion_labels(inputs, ignore_index=self.head.ignore_index))
        self._current_train_step_time += time.perf_counter() - start
        return batches, None

    def _prepare_inputs(self, inputs):
        """In a training step the micro-batch was prepared when the step was fetched: returned as it is. Elsewhere
        (evaluation) TRL's: generate and score the batch."""
        window = self.current_window
        if window is not None and window.index is not None:
            return inputs
        return super()._prepare_inputs(inputs)

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """Times each micro-batch for TRL's ``step_time`` metric (generation included), logged once per step."""
        return self._timed_micro_batch()

    @contextlib.contextmanager
    def _timed_micro_batch(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._current_train_step_time += time.perf_counter() - start
            if self.is_last_micro_batch:
                self._metrics["train"]["step_time"].append(self._current_train_step_time)
                self._current_train_step_time = 0.0

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch with TRL's normaliser undone: ``LossTerm(token sum, "tokens")`` or
        ``LossTerm(sum of per-sequence values, "samples")`` by ``loss_type``; the entropy bonus and the router term
        apart (``{"policy": ..., "entropy": ..., "aux": ...}``). Outside training: TRL's loss, unchanged."""
        window = _training_window(self)
        if window is None:
            return GRPOTrainer.compute_loss(
                self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        entropy_coef = self._entropy_coef_in_use()  # before TRL's adaptive controller moves it at the step's end
        needs_outputs = self._entropy_bonus_enabled or self.aux_loss_enabled
        recorder = _ForwardRecorder(model) if needs_outputs else None
        loss = GRPOTrainer.compute_loss(self, recorder or model, inputs, return_outputs=return_outputs)
        steps = self.current_gradient_accumulation_steps
        mask = _grpo_loss_mask(inputs)
        terms: dict[str, LossTerm] = {}
        if self._entropy_bonus_enabled:
            entropies = recorder.outputs.entropy[:, -mask.size(1) :]
            entropy_sum = (entropies * mask).sum()
            # TRL subtracted coef x the micro-batch's token mean / GA: put it back, keep coef x the sum apart.
            loss = loss + entropy_coef * entropy_sum / max(int(mask.sum()), 1) / steps
            terms["entropy"] = LossTerm(total=-entropy_coef * entropy_sum, normalize_by="tokens")
        router = _router_term(self, recorder, window)
        if router is not None:
            loss = loss - router[0] / steps  # TRL adds coef x aux / GA; kept apart, by routed tokens
            terms["aux"] = router[1]
        policy = LossTerm(
            total=loss * self._trl_normaliser(inputs, mask, steps), normalize_by=_GRPO_DENOMINATORS[self.loss_type]
        )
        return {"policy": policy, **terms} if terms else policy

    def _trl_normaliser(self, inputs: Mapping[str, Any], mask: torch.Tensor, steps: int) -> float:
        """What TRL's ``_compute_loss`` divided the micro-batch's sum by (training mode), so that the loss times it is
        the sum: the sum of per-token values (``dapo``, ``cispo``, ``vespo``, ``bnpo``), of per-sequence token means
        (``grpo``, ``sapo``), of per-sequence sums (``luspo``), or the token sum over ``max_completion_length``
        (``dr_grpo``)."""
        if self.loss_type in _GRPO_GENERATION_NORMALISED:
            # the generation batch's tokens over every process, rescaled to one step: N / W x GA / steps_per_generation
            generated = float(inputs["num_items_in_batch"].clamp(min=1.0))
            if not trl_at_least(_TRL_GRPO_STEP_NORMALISED):  # TRL 1.9: N / W, not rescaled to the step
                return generated / self.accelerator.num_processes
            return generated / self.accelerator.num_processes * steps / self.args.steps_per_generation
        if self.loss_type == "bnpo":
            return float(steps * max(int(mask.sum()), 1))
        return float(steps * inputs["completion_ids"].size(0))

    def _entropy_coef_in_use(self) -> float:
        """The entropy coefficient TRL applies to every micro-batch of this step (adaptive: 0 until the last step's
        entropy fell to ``entropy_target``)."""
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)


def _refuse_grpo_settings(trainer: Any) -> None:
    """The GRPO settings no split of the step into sums can reproduce, or that would replace TRL's dataloader."""
    args, settings, name = trainer.args, trainer.gradacc, type(trainer).__name__
    _refuse_grpo_before_fused_head(trainer)
    if trainer.loss_type not in _GRPO_DENOMINATORS:
        raise GradAccConfigError(
            f"`loss_type` {trainer.loss_type!r} is not one {name} knows how TRL normalises; it cannot make it exact. "
            f"Use one of {sorted(_GRPO_DENOMINATORS)}."
        )
    quantile = trainer.top_entropy_quantile
    if quantile < 1.0 and trainer._entropy_bonus_enabled:
        raise GradAccConfigError(
            f"`top_entropy_quantile` ({quantile}) < 1 with an entropy bonus (`entropy_coef` / `use_adaptive_entropy`): "
            "TRL's bonus is then a mean over the tokens above a quantile of each micro-batch's entropies, a count "
            f"{name} cannot gather over the step. Set `top_entropy_quantile=1.0`, or turn the entropy bonus off."
        )
    if quantile < 1.0 and args.gradient_accumulation_steps > 1:
        raise GradAccConfigError(
            f"`top_entropy_quantile` ({quantile}) < 1 keeps the tokens above a quantile of ONE micro-batch's "
            "entropies, so the step depends on how its completions are grouped (gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}). Set `top_entropy_quantile=1.0`, or `gradient_accumulation_steps=1` "
            "(the quantile is then over the step's tokens, gathered over processes)."
        )
    if settings.regroups:
        raise GradAccConfigError(
            f"`regroup_micro_batches` / `max_tokens_per_micro_batch` / `pack_micro_batches` is not supported by {name}: "
            "GRPO's dataloader yields generation batches of prompts (TRL's RepeatSampler), whose completions exist "
            "only after generation. Turn them off."
        )
    if settings.accumulation_schedule is not None:
        raise GradAccConfigError(
            f"`accumulation_schedule` is not supported by {name}: TRL's generation cadence and its choice to keep the "
            "generation-time log-probabilities follow the fixed `gradient_accumulation_steps`. Remove "
            "`accumulation_schedule`."
        )


def _refuse_grpo_before_fused_head(trainer: Any) -> None:
    """What GRPO reads from TRL's fused LM head (TRL >= 1.15), or from TRL >= 1.10's normalisers, refused on older
    TRL naming the field: TRL 1.9 computes the entropies and the router loss inside ``_compute_loss``, out of reach."""
    name = type(trainer).__name__
    if trainer._entropy_bonus_enabled:
        _refuse_before(
            _TRL_FUSED_LM_HEAD, f"{name}'s entropy bonus (`entropy_coef` / `use_adaptive_entropy`)",
            "hf_gradacc reads the per-token entropies from the outputs of TRL's fused LM head to keep the bonus as its "
            "own term over the step's tokens, and older TRL computes them from the logits inside its loss",
            "Set `entropy_coef=0.0` and `use_adaptive_entropy=False`",
        )  # fmt: skip
    if trainer.aux_loss_enabled:
        _refuse_before(
            _TRL_FUSED_LM_HEAD, f"{name} with a mixture-of-experts router loss (`router_aux_loss_coef`)",
            "hf_gradacc reads the router loss from the outputs of TRL's fused LM head to weight it by routed tokens, "
            "and older TRL computes it inside its loss",
            "Set `router_aux_loss_coef=0.0`",
        )  # fmt: skip
    exact_luspo = (
        trainer.importance_sampling_level == "sequence"
        and trainer.beta == 0.0
        and trainer.top_entropy_quantile == 1.0
        and not (trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    )
    if trainer.loss_type == "luspo" and not exact_luspo:
        _refuse_before(
            _TRL_GRPO_STEP_NORMALISED, f'{name} with `loss_type="luspo"` and a per-token loss',
            "TRL 1.9's luspo averages the per-token loss times each sequence's length over every position of the "
            "micro-batch, padding included, so the step depends on how completions are padded together",
            'Use `importance_sampling_level="sequence"` with `beta=0.0` (the LUSPO paper\'s setup), or another '
            "`loss_type`",
        )  # fmt: skip


def _agree_on_micro_batches(trainer: Any, num_local: int) -> None:
    """Every process must prepare as many micro-batches as the others: TRL's generation gathers rewards and lengths
    across processes. One small collective BEFORE generating, so that a process with fewer batches (an
    IterableDataset that runs out sooner) stops every process instead of leaving one waiting in TRL's gather."""
    if trainer.accelerator.num_processes == 1:
        return
    local = torch.tensor([num_local], dtype=torch.int64, device=trainer.args.device)
    per_rank = [int(n) for n in trainer.backend.all_gather(local).reshape(-1).tolist()]
    if len(set(per_rank)) > 1:
        raise GradAccDataError(
            f"The processes hold different numbers of micro-batches in this optimizer step ({per_rank}). "
            f"{type(trainer).__name__} generates each micro-batch's completions with TRL, which gathers rewards across "
            "processes, so a process with more would wait forever. Use a map-style dataset (accelerate gives every "
            "process the same number of batches) or an IterableDataset that yields as many batches on every process."
        )


def _grpo_loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The completion tokens TRL's loss sums over: ``completion_mask``, times ``tool_mask`` when tools ran."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def _with_completion_labels(inputs: Mapping[str, Any], *, ignore_index: int) -> dict[str, Any]:
    """``inputs`` plus ``labels``: a leading ignored column (dropped by the causal count's shift), then the completion
    ids where the loss mask is 1 and ``ignore_index`` elsewhere, so the window's count is exactly the loss mask's; plus
    the forward pass's ``attention_mask`` (prompt then completion), the routed tokens of a router term. TRL's loss
    reads neither key."""
    completion_ids = inputs["completion_ids"]
    targets = completion_ids.masked_fill(_grpo_loss_mask(inputs) == 0, ignore_index)
    first = torch.full_like(targets[:, :1], ignore_index)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return {**inputs, "labels": torch.cat([first, targets], dim=1), "attention_mask": attention_mask}
