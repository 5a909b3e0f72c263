"""`GradAccMixin`: what makes accumulation exact, for any `transformers.Trainer` subclass.

The mixin is the Trainer's side of the step: it adapts the Trainer's hooks onto the step's owner,
:class:`~hf_gradacc.step.engine.StepEngine`, built once at construction (``_setup_gradacc``), and keeps the public
surface (``current_window``, ``backward``, ``grads``, ``register_accumulated_grad_hook``, ``add_log_metrics``). One
optimizer step reads top-down from ``_run_epoch`` here into the engine and back:

1. ``_run_epoch`` takes the epoch one window at a time: the engine opens the window (fetch, count over every rank in
   one collective), trains it, and takes the optimizer step; the Trainer's bookkeeping (the step counter, the epoch,
   ``on_step_end``, logging, saving, evaluation) stays here;
2. every micro-batch goes through ``training_step`` (the Trainer's hook, overridable), which hands it back to
   :meth:`~hf_gradacc.step.engine.StepEngine.micro_batch`: ``compute_loss``, normalisation by the step's global
   counts, the backward pass through the backend.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from . import patches
from .backends import Backend, resolve_backend
from .backends.context_parallel import context_parallel_for
from .backends.distributed import (
    apply_ddp_timeout,
    collective_failure,
    failure_outside_step,
    finish_distributed,
    is_collective_failure,
)
from .backends.fsdp2 import warn_if_no_full_model
from .backends.mesh import mesh_from_accelerator
from .callbacks.batchnorm import batchnorm_callback_for
from .callbacks.callback import GradAccCallback
from .checkpoints import (
    POSITION_KEY,
    DataPosition,
    checkpoint_save,
    data_layout,
    prefix_blocker,
    resolve_resume,
    restore_weights,
)
from .compat import check_trainer_class
from .config import GlobalBatch, GradAccArguments, GradAccSettings, hold_total_train_batch_size, resolve_settings
from .counting import LABEL_KEY, Counter, SeenTokens
from .data.loader import (
    TrainData,
    build_train_dataloader,
    check_train_dataset,
    fetch_batches,
    find_regroup_sampler,
    plan_epoch,
)
from .data.pack_check import check_packing_support
from .errors import GradAccConfigError, GradAccError, GradAccLossError
from .fused.choice import FusedPolicy
from .grads import AccumulatedGradHook, GradAccess
from .heads import Head
from .log import announce_active
from .loss import LossTerm, parse_loss_output
from .moe_balance import check_router_balance
from .step.engine import DATA_RAN_OUT, LossSource, StepEngine
from .step.plan import realign_learning_rate
from .step.preemption import release_jit_checkpoint
from .step.window import Window
from .weights import LOSS_WEIGHTS_KEY

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

    def __init__(
        self, *args: Any, gradacc_args: GradAccArguments | dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
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
        """Everything hf_gradacc adds to a constructed `Trainer`: the settings, the head, the backend, the step's
        owner and its collaborators, the callbacks.

        The ONE setup path, run by ``__init__`` after `Trainer.__init__` and by :func:`~hf_gradacc.make_exact` on a
        trainer built by someone else. Subclasses with checks of their own (``hf_gradacc.trl``) extend it with
        ``super()._setup_gradacc(gradacc_args)`` first."""
        announce_active(self)  # hf_gradacc's loggers follow the Trainer's log_level; one line when training begins
        self.gradacc = settings = resolve_settings(self.args, gradacc_args)
        source = self._loss_source()
        name = type(self).__name__
        self.head = head = Head.for_model(
            self.model,
            requested=settings.head_type,
            ignore_index=settings.ignore_index,
            label_smoothing=self.args.label_smoothing_factor,
            custom_loss=source.custom_compute_loss,
        )
        if head.type is not None and LABEL_KEY not in self.label_names:
            # Keep `labels` through the Trainer's unused-column removal even when the model's forward does not
            # take them: the built-in loss is computed from them.
            self.label_names = [*self.label_names, LABEL_KEY]
        self._keep_weights_column()
        # total_train_batch_size: GA derived from the data ranks present, before the backend, the run's length, the
        # scheduler and the logs read it (on every (re)start, whatever the world)
        self.global_batch: GlobalBatch | None = hold_total_train_batch_size(
            self.args,
            settings,
            data_ranks=mesh_from_accelerator(self.accelerator, self.model).data_parallel_size
            if settings.total_train_batch_size is not None
            else 1,
        )
        multi_backward = (
            settings.backward_per_term
            or source.custom_training_step
            or settings.auto_micro_batch
            or settings.defer_normalization
        )
        self.backend = backend = resolve_backend(
            self.accelerator, self.args, settings, multi_backward=multi_backward, model=self.model
        )
        backend.check_model(self.model)
        if settings.pack_micro_batches:
            check_packing_support(self.model)  # no silent cross-sample attention
        cp, gather_function = context_parallel_for(  # cp_size > 1: a shard per rank, or refused by name
            accelerator=self.accelerator,
            settings=settings,
            head=head,
            model=self.model,
            source=source,
            trainer_class=type(self),
            sequence_parallel_size=int(getattr(backend, "sequence_parallel_size", 1) or 1),
        )
        if gather_function is not None:  # evaluation gathers one copy of each batch (the cp group's rank 0)
            self.gather_function = gather_function
        fused = FusedPolicy.at_construction(  # ignored (own loss), on, off, refused, or automatic: once, logged
            settings=settings,
            head=head,
            backend=backend,
            model=self.model,
            source=source,
            args=self.args,
            trainer_name=name,
            cp_size=cp.size,
            accelerator=self.accelerator,
        )
        router = check_router_balance(  # router_balance="global_batch": refused by name, or the pre-pass's shape
            settings=settings,
            head=head,
            model=self.model,
            backend=backend,
            custom_loss=source.custom_compute_loss,
            trainer_name=name,
        )
        apply_ddp_timeout(self.args)  # gloo groups made with use_cpu=True miss it (transformers 5.23)
        if settings.defer_normalization and source.custom_training_step:
            raise GradAccConfigError(
                "`defer_normalization=True` cannot be combined with an overridden `training_step`; turn one off."
            )
        seen = SeenTokens(
            mode=self.args.include_num_input_tokens_seen,
            main_input_name=getattr(self.model, "main_input_name", "input_ids"),
            pad_token_id=getattr(self.processing_class, "pad_token_id", None),
        )
        self.step_engine = StepEngine(
            self,
            settings=settings,
            head=head,
            counter=Counter(head, cp=cp, seen=seen),
            backend=backend,
            fused=fused,
            source=source,
            cp=cp,
            router=router,
        )
        self.grads: GradAccess = self.step_engine.grads
        if settings.save_on_preemption:  # transformers' per-rank SIGTERM checkpoint replaced by the agreed one
            release_jit_checkpoint(self.callback_handler.callbacks)
        batchnorm = batchnorm_callback_for(self.model, settings, self.callback_handler.callbacks)
        if batchnorm is not None:  # BatchNorm under accumulation: a warning, or the `batchnorm` mode (callbacks/)
            self.callback_handler.add_callback(batchnorm)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, GradAccCallback):
                callback.bind(self)

    @staticmethod
    def adopt(trainer: Any, exact_class: type, gradacc_args: Any) -> None:
        """Give ``trainer`` (a built `Trainer`) the class ``exact_class`` (the mixin in front of its class) and run the
        setup ``__init__`` would have run after `Trainer.__init__`; its class is restored if the setup refuses
        (:func:`~hf_gradacc.make_exact`)."""
        original = type(trainer)
        trainer.__class__ = exact_class
        try:
            trainer._setup_gradacc(gradacc_args)
        except BaseException:
            trainer.__class__ = original
            raise

    def _keep_weights_column(self) -> None:
        """Keep ``loss_weights`` through the Trainer's unused-column removal (``remove_unused_columns=True`` drops
        every dataset column the model's forward does not name), without making it a label name (which would change
        what ``prediction_step`` hands to ``compute_metrics``)."""
        setup = getattr(self, "_set_signature_columns_if_needed", None)
        if not callable(setup):
            return
        setup()
        columns = getattr(self, "_signature_columns", None)
        if isinstance(columns, list) and LOSS_WEIGHTS_KEY not in columns:
            columns.append(LOSS_WEIGHTS_KEY)

    def _loss_source(self) -> LossSource:
        """Where this trainer's loss comes from: its class's overrides, or a ``compute_loss_func`` (a Trainer
        argument, which replaces the built-in loss exactly as an override does)."""
        overridden = type(self).compute_loss is not GradAccMixin.compute_loss
        from_func = not overridden and self.compute_loss_func is not None
        return LossSource(
            custom_compute_loss=overridden or from_func,
            loss_from_func=from_func,
            custom_training_step=type(self).training_step is not GradAccMixin.training_step,
        )

    # ------------------------------------------------------------------ public surface
    @property
    def current_window(self) -> Window | None:
        """The optimizer step in flight (its counts, micro-batch cursor, state), from ``on_step_begin`` to
        ``on_optimizer_step``; None outside. ``current_window.global_count("tokens")`` is the step's denominator."""
        return self.step_engine.window

    @property
    def is_last_micro_batch(self) -> bool:
        """True while the last micro-batch of the current optimizer step runs."""
        window = self.step_engine.window
        return window is not None and window.is_last

    @property
    def primary_denominator(self) -> str:
        """``"samples"`` for sequence classification (and unlabelled data), ``"weights"`` for a step whose batches
        carry ``loss_weights``, ``"tokens"`` for every other head."""
        return self.step_engine.primary_denominator

    @property
    def num_skipped_windows(self) -> int:
        """Optimizer steps skipped because no rank counted an item (parameters unchanged)."""
        return self.step_engine.num_skipped_windows

    @property
    def num_nonfinite_skipped(self) -> int:
        """Optimizer steps dropped on every rank for a NaN/Inf loss or gradient (``nonfinite_steps="skip"``)."""
        return self.step_engine.num_nonfinite_skipped

    @property
    def preempted(self) -> bool:
        """The last ``train()`` stopped early because a rank received SIGTERM (``save_on_preemption``): every rank
        saved the checkpoint of the same optimizer step, ``state.global_step``, and training stopped there.

        Example:
            ```python
            trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))
            if trainer.preempted:  # checkpoint-<global_step> is complete; the job is requeued / restarted
                sys.exit(0)
            trainer.save_model()
            ```
        """
        return self.step_engine.preemption.preempted

    @property
    def data_position(self) -> DataPosition | None:
        """Where the training data stands after the last optimizer step (recorded by every checkpoint)."""
        return self.step_engine.plan.data_position

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
        self.step_engine.add_grad_hook(hook, local=local)

    def scheduled_accumulation_steps(self) -> int:
        """Micro-batches per rank of the next optimizer step: ``accumulation_schedule`` at ``state.global_step``, or
        ``gradient_accumulation_steps`` without a schedule."""
        schedule = self.gradacc.accumulation_schedule
        return self.args.gradient_accumulation_steps if schedule is None else schedule.at(self.state.global_step)

    def add_log_metrics(self, metrics: Mapping[str, float], *, per_step: bool = False) -> None:
        """Add ``metrics`` to the next training log line (used by hf_gradacc callbacks). ``per_step=True``: values of
        one optimizer step, logged as their MEAN over the steps since the previous log line."""
        self.step_engine.logs.add(metrics, per_step=per_step)

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
        self.step_engine.backward(loss, final=final, retain_graph=retain_graph)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; ``resume_from_checkpoint=True`` takes the newest checkpoint that can be resumed
        (:func:`~hf_gradacc.checkpoints.latest_complete_checkpoint`), passing over a save killed midway; a named folder
        that cannot be resumed is refused, naming the missing or broken file, and so is one saved with a data layout
        that cannot be carried over (dataset, seed, regrouping: samples lost or repeated). A changed batch size, GA,
        schedule or world size resumes at the recorded position, re-batched in this run's layout."""
        if resume_from_checkpoint is None and self.args.resume_from_checkpoint not in (None, ""):
            logger.warning(
                f"`resume_from_checkpoint` ({self.args.resume_from_checkpoint!r}) is set in the training arguments "
                "but `train()` was called without it: the Trainer does not read that field, so training starts from "
                "the beginning. Pass it as run_clm.py does: `trainer.train(resume_from_checkpoint="
                "training_args.resume_from_checkpoint)`."
            )
        plan = self.step_engine.plan
        resume_from_checkpoint, plan.resume_point = resolve_resume(
            resume_from_checkpoint,
            args=self.args,
            layout=self._data_layout,
            mismatch=self.gradacc.resume_data_mismatch,
            blocker=prefix_blocker(self.args, self.train_dataset),
        )
        if isinstance(resume_from_checkpoint, str):  # before anything is loaded: a ZeRO state on another world
            self.backend.check_resume(resume_from_checkpoint)
        plan.resume_at = plan.data_position = None  # set once the run's layout is known / after each step
        # the fused head's weight-gradient buffer kept from window to window; SIGTERM recorded, agreed at a step's end
        with self.step_engine.keeping_buffers(), self.step_engine.preemption.watch():
            try:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            except RuntimeError as error:  # a peer lost in a collective the Trainer or a callback runs itself
                if isinstance(error, GradAccError) or not is_collective_failure(error):
                    raise
                raise failure_outside_step(self.state.global_step, self.args) from error

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """`Trainer.evaluate`, after letting go of the fused head's kept weight-gradient buffer (evaluation needs no
        gradient, whatever computes its loss; the next window's first micro-batch makes a new buffer)."""
        self.step_engine.release_buffers()
        return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """`Trainer._save_checkpoint`, bracketed so that a kill at any point leaves the old checkpoint or a complete
        new one (:func:`~hf_gradacc.checkpoints.checkpoint_save`: a marker written last, rotation after it). No
        gradient is saved: the fused head's kept weight-gradient buffer is let go first (it would add to the save's
        peak)."""
        self.step_engine.release_buffers()
        with checkpoint_save(
            run_dir=self._get_output_dir(trial=trial),
            args=self.args,
            state=self.state,
            wait_for_everyone=self.accelerator.wait_for_everyone,
            record=self._checkpoint_record,
        ):
            super()._save_checkpoint(model, trial)

    def _data_layout(self) -> dict[str, Any]:
        """What decides which samples each optimizer step takes (:func:`~hf_gradacc.checkpoints.data_layout`)."""
        return data_layout(
            self.args, self.gradacc, self.train_dataset, data_parallel_size=self.backend.mesh.data_parallel_size
        )

    def _checkpoint_record(self) -> dict[str, Any]:
        """A checkpoint's data record: the layout, and where the data stands after the last optimizer step."""
        record = self._data_layout()
        if self.data_position is not None:
            record[POSITION_KEY] = asdict(self.data_position)
        return record

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
        rank is skipped, and the step itself is the step's owner's (:class:`~hf_gradacc.step.engine.StepEngine`).
        """
        engine, args = self.step_engine, self.args
        if epoch == epochs_trained:
            engine.begin_training(model, self.optimizer)
            if resume_from_checkpoint is not None:
                self.backend.after_resume_load()  # the backend has bound the loaded model
        resuming = epoch == epochs_trained and resume_from_checkpoint is not None
        skip = steps_trained_in_current_epoch if resuming and not args.ignore_data_skip else 0
        # Where the epoch stands in samples of its order (None: not a prefix of it), recorded by each checkpoint.
        relayout = resuming and engine.plan.resume_at is not None
        first_sample = engine.plan.resume_at.num_samples if relayout and not args.ignore_data_skip else 0
        regrouped = find_regroup_sampler(train_dataloader)
        if relayout:
            # the optimizer holds the rate the checkpoint's schedule set for this step
            realign_learning_rate(self.lr_scheduler, self.optimizer)
            steps_in_epoch = len(train_dataloader)  # the micro-batches left after the skipped samples, per rank
            num_update_steps_per_epoch = (
                regrouped.num_windows
                if regrouped is not None
                else math.ceil(steps_in_epoch / args.gradient_accumulation_steps)
            )
        num_samples = len(self.train_dataset) if prefix_blocker(args, self.train_dataset) is None else None
        # the micro-batch's rows times the ranks holding different samples (not the tensor / context / sequence copies)
        samples_per_micro_batch = self._train_batch_size * self.backend.mesh.data_parallel_size
        # Regrouped or packed windows keep each stock window's samples (GA x batch x ranks of the order), not its
        # micro-batches: count windows there.
        samples_per_window = samples_per_micro_batch * args.gradient_accumulation_steps
        windows_done = skip // args.gradient_accumulation_steps
        epoch_plan = plan_epoch(
            train_dataloader,
            epoch,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            steps_in_epoch=steps_in_epoch,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            steps_trained_in_current_epoch=skip,
            accumulation=None if self.gradacc.accumulation_schedule is None else self.scheduled_accumulation_steps,
        )
        if resuming and steps_trained_in_current_epoch == 0:
            self._load_rng_state(resume_from_checkpoint)
        step, steps_in_epoch, rng_to_sync = epoch_plan.step, epoch_plan.steps_in_epoch, epoch_plan.resumed_mid_epoch
        iterator = epoch_plan.epoch_iterator
        grad_norm = learning_rate = None
        any_rank_had_data = (
            epoch_plan.step >= 0
        )  # agreed: from the counts every rank gathered, never this rank's alone
        for num_batches in epoch_plan.num_batches:
            window = None
            try:
                streamed = self.gradacc.defer_normalization  # pulled as they run: nothing fetched ahead
                batches = None if streamed else self.get_batch_samples(iterator, num_batches, args.device)[0]
                window = engine.open_window(batches)
                if rng_to_sync:  # the skipped batches drew from the RNG: restore the checkpoint's state now
                    self._load_rng_state(resume_from_checkpoint)
                    rng_to_sync = False
                tr_loss_step = engine.train_window(model, window, iterator, num_batches)
                any_rank_had_data = any_rank_had_data or sum(window.counts.num_micro_batches_per_rank) > 0
                if tr_loss_step is DATA_RAN_OUT:
                    break  # the data ran out on every rank: the epoch ends here, nothing is carried over
                step += window.num_micro_batches
                windows_done += 1
                if tr_loss_step is None:
                    continue  # no counted item on any rank: skipped, parameters unchanged
                stepped = engine.optimizer_step(window)
                if stepped is None:
                    continue  # a non-finite step, dropped on every rank: parameters and optimizer state unchanged
                grad_norm, learning_rate = stepped
                step_loss = tr_loss_step.to(self._tr_loss.device)
                if args.logging_nan_inf_filter:  # a non-finite step logs the mean so far, chosen on the device
                    mean_so_far = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                    step_loss = torch.where(torch.isfinite(step_loss), step_loss, mean_so_far)
                self._tr_loss += step_loss
            except RuntimeError as error:
                if not is_collective_failure(error):
                    raise
                micro_batch = None if window is None else window.index
                raise collective_failure(self.state.global_step + 1, micro_batch, args) from error
            finally:
                engine.close_window()
            self.state.global_step += 1
            self.state.epoch = epoch + (step + 1) / steps_in_epoch
            done = windows_done * samples_per_window if regrouped is not None else (step + 1) * samples_per_micro_batch
            trained = None if num_samples is None else min(first_sample + done, num_samples)
            engine.plan.data_position = DataPosition(
                epoch=epoch, num_samples=trained, num_micro_batches=step + 1, epoch_done=step + 1 >= steps_in_epoch
            )
            if relayout and trained is not None:
                self.state.epoch = epoch + trained / num_samples
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if engine.preemption.stop_due(self.state.global_step, self.backend.mesh.world_size):
                # some rank was signalled, agreed at this step's end: every rank saves this step and stops
                self.control.should_save = self.control.should_training_stop = True
                self.control.should_evaluate = False
            self._maybe_log_save_evaluate(
                self._tr_loss,
                grad_norm,
                model,
                trial,
                epoch,
                ignore_keys_for_eval,
                start_time,
                learning_rate=learning_rate,
            )
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break

        if not any_rank_had_data:
            logger.warning(
                "There seems not to be a single sample in your epoch_iterator, stopping training at step"
                f" {self.state.global_step}!"
            )
            self.control.should_training_stop = True
        if self.backend.mesh.dp_world_size > 1:
            # The loss trained since the last log, as the mean over ranks: `Trainer` adds it to the run's
            # `train_loss` at the end without reducing it. Every rank reaches this point: an agreed collective.
            self._tr_loss.copy_(self.backend.all_gather(self._tr_loss.detach()).mean(dim=0))
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        if engine.preemption.stopped_at == self.state.global_step:  # saved at this step already: no second save
            self.control.should_save = self.control.should_evaluate = False
        self._maybe_log_save_evaluate(
            self._tr_loss,
            grad_norm,
            model,
            trial,
            epoch,
            ignore_keys_for_eval,
            start_time,
            learning_rate=learning_rate,
        )

    # ------------------------------------------------------------------ one micro-batch (Trainer hooks)
    def training_step_context(self) -> contextlib.AbstractContextManager:
        """A context entered around each micro-batch's ``training_step``, its forward AND backward passes; none by
        default. A subclass that must wrap the whole step (TRL's activation offloading, see :mod:`hf_gradacc.trl`)
        returns it here instead of overriding ``training_step``, which would switch the backend to multi-backward
        mode."""
        return contextlib.nullcontext()

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch of the current window (:meth:`StepEngine.micro_batch
        <hf_gradacc.step.engine.StepEngine.micro_batch>`); returns its share of the logged loss."""
        return self.step_engine.micro_batch(model, inputs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> dict[str, LossTerm] | torch.Tensor | tuple[Any, Any]:
        """The micro-batch's SUM-reduced loss, from the logits, as a :class:`~hf_gradacc.LossTerm`; a
        mixture-of-experts model's router terms make it ``{"main": LossTerm, "aux": LossTerm, ...}`` (see
        :mod:`hf_gradacc.auxiliary`).

        Labels are taken out of the inputs (the model does not compute a loss of its own, except on the first
        micro-batch of training, for the start-up check); seq2seq models get ``decoder_input_ids`` from
        ``prepare_decoder_input_ids_from_labels``. Outside a training step (evaluation) the batch's mean loss is
        returned as a tensor, as `Trainer` expects: NaN, with a warning, for a batch without a counted item.
        """
        if self.compute_loss_func is not None:
            return self._compute_loss_with_func(model, inputs, return_outputs, num_items_in_batch)
        return self.step_engine.builtin_loss(model, inputs, return_outputs)

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
                'or hf_gradacc.LossTerm(total=<sum>, normalize_by="tokens" | "samples").'
            ) from error
        return (loss, outputs) if return_outputs else loss

    def sum_loss_from_logits(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The SUM-reduced loss of the trainer's head family (``self.head.sum_loss``), for ``compute_loss``
        overrides."""
        return self.head.sum_loss(logits, labels, shift_labels)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, None]:
        """`Trainer.get_batch_samples`: the next (up to) ``num_batches`` micro-batches of this rank. Nothing is
        counted here: the step's :class:`~hf_gradacc.step.window.Window` counts them over every rank in one collective,
        so the second value is always None. Override it to see or change a step's batches before they are counted."""
        return fetch_batches(epoch_iterator, num_batches), None

    # ------------------------------------------------------------------ data
    @property
    def train_data(self) -> TrainData:
        """The training data as hf_gradacc's data planners and callbacks take it
        (:class:`~hf_gradacc.data.loader.TrainData`): the dataset, the collator, and the Trainer's own column
        handling, sampler, batch size and input preparation."""
        return TrainData(
            dataset=self.train_dataset,
            collator=self.data_collator,
            args=self.args,
            accelerator=self.accelerator,
            model=self.model,
            processing_class=self.processing_class,
            batch_size=self._train_batch_size,
            remove_columns=self._remove_unused_columns,
            wrap_collator=self._get_collator_with_removed_columns,
            train_sampler=self._get_train_sampler,
            prepare=self._prepare_inputs,
        )

    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`; with ``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` its batch
        sampler is a :class:`~hf_gradacc.data.WindowRegroupBatchSampler` (same samples per optimizer step, less
        padding). Iterable datasets keep the stock loader (a warning says so)."""
        check_train_dataset(self.train_dataset)
        dataloader = build_train_dataloader(self.train_data, self.gradacc)
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def set_initial_training_values(self, args, dataloader):
        """`Trainer.set_initial_training_values`, counting optimizer steps as windows when a token budget gives
        windows more than ``gradient_accumulation_steps`` micro-batches (agreed across ranks, one collective), under
        an ``accumulation_schedule``, and from a resumed checkpoint's recorded position
        (:meth:`RunPlan.training_values <hf_gradacc.step.plan.RunPlan.training_values>`)."""
        values = super().set_initial_training_values(args, dataloader)
        dataset = self.train_dataset
        return self.step_engine.plan.training_values(
            args,
            dataloader,
            values,
            settings=self.gradacc,
            backend=self.backend,
            samples_per_micro_batch=self._train_batch_size * self.backend.mesh.data_parallel_size,
            num_train_samples=len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None,
        )

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        """`Trainer._init_training_state`; a resumed run starts from every weight its checkpoint holds
        (:func:`~hf_gradacc.checkpoints.restore_weights`), and finds its epoch and what it already trained in it from
        the schedule (windows differ in size) or the checkpoint's record
        (:meth:`RunPlan.resumed_start <hf_gradacc.step.plan.RunPlan.resumed_start>`)."""
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is not None:  # after the Trainer's own load, before the first step
            self._restore_weights(resume_from_checkpoint, "resume_from_checkpoint")
        return self.step_engine.plan.resumed_start(
            self.args,
            self.state.global_step,
            epochs_trained,
            steps_trained,
            max_steps=max_steps,
            num_train_epochs=num_train_epochs,
            resume_from_checkpoint=resume_from_checkpoint,
            schedule=self.gradacc.accumulation_schedule,
        )

    def _load_best_model(self) -> None:
        """`Trainer._load_best_model`; the best checkpoint's weights are then all in the model, as on a resume
        (:func:`~hf_gradacc.checkpoints.restore_weights`: the Trainer loads them by name, which leaves a
        mixture-of-experts model's experts at the last step's values)."""
        super()._load_best_model()
        self._restore_weights(self.state.best_model_checkpoint, "load_best_model_at_end")

    def _restore_weights(self, folder: str, field: str) -> None:
        """What the Trainer's load by name of ``folder`` left out (FSDP and DeepSpeed load their own state dicts)."""
        managed_elsewhere = self.is_fsdp_enabled or self.is_deepspeed_enabled
        restore_weights(self.model, folder, managed_elsewhere=managed_elsewhere, field=field)

    # ------------------------------------------------------------------ logging, evaluation, the end
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, with per-term losses (``loss/<name>``) and callback metrics added to training logs."""
        if "loss" in logs:
            logs.update(self.step_engine.pop_logs())
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`, with a LossTerm from an overridden ``compute_loss`` read as its batch mean;
        under context parallelism on the batch padded and checked as in training (the check agreed over every rank)."""
        engine = self.step_engine
        cp, whole = engine.cp, inputs  # the padded copy is sharded in place by the Trainer's entry; not `whole`
        if cp.size > 1:
            inputs = cp.evaluation_inputs(
                self._prepare_inputs(inputs), prediction_loss_only, self.backend.all_gather, self.args.device
            )
            prediction_loss_only = True
        if not engine.source.custom_compute_loss:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        user_compute_loss = self.compute_loss

        def mean_compute_loss(*args: Any, **kwargs: Any) -> Any:
            out = user_compute_loss(*args, **kwargs)
            parsed = parse_loss_output(out)
            if parsed.plain is not None:
                return out
            loss = cp.custom_batch_mean(  # cp: this rank's chunks, summed over the cp ranks
                parsed,
                whole,
                counter=engine.counter,
                denominator=self.primary_denominator,
                all_gather=self.backend.all_gather,
            )
            return (loss, *out[1:]) if isinstance(out, tuple) else loss

        self.compute_loss = mean_compute_loss  # type: ignore[method-assign]
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
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
