"""The step's owner: :class:`StepEngine` holds one optimizer step and the run's steps, and runs them top-down.

`GradAccMixin` builds one engine at construction, from explicit collaborators (the settings, the head, the counter,
the backend with its mesh, the fused-head policy, the context-parallel group, the trainer seen through
:class:`~hf_gradacc.step.host.TrainerHost`), and its Trainer hooks hand the step to it. For each optimizer step the
mixin's epoch loop calls:

1. :meth:`StepEngine.open_window`: this rank's micro-batches of the step (fetched by the trainer's
   ``get_batch_samples``), counted over every rank in one collective (or a streamed window);
2. :meth:`StepEngine.train_window`: the checks every rank takes together, then every micro-batch through the
   trainer's ``training_step`` inside the backend's sync context (:meth:`StepEngine.micro_batches`), which hands the
   micro-batch back to :meth:`StepEngine.micro_batch`: the loss, its normalisation by the step's global counts
   (:class:`~hf_gradacc.step.window.Window`), the backward pass; with ``auto_micro_batch``, the agreed retry;
3. :meth:`StepEngine.optimizer_step`: accumulated-gradient hooks, norm and clipping, the non-finite verdict, the
   step, the scheduler.

Everything a step needs across those calls lives on the engine (the window in flight, the start-up check, the rows
per micro-batch after an out-of-memory retry, the loss terms and metrics waiting for the next log line, the skip
counters, the run's plan); nothing about the step is kept on the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from ..auxiliary import returns_router_loss, split_model_loss
from ..builtin_loss import MAIN_TERM, builtin_loss, model_mean_loss
from ..checks import LossCheck, agree, start_up_check
from ..errors import GradAccConfigError, GradAccDataError, GradAccUsageError
from ..fused import into_grad
from ..grads import AccumulatedGradHook, GradAccess
from ..loss import LossOutput, parse_loss_output
from ..memory import halve_rows, is_out_of_memory, release_memory
from ..moe_balance import RouterShape, StepRouting, router_shape, routing_prepass
from ..weights import primary_denominator
from .host import Events, TrainerHost
from .nonfinite import poison_nonfinite, step_verdict
from .plan import RunPlan
from .preemption import Preemption
from .window import TermLog, Window

logger = logging.get_logger(__name__)

DATA_RAN_OUT = object()  # train_window's answer when no rank had a micro-batch left


@dataclass(frozen=True, slots=True, kw_only=True)
class LossSource:
    """Where a trainer's loss comes from, read once from its class at construction.

    Attributes:
        custom_compute_loss: an overridden ``compute_loss`` or a ``compute_loss_func`` computes the loss.
        loss_from_func: the Trainer argument ``compute_loss_func`` does (not an override).
        custom_training_step: ``training_step`` is overridden (several backward passes may run per micro-batch).
    """

    custom_compute_loss: bool = False
    loss_from_func: bool = False
    custom_training_step: bool = False

    @property
    def plain_override(self) -> bool:
        """An overridden ``compute_loss`` (not a ``compute_loss_func``), whose forward outputs are watched."""
        return self.custom_compute_loss and not self.loss_from_func


@dataclass
class StepLogs:
    """What the next training log line adds: each loss term's share (and a mixture-of-experts model's expert load),
    the metrics callbacks add, and the per-step metrics logged as their mean."""

    terms: TermLog = field(default_factory=TermLog)
    extra: dict[str, float] = field(default_factory=dict)
    step_means: dict[str, tuple[float, int]] = field(default_factory=dict)

    def add(self, metrics: Mapping[str, float], *, per_step: bool = False) -> None:
        if not per_step:
            self.extra.update({k: float(v) for k, v in metrics.items()})
            return
        for key, value in metrics.items():
            total, steps = self.step_means.get(key, (0.0, 0))
            self.step_means[key] = (total + float(value), steps + 1)

    def pop(self, all_gather: Any, device: torch.device | str) -> dict[str, float]:
        """Everything waiting for this log line, then reset (the terms: one collective on several ranks)."""
        logs = self.terms.pop_means(all_gather, device)
        logs.update({key: total / steps for key, (total, steps) in self.step_means.items()})
        logs.update(self.extra)
        self.step_means, self.extra = {}, {}
        return logs


class StepEngine:
    """The one owner of an optimizer step and of the run's steps (see the module docstring for the path).

    Args:
        host: the trainer, through the members :class:`~hf_gradacc.step.host.TrainerHost` declares.
        settings: the resolved knobs (:class:`~hf_gradacc.config.GradAccSettings`).
        head: the model's loss family (:class:`~hf_gradacc.heads.Head`).
        counter: what a micro-batch counts on this rank (:class:`~hf_gradacc.counting.Counter`).
        backend: syncs, backward passes, reductions, clipping and stepping; ``backend.mesh`` says which ranks count.
        fused: the fused LM head's decision (:class:`~hf_gradacc.fused.choice.FusedPolicy`).
        source: where the loss comes from (:class:`LossSource`).
        cp: this rank's context-parallel group (:class:`~hf_gradacc.backends.context_parallel.ContextParallel`).
        router: the routing pre-pass's shape under ``router_balance="global_batch"`` (None otherwise).

    Example:
        ```python
        engine = trainer.step_engine          # built by GradAccMixin at construction
        engine.window                         # the optimizer step in flight (None between steps)
        engine.num_skipped_windows            # steps skipped because nothing was counted on any rank
        ```
    """

    def __init__(
        self,
        host: TrainerHost,
        *,
        settings: Any,
        head: Any,
        counter: Any,
        backend: Any,
        fused: Any,
        source: LossSource,
        cp: Any,
        router: RouterShape | None = None,
    ) -> None:
        self.host = host
        self.settings, self.head, self.counter, self.backend = settings, head, counter, backend
        self.fused, self.source, self.cp, self.router = fused, source, cp, router
        self.events = Events(host)
        self.plan = RunPlan()
        self.logs = StepLogs()
        self.window: Window | None = None
        self.auto_rows: int | None = None  # auto_micro_batch: rows per micro-batch once an out-of-memory was survived
        self.grad_hooks: list[tuple[AccumulatedGradHook, bool]] = []
        self.training_started = False
        self.num_skipped_windows = self.num_nonfinite_skipped = 0
        self.start_check_due, self.start_check = False, None  # the first micro-batch's loss check, agreed after it
        self.fused_head_ran = False  # the built-in loss ran the fused head (a custom training_step may bypass it)
        self.grads = GradAccess(backend, self.trainable_parameters, lambda: self.window)
        self.preemption = Preemption(settings.save_on_preemption)  # the agreed SIGTERM checkpoint (step/preemption.py)

    # ------------------------------------------------------------------ the run
    def begin_training(self, model: nn.Module, optimizer: Any) -> None:
        """Before the first optimizer step: the backend binds the prepared model; the start-up check is due."""
        self.training_started = True
        self.backend.setup(model, optimizer)
        self.start_check_due, self.start_check = self.settings.check_loss_at_start, None

    @property
    def primary_denominator(self) -> str:
        """``"samples"`` for sequence-level heads (and unlabelled data), ``"weights"`` for a step with
        ``loss_weights``, ``"tokens"`` for every other head."""
        return primary_denominator(self.head, self.window)

    def count(self, batch: Mapping[str, Any], *, deferred: bool = False) -> Any:
        """What this rank counts of ``batch``: the whole micro-batch, or its context-parallel shard (``deferred``:
        its counts left on the device until the step's count transfer, :meth:`~hf_gradacc.counting.Counter.count`)."""
        return self.counter.count(batch, deferred=deferred)

    def add_grad_hook(self, hook: AccumulatedGradHook, *, local: bool) -> None:
        if self.training_started:
            raise GradAccUsageError(
                "register_accumulated_grad_hook must be called before `train()`: hooks registered mid-training "
                "would see some optimizer steps and not others."
            )
        if not callable(hook):
            raise GradAccConfigError(f"`hook` must be callable as hook(name, grad), got {type(hook).__name__}")
        self.grad_hooks.append((hook, local))

    def require_window(self, what: str) -> Window:
        """The window in flight, for ``what`` (``training_step``, ``backward``), which runs only inside a micro-batch
        of ``train()``: anywhere else a :class:`~hf_gradacc.GradAccUsageError` that says where it was called and
        names the way out."""
        window = self.window
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
                    "`transformers.Trainer.training_step(trainer, ...)`, which divides by "
                    "`gradient_accumulation_steps` "
                    "and fails before `train()`); `trainer.evaluate()` gives the loss alone"
                )
            raise GradAccUsageError(
                f"`{what}` was called {where}: it runs only inside a training step of `trainer.train()`, on a "
                f"micro-batch of the optimizer step in flight, whose counts over the whole step normalise its loss. "
                f"{way_out}."
            )
        return window

    # ------------------------------------------------------------------ 1. open the step
    def open_window(self, batches: list[Any] | None) -> Window:
        """The next optimizer step: this rank's ``batches`` (what the trainer's ``get_batch_samples`` fetched)
        counted over every rank in one collective; None: a streamed window (``defer_normalization``), whose
        micro-batches are pulled as they run (:meth:`train_window`)."""
        host, world = self.host, self.backend.mesh.dp_world_size
        if batches is None:
            window = Window.stream(dp_world_size=world)
        else:
            window = Window.prefetched(
                batches,
                count=partial(self.count, deferred=True),  # no device value read per micro-batch: one per step
                recheck=self.count,
                all_gather=self.backend.all_gather,
                device=host.args.device,
                dp_world_size=world,
                defers_sync=self.settings.auto_micro_batch,
            )
            if self.auto_rows is not None:
                window.resplit(self.auto_rows, self.count)
            host.current_gradient_accumulation_steps = max(window.num_micro_batches, 1)
        self.window = window
        if not window.streamed:
            self.fused.decide(window, wrapped=host.model_wrapped)  # automatic: on the first step's counts
            self.events.fire_ours("on_window_counted", window=window)
        return window

    def close_window(self) -> None:
        self.window = None

    def skip_window(self, window: Window) -> None:
        self.num_skipped_windows += 1
        denominator = self.primary_denominator
        why = f"every label is {self.head.ignore_index}"
        if denominator == "weights" and window.counts.global_tokens > 0:
            why = f"every `loss_weights` of its {window.counts.global_tokens} counted targets is 0"
        logger.warning(
            f"Optimizer step {self.host.state.global_step + 1} has no counted {denominator} on any rank ({why}): "
            f"skipped, parameters unchanged ({self.num_skipped_windows} skipped so far)."
        )

    # ------------------------------------------------------------------ 2. its micro-batches
    def train_window(self, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int) -> Any:
        """Every micro-batch of ``window``, forward and backward; returns the step's logged loss, None for a step
        skipped because nothing is counted on any rank, or ``DATA_RAN_OUT``.

        Every branch depends only on counts gathered from all ranks, so all ranks take it together."""
        host, backend = self.host, self.backend
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
            if window.global_count(self.primary_denominator) == 0:
                self.skip_window(window)
                return None
        self.events.fire("on_step_begin")
        window.routing = self.step_routing(model, window)  # router_balance="global_batch": the routing pre-pass
        total = self.micro_batches_with_retry(model, window, epoch_iterator, num_batches)
        if self.start_check_due:  # every rank joins, with its verdict or none: one collective, once
            agree(self.start_check or LossCheck(), backend.all_gather, host.args.device)
            self.start_check_due, self.start_check = False, None
        if window.streamed:
            global_count = window.finish_streamed(backend.all_gather, host.args.device)
            self.events.fire_ours("on_window_counted", window=window)
            if global_count is None:
                return DATA_RAN_OUT
            backend.sync_window()
            if global_count == 0:
                backend.zero_grad()
                self.skip_window(window)
                return None
            backend.scale_grads(1.0 / global_count)
            total = total / global_count
        # accelerate's optimizer wrapper only steps when it believes the gradients are synced.
        host.accelerator.gradient_state._set_sync_gradients(True)
        host.state.num_input_tokens_seen += window.counts.global_seen_tokens
        return total

    def step_routing(self, model: nn.Module, window: Window) -> StepRouting | None:
        """The step's routing: the pre-pass under ``router_balance="global_batch"``; under ``"micro_batch"`` an
        empty one the training forwards fill (for the load log) when the model returns router logits."""
        if self.router is None:
            shape = router_shape(self.host.model) if self.returns_router_logits else None
            return StepRouting(shape=shape) if shape is not None else None
        return routing_prepass(
            model,
            window.micro_batches,
            shape=self.router,
            prepare=self.host._prepare_inputs,
            all_gather=self.backend.all_gather,
            device=self.host.args.device,
            num_input_tokens=window.global_count("input_tokens"),
        )

    @property
    def returns_router_logits(self) -> bool:
        from ..heads import unwrap_model

        return bool(getattr(getattr(unwrap_model(self.host.model), "config", None), "output_router_logits", False))

    def micro_batches_with_retry(
        self, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int
    ) -> torch.Tensor:
        """Forward and backward passes of every micro-batch of the window; returns the window's logged loss.

        With ``auto_micro_batch``, an out-of-memory error on any rank makes EVERY rank drop the window's partial
        gradient, halve the rows per micro-batch and run the same samples again: the update is unchanged (the
        global denominator does not depend on the grouping), nothing hangs (no collective runs inside the window
        in that mode), and the smaller size is kept for the rest of training."""
        retry, backend = self.settings.auto_micro_batch, self.backend
        while True:
            window.final_backward_done = False
            window.term_totals, window.losses = {}, []
            out_of_memory, total = None, None
            try:
                total = self.micro_batches(model, window, epoch_iterator, num_batches)
            except Exception as error:  # noqa: BLE001 - only out-of-memory errors are caught, the rest re-raised
                if not (retry and is_out_of_memory(error)):
                    raise
                out_of_memory = error
                release_memory()
            if not retry:
                break
            # One flag per rank, agreed before anything else communicates: every rank retries, or none does.
            flags = backend.all_gather(torch.tensor([int(out_of_memory is not None)], device=self.host.args.device))
            if not bool(flags.max()):
                backend.sync_window()
                break
            backend.zero_grad()
            previous, self.auto_rows = halve_rows(window, self.auto_rows, cause=out_of_memory)
            where = "this" if out_of_memory is not None else "another"
            logger.warning(
                f"auto_micro_batch: out of memory on {where} rank; micro-batches now hold at most {self.auto_rows} "
                f"row(s) (were {previous}). The optimizer step's samples and update are unchanged; the step is "
                "recomputed."
            )
            self.logs.add({"auto_micro_batch_rows": self.auto_rows})
            window.resplit(self.auto_rows, self.count)
        if not window.streamed and not window.final_backward_done:
            raise GradAccUsageError(
                "The optimizer step's last micro-batch ran no final backward pass: a custom `training_step` must call "
                "`trainer.backward(loss, final=trainer.is_last_micro_batch)` (or super().training_step)."
            )
        return total

    def micro_batches(
        self, model: nn.Module, window: Window, epoch_iterator: Iterator, num_batches: int
    ) -> torch.Tensor:
        """One pass over the window's micro-batches (prefetched, or pulled from the iterator when streamed): each
        through the trainer's ``training_step``, the one call back into the trainer per micro-batch."""
        host = self.host
        batches = window.pull(epoch_iterator, num_batches, self.count) if window.streamed else window.micro_batches
        total = torch.zeros((), device=host.args.device)
        flops, num_items = 0.0, None
        if not window.streamed:
            num_items = torch.tensor(window.global_count(self.primary_denominator), device=host.args.device)
        for i, inputs in enumerate(batches):
            window.index = 0 if window.streamed else i
            is_last = window.is_last
            host.accelerator.gradient_state._set_sync_gradients(is_last)
            try:
                with self.backend.sync_context(is_last=is_last), host.training_step_context():
                    loss = host.training_step(model, inputs, num_items)
                if self.settings.fused_lm_head and not (self.fused_head_ran or self.source.custom_compute_loss):
                    self.warn_fused_head_bypassed()
                window.losses.append(loss.detach())
                total = total + loss.to(total.device)
            finally:
                window.index = None
            flops += float(host.floating_point_ops(inputs))
            if not is_last:
                self.events.fire("on_substep_end")
        host.current_flos += flops
        return total

    def warn_fused_head_bypassed(self) -> None:
        """``fused_lm_head=True`` with an overridden ``training_step`` that ran a micro-batch without the built-in
        loss (it called the model itself): the setting did nothing there, so say it, once."""
        logger.warning_once(
            f"`fused_lm_head=True` is ignored: {type(self.host).__name__}.training_step computed a micro-batch's loss "
            "without `self.compute_loss` (the model ran with its full logits). Call `self.compute_loss(model, "
            "inputs)` "
            "(or `super().training_step`) in the overridden `training_step`, or set `fused_lm_head=False`."
        )

    # ------------------------------------------------------------------ one micro-batch (from training_step)
    def micro_batch(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Forward and backward of one micro-batch of the current window (the trainer's ``training_step``); returns
        its share of the logged loss."""
        window = self.require_window("training_step")
        host = self.host
        if self.cp.size > 1 and not self.cp.inside:  # context parallelism: this rank's shard, inside torch's context
            shard = self.cp.pad(host._prepare_inputs(inputs))
            cp_context, shard = host._prepare_context_parallel_inputs(model, shard)
            with self.cp.entered(), cp_context():
                return self.micro_batch(model, shard)
        model.train()
        if hasattr(host.optimizer, "train") and callable(host.optimizer.train):
            host.optimizer.train()
        inputs = host._prepare_inputs(inputs)
        source = self.source
        # a `compute_loss_func` is the user's own loss, called with this micro-batch's count: nothing to compare it
        # with
        check = self.start_check_due and window.index == 0 and self.start_check is None and not source.loss_from_func
        denominator = self.primary_denominator
        local = window.current_counts.get(denominator)
        # An overridden compute_loss gets this micro-batch's own count: a plain `outputs.loss` is then its mean.
        num_items = torch.tensor(local, device=host.args.device) if source.custom_compute_loss else None
        untouched = dict(inputs) if check else None  # an override may pop the labels the check needs
        # An override's forward outputs, to recognise a returned `outputs.loss` that holds router terms (below).
        seen: list[Any] = []
        unwrapped = host.accelerator.unwrap_model(model) if source.plain_override else None
        hook = unwrapped.register_forward_hook(lambda _m, _a, out: seen.append(out)) if unwrapped is not None else None
        try:
            with host.compute_loss_context_manager():
                raw = host.compute_loss(
                    model,
                    inputs,
                    return_outputs=check and not source.custom_compute_loss,
                    num_items_in_batch=num_items,
                )
        finally:
            if hook is not None:
                hook.remove()
        parsed = parse_loss_output(raw)
        if check:
            self.start_check = start_up_check(
                parsed,
                window,
                denominator=denominator,
                builtin=not source.custom_compute_loss,
                label_smoothing=self.head.label_smoothing,
                dp_world_size=self.backend.mesh.dp_world_size,
                model_mean=partial(model_mean_loss, host.accelerator.unwrap_model(model), untouched),
            )
        if seen and parsed.plain is not None:
            parsed = self.split_router_terms(unwrapped, parsed, seen, local, window)
        seen.clear()  # the outputs are not kept through the backward pass
        del inputs, raw
        parsed = replace(parsed, outputs=None)  # nor the start-up check's: its logits, [tokens x vocabulary]
        parts = window.normalized_terms(
            parsed, primary=denominator, warn_on_plain_loss=self.settings.warn_on_plain_loss
        )
        window.add_term_totals(parts)
        self.backward_terms(parts, is_last=window.is_last)
        return sum((p.detach() for _, p in parts), torch.zeros((), device=parts[0][1].device))

    def split_router_terms(
        self, unwrapped: nn.Module, parsed: LossOutput, seen: list[Any], local: Any, window: Window
    ) -> LossOutput:
        """A mixture-of-experts model's own loss returned by an override (CE mean + coef x aux): its router terms
        weighted by routed tokens."""
        terms = split_model_loss(
            unwrapped,
            parsed.plain,
            seen,
            main_count=local,
            main_denominator=self.primary_denominator,
            num_input_tokens=window.current_counts.num_input_tokens,
        )
        if terms is not None:
            return LossOutput(terms=terms, outputs=parsed.outputs)
        if returns_router_loss(unwrapped, seen):
            logger.warning_once(
                "compute_loss returned a plain value that is not the model's own loss, and the model returned a "
                "router load-balancing loss: the value is read as a mean over target tokens, so a router term "
                "added to it would be weighted by target tokens, not routed tokens. Return hf_gradacc.LossTerms "
                "(the router term as LossTerm(coef * aux * routed_tokens, 'input_tokens')), or the model's own "
                "`outputs.loss`, which hf_gradacc splits exactly."
            )
        return parsed

    def backward_terms(self, parts: list[tuple[str, torch.Tensor]], *, is_last: bool) -> None:
        """The micro-batch's normalised terms back-propagated: summed in one backward pass, or one pass per term
        (``backward_per_term``), the last one final on the step's last micro-batch."""
        per_term = self.settings.backward_per_term and len(parts) > 1
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

    def backward(self, loss: torch.Tensor, *, final: bool, retain_graph: bool = False) -> None:
        """Accumulate ``loss``'s (normalised) gradient; ``final`` marks the step's last backward pass, which
        reduces (see :meth:`hf_gradacc.GradAccMixin.backward`)."""
        window = self.require_window("backward")
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
        if self.settings.nonfinite_steps != "propagate":
            loss = poison_nonfinite(
                loss
            )  # a NaN/Inf loss on any rank makes the reduced gradient non-finite everywhere
        # A window that defers its sync reduces once after its last micro-batch (Window.defers_sync).
        self.backend.backward(loss, is_final=final and not window.defers_sync, retain_graph=retain_graph)
        if final:
            window.final_backward_done = True

    # ------------------------------------------------------------------ the built-in loss (from compute_loss)
    def builtin_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool) -> Any:
        """The built-in ``compute_loss``: in training the micro-batch's SUM-reduced :class:`~hf_gradacc.LossTerm`
        (a dict of them with router terms); outside training the batch's mean, as `Trainer` expects."""
        window = self.window
        training = window is not None and window.index is not None
        check = training and self.start_check_due and self.start_check is None and window.index == 0
        fused = training and self.fused.enabled  # evaluation keeps the logits metrics need
        if not fused:
            into_grad.release_buffers()  # the full logits make their own weight gradient (or none: evaluation)
        self.fused_head_ran |= fused
        terms, outputs = builtin_loss(
            self.head,
            model,
            inputs,
            denominator=self.primary_denominator,
            with_model_loss=check,
            fused_lm_head=fused,
            routing=window.routing if training else None,
            micro_batch_index=window.index if training else None,
            all_gather=self.backend.all_gather,
            num_input_tokens=window.current_counts.num_input_tokens if training else None,  # counted already
        )
        result: Any = terms if len(terms) > 1 else terms[MAIN_TERM]  # a LossTerm, as in 0.1, unless router terms
        if not training:  # evaluation / prediction: the batch mean
            counts = self.counter.count_batch(inputs)
            result = self.cp.batch_mean(terms, counts, self.primary_denominator, self.backend.all_gather)
        return (result, outputs) if return_outputs else result

    # ------------------------------------------------------------------ 3. the optimizer step
    def optimizer_step(self, window: Window) -> tuple[torch.Tensor, float] | None:
        """Hooks, norm and clipping, `on_pre_optimizer_step`, the step, the scheduler; returns the pre-clip norm and
        the learning rate the step used, or None for a non-finite step dropped on every rank (``nonfinite_steps``)."""
        host, backend, settings = self.host, self.backend, self.settings
        window.grads_ready = True
        try:
            hooks_nonfinite = self.grads.run_hooks(self.grad_hooks)
            self.events.fire_ours("on_accumulated_grads")
            max_norm = host.args.max_grad_norm
            grad_norm = backend.clip_grad_norm(max_norm if max_norm is not None and max_norm > 0 else float("inf"))
            policy = "propagate" if backend.scales_loss else settings.nonfinite_steps  # a scaler skips itself
            step = host.state.global_step + 1
            # one verdict on every rank, AFTER the hooks and callbacks: a NaN they wrote on one rank drops the step;
            # the preemption flag (save_on_preemption) rides in the same all-reduce
            verdict = step_verdict(
                policy,
                grad_norm,
                step=step,
                rank=host.args.process_index,
                losses=window.losses,
                agree=backend.sum_over_processes,
                hooks_nonfinite=hooks_nonfinite,
                signalled=self.preemption.local_flag(),
            )
            if verdict.ranks_signalled:
                self.preemption.agreed(verdict.ranks_signalled)
            if verdict.skip:
                self.num_nonfinite_skipped += 1
                self.logs.add({"nonfinite_skipped": self.num_nonfinite_skipped})
                backend.skip_step()
                return None
            self.events.fire("on_pre_optimizer_step")
        finally:
            window.grads_ready = False
        schedule = settings.accumulation_schedule
        lr_factor = 1.0 if schedule is None else schedule.lr_factor(host.state.global_step, settings.lr_scaling)
        # the rate this step uses, read before the step (DeepSpeed's engine moves its scheduler inside the step)
        learning_rate = host._get_learning_rate() * lr_factor
        backend.optimizer_step(host.optimizer, lr_factor=lr_factor)
        self.events.fire("on_optimizer_step")
        if schedule is not None:
            self.logs.add(
                {
                    "accumulation_steps": schedule.at(host.state.global_step),
                    "effective_batch_size": window.counts.global_samples,
                },
                per_step=True,
            )
        if not host.accelerator.optimizer_step_was_skipped and not isinstance(
            host.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            host.lr_scheduler.step()
        backend.zero_grad()
        self.logs.terms.add(window)
        return grad_norm, learning_rate

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trainable parameters, by name, in the same order on every rank."""
        host = self.host
        module = host.accelerator.unwrap_model(host.model_wrapped)
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ the log line
    def pop_logs(self) -> dict[str, float]:
        """The loss terms, per-step metrics and callback metrics of the next training log line (a collective)."""
        return self.logs.pop(self.backend.all_gather, self.host.args.device)

    @contextlib.contextmanager
    def keeping_buffers(self) -> Iterator[None]:
        """Around ``train()``: the fused head's weight-gradient buffer kept from window to window."""
        with into_grad.keeping_buffers():
            yield

    def release_buffers(self) -> None:
        """Let go of the fused head's kept weight-gradient buffer (evaluation and checkpoint saves need no
        gradient)."""
        into_grad.release_buffers()
