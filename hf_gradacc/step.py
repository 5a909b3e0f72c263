"""One optimizer step, top-down: the window path of :class:`~hf_gradacc.GradAccMixin`.

``GradAccMixin._run_epoch`` calls, for each optimizer step:

1. :func:`open_window`: fetch this rank's micro-batches (``get_batch_samples``) and count them over every rank in
   one collective (or open a streamed window);
2. :func:`train_window`: the checks every rank takes together, then :func:`run_micro_batches` — every micro-batch
   through the trainer's ``training_step`` inside the backend's sync context (:func:`micro_batch_loop`), with the
   ``auto_micro_batch`` retry — and, for a streamed window, the one reduction and scaling after it;
3. :func:`optimizer_step`: hooks, norm and clipping, the non-finite verdict, the step, the scheduler.

Every function takes the trainer and the step's :class:`~hf_gradacc.window.Window`; nothing about the step is kept
anywhere else but ``trainer.current_window``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from transformers.utils import logging

from .checks import LossCheck, agree
from .errors import GradAccDataError, GradAccUsageError
from .memory import halve_rows, is_out_of_memory, release_memory
from .moe_balance import step_routing
from .nonfinite import must_skip
from .window import Window

if TYPE_CHECKING:
    from .mixin import GradAccMixin

logger = logging.get_logger(__name__)

DATA_RAN_OUT = object()  # train_window's answer when no rank had a micro-batch left


def open_window(trainer: GradAccMixin, epoch_iterator: Iterator, num_batches: int) -> Window:
    """The next optimizer step: prefetched and counted over all ranks (one collective), or streamed."""
    world = trainer.backend.dp_world_size
    if trainer.gradacc.defer_normalization:
        window = Window.stream(dp_world_size=world)
    else:
        batches, _ = trainer.get_batch_samples(epoch_iterator, num_batches, trainer.args.device)
        window = Window.prefetched(
            batches,
            count=trainer._count,
            all_gather=trainer.backend.all_gather,
            device=trainer.args.device,
            dp_world_size=world,
            defers_sync=trainer.gradacc.auto_micro_batch,
        )
        if trainer._auto_rows is not None:
            window.resplit(trainer._auto_rows, trainer._count)
        trainer.current_gradient_accumulation_steps = max(window.num_micro_batches, 1)
    trainer._window = window
    if not window.streamed:
        call_event(trainer, "on_window_counted", window=window)
    return window

def skip_window(trainer: GradAccMixin, window: Window) -> None:
    trainer.num_skipped_windows += 1
    why = f"every label is {trainer.head.ignore_index}"
    if trainer.primary_denominator == "weights" and window.counts.global_tokens > 0:
        why = f"every `loss_weights` of its {window.counts.global_tokens} counted targets is 0"
    logger.warning(
        f"Optimizer step {trainer.state.global_step + 1} has no counted {trainer.primary_denominator} on any rank "
        f"({why}): skipped, parameters unchanged ({trainer.num_skipped_windows} skipped so far)."
    )

def train_window(trainer: GradAccMixin, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int) -> Any:
    """Every micro-batch of ``window``, forward and backward; returns the step's logged loss, None for a step
    skipped because nothing is counted on any rank, or ``DATA_RAN_OUT``.

    Every branch depends only on counts gathered from all ranks, so all ranks take it together.
    """
    if not window.streamed:
        per_rank = window.counts.num_micro_batches_per_rank
        if max(per_rank) == 0:
            return DATA_RAN_OUT
        if min(per_rank) == 0:
            raise GradAccDataError(
                f"Ranks hold different numbers of micro-batches for this optimizer step ({list(per_rank)}); a "
                "rank with none cannot join the gradient reduction. Keep `dataloader_drop_last=False` with "
                "accelerate's `even_batches=True` (the default), or give every rank the same number of batches."
            )
        if window.global_count(trainer.primary_denominator) == 0:
            skip_window(trainer, window)
            return None
    trainer.control = trainer.callback_handler.on_step_begin(trainer.args, trainer.state, trainer.control)
    window.routing = step_routing(trainer, model, window)  # router_balance="global_batch": the routing pre-pass
    total = run_micro_batches(trainer, model, window, epoch_iterator, num_batches)
    if trainer._loss_check_due:  # every rank joins, with its verdict or none: one collective, once
        agree(trainer._loss_check or LossCheck(), trainer.backend.all_gather, trainer.args.device)
        trainer._loss_check_due, trainer._loss_check = False, None
    if window.streamed:
        global_count = window.finish_streamed(trainer.backend.all_gather, trainer.args.device)
        call_event(trainer, "on_window_counted", window=window)
        if global_count is None:
            return DATA_RAN_OUT
        trainer.backend.sync_window()
        if global_count == 0:
            trainer.backend.zero_grad()
            skip_window(trainer, window)
            return None
        trainer.backend.scale_grads(1.0 / global_count)
        total = total / global_count
    # accelerate's optimizer wrapper only steps when it believes the gradients are synced.
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    trainer.state.num_input_tokens_seen += window.counts.global_seen_tokens
    return total

def run_micro_batches(trainer: GradAccMixin, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int):
    """Forward and backward passes of every micro-batch of the window; returns the window's logged loss.

    With ``auto_micro_batch``, an out-of-memory error on any rank makes EVERY rank drop the window's partial
    gradient, halve the rows per micro-batch and run the same samples again: the update is unchanged (the
    global denominator does not depend on the grouping), nothing hangs (no collective runs inside the window
    in that mode), and the smaller size is kept for the rest of training.
    """
    retry = trainer.gradacc.auto_micro_batch
    while True:
        window.final_backward_done = False
        window.term_totals, window.losses = {}, []
        out_of_memory, total = None, None
        try:
            total = micro_batch_loop(trainer, model, window, epoch_iterator, num_batches)
        except Exception as error:  # noqa: BLE001 - only out-of-memory errors are caught, the rest re-raised
            if not (retry and is_out_of_memory(error)):
                raise
            out_of_memory = error
            release_memory()
        if not retry:
            break
        # One flag per rank, agreed before anything else communicates: every rank retries, or none does.
        flags = trainer.backend.all_gather(torch.tensor([int(out_of_memory is not None)], device=trainer.args.device))
        if not bool(flags.max()):
            trainer.backend.sync_window()
            break
        trainer.backend.zero_grad()
        previous, trainer._auto_rows = halve_rows(window, trainer._auto_rows, cause=out_of_memory)
        logger.warning(
            f"auto_micro_batch: out of memory on {'this' if out_of_memory is not None else 'another'} rank; micro-batches now "
            f"hold at most {trainer._auto_rows} row(s) (were {previous}). The optimizer step's samples and update are "
            "unchanged; the step is recomputed."
        )
        trainer.add_log_metrics({"auto_micro_batch_rows": trainer._auto_rows})
        window.resplit(trainer._auto_rows, trainer._count)
    if not window.streamed and not window.final_backward_done:
        raise GradAccUsageError(
            "The optimizer step's last micro-batch ran no final backward pass: a custom `training_step` must call "
            "`trainer.backward(loss, final=trainer.is_last_micro_batch)` (or super().training_step)."
        )
    return total

def warn_fused_head_bypassed(trainer: GradAccMixin) -> None:
    """``fused_lm_head=True`` with an overridden ``training_step`` that ran a micro-batch without the built-in loss
    (it called the model itself): the setting did nothing there, so say it, once."""
    logger.warning_once(
        f"`fused_lm_head=True` is ignored: {type(trainer).__name__}.training_step computed a micro-batch's loss "
        "without `self.compute_loss` (the model ran with its full logits). Call `self.compute_loss(model, inputs)` "
        "(or `super().training_step`) in the overridden `training_step`, or set `fused_lm_head=False`."
    )


def micro_batch_loop(trainer: GradAccMixin, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int):
    """One pass over the window's micro-batches (prefetched, or pulled from the iterator when streamed)."""
    batches = window.pull(epoch_iterator, num_batches, trainer._count) if window.streamed else window.micro_batches
    total = torch.zeros((), device=trainer.args.device)
    flops, num_items = 0.0, None
    if not window.streamed:
        num_items = torch.tensor(window.global_count(trainer.primary_denominator), device=trainer.args.device)
    for i, inputs in enumerate(batches):
        window.index = 0 if window.streamed else i
        is_last = window.is_last
        trainer.accelerator.gradient_state._set_sync_gradients(is_last)
        try:
            with trainer.backend.sync_context(is_last=is_last), trainer.training_step_context():
                loss = trainer.training_step(model, inputs, num_items)
            if trainer.gradacc.fused_lm_head and not (trainer._fused_head_ran or trainer._custom_compute_loss):
                warn_fused_head_bypassed(trainer)
            window.losses.append(loss.detach())
            total = total + loss.to(total.device)
        finally:
            window.index = None
        flops += float(trainer.floating_point_ops(inputs))
        if not is_last:
            trainer.control = trainer.callback_handler.on_substep_end(trainer.args, trainer.state, trainer.control)
    trainer.current_flos += flops
    return total

