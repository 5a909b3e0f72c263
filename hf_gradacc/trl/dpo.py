"""``GradAccDPOTrainer`` and ``GradAccDPOConfig``: TRL's direct preference optimisation with exact accumulation.

TRL returns the mean over the micro-batch's pairs; it is weighted by the micro-batch's share of the step's pairs
(``LossTerm(mean x rows, "samples")``; a preference batch holds two rows per pair, chosen then rejected, in every
micro-batch alike). The loss of the step is the mean over ALL its pairs, not the mean of micro-batch means.

``loss_type="sft"`` (a token mean per micro-batch in TRL) is kept apart, normalised by the step's chosen completion
tokens; ``"aot"`` / ``"aot_unpaired"`` (which sort the pairs of a micro-batch) are refused with accumulation. A
mixture-of-experts model's router term is its own term, weighted by routed tokens (:mod:`hf_gradacc.auxiliary`).

Regrouping keeps every pair whole, each counted as its two padded rows (one process: TRL gathers per-pair values
once per micro-batch, so several processes would need micro-batches of one size); packing is refused (a preference
batch is chosen rows then rejected rows, never one row).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from trl import DPOConfig, DPOTrainer

from ..config import GradAccArguments
from ..errors import GradAccConfigError
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import (
    ForwardRecorder,
    check_args_class,
    pair_lengths,
    planned_train_dataloader,
    refuse_packed_pairs,
    refuse_uneven_micro_batches,
    router_term,
    split_outputs,
    training_window,
    with_outputs,
)

__all__ = ["GradAccDPOConfig", "GradAccDPOTrainer"]

# TRL's DPO losses that are not a mean of per-pair values: they sort the log-ratios of the micro-batch, so the step
# depends on how pairs are grouped. Exact only when the whole step is one micro-batch on one process.
_BATCH_LEVEL_DPO_LOSSES = frozenset({"aot", "aot_unpaired"})
# TRL's DPO loss that is a token mean over the micro-batch's chosen completions (RPO's NLL term).
_TOKEN_MEAN_DPO_LOSS = "sft"


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


class GradAccDPOTrainer(GradAccMixin, DPOTrainer):
    """TRL's `DPOTrainer` whose optimizer step is the mean over ALL the step's preference pairs, on every process count
    and micro-batch split (stock TRL averages micro-batch means, then divides by the accumulation steps).

    The reference model (``ref_model``, a PEFT adapter switched off, or ``precompute_ref_log_probs=True``), the fused
    LM head, every per-pair ``loss_type`` and their weights, ``ld_alpha``, ``use_weighting`` and TRL's logged rewards
    and log-probabilities are TRL's. ``loss_type="sft"`` (RPO's NLL term) is a mean over the step's chosen completion
    tokens. ``"aot"`` / ``"aot_unpaired"`` sort the pairs of a micro-batch, so they are refused unless the whole step
    is one micro-batch on one process.

    Example:
        ```python
        from hf_gradacc.trl import GradAccDPOConfig, GradAccDPOTrainer

        args = GradAccDPOConfig(
            output_dir="out", per_device_train_batch_size=2, gradient_accumulation_steps=8, beta=0.1
        )
        trainer = GradAccDPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=pairs,
                                    processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        check_args_class(config, DPOConfig, GradAccDPOConfig)
        refuse_packed_pairs(type(self).__name__, config, gradacc_args)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then what TRL's DPO cannot do exactly (also run by :func:`~hf_gradacc.make_exact`)."""
        refuse_packed_pairs(type(self).__name__, self.args, gradacc_args)
        super()._setup_gradacc(gradacc_args)
        refuse_uneven_micro_batches(self, rows_gathered=True)
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
        dataloader = planned_train_dataloader(
            self,
            lengths_of=lambda dataset: pair_lengths(
                self, dataset, prompt="prompt_ids", max_length=self.args.max_length
            ),
        )
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and
        backward."""
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
        window = training_window(self)
        if window is None:
            return DPOTrainer.compute_loss(self, model, _without_labels(inputs), return_outputs=return_outputs)
        needs_outputs = self.aux_loss_enabled or bool(self._sft_weight)
        recorder = ForwardRecorder(model) if needs_outputs else None
        out = DPOTrainer.compute_loss(self, recorder or model, _without_labels(inputs), return_outputs=return_outputs)
        loss, outputs = split_outputs(out, return_outputs)
        terms: dict[str, LossTerm] = {}
        router = router_term(self, recorder, window)
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
            return with_outputs(pairs, return_outputs, outputs)
        return with_outputs({"pairs": pairs, **terms}, return_outputs, outputs)


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
