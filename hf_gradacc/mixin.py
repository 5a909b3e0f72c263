"""`GradAccMixin`: what makes accumulation exact, for any `transformers.Trainer` subclass.

One optimizer step reads top-down in this file:

1. ``_run_epoch`` takes the epoch one window at a time: ``_open_window`` fetches and counts the step's micro-batches
   (one collective), ``_train_window`` runs them, ``_optimizer_step`` applies the step;
2. ``_run_micro_batches`` runs every micro-batch through ``training_step`` inside the backend's sync context, and
   retries a window that ran out of memory (``auto_micro_batch``);
3. ``training_step`` calls ``compute_loss``, has the :class:`~hf_gradacc.window.Window` normalise what it returned
   by the step's global counts, and back-propagates through the backend.

The step's state travels in the ``Window``; the only step state on the trainer is ``current_window``, the window in
flight, because `Trainer`'s ``training_step`` / ``compute_loss`` signatures cannot carry it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from . import patches
from .backends import Backend, resolve_backend
from .callbacks.base import GradAccCallback
from .config import GradAccSettings, resolve_settings
from .data.loader import adjust_training_values, build_train_dataloader, plan_epoch
from .distributed import finish_distributed
from .errors import GradAccConfigError, GradAccDataError, GradAccUsageError
from .grads import AccumulatedGradHook, GradAccess
from .heads import Head, unwrap_model
from .loss import LossTerm, parse_loss_output
from .memory import halve_rows, is_out_of_memory, release_memory
from .window import LABEL_KEY, SHIFT_LABELS_KEY, MicroBatchCounts, TermLog, Window

logger = logging.get_logger(__name__)

_DATA_RAN_OUT = object()  # _train_window's answer when no rank had a micro-batch left


class GradAccMixin:
    """Exact gradient accumulation for any `transformers.Trainer` subclass: put it FIRST in the bases.

    For every optimizer step the mixin

    1. prefetches the step's micro-batches and counts the denominator (non-ignored target tokens for LM and
       token heads, samples for sequence classification) over all of them and all ranks, in one collective;
    2. computes each micro-batch's loss as a SUM over its items (built-in heads: from the logits, so it does not
       matter whether the model's own loss honours ``num_items_in_batch``, or whether PEFT wraps the model);
    3. divides by the global count, multiplies by the data-parallel world size, and never divides by the number
       of micro-batches.

    The logged ``loss`` is the exact token- (or sample-) weighted mean of the step across ranks, and ``grad_norm``
    the norm of the exact accumulated gradient. A step whose micro-batches hold no counted item on any rank is
    skipped with a warning, on every rank alike.

    Knobs: the :class:`~hf_gradacc.GradAccArguments` fields, from ``args`` when it is a GradAcc config, or from the
    extra keyword ``gradacc_args=`` (a ``GradAccArguments`` or a dict) with any other `TrainingArguments`.

    Overriding ``compute_loss``: return an :class:`~hf_gradacc.LossTerm` (a sum and its denominator) or a
    ``dict[str, LossTerm]`` for an exact step. A plain tensor is read as a MEAN over the micro-batch's counted
    items (what ``outputs.loss`` is when the model gets ``num_items_in_batch`` = that local count, which is what the
    mixin passes to an overridden ``compute_loss``), and a warning says so once. ``current_window`` gives the
    step's global counts to an override.

    Example:
        ```python
        from transformers import Seq2SeqTrainer, TrainingArguments
        from hf_gradacc import GradAccMixin

        class MyTrainer(GradAccMixin, Seq2SeqTrainer):
            pass

        args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=4)
        trainer = MyTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator,
                            gradacc_args={"regroup_micro_batches": True})
        trainer.train()
        ```
    """

    gradacc: GradAccSettings
    head: Head
    backend: Backend

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        # HF_GRADACC_CPU_DISTRIBUTED=1: patch accelerate BEFORE Trainer.__init__ builds the accelerator (patches/)
        patches.maybe_enable_from_env()
        super().__init__(*args, **kwargs)
        self.gradacc = settings = resolve_settings(self.args, gradacc_args)
        self._custom_compute_loss = type(self).compute_loss is not GradAccMixin.compute_loss
        self._custom_training_step = type(self).training_step is not GradAccMixin.training_step
        self.head = Head.for_model(
            self.model,
            requested=settings.head_type,
            ignore_index=settings.ignore_index,
            label_smoothing=self.args.label_smoothing_factor,
            custom_loss=self._custom_compute_loss,
        )
        if self.args.n_gpu > 1:
            raise GradAccConfigError(
                f"GradAccTrainer does not support torch.nn.DataParallel over {self.args.n_gpu} GPUs in one process; "
                "launch one process per GPU (`accelerate launch` / `torchrun`) or set CUDA_VISIBLE_DEVICES."
            )
        if self.head.type is not None and LABEL_KEY not in self.label_names:
            # Keep `labels` through the Trainer's unused-column removal even when the model's forward does not
            # take them: the built-in loss is computed from them.
            self.label_names = [*self.label_names, LABEL_KEY]
        self.backend = resolve_backend(
            self.accelerator,
            self.args,
            settings,
            multi_backward=settings.backward_per_term
            or self._custom_training_step
            or settings.auto_micro_batch
            or settings.defer_normalization,
        )
        self.backend.check_model(self.model)
        if settings.defer_normalization and self._custom_training_step:
            raise GradAccConfigError(
                "`defer_normalization=True` cannot be combined with an overridden `training_step`; turn one off."
            )
        self.num_skipped_windows = 0
        self._window: Window | None = None
        self._auto_rows: int | None = None  # auto_micro_batch: rows per micro-batch once an OOM was survived
        self._training_started = False
        self._accumulated_grad_hooks: list[tuple[AccumulatedGradHook, bool]] = []
        self._term_log = TermLog()
        self._extra_logs: dict[str, float] = {}
        self.grads = GradAccess(self)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, GradAccCallback):
                callback.bind(self)

    # ------------------------------------------------------------------ public surface
    @property
    def current_window(self) -> Window | None:
        """The optimizer step in flight (its counts, micro-batch cursor, state), from ``on_step_begin`` to
        ``on_optimizer_step``; None outside. ``current_window.global_count("tokens")`` is the step's denominator."""
        return self._window

    @property
    def is_last_micro_batch(self) -> bool:
        """True while the last micro-batch of the current optimizer step runs."""
        return self._window is not None and self._window.is_last

    @property
    def primary_denominator(self) -> str:
        """``"samples"`` for sequence classification (and unlabelled data), ``"tokens"`` for every other head."""
        return self.head.denominator(labelled=self._window is None or self._window.counts.labelled)

    def add_callback(self, callback: Any) -> None:
        """`Trainer.add_callback`; a :class:`~hf_gradacc.callbacks.GradAccCallback` also gets the trainer."""
        super().add_callback(callback)
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, GradAccCallback):
                cb.bind(self)

    def register_accumulated_grad_hook(self, hook: AccumulatedGradHook, *, local: bool = False) -> None:
        """Call ``hook(name, grad)`` once per trainable parameter per optimizer step, after every micro-batch and
        every backward pass of the step, with the fully reduced gradient, before clipping and the step.

        ``grad`` is the full gradient (``local=False``) or this rank's shard under ZeRO-3 / FSDP2 (``local=True``).
        The hook may modify it in place; the change reaches the optimizer on every backend. Hooks run on every
        rank, in registration order, over the parameters in the same order. Register before ``train()``.

        Example:
            ```python
            def clip_embeddings(name, grad):
                if "embed_tokens" in name:
                    grad.clamp_(-0.01, 0.01)

            trainer.register_accumulated_grad_hook(clip_embeddings)
            trainer.train()
            ```
        """
        if self._training_started:
            raise GradAccUsageError(
                "register_accumulated_grad_hook must be called before `train()`: hooks registered mid-training "
                "would see some optimizer steps and not others."
            )
        if not callable(hook):
            raise GradAccConfigError(f"`hook` must be callable as hook(name, grad), got {type(hook).__name__}")
        self._accumulated_grad_hooks.append((hook, local))

    def add_log_metrics(self, metrics: Mapping[str, float]) -> None:
        """Add ``metrics`` to the next training log line (used by hf_gradacc callbacks)."""
        self._extra_logs.update({k: float(v) for k, v in metrics.items()})

    def backward(self, loss: torch.Tensor, *, final: bool, retain_graph: bool = False) -> None:
        """Low-level backward pass for custom training steps: accumulate ``loss``'s gradient.

        ``loss`` must already be normalised (see :func:`hf_gradacc.loss.normalize` and ``current_window``).
        ``final=True`` marks the LAST backward pass of the optimizer step (last micro-batch, last term): it triggers
        the gradient reduction on every backend. Exactly one final pass per step; earlier passes through the same
        forward need ``retain_graph=True``.

        Example:
            ```python
            class TwoPassTrainer(GradAccTrainer):
                def training_step(self, model, inputs, num_items_in_batch=None):
                    rec, adv = my_losses(model, inputs)             # normalised scalars
                    self.backward(rec, final=False, retain_graph=True)
                    self.backward(adv, final=self.is_last_micro_batch)
                    return (rec + adv).detach()
            ```
        """
        window = self._require_window("backward")
        if window.final_backward_done:
            raise GradAccUsageError(
                "backward(..., final=True) was already called in this optimizer step; exactly one backward pass per "
                "step may be final (the last one of the last micro-batch)."
            )
        if final and not window.is_last:
            raise GradAccUsageError(
                f"backward(final=True) on micro-batch {window.index + 1} of {window.num_micro_batches}: only the "
                "last micro-batch's last backward pass may be final."
            )
        # A window that defers its sync reduces once after its last micro-batch (Window.defers_sync).
        self.backend.backward(loss, is_final=final and not window.defers_sync, retain_graph=retain_graph)
        if final:
            window.final_backward_done = True

    def _require_window(self, what: str) -> Window:
        window = self._window
        if window is None or window.index is None:
            raise GradAccUsageError(f"{what} runs inside a training step's micro-batch only (from training_step)")
        return window

    # ------------------------------------------------------------------ the loop: one window per optimizer step
    def _run_epoch(
        self,
        model,
        epoch,
        train_dataloader,
        steps_in_epoch,
        num_update_steps_per_epoch,
        trial,
        ignore_keys_for_eval,
        start_time,
        resume_from_checkpoint,
        epochs_trained,
        steps_trained_in_current_epoch,
    ):
        """One pass over the data, one window per optimizer step; the window decides where the step falls.

        Differences with `Trainer._run_epoch`: the step happens after the LAST micro-batch the window really
        holds (a short last window of an epoch or of an `IterableDataset` is its own step, nothing leaks into
        the next epoch), an empty window on every rank ends the epoch, a window without counted items on any
        rank is skipped, and sync / backward / clipping / stepping go through the backend.
        """
        if epoch == epochs_trained:
            self._training_started = True
            self.backend.setup(model, self.optimizer)
        resuming = epoch == epochs_trained and resume_from_checkpoint is not None
        skip = steps_trained_in_current_epoch if resuming and not self.args.ignore_data_skip else 0
        plan = plan_epoch(
            train_dataloader,
            epoch,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            steps_in_epoch=steps_in_epoch,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            steps_trained_in_current_epoch=skip,
        )
        if resuming and steps_trained_in_current_epoch == 0:
            self._load_rng_state(resume_from_checkpoint)
        step, steps_in_epoch, rng_to_sync = plan.step, plan.steps_in_epoch, plan.resumed_mid_epoch
        grad_norm = learning_rate = None
        for num_batches in plan.num_batches:
            window = self._open_window(plan.epoch_iterator, num_batches)
            if rng_to_sync:  # the skipped batches drew from the RNG: restore the checkpoint's state now
                self._load_rng_state(resume_from_checkpoint)
                rng_to_sync = False
            try:
                tr_loss_step = self._train_window(model, window, plan.epoch_iterator, num_batches)
                if tr_loss_step is _DATA_RAN_OUT:
                    break  # the data ran out on every rank: the epoch ends here, nothing is carried over
                step += window.num_micro_batches
                if tr_loss_step is None:
                    continue  # no counted item on any rank: skipped, parameters unchanged
                if self.args.logging_nan_inf_filter and not bool(torch.isfinite(tr_loss_step)):
                    self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                else:
                    self._tr_loss += tr_loss_step.to(self._tr_loss.device)
                grad_norm, learning_rate = self._optimizer_step(window)
            finally:
                self._window = None
            self.state.global_step += 1
            self.state.epoch = epoch + (step + 1) / steps_in_epoch
            self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
            self._maybe_log_save_evaluate(
                self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                learning_rate=learning_rate,
            )  # fmt: skip
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break

        if step < 0:
            logger.warning(
                "There seems not to be a single sample in your epoch_iterator, stopping training at step"
                f" {self.state.global_step}!"
            )
            self.control.should_training_stop = True
        self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
        self._maybe_log_save_evaluate(
            self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
            learning_rate=learning_rate,
        )  # fmt: skip

    def _count(self, batch: Mapping[str, Any]) -> MicroBatchCounts:
        return self.head.count(batch)

    def _open_window(self, epoch_iterator: Iterator, num_batches: int) -> Window:
        """The next optimizer step: prefetched and counted over all ranks (one collective), or streamed."""
        world = self.backend.dp_world_size
        if self.gradacc.defer_normalization:
            window = Window.stream(dp_world_size=world)
        else:
            batches, _ = self.get_batch_samples(epoch_iterator, num_batches, self.args.device)
            window = Window.prefetched(
                batches,
                count=self._count,
                all_gather=self.backend.all_gather,
                device=self.args.device,
                dp_world_size=world,
                defers_sync=self.gradacc.auto_micro_batch,
            )
            if self.head.type is None and window.micro_batches and window.counts.labelled:
                logger.warning_once(
                    "GradAccTrainer could not tell the model's loss family; 'tokens' are counted on unshifted labels. "
                    "Set `head_type` in GradAccConfig if the model shifts its labels (causal LM)."
                )
            if self._auto_rows is not None:
                window.resplit(self._auto_rows, self._count)
            self.current_gradient_accumulation_steps = max(window.num_micro_batches, 1)
        self._window = window
        if not window.streamed:
            self._call_event("on_window_counted", window=window)
        return window

    def _skip_window(self, window: Window) -> None:
        self.num_skipped_windows += 1
        logger.warning(
            f"Optimizer step {self.state.global_step + 1} has no counted {self.primary_denominator} on any rank "
            f"(every label is {self.head.ignore_index}): skipped, parameters unchanged ({self.num_skipped_windows} "
            "skipped so far)."
        )

    def _train_window(self, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int) -> Any:
        """Every micro-batch of ``window``, forward and backward; returns the step's logged loss, None for a step
        skipped because nothing is counted on any rank, or ``_DATA_RAN_OUT``.

        Every branch depends only on counts gathered from all ranks, so all ranks take it together.
        """
        if not window.streamed:
            per_rank = window.counts.num_micro_batches_per_rank
            if max(per_rank) == 0:
                return _DATA_RAN_OUT
            if min(per_rank) == 0:
                raise GradAccDataError(
                    f"Ranks hold different numbers of micro-batches for this optimizer step ({list(per_rank)}); a "
                    "rank with none cannot join the gradient reduction. Keep `dataloader_drop_last=False` with "
                    "accelerate's `even_batches=True` (the default), or give every rank the same number of batches."
                )
            if window.global_count(self.primary_denominator) == 0:
                self._skip_window(window)
                return None
        self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
        total = self._run_micro_batches(model, window, epoch_iterator, num_batches)
        if window.streamed:
            global_count = window.finish_streamed(self.backend.all_gather, self.args.device)
            self._call_event("on_window_counted", window=window)
            if global_count is None:
                return _DATA_RAN_OUT
            self.backend.sync_window()
            if global_count == 0:
                self.backend.zero_grad()
                self._skip_window(window)
                return None
            self.backend.scale_grads(1.0 / global_count)
            total = total / global_count
        # accelerate's optimizer wrapper only steps when it believes the gradients are synced.
        self.accelerator.gradient_state._set_sync_gradients(True)
        return total

    def _run_micro_batches(self, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int):
        """Forward and backward passes of every micro-batch of the window; returns the window's logged loss.

        With ``auto_micro_batch``, an out-of-memory error on any rank makes EVERY rank drop the window's partial
        gradient, halve the rows per micro-batch and run the same samples again: the update is unchanged (the
        global denominator does not depend on the grouping), nothing hangs (no collective runs inside the window
        in that mode), and the smaller size is kept for the rest of training.
        """
        retry = self.gradacc.auto_micro_batch
        while True:
            window.final_backward_done = False
            window.term_totals = {}
            out_of_memory, total = False, None
            try:
                total = self._micro_batch_loop(model, window, epoch_iterator, num_batches)
            except Exception as error:  # noqa: BLE001 - only out-of-memory errors are caught, the rest re-raised
                if not (retry and is_out_of_memory(error)):
                    raise
                out_of_memory = True
                release_memory()
            if not retry:
                break
            # One flag per rank, agreed before anything else communicates: every rank retries, or none does.
            flags = self.backend.all_gather(torch.tensor([int(out_of_memory)], device=self.args.device))
            if not bool(flags.max()):
                self.backend.sync_window()
                break
            self.backend.zero_grad()
            previous, self._auto_rows = halve_rows(window, self._auto_rows)
            logger.warning(
                f"auto_micro_batch: out of memory on {'this' if out_of_memory else 'another'} rank; micro-batches now "
                f"hold at most {self._auto_rows} row(s) (were {previous}). The optimizer step's samples and update are "
                "unchanged; the step is recomputed."
            )
            self.add_log_metrics({"auto_micro_batch_rows": self._auto_rows})
            window.resplit(self._auto_rows, self._count)
        if not window.streamed and not window.final_backward_done:
            raise GradAccUsageError(
                "The optimizer step's last micro-batch ran no final backward pass: a custom `training_step` must call "
                "`self.backward(loss, final=self.is_last_micro_batch)` (or super().training_step)."
            )
        return total

    def _micro_batch_loop(self, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int):
        """One pass over the window's micro-batches (prefetched, or pulled from the iterator when streamed)."""
        batches = window.pull(epoch_iterator, num_batches, self._count) if window.streamed else window.micro_batches
        total = torch.zeros((), device=self.args.device)
        flops, num_items = 0.0, None
        if not window.streamed:
            num_items = torch.tensor(window.global_count(self.primary_denominator), device=self.args.device)
        for i, inputs in enumerate(batches):
            window.index = 0 if window.streamed else i
            is_last = window.is_last
            self.accelerator.gradient_state._set_sync_gradients(is_last)
            try:
                with self.backend.sync_context(is_last=is_last):
                    total = total + self.training_step(model, inputs, num_items).to(total.device)
            finally:
                window.index = None
            flops += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)
            if not is_last:
                self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)
        self.current_flos += flops
        return total

    def _optimizer_step(self, window: Window) -> tuple[torch.Tensor, float]:
        """Hooks, norm and clipping, `on_pre_optimizer_step`, the step, the scheduler; returns the pre-clip norm and
        the learning rate the step used."""
        window.grads_ready = True
        try:
            self.grads.run_hooks(self._accumulated_grad_hooks)
            self._call_event("on_accumulated_grads")
            max_norm = self.args.max_grad_norm
            grad_norm = self.backend.clip_grad_norm(max_norm if max_norm is not None and max_norm > 0 else float("inf"))
            self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        finally:
            window.grads_ready = False
        self.backend.optimizer_step(self.optimizer)
        self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
        learning_rate = self._get_learning_rate()  # the rate this step used, before the scheduler moves on
        if not self.accelerator.optimizer_step_was_skipped and not isinstance(
            self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            self.lr_scheduler.step()
        self.backend.zero_grad()
        self._term_log.add(window)
        return grad_norm, learning_rate

    def _call_event(self, event: str, **kwargs: Any) -> None:
        """`CallbackHandler.call_event` for an hf_gradacc event, on the callbacks that define it."""
        handler = copy.copy(self.callback_handler)
        handler.callbacks = [cb for cb in self.callback_handler.callbacks if callable(getattr(cb, event, None))]
        self.control = handler.call_event(event, self.args, self.state, self.control, **kwargs)

    # ------------------------------------------------------------------ one micro-batch (Trainer hooks)
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch of the current window; returns its share of the logged loss."""
        window = self._require_window("training_step")
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if self._custom_compute_loss:  # a plain `outputs.loss` is then the mean over this micro-batch's items
            num_items_in_batch = torch.tensor(window.current_counts.get(self.primary_denominator), device=self.args.device)
        else:
            num_items_in_batch = None
        with self.compute_loss_context_manager():
            raw = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        parts = window.normalized_terms(
            parse_loss_output(raw), primary=self.primary_denominator, warn_on_plain_loss=self.gradacc.warn_on_plain_loss
        )
        window.add_term_totals(parts)
        is_last = window.is_last
        per_term = self.gradacc.backward_per_term and len(parts) > 1
        if per_term and not self.backend.supports_backward_per_term:
            logger.warning_once(
                f"backward_per_term: the {self.backend.name} backend cannot run several backward passes through one "
                "forward pass (DeepSpeed ZeRO-3 fails upstream); the terms are summed into ONE backward pass per "
                "micro-batch instead. The gradient is the same."
            )
            per_term = False
        if per_term:
            for k, (_, part) in enumerate(parts):
                last_term = k == len(parts) - 1
                self.backward(part, final=is_last and last_term, retain_graph=not last_term)
        else:
            self.backward(sum((p for _, p in parts[1:]), parts[0][1]), final=is_last)
        return sum((p.detach() for _, p in parts), torch.zeros((), device=parts[0][1].device))

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> LossTerm | torch.Tensor | tuple[Any, Any]:
        """The micro-batch's SUM-reduced loss, from the logits, as a :class:`~hf_gradacc.LossTerm`.

        Labels are taken out of the inputs (the model does not compute a loss of its own); seq2seq models get
        ``decoder_input_ids`` from ``prepare_decoder_input_ids_from_labels``. Outside a training step
        (evaluation), the mean over the batch's counted items is returned as a tensor, as `Trainer` expects.
        """
        inputs = dict(inputs)
        labels = inputs.pop(LABEL_KEY, None)
        shift_labels = inputs.pop(SHIFT_LABELS_KEY, None)
        if labels is None and shift_labels is None:
            raise GradAccDataError(
                f"The batch has no `{LABEL_KEY}` (keys: {sorted(inputs)}); GradAccTrainer computes the loss from the "
                "labels. Have the data collator return `labels`, or override `compute_loss` and return a LossTerm."
            )
        if (
            self.head.type == "seq2seq"
            and labels is not None
            and "decoder_input_ids" not in inputs
            and "decoder_inputs_embeds" not in inputs
        ):
            base = unwrap_model(model)
            if hasattr(base, "prepare_decoder_input_ids_from_labels"):
                inputs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=labels)
            else:
                inputs[LABEL_KEY] = labels  # the model builds its decoder inputs (and a loss we do not use)
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        total = self.head.sum_loss(logits, labels, shift_labels)
        result: Any = LossTerm(total=total, normalize_by=self.primary_denominator)
        if self._window is None or self._window.index is None:  # evaluation / prediction: a mean, as Trainer expects
            result = total / max(self.head.count_labels(labels, shift_labels), 1)
        return (result, outputs) if return_outputs else result

    def sum_loss_from_logits(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The SUM-reduced loss of the trainer's head family (``self.head.sum_loss``), for ``compute_loss`` overrides."""
        return self.head.sum_loss(logits, labels, shift_labels)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, None]:
        """`Trainer.get_batch_samples`: the next (up to) ``num_batches`` micro-batches of this rank. Nothing is
        counted here: the step's :class:`~hf_gradacc.window.Window` counts them over every rank in one collective,
        so the second value is always None. Override it to see or change a step's batches before they are counted."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`; with ``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` its batch
        sampler is a :class:`~hf_gradacc.data.WindowRegroupBatchSampler` (same samples per optimizer step, less
        padding). Iterable datasets keep the stock loader (a warning says so)."""
        dataloader = build_train_dataloader(self, self.gradacc)
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def set_initial_training_values(self, args, dataloader):
        """`Trainer.set_initial_training_values`, counting optimizer steps as windows when a token budget gives
        windows more than ``gradient_accumulation_steps`` micro-batches."""
        return adjust_training_values(dataloader, args, super().set_initial_training_values(args, dataloader))

    # ------------------------------------------------------------------ logging, evaluation, the end
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, with per-term losses (``loss/<name>``) and callback metrics added to training logs."""
        if "loss" in logs:
            logs.update(self._term_log.pop_means(self.backend.all_gather, self.args.device))
        if "loss" in logs and self._extra_logs:
            logs.update(self._extra_logs)
            self._extra_logs = {}
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`, with a LossTerm from an overridden ``compute_loss`` read as its batch mean."""
        if not self._custom_compute_loss:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        user_compute_loss = self.compute_loss

        def mean_compute_loss(*args: Any, **kwargs: Any) -> Any:
            out = user_compute_loss(*args, **kwargs)
            parsed = parse_loss_output(out)
            if parsed.plain is not None:
                return out
            loss = parsed.batch_mean(self.head.count(inputs))
            return (loss, *out[1:]) if isinstance(out, tuple) else loss

        self.compute_loss = mean_compute_loss  # type: ignore[method-assign]
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            del self.compute_loss

    def end(self) -> None:
        """`Trainer.end` (finish trackers, destroy the process group), safe at exit on CPU ranks (gloo).

        Example:
            ```python
            trainer.train()
            trainer.end()
            ```
        """
        finish_distributed()  # barrier, destroy the group, let gloo threads finish
        super().end()  # trackers; the group is already gone

