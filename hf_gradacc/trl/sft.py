"""``GradAccSFTTrainer`` and ``GradAccSFTConfig``: TRL's supervised fine-tuning with exact accumulation.

TRL's ``compute_loss`` is called with ``num_items_in_batch`` = the step's target tokens counted over every
micro-batch and rank (completion-only and assistant-only masks, padding-free batches), so the micro-batch's token sum
comes back divided by the step's count; it is handed to the mixin as that sum (``LossTerm(..., "tokens")``). The loss
of the step is the mean over ALL its target tokens. A mixture-of-experts model's router load-balancing term is taken
out of TRL's loss and kept as its own term weighted by the micro-batch's routed tokens (:mod:`hf_gradacc.auxiliary`).

``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` / ``pack_micro_batches`` plan from TRL's tokenized rows,
and every packed row is collated by TRL's own collator in its padding-free mode (TRL's labels, its ``seq_lengths``).
``auto_micro_batch`` and ``defer_normalization`` are refused (TRL gathers its metrics once per micro-batch), and so is
packing a vision dataset.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from ..compat import trl_at_least
from ..config import GradAccArguments
from ..errors import GradAccConfigError
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import (
    TRL_FUSED_LM_HEAD,
    ForwardRecorder,
    check_args_class,
    planned_train_dataloader,
    refuse_uneven_micro_batches,
    router_term,
    split_outputs,
    training_window,
    with_outputs,
)

__all__ = ["GradAccSFTConfig", "GradAccSFTTrainer"]


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
        check_args_class(kwargs.get("args", args[1] if len(args) > 1 else None), SFTConfig, GradAccSFTConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then what TRL's SFT cannot do exactly (also run by :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        refuse_uneven_micro_batches(self, rows_gathered=False)
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
            dataloader = planned_train_dataloader(self, packing_collator=padding_free)
            if dataloader is not None:
                return dataloader
        return super().get_train_dataloader()

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and
        backward."""
        return self.maybe_activation_offload_context

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch, as its token SUM over the step's global count (``LossTerm(..., "tokens")``),
        plus the router term of a mixture-of-experts model. Outside training: TRL's batch mean, unchanged."""
        window = training_window(self)
        if window is None:
            return SFTTrainer.compute_loss(
                self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        num_tokens = window.global_count("tokens")
        recorder = ForwardRecorder(model) if self._trl_adds_router_loss() else None
        out = SFTTrainer.compute_loss(
            self,
            recorder or model,
            inputs,
            return_outputs=return_outputs,
            num_items_in_batch=torch.tensor(num_tokens, device=self.args.device),
        )
        loss, outputs = split_outputs(out, return_outputs)
        router = router_term(self, recorder, window)
        if router is not None and trl_at_least(TRL_FUSED_LM_HEAD):
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
            return with_outputs(main, return_outputs, outputs)
        return with_outputs({"main": main, "aux": router[1]}, return_outputs, outputs)

    def _trl_adds_router_loss(self) -> bool:
        """Whether TRL's ``compute_loss`` adds ``coef x aux / GA`` to its loss: on its fused path only (label smoothing
        and ``compute_loss_func`` leave the router loss out; DeepSpeed sequence parallelism is not data parallelism,
        which is all hf_gradacc's backends do)."""
        if not self.aux_loss_enabled or self.compute_loss_func is not None:
            return False
        if not trl_at_least(TRL_FUSED_LM_HEAD):
            return self.label_smoother is None  # TRL < 1.15 takes the labels away from the model for label smoothing
        return not (self.label_smoother is not None and self.args.loss_type == "nll")

    def _trl_loss_scale(self) -> int:
        """The factor SFTTrainer multiplies its loss by when given ``num_items_in_batch``."""
        if not self.args.average_tokens_across_devices:
            return 1
        return self.accelerator.num_processes // self.get_tp_size()
