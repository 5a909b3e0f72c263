"""``GradAccGRPOTrainer`` and ``GradAccGRPOConfig``: TRL's group relative policy optimisation with exact accumulation.

Completions are generated, scored and sliced when the step's micro-batches are fetched (TRL's ``_prepare_inputs``, in
order), so the step's completion tokens and sequences are counted over every rank before the first forward pass;
TRL's normaliser of each ``loss_type`` is undone and the micro-batch's sum is divided by the step's tokens (``dapo``,
``bnpo``, ``cispo``, ``vespo``) or sequences (``grpo``, ``dr_grpo``, ``sapo``, ``luspo``), whatever
``steps_per_generation`` and ``num_iterations``; the entropy bonus is its own term by tokens, and a mixture-of-experts
router term its own term by routed tokens (:mod:`hf_gradacc.auxiliary`).

Regrouping, packing, ``accumulation_schedule``, ``auto_micro_batch`` and ``defer_normalization`` are refused, and so
is ``top_entropy_quantile < 1`` with accumulation or an entropy bonus; a step in which the processes fetched different
numbers of micro-batches stops every process before generating.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from ..compat import trl_at_least
from ..config import GradAccArguments
from ..errors import GradAccConfigError
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import (
    TRL_FUSED_LM_HEAD,
    TRL_GRPO_STEP_NORMALISED,
    ForwardRecorder,
    agree_on_micro_batches,
    check_args_class,
    note_generation_given,
    refuse_before,
    refuse_generation_for_the_given_accumulation,
    refuse_uneven_micro_batches,
    router_term,
    training_window,
    with_completion_labels,
)

__all__ = ["GradAccGRPOConfig", "GradAccGRPOTrainer"]

# What each TRL `loss_type` is a mean over, in the full-batch step: the step's completion tokens, or its sequences
# (`dr_grpo`: its sequences times `max_completion_length`, a constant folded into the micro-batch's sum). `bnpo`'s
# "local batch" (TRL's docstring) is the whole step over every process here: by design TRL's is one micro-batch.
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

    With ``total_train_batch_size``, give ``steps_per_generation`` or ``generation_batch_size`` too: TRL derives
    them here from ``gradient_accumulation_steps`` before the trainer derives it (refused at construction otherwise).
    """

    def __post_init__(self) -> None:
        note_generation_given(self)
        super().__post_init__()


