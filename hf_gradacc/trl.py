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
- A mixture-of-experts model's router load-balancing term (SFT, DPO) is taken out of TRL's loss and kept as its own
  term weighted by the micro-batch's routed tokens (:mod:`hf_gradacc.auxiliary`), logged as ``loss/aux``.

DPO's ``loss_type="sft"`` (a token mean per micro-batch in TRL) is kept apart, normalised by the step's chosen
completion tokens; ``"aot"`` / ``"aot_unpaired"`` (which sort the pairs of a micro-batch) are refused with accumulation.

TRL gathers its metrics across ranks INSIDE ``compute_loss``, once per micro-batch (``entropy``,
``mean_token_accuracy``, rewards, ...): every rank must run the same micro-batches, row for row. The modes in which ranks
may run different numbers (or sizes) of micro-batches are refused at construction: ``auto_micro_batch``,
``defer_normalization``, and for DPO / reward models regrouping on several processes; a step in which the ranks hold
different numbers of micro-batches stops every rank before TRL's first gather. See docs/trl.md.

``pip install "hf_gradacc[trl]"`` installs TRL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .config import GradAccArguments
from .errors import GradAccConfigError, GradAccDataError, GradAccError
from .loss import LossTerm
from .mixin import GradAccMixin


class TRLDependencyError(GradAccError, ImportError):
    """``hf_gradacc.trl`` was imported but TRL is not installed (or too old to provide its trainers)."""


try:
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
except ImportError as _error:  # pragma: no cover - exercised with trl hidden from sys.modules
    raise TRLDependencyError(
        f"hf_gradacc.trl needs TRL's trainers, which could not be imported ({_error}). Install the extra: "
        'pip install "hf_gradacc[trl]"'
    ) from _error

__all__ = [
    "GradAccDPOConfig",
    "GradAccDPOTrainer",
    "GradAccRewardConfig",
    "GradAccRewardTrainer",
    "GradAccSFTConfig",
    "GradAccSFTTrainer",
    "TRLDependencyError",
]

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


class _ForwardRecorder:
    """Stands for the model inside TRL's ``compute_loss`` and keeps the outputs of the first forward pass that uses
    the fused LM head (the policy's), for the router term. Everything else is the model's."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.outputs: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._model(*args, **kwargs)
        if self.outputs is None and kwargs.get("fused_lm_head"):
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
    weighted = trainer.router_aux_loss_coef * aux.reshape(())
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
        _refuse_uneven_micro_batches(self, rows_gathered=False)

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
        if router is not None:
            # TRL adds coef x aux / (micro-batches of the step); the router term is kept apart, by routed tokens.
            loss = loss - router[0] / self.current_gradient_accumulation_steps
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
        _check_args_class(kwargs.get("args", args[2] if len(args) > 2 else None), DPOConfig, GradAccDPOConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)
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
    over the micro-batch's chosen tokens), from the policy forward's per-token log-probabilities."""
    shift_mask = inputs["completion_mask"][..., 1:]
    per_token = outputs.log_probs[:, -shift_mask.size(1) :]
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
        _check_args_class(kwargs.get("args", args[1] if len(args) > 1 else None), RewardConfig, GradAccRewardConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)
        _refuse_uneven_micro_batches(self, rows_gathered=True)

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