def optimizer_step(trainer: GradAccMixin, window: Window) -> tuple[torch.Tensor, float] | None:
    """Hooks, norm and clipping, `on_pre_optimizer_step`, the step, the scheduler; returns the pre-clip norm and
    the learning rate the step used, or None for a non-finite step dropped on every rank (``nonfinite_steps``)."""
    window.grads_ready = True
    try:
        hooks_nonfinite = trainer.grads.run_hooks(trainer._accumulated_grad_hooks)
        call_event(trainer, "on_accumulated_grads")
        max_norm = trainer.args.max_grad_norm
        grad_norm = trainer.backend.clip_grad_norm(max_norm if max_norm is not None and max_norm > 0 else float("inf"))
        policy = "propagate" if trainer.backend.scales_loss else trainer.gradacc.nonfinite_steps  # a scaler skips itself
        step = trainer.state.global_step + 1
        # one verdict on every rank, AFTER the hooks and callbacks: a NaN they wrote on one rank drops the step everywhere
        if must_skip(policy, grad_norm, step=step, rank=trainer.args.process_index, losses=window.losses,
                     hooks_nonfinite=hooks_nonfinite):  # fmt: skip
            trainer.num_nonfinite_skipped += 1
            trainer.add_log_metrics({"nonfinite_skipped": trainer.num_nonfinite_skipped})
            trainer.backend.skip_step()
            return None
        trainer.control = trainer.callback_handler.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)
    finally:
        window.grads_ready = False
    schedule = trainer.gradacc.accumulation_schedule
    lr_factor = 1.0 if schedule is None else schedule.lr_factor(trainer.state.global_step, trainer.gradacc.lr_scaling)
    # the rate this step uses, read before the step (DeepSpeed's engine moves its scheduler inside the step)
    learning_rate = trainer._get_learning_rate() * lr_factor
    trainer.backend.optimizer_step(trainer.optimizer, lr_factor=lr_factor)
    trainer.control = trainer.callback_handler.on_optimizer_step(trainer.args, trainer.state, trainer.control)
    if schedule is not None:
        trainer.add_log_metrics(
            {"accumulation_steps": schedule.at(trainer.state.global_step), "effective_batch_size": window.counts.global_samples},
            per_step=True,
        )
    if not trainer.accelerator.optimizer_step_was_skipped and not isinstance(
        trainer.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    ):
        trainer.lr_scheduler.step()
    trainer.backend.zero_grad()
    trainer._term_log.add(window)
    return grad_norm, learning_rate

def call_event(trainer: GradAccMixin, event: str, **kwargs: Any) -> None:
    """`CallbackHandler.call_event` for an hf_gradacc event, on the callbacks that define it."""
    handler = copy.copy(trainer.callback_handler)
    handler.callbacks = [cb for cb in trainer.callback_handler.callbacks if callable(getattr(cb, event, None))]
    trainer.control = handler.call_event(event, trainer.args, trainer.state, trainer.control, **kwargs)
