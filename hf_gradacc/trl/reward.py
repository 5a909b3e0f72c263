"""``GradAccRewardTrainer`` and ``GradAccRewardConfig``: TRL's reward-model training with exact accumulation.

TRL returns the mean over the micro-batch's pairs (the Bradley-Terry loss); it is weighted by the micro-batch's share
of the step's pairs (``LossTerm(mean x rows, "samples")``; two rows per pair, chosen then rejected, in every
micro-batch alike). The loss of the step is the mean over ALL its pairs, not the mean of micro-batch means.

Regrouping keeps every pair whole, each counted as its two padded rows (one process); packing is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from trl import RewardConfig, RewardTrainer

from ..config import GradAccArguments
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import (
    check_args_class,
    pair_lengths,
    planned_train_dataloader,
    refuse_packed_pairs,
    refuse_uneven_micro_batches,
    split_outputs,
    training_window,
    with_outputs,
)

__all__ = ["GradAccRewardConfig", "GradAccRewardTrainer"]


@dataclass
class GradAccRewardConfig(GradAccArguments, RewardConfig):
    """TRL's `RewardConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccRewardTrainer`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccRewardConfig

        args = GradAccRewardConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8)
        ```
    """


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
        check_args_class(config, RewardConfig, GradAccRewardConfig)
        refuse_packed_pairs(type(self).__name__, config, gradacc_args)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then the reward trainer's refusals (also run by :func:`~hf_gradacc.make_exact`)."""
        refuse_packed_pairs(type(self).__name__, self.args, gradacc_args)
        super()._setup_gradacc(gradacc_args)
        refuse_uneven_micro_batches(self, rows_gathered=True)

    def get_train_dataloader(self):
        """With regrouping (one process), the planner reads each pair's padded footprint: twice the longer of its
        ``chosen_ids`` and ``rejected_ids``, as TRL's collator pads both rows."""
        dataloader = planned_train_dataloader(
            self, lengths_of=lambda dataset: pair_lengths(self, dataset, prompt=None, max_length=None)
        )
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and
        backward."""
        return self.maybe_activation_offload_context

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch (the mean over its pairs), weighted by its share of the step's pairs."""
        window = training_window(self)
        out = RewardTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)
        if window is None:
            return out
        loss, outputs = split_outputs(out, return_outputs)
        # A preference batch is [chosen; rejected]: counted rows are twice the pairs in every micro-batch alike.
        pairs = LossTerm(total=loss * window.current_counts.num_samples, normalize_by="samples")
        return with_outputs(pairs, return_outputs, outputs)
