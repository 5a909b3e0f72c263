"""``GradAccRLOOTrainer`` and ``GradAccRLOOConfig``: TRL's REINFORCE leave-one-out with exact accumulation.

RLOO's advantage of a completion is its reward minus the mean reward of the other completions of its prompt (over
the generation batch, every process's rewards gathered); its loss is per SEQUENCE (``-A min(rho, clip(rho))`` with the
sequence ratio ``rho``), and the step's loss is the mean over ALL the step's completions. TRL averages each
micro-batch's sequences and divides by the accumulation steps: exact while every micro-batch holds as many
completions (TRL slices its generation buffer evenly), not otherwise.

Here the step's micro-batches are generated, scored and sliced by TRL's own ``_prepare_inputs`` when the step is
fetched (as :mod:`hf_gradacc.trl.grpo` does), each micro-batch's mean is weighted by its share of the step's
completions (``LossTerm(mean x rows, "samples")``), counted over every process, whatever ``steps_per_generation`` and
``num_iterations``.

Refused: regrouping and packing (the dataloader yields prompts), ``accumulation_schedule``, ``auto_micro_batch``,
``defer_normalization`` and a mixture-of-experts router term (not tested for RLOO). ``num_generations`` below 2 (no
other completion of the prompt for the baseline) is refused by :class:`GradAccRLOOConfig` when it is built, naming the
field; TRL's own ``RLOOConfig`` refuses 1 with its ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import RLOOConfig, RLOOTrainer

from ..config import GradAccArguments
from ..errors import GradAccConfigError
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import (
    GeneratesAtFetch,
    check_args_class,
    note_generation_given,
    refuse_generation_for_the_given_accumulation,
    refuse_uneven_micro_batches,
    training_window,
)

__all__ = ["GradAccRLOOConfig", "GradAccRLOOTrainer"]


@dataclass
class GradAccRLOOConfig(GradAccArguments, RLOOConfig):
    """TRL's `RLOOConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccRLOOTrainer`;
    every field is a flag with `HfArgumentParser`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccRLOOConfig

        args = GradAccRLOOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                                 num_generations=4, steps_per_generation=8)
        ```

    ``num_generations`` below 2 is refused here, before TRL's own checks (whose divisibility test divides by it), as a
    :class:`~hf_gradacc.GradAccConfigError` naming the field. With ``total_train_batch_size``, give
    ``steps_per_generation`` or ``generation_batch_size`` too (TRL derives them here from
    ``gradient_accumulation_steps``; refused at construction otherwise).
    """

    def __post_init__(self) -> None:
        refuse_single_generation(self.num_generations)
        note_generation_given(self)
        super().__post_init__()


def refuse_single_generation(num_generations: Any) -> None:
    """RLOO's baseline of a completion is the mean reward of the OTHER completions of its prompt: every prompt needs
    2 or more. Refused naming the field (TRL's RLOOConfig refuses 1 without naming it, and 0 divides by zero)."""
    if isinstance(num_generations, int) and num_generations < 2:
        raise GradAccConfigError(
            f"`num_generations` is {num_generations}: RLOO's baseline for a completion is the mean reward of the "
            "OTHER "
            "completions of its prompt, so every prompt needs at least 2. Set `num_generations` to 2 or more (the "
            "generation batch, `per_device_train_batch_size` x processes x `steps_per_generation`, must be divisible "
            "by it)."
        )


class GradAccRLOOTrainer(GradAccMixin, GeneratesAtFetch, RLOOTrainer):
    """TRL's `RLOOTrainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step: the mean
    over ALL the step's completions of the clipped per-sequence RLOO loss, whatever ``steps_per_generation`` and
    ``num_iterations``, counted by the window over every process.

    Generation, reward functions, the leave-one-out baseline (over each prompt's generations in TRL's generation
    batch), the KL penalty in the reward and TRL's logged metrics are TRL's. Refused with the field to change:
    regrouping and packing, ``accumulation_schedule``, ``auto_micro_batch``, ``defer_normalization``, a
    mixture-of-experts router term.

    Example:
        ```python
        from hf_gradacc.trl import GradAccRLOOConfig, GradAccRLOOTrainer

        def reward_len(completions, **kwargs):
            return [-abs(20 - len(c)) for c in completions]

        args = GradAccRLOOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                                 num_generations=4)
        trainer = GradAccRLOOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=prompts,
                                     processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        check_args_class(kwargs.get("args", args[2] if len(args) > 2 else None), RLOOConfig, GradAccRLOOConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then RLOO's refusals (also run by :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        refuse_uneven_micro_batches(self, rows_gathered=True)
        refuse_generation_for_the_given_accumulation(self)
        name = type(self).__name__
        if self.gradacc.regroups:
            raise GradAccConfigError(
                f"`regroup_micro_batches` / `max_tokens_per_micro_batch` / `pack_micro_batches` is not supported by "
                f"{name}: its dataloader yields generation batches of prompts, whose completions exist only after "
                "generation. Turn them off."
            )
        if self.gradacc.accumulation_schedule is not None:
            raise GradAccConfigError(
                f"`accumulation_schedule` is not supported by {name}: TRL's generation cadence follows the fixed "
                "`gradient_accumulation_steps`. Remove `accumulation_schedule`."
            )
        if self.aux_loss_enabled:
            raise GradAccConfigError(
                f"{name} does not support a mixture-of-experts router loss (`router_aux_loss_coef` "
                f"{self.router_aux_loss_coef} on a model with `output_router_logits`): its weighting by routed tokens "
                "is not tested for RLOO. Set `router_aux_loss_coef=0.0`."
            )

    # ------------------------------------------------------------------ fetch: generate before counting
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, each generated, scored and sliced by TRL's ``_prepare_inputs`` in order (TRL
        generates once every ``steps_per_generation x num_iterations`` micro-batches)."""
        generation_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return self._generate_at_fetch(RLOOTrainer._prepare_inputs, generation_batches), None

    def _prepare_inputs(self, inputs):
        """In a training step the micro-batch was prepared when the step was fetched: returned as it is."""
        window = self.current_window
        if window is not None and window.index is not None:
            return inputs
        return super()._prepare_inputs(inputs)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch (the mean over its completions), weighted by its share of the step's
        completions: ``LossTerm(mean x rows, "samples")``. Outside training: TRL's loss, unchanged."""
        window = training_window(self)
        if window is None:
            return RLOOTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)
        loss = RLOOTrainer.compute_loss(self, model, inputs)
        return LossTerm(total=loss * inputs["completion_ids"].size(0), normalize_by="samples")
