"""``GradAccKTOTrainer`` and ``GradAccKTOConfig``: TRL's KTO (Kahneman-Tversky optimisation) with exact accumulation.

KTO's loss of a sample depends on a batch-level quantity: the reference point ``z0``, an estimate of
``KL(policy || reference)`` from mismatched (prompt, completion) pairs (TRL's ``KL_completion_ids``), clamped at 0
and not differentiated. TRL estimates it per micro-batch (the mean over the micro-batch's mismatched pairs, then the
mean over processes), so a step over N micro-batches mixes N different reference points and weighs the samples of
short micro-batches more (it averages each micro-batch, then divides by the accumulation steps).

Here the step's estimate is defined over the WINDOW: ``z0 = max(0, mean over every mismatched pair of the optimizer
step, all micro-batches, all processes, of log pi(y'|x) - log pi_ref(y'|x))``, the full-batch estimate. It is computed
when the step's micro-batches are fetched (the policy has not moved yet within a step), with TRL's own forward passes
and ONE all-gather per step, and every micro-batch's loss uses it. The loss of the step is the mean over ALL its
samples (desirable and undesirable, weighted by ``desirable_weight`` / ``undesirable_weight``). TRL's logged ``kl`` is
then the window's ``z0``.

Refused: regrouping and packing (TRL pairs each sample with its dataset neighbours' completion), ``auto_micro_batch``
and ``defer_normalization`` (the estimate needs every micro-batch of the step before its first forward pass), and a
mixture-of-experts router term (not tested for KTO). ``per_device_train_batch_size=1`` with the ``"kto"`` loss (each
sample would be paired with its own completion) is refused as TRL refuses it, but as a
:class:`~hf_gradacc.GradAccConfigError` naming the field, before any model is loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from trl import KTOConfig, KTOTrainer

from ..compat import installed_version
from ..config import GradAccArguments
from ..errors import GradAccCompatibilityError, GradAccConfigError
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import check_args_class, refuse_uneven_micro_batches, split_outputs, training_window, with_outputs

__all__ = ["GradAccKTOConfig", "GradAccKTOTrainer"]

# The window's KL estimate, one value per row of the micro-batch, carried in the micro-batch (taken out before TRL's
# loss, which hands every other key to the model).
KL_ESTIMATE_KEY = "gradacc_kl_estimate"
# TRL's loss types without the KL estimate (TRL 1.16's `calculate_kl`): the only ones that run on one sample per
# micro-batch.
KTO_LOSSES_WITHOUT_KL = ("apo_zero_unpaired",)


@dataclass
class GradAccKTOConfig(GradAccArguments, KTOConfig):
    """TRL's `KTOConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for :class:`GradAccKTOTrainer`;
    every field is a flag with `HfArgumentParser`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccKTOConfig

        args = GradAccKTOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
                                beta=0.1, train_sampling_strategy="sequential")
        ```
    """


class GradAccKTOTrainer(GradAccMixin, KTOTrainer):
    """TRL's `KTOTrainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step: the loss is
    the mean over ALL the step's samples, and KTO's reference point ``z0`` (the KL estimate) is the mean over ALL the
    step's mismatched pairs (every micro-batch, every process), clamped at 0, instead of one estimate per micro-batch.

    TRL's loss types (``"kto"``, ``"apo_zero_unpaired"``), weights, reference model (``ref_model``, a PEFT adapter
    switched off, or ``precompute_ref_log_probs=True``), fused LM head and logged metrics are TRL's; the logged ``kl``
    is the step's estimate. Refused with the field to change: regrouping and packing, ``auto_micro_batch``,
    ``defer_normalization``, a mixture-of-experts router term, ``per_device_train_batch_size=1`` with the ``"kto"``
    loss (checked first, before TRL loads a model).

    Example:
        ```python
        from hf_gradacc.trl import GradAccKTOConfig, GradAccKTOTrainer

        args = GradAccKTOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
                                train_sampling_strategy="sequential")
        trainer = GradAccKTOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=unpaired,
                                    processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        check_args_class(config, KTOConfig, GradAccKTOConfig)
        refuse_single_sample_micro_batches(config)  # before TRL loads a model or a reference model
        self._kl_replies: Iterator[torch.Tensor] | None = None
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then KTO's refusals (also run by :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        self._kl_replies = None
        refuse_uneven_micro_batches(self, rows_gathered=False)
        name = type(self).__name__
        if self.gradacc.regroups:
            raise GradAccConfigError(
                f"`regroup_micro_batches` / `max_tokens_per_micro_batch` / `pack_micro_batches` is not supported by "
                f"{name}: TRL pairs each sample with a mismatched completion of its dataset neighbours for the KL "
                "estimate (`KL_completion_ids`), in a fixed order. Turn them off."
            )
        if self.aux_loss_enabled:
            raise GradAccConfigError(
                f"{name} does not support a mixture-of-experts router loss (`router_aux_loss_coef` "
                f"{self.router_aux_loss_coef} on a model with `output_router_logits`): its weighting by routed tokens "
                "is not tested for KTO. Set `router_aux_loss_coef=0.0`."
            )

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading=True``) around each micro-batch's forward and
        backward."""
        return self.maybe_activation_offload_context

    # ------------------------------------------------------------------ fetch: the window's KL estimate
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, each carrying the step's KL estimate (``z0``): every mismatched pair of every
        micro-batch is scored by the policy and the reference model (no gradient) and the estimate is summed over
        the processes with one all-gather, before the first forward pass of the step."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not self.calculate_KL:
            return batches, num_items
        self.model.train()  # as in TRL's loss, whose forward passes score the pairs in training mode
        batches = [self._prepare_inputs(batch) for batch in batches]
        total, count = torch.zeros((), dtype=torch.float64), 0
        for batch in batches:
            differences = self._kl_differences(batch)
            total, count = total + differences.double().sum().cpu(), count + differences.numel()
        z0 = window_kl_estimate(total, count, self.backend.all_gather, self.args.device)
        return [{**batch, KL_ESTIMATE_KEY: _rows_of(batch, z0)} for batch in batches], num_items

    def _kl_differences(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``log pi(y'|x) - log pi_ref(y'|x)`` of each mismatched pair of ``batch``, with TRL's own forward passes
        (the policy, then the reference model, a PEFT adapter switched off, or the precomputed values)."""
        from accelerate.utils import is_peft_model
        from trl.trainer.utils import use_adapter

        with torch.no_grad():
            policy = KTOTrainer._compute_kl_logps(self, self.model, batch)
            if self.precompute_ref_logps:
                reference = batch["ref_KL_logps"].to(policy.device)
            elif is_peft_model(self.model) and self.ref_model is None:
                unwrapped = self.accelerator.unwrap_model(self.model)
                adapter = "ref" if "ref" in unwrapped.peft_config else None
                with use_adapter(unwrapped, adapter_name=adapter):
                    reference = KTOTrainer._compute_kl_logps(self, self.model, batch)
            else:
                reference = KTOTrainer._compute_kl_logps(self, self.ref_model, batch)
        return (policy - reference).detach()

    def _compute_kl_logps(self, model, batch):
        """Within a training step TRL's loss asks for the mismatched pairs' log-probabilities of the policy, then of
        the reference model: it gets the step's estimate, then zeros, so that TRL's ``mean(policy - reference)`` is the
        step's ``z0`` (no forward pass: they were scored when the step was fetched). Elsewhere: TRL's."""
        if self._kl_replies is None:
            return super()._compute_kl_logps(model, batch)
        return next(self._kl_replies)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch (the mean over its samples) with the step's KL estimate, weighted by its
        share of the step's samples (``LossTerm(mean x rows, "samples")``). Outside training: TRL's loss, unchanged."""
        window = training_window(self)
        if window is None:
            return KTOTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)
        trl_inputs = {k: v for k, v in inputs.items() if k != KL_ESTIMATE_KEY}
        replies = None
        if self.calculate_KL:
            estimate = inputs[KL_ESTIMATE_KEY]
            if self.precompute_ref_logps:  # TRL reads the reference's values from the batch, not _compute_kl_logps
                trl_inputs["ref_KL_logps"] = torch.zeros_like(trl_inputs["ref_KL_logps"])
                replies = iter([estimate])
            else:
                replies = iter([estimate, torch.zeros_like(estimate)])
            self._kl_replies = replies
        try:
            out = KTOTrainer.compute_loss(self, model, trl_inputs, return_outputs=return_outputs)
        finally:
            self._kl_replies = None
        if replies is not None and next(replies, None) is not None:
            raise GradAccCompatibilityError(
                f"TRL {installed_version('trl')}'s KTO loss did not ask `_compute_kl_logps` for the policy's and the "
                "reference's mismatched-pair log-probabilities as TRL 1.16 does, so the step's KL estimate did not "
                "reach it. Use a TRL release hf_gradacc supports for KTO (docs/compatibility.md)."
            )
        loss, outputs = split_outputs(out, return_outputs)
        samples = LossTerm(total=loss * window.current_counts.num_samples, normalize_by="samples")
        return with_outputs(samples, return_outputs, outputs)


def refuse_single_sample_micro_batches(args: Any) -> None:
    """TRL pairs each sample with the completion of its neighbour in the same micro-batch for the KL estimate: one
    sample per micro-batch pairs it with its own completion. Refused with the field to change, as TRL refuses it, but
    before any model is loaded (TRL checks after loading the policy)."""
    if args is None or args.loss_type in KTO_LOSSES_WITHOUT_KL or args.per_device_train_batch_size > 1:
        return
    raise GradAccConfigError(
        f"`per_device_train_batch_size` is {args.per_device_train_batch_size} with KTO's loss_type "
        f"{args.loss_type!r}: TRL pairs each sample with the completion of its neighbour in the same micro-batch "
        "(`KL_completion_ids`) for the KL estimate `z0`, so with one sample per micro-batch each sample is paired "
        "with "
        "its own completion and `z0` is its implied reward, not a KL estimate. Set `per_device_train_batch_size` to 2 "
        "or more (and lower `gradient_accumulation_steps` to keep the samples per optimizer step: the step is the "
        "same full-batch step in any split), or use `loss_type='apo_zero_unpaired'`, which has no KL estimate."
    )


def window_kl_estimate(total: torch.Tensor, count: int, all_gather: Any, device: Any) -> float:
    """``max(0, sum / count)`` over every process's (sum, count): one all-gather."""
    local = torch.stack([total.double(), torch.tensor(float(count), dtype=torch.float64)]).to(device)
    summed = all_gather(local).reshape(-1, 2).sum(dim=0)
    return max(0.0, float(summed[0]) / max(float(summed[1]), 1.0))


def _rows_of(batch: Mapping[str, Any], value: float) -> torch.Tensor:
    rows = batch["KL_input_ids"].shape[0]
    return torch.full((rows,), value, dtype=torch.float32, device=batch["KL_input_ids"].device)