class GradAccGRPOTrainer(GradAccMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step over the
    same completions: each ``loss_type`` is a mean over ALL the step's completion tokens (``dapo``, ``bnpo``,
    ``cispo``, ``vespo``) or sequences (``grpo``, ``dr_grpo``, ``sapo``, ``luspo``), whatever
    ``steps_per_generation`` (below, equal to or above ``gradient_accumulation_steps``) and ``num_iterations``.
    ``bnpo``, which TRL's docstring normalises by the tokens of the "local batch" (one micro-batch of one process),
    takes the whole step over every process as that batch: a ``bnpo`` step is then a ``dapo`` step, whatever the split
    (docs/rl.md; every loss type against its definition: ``hf-gradacc check --trainer grpo``).

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
        check_args_class(kwargs.get("args", args[2] if len(args) > 2 else None), GRPOConfig, GradAccGRPOConfig)
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then GRPO's refusals (also run by :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        self._refuse_grpo_settings()
        refuse_generation_for_the_given_accumulation(self)
        refuse_uneven_micro_batches(self, rows_gathered=True)

    # ------------------------------------------------------------------ fetch: generate before counting
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, each generated, scored and sliced by TRL's ``_prepare_inputs`` in order (TRL
        generates once every ``steps_per_generation x num_iterations`` micro-batches and serves slices of its buffer in
        between), with ``labels`` marking the completion tokens of the loss (``completion_mask x tool_mask``) and the
        ``attention_mask`` of the forward pass, so that the window counts them."""
        generation_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        agree_on_micro_batches(self, len(generation_batches))
        self.model.train()  # TRL keys generation, its buffer and its metrics on `model.training`
        start = time.perf_counter()
        batches = []
        for generation_batch in generation_batches:
            inputs = GRPOTrainer._prepare_inputs(self, generation_batch)
            self._step += 1  # TRL advances its micro-batch counter in its training_step, which the mixin replaces
            batches.append(with_completion_labels(inputs, ignore_index=self.head.ignore_index))
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
        window = training_window(self)
        if window is None:
            return GRPOTrainer.compute_loss(
                self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        entropy_coef = self._entropy_coef_in_use()  # before TRL's adaptive controller moves it at the step's end
        needs_outputs = self._entropy_bonus_enabled or self.aux_loss_enabled
        recorder = ForwardRecorder(model) if needs_outputs else None
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
        router = router_term(self, recorder, window)
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
            if not trl_at_least(TRL_GRPO_STEP_NORMALISED):  # TRL 1.9: N / W, not rescaled to the step
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

    def _refuse_grpo_settings(self) -> None:
        """The GRPO settings no split of the step into sums can reproduce, or that would replace TRL's dataloader."""
        args, settings, name = self.args, self.gradacc, type(self).__name__
        self._refuse_grpo_before_fused_head()
        if self.loss_type not in _GRPO_DENOMINATORS:
            raise GradAccConfigError(
                f"`loss_type` {self.loss_type!r} is not one {name} knows how TRL normalises; it cannot make it exact. "
                f"Use one of {sorted(_GRPO_DENOMINATORS)}."
            )
        quantile = self.top_entropy_quantile
        if quantile < 1.0 and self._entropy_bonus_enabled:
            raise GradAccConfigError(
                f"`top_entropy_quantile` ({quantile}) < 1 with an entropy bonus (`entropy_coef` / "
                "`use_adaptive_entropy`): "
                "TRL's bonus is then a mean over the tokens above a quantile of each micro-batch's entropies, a count "
                f"{name} cannot gather over the step. Set `top_entropy_quantile=1.0`, or turn the entropy bonus off."
            )
        if quantile < 1.0 and args.gradient_accumulation_steps > 1:
            raise GradAccConfigError(
                f"`top_entropy_quantile` ({quantile}) < 1 keeps the tokens above a quantile of ONE micro-batch's "
                "entropies, so the step depends on how its completions are grouped (gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps}). Set `top_entropy_quantile=1.0`, or "
                "`gradient_accumulation_steps=1` "
                "(the quantile is then over the step's tokens, gathered over processes)."
            )
        if settings.regroups:
            raise GradAccConfigError(
                "`regroup_micro_batches` / `max_tokens_per_micro_batch` / `pack_micro_batches` is not supported by "
                f"{name}: "
                "GRPO's dataloader yields generation batches of prompts (TRL's RepeatSampler), whose completions "
                "exist "
                "only after generation. Turn them off."
            )
        if settings.accumulation_schedule is not None:
            raise GradAccConfigError(
                f"`accumulation_schedule` is not supported by {name}: TRL's generation cadence and its choice to keep "
                "the "
                "generation-time log-probabilities follow the fixed `gradient_accumulation_steps`. Remove "
                "`accumulation_schedule`."
            )

    def _refuse_grpo_before_fused_head(self) -> None:
        """What GRPO reads from TRL's fused LM head (TRL >= 1.15), or from TRL >= 1.10's normalisers, refused on older
        TRL naming the field: TRL 1.9 computes the entropies and the router loss inside ``_compute_loss``, out of
        reach."""
        name = type(self).__name__
        if self._entropy_bonus_enabled:
            refuse_before(
                TRL_FUSED_LM_HEAD,
                f"{name}'s entropy bonus (`entropy_coef` / `use_adaptive_entropy`)",
                "hf_gradacc reads the per-token entropies from the outputs of TRL's fused LM head to keep the bonus "
                "as its "
                "own term over the step's tokens, and older TRL computes them from the logits inside its loss",
                "Set `entropy_coef=0.0` and `use_adaptive_entropy=False`",
            )
        if self.aux_loss_enabled:
            refuse_before(
                TRL_FUSED_LM_HEAD,
                f"{name} with a mixture-of-experts router loss (`router_aux_loss_coef`)",
                "hf_gradacc reads the router loss from the outputs of TRL's fused LM head to weight it by routed "
                "tokens, "
                "and older TRL computes it inside its loss",
                "Set `router_aux_loss_coef=0.0`",
            )
        exact_luspo = (
            self.importance_sampling_level == "sequence"
            and self.beta == 0.0
            and self.top_entropy_quantile == 1.0
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        )
        if self.loss_type == "luspo" and not exact_luspo:
            refuse_before(
                TRL_GRPO_STEP_NORMALISED,
                f'{name} with `loss_type="luspo"` and a per-token loss',
                "TRL 1.9's luspo averages the per-token loss times each sequence's length over every position of the "
                "micro-batch, padding included, so the step depends on how completions are padded together",
                'Use `importance_sampling_level="sequence"` with `beta=0.0` (the LUSPO paper\'s setup), or another '
                "`loss_type`",
            )


def _grpo_loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The completion tokens TRL's loss sums over: ``completion_mask``, times ``tool_mask`` when tools ran."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
