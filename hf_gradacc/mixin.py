"""`GradAccMixin`: what makes accumulation exact, for any `transformers.Trainer` subclass.

One optimizer step reads top-down from ``_run_epoch`` here, through :mod:`hf_gradacc.step` and back:

1. ``_run_epoch`` takes the epoch one window at a time: :func:`~hf_gradacc.step.open_window` fetches and counts the
   step's micro-batches (one collective), :func:`~hf_gradacc.step.train_window` runs them,
   :func:`~hf_gradacc.step.optimizer_step` applies the step;
2. every micro-batch goes through ``training_step`` (here), inside the backend's sync context;
3. ``training_step`` calls ``compute_loss``, has the :class:`~hf_gradacc.window.Window` normalise what it returned
   by the step's global counts, and back-propagates through the backend (``backward``).

The step's state travels in the ``Window``; the only step state on the trainer is ``current_window``, the window in
flight, because `Trainer`'s ``training_step`` / ``compute_loss`` signatures cannot carry it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from . import context_parallel, fused_choice, fused_into_grad, patches
from .auxiliary import returns_router_loss, split_model_loss
from .backends import Backend, resolve_backend
from .backends.fsdp2 import warn_if_no_full_model
from .builtin_loss import MAIN_TERM, builtin_loss, model_mean_loss
from .callbacks.base import GradAccCallback
from .callbacks.batchnorm import batchnorm_callback_for
from .checkpoints import DataPosition, ResumePoint, checkpoint_save, data_parallel_size, prefix_blocker, resolve_resume
from .checks import start_up_check
from .compat import check_trainer_class
from .config import GradAccArguments, GradAccSettings, resolve_settings
from .data.loader import build_train_dataloader, check_train_dataset, fetch_batches, find_regroup_sampler, plan_epoch
from .data.pack_check import check_packing_support
from .distributed import apply_ddp_timeout, collective_failure, finish_distributed, is_collective_failure
from .errors import GradAccConfigError, GradAccLossError, GradAccUsageError
from .fused_choice import check_fused_setting
from .grads import AccumulatedGradHook, GradAccess
from .heads import Head
from .log import announce_active
from .loss import LossOutput, LossTerm, parse_loss_output
from .nonfinite import poison_nonfinite
from .run_plan import realign_learning_rate, resumed_start, training_values
from .step import DATA_RAN_OUT, open_window, optimizer_step, train_window
from .weights import keep_weights_column, primary_denominator
from .window import LABEL_KEY, MicroBatchCounts, TermLog, Window

logger = logging.get_logger(__name__)

class GradAccMixin:
    """Exact gradient accumulation for any `transformers.Trainer` subclass: put it FIRST in the bases.

    Per optimizer step it counts the denominator (non-ignored target tokens, or samples for sequence-level heads)
    over every micro-batch and rank in one collective, computes each micro-batch's loss as a SUM (the built-in one
    from the logits, plus a mixture-of-experts model's router terms), divides it by the global count times the
    data-parallel world size, and never divides by the number of micro-batches. The logged ``loss`` is the step's
    exact mean, ``grad_norm`` the exact accumulated gradient's norm. A step without counted items on any rank, or
    (``nonfinite_steps="skip"``) with a NaN/Inf loss or gradient, is skipped on every rank alike.

    Knobs: the :class:`~hf_gradacc.GradAccArguments` fields, from ``args`` when it is a GradAcc config, or from the
    extra keyword ``gradacc_args=`` (a ``GradAccArguments`` or a dict) with any other `TrainingArguments`.
    Overriding ``compute_loss``: return :class:`~hf_gradacc.LossTerm` (s) for an exact step; a plain tensor is read
    as the MEAN over the micro-batch's counted items (``num_items_in_batch`` is that local count), with a warning
    once. ``current_window`` gives an override the step's global counts. See docs/api.md and docs/architecture.md.

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

    def __init__(self, *args: Any, gradacc_args: GradAccArguments | dict[str, Any] | None = None, **kwargs: Any) -> None:
        """The trainer class's own parameters (``*args``, ``**kwargs``: `Trainer`'s, TRL's, your subclass's), plus
        ``gradacc_args``: the :class:`~hf_gradacc.GradAccArguments` (or a dict of them) when ``args`` is not a
        GradAcc config. :class:`~hf_gradacc.GradAccTrainer` spells out `Trainer`'s parameters."""
        # the private Trainer / TRL / accelerate members the step rests on, before anything is built (compat.py)
        check_trainer_class(type(self))
        # HF_GRADACC_CPU_DISTRIBUTED=1: patch accelerate BEFORE Trainer.__init__ builds the accelerator (patches/)
        patches.maybe_enable_from_env()
        super().__init__(*args, **kwargs)
        self._setup_gradacc(gradacc_args)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """Everything hf_gradacc adds to a constructed `Trainer`: settings, head, backend, step state, callbacks.

        The ONE setup path, run by ``__init__`` after `Trainer.__init__` and by :func:`~hf_gradacc.make_exact` on a
        trainer built by someone else. Subclasses with checks of their own (``hf_gradacc.trl``) extend it with
        ``super()._setup_gradacc(gradacc_args)`` first."""
        announce_active(self)  # hf_gradacc's loggers follow the Trainer's log_level; one line when training begins
        self.gradacc = settings = resolve_settings(self.args, gradacc_args)
        # `compute_loss_func` (a Trainer argument) replaces the built-in loss exactly as an override does.
        self._loss_from_func = type(self).compute_loss is GradAccMixin.compute_loss and self.compute_loss_func is not None
        self._custom_compute_loss = type(self).compute_loss is not GradAccMixin.compute_loss or self._loss_from_func
        self._plain_override = self._custom_compute_loss and not self._loss_from_func
        self._custom_training_step = type(self).training_step is not GradAccMixin.training_step
        self.head = Head.for_model(
            self.model,
            requested=settings.head_type,
            ignore_index=settings.ignore_index,
            label_smoothing=self.args.label_smoothing_factor,
            custom_loss=self._custom_compute_loss,
        )
        if self.head.type is not None and LABEL_KEY not in self.label_names:
            # Keep `labels` through the Trainer's unused-column removal even when the model's forward does not
            # take them: the built-in loss is computed from them.
            self.label_names = [*self.label_names, LABEL_KEY]
        keep_weights_column(self)  # `loss_weights` survives remove_unused_columns, without being a label name
        self.backend = resolve_backend(
            self.accelerator,
            self.args,
            settings,
            multi_backward=settings.backward_per_term
            or self._custom_training_step
            or settings.auto_micro_batch
            or settings.defer_normalization,
            model=self.model,
        )
        self.backend.check_model(self.model)
        if settings.fused_lm_head:
            check_fused_setting(self)  # ignored (own loss, a warning), runs, or refused: once, not per micro-batch
        self._fused_choice = fused_choice.initial_choice(self)  # None: automatic, decided on the first optimizer step
        if settings.pack_micro_batches:
            check_packing_support(self.model)  # no silent cross-sample attention
        self._cp = context_parallel.context_parallel_for(self)  # cp_size > 1: a shard per rank, or refused by name
        apply_ddp_timeout(self.args)  # gloo groups made with use_cpu=True miss it (transformers 5.23)
        if settings.defer_normalization and self._custom_training_step:
            raise GradAccConfigError(
                "`defer_normalization=True` cannot be combined with an overridden `training_step`; turn one off."
            )
        self.num_skipped_windows = self.num_nonfinite_skipped = 0
        self._loss_check_due, self._loss_check = False, None
        self._fused_head_ran = False  # the built-in loss ran the fused head (a custom training_step may bypass it)
        self._window: Window | None = None
        self._auto_rows: int | None = None  # auto_micro_batch: rows per micro-batch once an OOM was survived
        self._training_started = False
        self._batches_per_epoch: int | None = None  # micro-batches per rank of an epoch (None: no length)
        self._accumulated_grad_hooks: list[tuple[AccumulatedGradHook, bool]] = []
        self._term_log = TermLog()
        self._extra_logs: dict[str, float] = {}
        self._step_means: dict[str, tuple[float, int]] = {}  # add_log_metrics(per_step=True): sum, steps
        self.grads = GradAccess(self)
        batchnorm = batchnorm_callback_for(self.model, settings, self.callback_handler.callbacks)
        if batchnorm is not None:  # BatchNorm under accumulation: a warning, or the `batchnorm` mode (callbacks/)
            self.callback_handler.add_callback(batchnorm)
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
        return primary_denominator(self.head, self._window)  # "weights" when the step carries `loss_weights`

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

    def scheduled_accumulation_steps(self) -> int:
        """Micro-batches per rank of the next optimizer step: ``accumulation_schedule`` at ``state.global_step``, or
        ``gradient_accumulation_steps`` without a schedule."""
        schedule = self.gradacc.accumulation_schedule
        return self.args.gradient_accumulation_steps if schedule is None else schedule.at(self.state.global_step)

    def add_log_metrics(self, metrics: Mapping[str, float], *, per_step: bool = False) -> None:
        """Add ``metrics`` to the next training log line (used by hf_gradacc callbacks). ``per_step=True``: values of
        one optimizer step, logged as their MEAN over the steps since the previous log line."""
        if not per_step:
            self._extra_logs.update({k: float(v) for k, v in metrics.items()})
            return
        for key, value in metrics.items():
            total, steps = self._step_means.get(key, (0.0, 0))
            self._step_means[key] = (total + float(value), steps + 1)

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
        if self.gradacc.nonfinite_steps != "propagate":
            loss = poison_nonfinite(loss)  # a NaN/Inf loss on any rank makes the reduced gradient non-finite everywhere
        # A window that defers its sync reduces once after its last micro-batch (Window.defers_sync).
        self.backend.backward(loss, is_final=final and not window.defers_sync, retain_graph=retain_graph)
        if final:
            window.final_backward_done = True

    def _require_window(self, what: str) -> Window:
        window = self._window
        if window is None or window.index is None:
            where = "outside `trainer.train()`" if window is None else "between two micro-batches (a callback, a hook)"
            if what == "backward":
                way_out = (
                    "`trainer.backward(loss, final=...)` is for a `training_step` override, which `trainer.train()` "
                    "calls once per micro-batch; outside training call `loss.backward()` on your loss yourself"
                )
            else:
                way_out = (
                    "To train, call `trainer.train()`. For a one-off forward and backward pass outside training, "
                    "`loss = trainer.compute_loss(trainer.model, batch)` is the batch's mean loss (as in `Trainer`; "
                    "the batch's tensors on the model's device): call `loss.backward()` on it (not "
                    "`transformers.Trainer.training_step(trainer, ...)`, which divides by `gradient_accumulation_steps` "
                    "and fails before `train()`); `trainer.evaluate()` gives the loss alone"
                )
            raise GradAccUsageError(
                f"`{what}` was called {where}: it runs only inside a training step of `trainer.train()`, on a "
                f"micro-batch of the optimizer step in flight, whose counts over the whole step normalise its loss. "
                f"{way_out}."
            )
        return window

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; ``resume_from_checkpoint=True`` takes the newest checkpoint that can be resumed
        (:func:`~hf_gradacc.checkpoints.latest_complete_checkpoint`), passing over a save killed midway; a named folder
        that cannot be resumed is refused, naming the missing or broken file, and so is one saved with a data layout
        that cannot be carried over (dataset, seed, regrouping: samples lost or repeated). A changed batch size, GA,
        schedule or world size resumes at the recorded position, re-batched in this run's layout."""
        resume_from_checkpoint, self._resume_point = resolve_resume(self, resume_from_checkpoint)
        self._resume_at: ResumePoint | None = None  # set once the run's layout is known, when the stock skip is wrong
        self.data_position: DataPosition | None = None  # where the data stands, recorded by each checkpoint
        with fused_into_grad.keeping_buffers():  # the fused head's weight-gradient buffer kept from window to window
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """`Trainer._save_checkpoint`, bracketed so that a kill at any point leaves the old checkpoint or a complete
        new one (:func:`~hf_gradacc.checkpoints.checkpoint_save`: a marker written last, rotation after it)."""
        with checkpoint_save(self, trial):
            super()._save_checkpoint(model, trial)

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
            self._loss_check_due, self._loss_check = self.gradacc.check_loss_at_start, None
        resuming = epoch == epochs_trained and resume_from_checkpoint is not None
        skip = steps_trained_in_current_epoch if resuming and not self.args.ignore_data_skip else 0
        # Where the epoch stands in samples of its order (None: not a prefix of it), recorded by each checkpoint.
        relayout = resuming and self._resume_at is not None
        first_sample = self._resume_at.num_samples if relayout and not self.args.ignore_data_skip else 0
        regrouped = find_regroup_sampler(train_dataloader)
        if relayout:
            realign_learning_rate(self)  # the optimizer holds the rate the checkpoint's schedule set for this step
            steps_in_epoch = len(train_dataloader)  # the micro-batches left after the skipped samples, per rank
            num_update_steps_per_epoch = (
                regrouped.num_windows if regrouped is not None
                else math.ceil(steps_in_epoch / self.args.gradient_accumulation_steps)
            )  # fmt: skip
        num_samples = len(self.train_dataset) if prefix_blocker(self) is None else None
        samples_per_micro_batch = self._train_batch_size * data_parallel_size(self)  # not the cp / tp / sp copies
        # Regrouped or packed windows keep each stock window's samples (GA x batch x ranks of the order), not its
        # micro-batches: count windows there.
        samples_per_window = samples_per_micro_batch * self.args.gradient_accumulation_steps
        windows_done = skip // self.args.gradient_accumulation_steps
        plan = plan_epoch(
            train_dataloader,
            epoch,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            steps_in_epoch=steps_in_epoch,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            steps_trained_in_current_epoch=skip,
            accumulation=None if self.gradacc.accumulation_schedule is None else self.scheduled_accumulation_steps,
        )
        if resuming and steps_trained_in_current_epoch == 0:
            self._load_rng_state(resume_from_checkpoint)
        step, steps_in_epoch, rng_to_sync = plan.step, plan.steps_in_epoch, plan.resumed_mid_epoch
        grad_norm = learning_rate = None
        any_rank_had_data = plan.step >= 0  # agreed: from the counts every rank gathered, never this rank's alone
        for num_batches in plan.num_batches:
            window = None
            try:
                window = open_window(self, plan.epoch_iterator, num_batches)
                if rng_to_sync:  # the skipped batches drew from the RNG: restore the checkpoint's state now
                    self._load_rng_state(resume_from_checkpoint)
                    rng_to_sync = False
                tr_loss_step = train_window(self, model, window, plan.epoch_iterator, num_batches)
                any_rank_had_data = any_rank_had_data or sum(window.counts.num_micro_batches_per_rank) > 0
                if tr_loss_step is DATA_RAN_OUT:
                    break  # the data ran out on every rank: the epoch ends here, nothing is carried over
                step += window.num_micro_batches
                windows_done += 1
                if tr_loss_step is None:
                    continue  # no counted item on any rank: skipped, parameters unchanged
                stepped = optimizer_step(self, window)
                if stepped is None:
                    continue  # a non-finite step, dropped on every rank: parameters and optimizer state unchanged
                grad_norm, learning_rate = stepped
                if self.args.logging_nan_inf_filter and not bool(torch.isfinite(tr_loss_step)):
                    self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                else:
                    self._tr_loss += tr_loss_step.to(self._tr_loss.device)
            except RuntimeError as error:
                if not is_collective_failure(error):
                    raise
                micro_batch = None if window is None else window.index
                raise collective_failure(self.state.global_step + 1, micro_batch, self.args) from error
            finally:
                self._window = None
            self.state.global_step += 1
            self.state.epoch = epoch + (step + 1) / steps_in_epoch
            done = windows_done * samples_per_window if regrouped is not None else (step + 1) * samples_per_micro_batch
            trained = None if num_samples is None else min(first_sample + done, num_samples)
            self.data_position = DataPosition(
                epoch=epoch, num_samples=trained, num_micro_batches=step + 1, epoch_done=step + 1 >= steps_in_epoch
            )
            if relayout and trained is not None:
                self.state.epoch = epoch + trained / num_samples
            self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
            self._maybe_log_save_evaluate(
                self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                learning_rate=learning_rate,
            )  # fmt: skip
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break

        if not any_rank_had_data:
            logger.warning(
                "There seems not to be a single sample in your epoch_iterator, stopping training at step"
                f" {self.state.global_step}!"
            )
            self.control.should_training_stop = True
        if self.backend.dp_world_size > 1:
            # The loss trained since the last log, as the mean over ranks: `Trainer` adds it to the run's
            # `train_loss` at the end without reducing it. Every rank reaches this point: an agreed collective.
            self._tr_loss.copy_(self.backend.all_gather(self._tr_loss.detach()).mean(dim=0))
        self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
        self._maybe_log_save_evaluate(
            self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
            learning_rate=learning_rate,
        )  # fmt: skip

    def _count(self, batch: Mapping[str, Any]) -> MicroBatchCounts:
        """The head's counts, plus the input tokens `include_num_input_tokens_seen` tracks (summed with the counts in
        the step's one collective, not gathered per micro-batch as `Trainer._track_num_input_tokens` does)."""
        return self._cp.count(self, batch)  # what this rank holds: the whole micro-batch, or its context-parallel shard

    # ------------------------------------------------------------------ one micro-batch (Trainer hooks)
    def training_step_context(self) -> contextlib.AbstractContextManager:
        """A context entered around each micro-batch's ``training_step``, its forward AND backward passes; none by
        default. A subclass that must wrap the whole step (TRL's activation offloading, see :mod:`hf_gradacc.trl`)
        returns it here instead of overriding ``training_step``, which would switch the backend to multi-backward mode."""
        return contextlib.nullcontext()

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch of the current window; returns its share of the logged loss."""
        window = self._require_window("training_step")
        if (loss := self._cp.training_step(self, model, inputs, num_items_in_batch)) is not None:
            return loss  # context parallelism: ran below on this rank's shard, inside torch's context
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        # a `compute_loss_func` is the user's own loss, called with this micro-batch's count: nothing to compare it with
        check = self._loss_check_due and window.index == 0 and self._loss_check is None and not self._loss_from_func
        local = window.current_counts.get(self.primary_denominator)
        # An overridden compute_loss gets this micro-batch's own count: a plain `outputs.loss` is then its mean.
        num_items = torch.tensor(local, device=self.args.device) if self._custom_compute_loss else None
        untouched = dict(inputs) if check else None  # an override may pop the labels the check needs
        # An override's forward outputs, to recognise a returned `outputs.loss` that holds router terms (below).
        seen: list[Any] = []
        unwrapped = self.accelerator.unwrap_model(model) if self._plain_override else None
        hook = unwrapped.register_forward_hook(lambda _m, _a, out: seen.append(out)) if unwrapped is not None else None
        try:
            with self.compute_loss_context_manager():
                raw = self.compute_loss(
                    model, inputs, return_outputs=check and not self._custom_compute_loss, num_items_in_batch=num_items
                )
        finally:
            if hook is not None:
                hook.remove()
        parsed = parse_loss_output(raw)
        if check:
            self._loss_check = start_up_check(
                parsed, window, denominator=self.primary_denominator, builtin=not self._custom_compute_loss,
                label_smoothing=self.head.label_smoothing, dp_world_size=self.backend.dp_world_size,
                model_mean=partial(model_mean_loss, self.accelerator.unwrap_model(model), untouched),
            )  # fmt: skip
        if seen and parsed.plain is not None:
            # A mixture-of-experts model's own loss (CE mean + coef x aux): its router terms weighted by routed tokens.
            terms = split_model_loss(
                unwrapped, parsed.plain, seen, main_count=local, main_denominator=self.primary_denominator,
                num_input_tokens=window.current_counts.num_input_tokens,
            )  # fmt: skip
            if terms is not None:
                parsed = LossOutput(terms=terms, outputs=parsed.outputs)
            elif returns_router_loss(unwrapped, seen):
                logger.warning_once(
                    "compute_loss returned a plain value that is not the model's own loss, and the model returned a "
                    "router load-balancing loss: the value is read as a mean over target tokens, so a router term "
                    "added to it would be weighted by target tokens, not routed tokens. Return hf_gradacc.LossTerms "
                    "(the router term as LossTerm(coef * aux * routed_tokens, 'input_tokens')), or the model's own "
                    "`outputs.loss`, which hf_gradacc splits exactly."
                )
        seen.clear()  # the outputs are not kept through the backward pass
        del inputs, raw
        parsed = replace(parsed, outputs=None)  # nor the start-up check's: its logits, [tokens x vocabulary]
        parts = window.normalized_terms(parsed, primary=self.primary_denominator, warn_on_plain_loss=self.gradacc.warn_on_plain_loss)
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
    ) -> dict[str, LossTerm] | torch.Tensor | tuple[Any, Any]:
        """The micro-batch's SUM-reduced loss, from the logits, as a :class:`~hf_gradacc.LossTerm`; a mixture-of-experts
        model's router terms make it ``{"main": LossTerm, "aux": LossTerm, ...}`` (see :mod:`hf_gradacc.auxiliary`).

        Labels are taken out of the inputs (the model does not compute a loss of its own, except on the first
        micro-batch of training, for the start-up check); seq2seq models get ``decoder_input_ids`` from
        ``prepare_decoder_input_ids_from_labels``. Outside a training step (evaluation) the batch's mean loss is
        returned as a tensor, as `Trainer` expects: NaN, with a warning, for a batch without a counted item.
        """
        if self.compute_loss_func is not None:
            return self._compute_loss_with_func(model, inputs, return_outputs, num_items_in_batch)
        window = self._window
        training = window is not None and window.index is not None
        check = training and self._loss_check_due and self._loss_check is None and window.index == 0
        fused = fused_choice.runs_now(self, window, training)  # evaluation keeps the logits metrics need
        self._fused_head_ran |= fused
        terms, outputs = builtin_loss(
            self.head, model, inputs, denominator=self.primary_denominator, with_model_loss=check, fused_lm_head=fused,
            routing=window.routing if training else None, micro_batch_index=window.index if training else None,
        )
        result: Any = terms if len(terms) > 1 else terms[MAIN_TERM]  # a LossTerm, as in 0.1, unless router terms
        if not training:  # evaluation / prediction: the batch mean
            result = self._cp.batch_mean(self, terms, self.head.count(inputs), self.primary_denominator)  # cp: agreed
        return (result, outputs) if return_outputs else result

    def _compute_loss_with_func(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> Any:
        """The Trainer argument ``compute_loss_func(outputs, labels, num_items_in_batch=...)``, called as `Trainer`
        calls it. In training ``num_items_in_batch`` is THIS micro-batch's count (never the step's, never times the
        processes): a function that divides its sum by it returns the micro-batch's mean, which the window weights by
        the micro-batch's share of the step, as for a plain ``compute_loss`` override. A
        :class:`~hf_gradacc.LossTerm` (or a dict of them) is taken as it is."""
        inputs = dict(inputs)
        labels = inputs.pop(LABEL_KEY, None)
        outputs = model(**inputs)
        loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        try:
            parse_loss_output(loss)
        except GradAccLossError as error:
            raise GradAccLossError(
                f"`compute_loss_func` ({getattr(self.compute_loss_func, '__name__', self.compute_loss_func)!r}) "
                f"returned something hf_gradacc cannot normalise: {error}. Return the micro-batch's MEAN as a scalar "
                "tensor (divide the sum by `num_items_in_batch`, which hf_gradacc sets to this micro-batch's count), "
                "or hf_gradacc.LossTerm(total=<sum>, normalize_by=\"tokens\" | \"samples\")."
            ) from error
        return (loss, outputs) if return_outputs else loss

    def sum_loss_from_logits(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The SUM-reduced loss of the trainer's head family (``self.head.sum_loss``), for ``compute_loss`` overrides."""
        return self.head.sum_loss(logits, labels, shift_labels)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, None]:
        """`Trainer.get_batch_samples`: the next (up to) ``num_batches`` micro-batches of this rank. Nothing is
        counted here: the step's :class:`~hf_gradacc.window.Window` counts them over every rank in one collective,
        so the second value is always None. Override it to see or change a step's batches before they are counted."""
        return fetch_batches(epoch_iterator, num_batches), None

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`; with ``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` its batch
        sampler is a :class:`~hf_gradacc.data.WindowRegroupBatchSampler` (same samples per optimizer step, less
        padding). Iterable datasets keep the stock loader (a warning says so)."""
        check_train_dataset(self.train_dataset)
        dataloader = build_train_dataloader(self, self.gradacc)
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def set_initial_training_values(self, args, dataloader):
        """`Trainer.set_initial_training_values`, counting optimizer steps as windows when a token budget gives
        windows more than ``gradient_accumulation_steps`` micro-batches (agreed across ranks, one collective), under
        an ``accumulation_schedule``, and from a resumed checkpoint's recorded position
        (:func:`~hf_gradacc.run_plan.training_values`)."""
        return training_values(self, args, dataloader, super().set_initial_training_values(args, dataloader))

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial):
        """`Trainer._init_training_state`; a resumed run finds its epoch and what it already trained in it from the
        schedule (windows differ in size) or the checkpoint's record (:func:`~hf_gradacc.run_plan.resumed_start`)."""
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        return resumed_start(self, epochs_trained, steps_trained, max_steps, num_train_epochs, resume_from_checkpoint)

    # ------------------------------------------------------------------ logging, evaluation, the end
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, with per-term losses (``loss/<name>``) and callback metrics added to training logs."""
        if "loss" in logs:
            logs.update(self._term_log.pop_means(self.backend.all_gather, self.args.device))
        if "loss" in logs and self._step_means:
            logs.update({key: total / steps for key, (total, steps) in self._step_means.items()})
            self._step_means = {}
        if "loss" in logs and self._extra_logs:
            logs.update(self._extra_logs)
            self._extra_logs = {}
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`, with a LossTerm from an overridden ``compute_loss`` read as its batch mean."""
        if not self._custom_compute_loss:  # context parallelism: padded, checked (agreed) first
            return self._cp.prediction_step(self, super().prediction_step, model, inputs, prediction_loss_only, ignore_keys)
        user_compute_loss = self.compute_loss

        def mean_compute_loss(*args: Any, **kwargs: Any) -> Any:
            out = user_compute_loss(*args, **kwargs)
            parsed = parse_loss_output(out)
            if parsed.plain is not None:
                return out
            loss = self._cp.custom_batch_mean(self, parsed, inputs)  # cp: this rank's chunks, summed over the cp ranks
            return (loss, *out[1:]) if isinstance(out, tuple) else loss

        self.compute_loss = mean_compute_loss  # type: ignore[method-assign]
        try:
            return self._cp.prediction_step(self, super().prediction_step, model, inputs, prediction_loss_only, ignore_keys)
        finally:
            del self.compute_loss

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`; under FSDP with a sharded state dict, from which transformers 5.23 writes NO model
        (and raises nothing), a warning says so and how to get a full model."""
        super().save_model(output_dir, _internal_call)
        if self.is_fsdp_enabled and not _internal_call:
            warn_if_no_full_model(self.accelerator, output_dir or self.args.output_dir)

    def end(self) -> None:
        """`Trainer.end` (finish trackers, destroy the process group), safe at exit on CPU ranks (gloo).

        Example:
            ```python
            trainer.train()
            trainer.end()
            ```
        """
        finish_distributed()  # barrier, destroy the group, let gloo threads finish
        upstream_end = getattr(super(), "end", None)  # no `Trainer.end` in transformers 5.6 / 5.16
        if upstream_end is not None:
            upstream_end()  # trackers; the group is already gone

