"""`GradAccTrainer`: a drop-in `transformers.Trainer` whose accumulated step equals the full-batch step."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from transformers import Trainer

from . import patches
from .backends import Backend, finish_distributed, resolve_backend
from .callbacks.base import GradAccCallback
from .config import validate_gradacc_args
from .errors import GradAccConfigError, GradAccDataError, GradAccLossError, UnsupportedBackendError
from .grads import AccumulatedGradHook, GradAccess
from .heads import detect_head_type, resolve_head_type, unwrap_model
from .loss import (
    IGNORE_INDEX,
    HeadType,
    LossTerm,
    causal_targets,
    infer_problem_type,
    normalize,
    sequence_classification_sum,
    token_cross_entropy_sum,
)
from .window import (
    LABEL_KEY,
    SHIFT_LABELS_KEY,
    WindowCounts,
    count_micro_batch,
    gather_window_counts,
    rows_of,
    split_micro_batches,
)

logger = logging.getLogger(__name__)

# Denominator kinds of deferred normalisation, in the column order of its gathered count vector.
_DEFERRED_KINDS: tuple[str, ...] = ("tokens", "samples", "custom")


def is_out_of_memory(error: BaseException) -> bool:
    """True for a device (or host) out-of-memory error."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class GradAccTrainer(Trainer):
    """A `transformers.Trainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step.

    It takes the same constructor arguments as `Trainer`; `args` may be a plain `TrainingArguments` or a
    :class:`~hf_gradacc.GradAccConfig`. For every optimizer step it

    1. prefetches the step's micro-batches and counts the denominator (non-ignored target tokens for LM and
       token heads, samples for sequence classification) over all of them and all ranks, in one collective;
    2. computes each micro-batch's loss as a SUM over its items from the logits (so it does not matter whether
       the model's own loss honours ``num_items_in_batch``, or whether the model is wrapped by PEFT);
    3. divides by the global count, multiplies by the data-parallel world size, and never divides by the number
       of micro-batches.

    The logged ``loss`` is the exact token- (or sample-) weighted mean of the step across ranks, and
    ``grad_norm`` the norm of the exact accumulated gradient. A step whose micro-batches hold no counted item on
    any rank is skipped with a warning, on every rank alike.

    Overriding ``compute_loss``: return an :class:`~hf_gradacc.LossTerm` (a sum and its denominator) or a
    ``dict[str, LossTerm]`` for an exact step. A plain tensor is read as a MEAN over the micro-batch's counted
    items (what ``outputs.loss`` is when the model gets ``num_items_in_batch`` = that local count, which is what
    GradAccTrainer passes to an overridden ``compute_loss``), and a warning says so once.

    Example:
        ```python
        from transformers import AutoModelForSequenceClassification
        from hf_gradacc import GradAccConfig, GradAccTrainer

        model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=3)
        args = GradAccConfig(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=4)
        trainer = GradAccTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # HF_GRADACC_CPU_DISTRIBUTED=1: patch accelerate BEFORE Trainer.__init__ builds the accelerator (hf_gradacc.patches)
        patches.maybe_enable_from_env()
        super().__init__(*args, **kwargs)
        validate_gradacc_args(self.args)
        self.ignore_index: int = getattr(self.args, "ignore_index", IGNORE_INDEX)
        self._requested_head_type: str = getattr(self.args, "head_type", "auto")
        self._warn_on_plain_loss: bool = getattr(self.args, "warn_on_plain_loss", True)
        self._custom_compute_loss = type(self).compute_loss is not GradAccTrainer.compute_loss
        self.head_type: HeadType | None
        if self._custom_compute_loss:
            self.head_type = (
                detect_head_type(self.model) if self._requested_head_type == "auto" else self._requested_head_type  # type: ignore[assignment]
            )
        else:
            self.head_type = resolve_head_type(self.model, self._requested_head_type)
        if self.args.n_gpu > 1:
            raise GradAccConfigError(
                f"GradAccTrainer does not support torch.nn.DataParallel over {self.args.n_gpu} GPUs in one process; "
                "launch one process per GPU (`accelerate launch` / `torchrun`) or set CUDA_VISIBLE_DEVICES."
            )
        if self.head_type is not None and LABEL_KEY not in self.label_names:
            # Keep `labels` through the Trainer's unused-column removal even when the model's forward does not
            # take them: GradAccTrainer computes the loss from them.
            self.label_names = [*self.label_names, LABEL_KEY]
        self.backend: Backend = resolve_backend(self.accelerator, self.args)
        self.backend.check_model(self.model)
        self._backward_per_term: bool = bool(getattr(self.args, "backward_per_term", False))
        self._custom_training_step = type(self).training_step is not GradAccTrainer.training_step
        self._auto_micro_batch: bool = bool(getattr(self.args, "auto_micro_batch", False))
        self._defer_normalization: bool = bool(getattr(self.args, "defer_normalization", False))
        self._auto_rows: int | None = None
        self.backend.multi_backward = (
            self._backward_per_term or self._custom_training_step or self._auto_micro_batch or self._defer_normalization
        )
        if self._defer_normalization and not self.backend.supports_deferred_sync:
            raise UnsupportedBackendError(
                f"`defer_normalization=True` is not supported on the {self.backend.name} backend: its gradient cannot "
                "be reduced and scaled once after the window. Supported: single process and DDP; turn it off "
                "(the default prefetching path is exact everywhere)."
            )
        if self._defer_normalization and (self._auto_micro_batch or self._backward_per_term or self._custom_training_step):
            raise GradAccConfigError(
                "`defer_normalization=True` cannot be combined with `auto_micro_batch`, `backward_per_term` or an "
                "overridden `training_step`; turn one of them off."
            )
        if self._auto_micro_batch and not self.backend.supports_deferred_sync:
            raise UnsupportedBackendError(
                f"`auto_micro_batch=True` is not supported on the {self.backend.name} backend: a rank that runs out of "
                "memory mid-window would leave the others waiting in a collective. Supported: single process and DDP."
            )
        self.num_skipped_windows = 0
        self._window: WindowCounts | None = None
        self._micro_batch_index: int | None = None
        self._warned: set[str] = set()
        self._final_backward_done = False
        self._grads_ready = False
        self._training_started = False
        self._accumulated_grad_hooks: list[tuple[AccumulatedGradHook, bool]] = []
        self._term_loss_totals: dict[str, torch.Tensor] = {}
        self._term_loss_steps = 0
        self._extra_logs: dict[str, float] = {}
        self.grads = GradAccess(self)
        for callback in self.callback_handler.callbacks:
            self._bind_callback(callback)

    # ------------------------------------------------------------------ add-ons
    def _bind_callback(self, callback: Any) -> None:
        if isinstance(callback, GradAccCallback):
            callback.bind(self)

    def add_callback(self, callback: Any) -> None:
        """`Trainer.add_callback`; a :class:`~hf_gradacc.callbacks.GradAccCallback` also gets the trainer."""
        super().add_callback(callback)
        for cb in self.callback_handler.callbacks:
            self._bind_callback(cb)

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
            raise RuntimeError(
                "register_accumulated_grad_hook must be called before `train()`: hooks registered mid-training "
                "would see some optimizer steps and not others."
            )
        if not callable(hook):
            raise TypeError(f"`hook` must be callable as hook(name, grad), got {type(hook).__name__}")
        self._accumulated_grad_hooks.append((hook, local))

    def add_log_metrics(self, metrics: Mapping[str, float]) -> None:
        """Add ``metrics`` to the next training log line (used by hf_gradacc callbacks)."""
        self._extra_logs.update({k: float(v) for k, v in metrics.items()})

    def _trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        module = self.accelerator.unwrap_model(self.model_wrapped)
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def _run_accumulated_grad_hooks(self) -> None:
        if not self._accumulated_grad_hooks:
            return
        for name, param in self._trainable_named_parameters():
            for hook, local in self._accumulated_grad_hooks:
                if local:
                    hook(name, self.backend.local_grad(name, param))
                else:
                    grad = self.backend.full_grad(name, param)
                    hook(name, grad)
                    self.backend.write_full_grad(name, param, grad)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, with per-term losses (``loss/<name>``) and callback metrics added to training logs."""
        if "loss" in logs and self._term_loss_totals and self._term_loss_steps > 0:
            names = sorted(self._term_loss_totals)
            stacked = torch.stack([self._term_loss_totals[n] for n in names]).to(self.args.device)
            if self.backend.dp_world_size > 1:
                stacked = self.backend.all_gather(stacked).mean(dim=0)
            for name, value in zip(names, stacked.tolist()):
                logs[f"loss/{name}"] = value / self._term_loss_steps
            self._term_loss_totals = {}
            self._term_loss_steps = 0
        if "loss" in logs and self._extra_logs:
            logs.update(self._extra_logs)
            self._extra_logs = {}
        super().log(logs, start_time)

    def backward(self, loss: torch.Tensor, *, final: bool, retain_graph: bool = False) -> None:
        """Low-level backward pass for custom training steps: accumulate ``loss``'s gradient.

        ``loss`` must already be normalised (see :func:`hf_gradacc.loss.normalize`). ``final=True`` marks the LAST
        backward pass of the optimizer step (last micro-batch, last term): it triggers the gradient reduction on
        every backend. Exactly one final pass per step; earlier passes through the same forward need
        ``retain_graph=True``.

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
        if self._window is None or self._micro_batch_index is None:
            raise RuntimeError("GradAccTrainer.backward runs inside a training window only (from training_step)")
        if self._final_backward_done:
            raise RuntimeError(
                "GradAccTrainer.backward(..., final=True) was already called in this optimizer step; exactly one "
                "backward pass per step may be final (the last one of the last micro-batch)."
            )
        if final and not self.is_last_micro_batch:
            raise RuntimeError(
                f"backward(final=True) on micro-batch {self._micro_batch_index + 1} of "
                f"{len(self._window.micro_batches)}: only the last micro-batch's last backward pass may be final."
            )
        extra = {"retain_graph": True} if retain_graph else {}
        # With auto_micro_batch no backward pass reduces: the window's gradient is reduced by `sync_window` once
        # every rank has agreed that no rank ran out of memory.
        self.backend.backward(loss, model=self.model_wrapped, is_final=final and not self._auto_micro_batch, **extra)
        if final:
            self._final_backward_done = True

    @property
    def is_last_micro_batch(self) -> bool:
        """True while the last micro-batch of the current optimizer step runs."""
        return self._window is not None and self._micro_batch_index == len(self._window.micro_batches) - 1

    # ------------------------------------------------------------------ denominators
    @property
    def primary_denominator(self) -> str:
        """``"samples"`` for sequence classification (and unlabelled data), ``"tokens"`` for every other head."""
        if self.head_type == "sequence_classification":
            return "samples"
        if self._window is not None and not self._window.labelled:
            return "samples"
        return "tokens"

    def _problem_type(self, labels: torch.Tensor | None) -> str | None:
        config = getattr(unwrap_model(self.model), "config", None)
        if config is None or labels is None:
            return None
        return infer_problem_type(getattr(config, "num_labels", 2), labels, getattr(config, "problem_type", None))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | None]:
        """Prefetch the window's micro-batches and count its denominator over all ranks (one collective).

        Returns the micro-batches and the global count of the primary denominator; the full
        :class:`~hf_gradacc.window.WindowCounts` is kept in ``self._window``.
        """
        batch_samples: list = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        counts = [self._count(batch) for batch in batch_samples]
        if self.head_type is None and all(c.labelled for c in counts) and counts:
            self._warn_once(
                "unknown_head",
                "GradAccTrainer could not tell the model's loss family; 'tokens' are counted on unshifted labels. "
                "Set `head_type` in GradAccConfig if the model shifts its labels (causal LM).",
            )
        self._window = gather_window_counts(counts, self.backend.all_gather, device=device)
        return batch_samples, torch.tensor(self._window.global_count(self.primary_denominator), device=device)

    # ------------------------------------------------------------------ loss
    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> LossTerm | torch.Tensor | tuple[Any, Any]:
        """The micro-batch's SUM-reduced loss, from the logits, as a :class:`~hf_gradacc.LossTerm`.

        Labels are taken out of the inputs (the model does not compute a loss of its own); seq2seq models get
        ``decoder_input_ids`` from ``prepare_decoder_input_ids_from_labels``. Outside a training window
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
            self.head_type == "seq2seq"
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
        total = self.sum_loss_from_logits(logits, labels, shift_labels)
        term = LossTerm(total=total, normalize_by=self.primary_denominator)
        result: Any = term
        if self._micro_batch_index is None:  # evaluation / prediction: a plain mean, as Trainer expects
            count = count_micro_batch(
                {LABEL_KEY: labels} if shift_labels is None else {LABEL_KEY: labels, SHIFT_LABELS_KEY: shift_labels},
                self.head_type or "masked_lm",
                ignore_index=self.ignore_index,
                problem_type=self._problem_type(labels),
            ).get(self.primary_denominator)
            result = total / max(count, 1)
        return (result, outputs) if return_outputs else result

    def sum_loss_from_logits(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum-reduced loss of the trainer's head family (see :mod:`hf_gradacc.loss`)."""
        smoothing = float(self.args.label_smoothing_factor or 0.0)
        head = self.head_type
        if head == "causal_lm":
            targets = shift_labels if shift_labels is not None else causal_targets(labels, self.ignore_index)
            return token_cross_entropy_sum(logits, targets, self.ignore_index, smoothing)
        if head in ("seq2seq", "masked_lm", "token_classification"):
            return token_cross_entropy_sum(logits, labels, self.ignore_index, smoothing)
        if head == "sequence_classification":
            problem_type = self._problem_type(labels)
            if smoothing and problem_type != "single_label_classification":
                self._warn_once(
                    "smoothing",
                    f"`label_smoothing_factor` ({smoothing}) is ignored for problem type {problem_type!r}.",
                )
                smoothing = 0.0
            total, _ = sequence_classification_sum(logits, labels, problem_type, self.ignore_index, smoothing)
            return total
        raise GradAccLossError(f"No built-in loss for head type {head!r}: set `head_type` or return a LossTerm.")

    def _normalized_terms(self, raw: Any) -> list[tuple[str, torch.Tensor]]:
        """Each term of what ``compute_loss`` returned, normalised by its own global denominator."""
        window = self._window
        assert window is not None and self._micro_batch_index is not None
        world = self.backend.dp_world_size
        if isinstance(raw, tuple):
            raw = raw[0]
        if isinstance(raw, LossTerm):
            raw = {"loss": raw}
        if isinstance(raw, Mapping):
            if not raw:
                raise GradAccLossError("compute_loss returned an empty dict; return at least one LossTerm")
            parts: list[tuple[str, torch.Tensor]] = []
            for name, term in raw.items():
                if not isinstance(term, LossTerm):
                    raise GradAccLossError(
                        f"compute_loss returned a dict whose value {name!r} is a {type(term).__name__}; "
                        "every value must be an hf_gradacc.LossTerm"
                    )
                if not isinstance(term.normalize_by, str):
                    raise GradAccLossError(
                        f"LossTerm {name!r} has a custom count ({term.normalize_by!r}), known only after the forward "
                        "pass: set `defer_normalization=True` (the gradient is scaled once per step), or use "
                        "normalize_by='tokens' / 'samples'."
                    )
                if term.normalize_by == "tokens" and not window.labelled:
                    raise GradAccLossError(
                        f"LossTerm {name!r} is normalised by 'tokens' but the batch has no `labels` to count them; "
                        "use normalize_by='samples', or have the data collator return `labels`."
                    )
                global_count = window.global_count(term.normalize_by)
                if global_count == 0:
                    self._warn_once(
                        f"zero_term_{name}",
                        f"Loss term {name!r} has no counted {term.normalize_by} in this optimizer step on any rank; "
                        "it is left out of the step (no NaN).",
                    )
                    part = term.total * 0.0
                else:
                    part = normalize(term.total, global_count, world)
                parts.append((str(name), part))
            return parts
        if not torch.is_tensor(raw):
            raise GradAccLossError(
                f"compute_loss returned a {type(raw).__name__}; return a scalar tensor, an hf_gradacc.LossTerm or a "
                "dict of LossTerms"
            )
        if raw.dim() != 0:
            raise GradAccLossError(
                f"compute_loss returned a loss of shape {tuple(raw.shape)}; it must be a scalar. Reduce it with "
                ".sum() and return hf_gradacc.LossTerm(total=..., normalize_by=...)."
            )
        if self._warn_on_plain_loss:
            self._warn_once(
                "plain_loss",
                "compute_loss returned a plain tensor: GradAccTrainer reads it as the MEAN over the micro-batch's "
                f"counted {self.primary_denominator} (num_items_in_batch is that local count) and re-weights it "
                "exactly. If it is not such a mean, return hf_gradacc.LossTerm(total=<sum>, normalize_by=...) "
                "(set `warn_on_plain_loss=False` to silence this).",
            )
        local = window.micro_batches[self._micro_batch_index].get(self.primary_denominator)
        global_count = window.global_count(self.primary_denominator)
        if local == 0:
            if not bool(torch.isfinite(raw)):
                raise GradAccLossError(
                    "compute_loss returned a non-finite mean for a micro-batch with no counted item. Return "
                    "hf_gradacc.LossTerm(total=<sum>, ...), whose sum is 0 for an empty micro-batch."
                )
            return [("loss", raw * 0.0)]
        return [("loss", normalize(raw * local, global_count, world))]

    # ------------------------------------------------------------------ one micro-batch
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch of the current window; returns its share of the logged loss."""
        if self._window is None or self._micro_batch_index is None:
            raise RuntimeError("GradAccTrainer.training_step runs inside the training loop's window only")
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        is_last = self.is_last_micro_batch
        if self._custom_compute_loss:
            local = self._window.micro_batches[self._micro_batch_index].get(self.primary_denominator)
            num_items_in_batch = torch.tensor(local, device=self.args.device)
        with self.compute_loss_context_manager():
            raw = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        parts = self._normalized_terms(raw)
        if len(parts) > 1:
            for name, part in parts:
                total = self._term_loss_totals.get(name)
                value = part.detach().float()
                self._term_loss_totals[name] = value if total is None else total + value
        per_term = self._backward_per_term and len(parts) > 1
        if per_term and not self.backend.supports_backward_per_term:
            self._warn_once(
                "per_term_fallback",
                f"backward_per_term: the {self.backend.name} backend cannot run several backward passes through one "
                "forward pass (DeepSpeed ZeRO-3 fails upstream); the terms are summed into ONE backward pass per "
                "micro-batch instead. The gradient is the same.",
            )
            per_term = False
        if per_term:
            for k, (_, part) in enumerate(parts):
                last_term = k == len(parts) - 1
                self.backward(part, final=is_last and last_term, retain_graph=not last_term)
        else:
            loss = parts[0][1]
            for _, part in parts[1:]:
                loss = loss + part
            self.backward(loss, final=is_last)
        return sum((p.detach() for _, p in parts), torch.zeros((), device=parts[0][1].device))

    # ------------------------------------------------------------------ regrouped micro-batches (regroup.py)
    def get_train_dataloader(self):
        """`Trainer.get_train_dataloader`; with ``regroup_micro_batches`` / ``max_tokens_per_micro_batch`` its batch
        sampler is a :class:`~hf_gradacc.regroup.WindowRegroupBatchSampler` (same samples per optimizer step, less
        padding). Iterable datasets keep the stock loader (a warning says so)."""
        from .regroup import build_train_dataloader

        dataloader = build_train_dataloader(self)
        return dataloader if dataloader is not None else super().get_train_dataloader()

    def set_initial_training_values(self, args, dataloader):
        """`Trainer.set_initial_training_values`, counting optimizer steps as windows when a token budget gives
        windows more than ``gradient_accumulation_steps`` micro-batches."""
        from .regroup import adjust_training_values

        return adjust_training_values(dataloader, args, super().set_initial_training_values(args, dataloader))

    # ------------------------------------------------------------------ the loop
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
        from accelerate.data_loader import skip_first_batches

        if epoch == epochs_trained:
            self._training_started = True
            self.backend.setup(model, self.optimizer)
        step = -1
        grad_norm = None
        learning_rate = None
        rng_to_sync = False
        gas = self.args.gradient_accumulation_steps

        num_update_steps_trained = 0
        # Regrouped micro-batches (regroup.py): the batch sampler says how many micro-batches each window holds.
        from .regroup import window_schedule

        schedule = window_schedule(train_dataloader, epoch)
        if schedule is not None:
            steps_in_epoch = max(sum(schedule), 1)
        if epoch == epochs_trained and resume_from_checkpoint is not None:
            if steps_trained_in_current_epoch > 0 and not self.args.ignore_data_skip:
                num_update_steps_trained = steps_trained_in_current_epoch // gas
                if schedule is not None:
                    steps_trained_in_current_epoch = sum(schedule[:num_update_steps_trained])
                train_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)
                step = steps_trained_in_current_epoch - 1
                rng_to_sync = True
            elif steps_trained_in_current_epoch == 0:
                self._load_rng_state(resume_from_checkpoint)

        if hasattr(train_dataloader, "set_epoch"):
            train_dataloader.set_epoch(epoch)
        underlying_sampler = getattr(getattr(train_dataloader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(underlying_sampler, "set_epoch"):
            underlying_sampler.set_epoch(epoch)
        epoch_iterator = iter(train_dataloader)

        remainder = steps_in_epoch % gas or gas
        for update_step in range(num_update_steps_trained, num_update_steps_per_epoch):
            num_batches = gas if update_step != (num_update_steps_per_epoch - 1) else remainder
            if schedule is not None:
                num_batches = schedule[update_step] if update_step < len(schedule) else 0
            if self._defer_normalization:
                if rng_to_sync:
                    self._load_rng_state(resume_from_checkpoint)
                    rng_to_sync = False
                self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
                outcome = self._run_deferred_window(model, epoch_iterator, num_batches)
            else:
                batch_samples, _ = self.get_batch_samples(epoch_iterator, num_batches, self.args.device)
                self.current_gradient_accumulation_steps = len(batch_samples)
                if rng_to_sync:
                    self._load_rng_state(resume_from_checkpoint)
                    rng_to_sync = False
                outcome = self._run_prefetched_window(model, batch_samples)
            if outcome is None:
                break  # the data ran out on every rank: the epoch ends here, nothing is carried over
            tr_loss_step, num_micro_batches = outcome
            step += num_micro_batches
            if tr_loss_step is None:
                continue  # no counted item on any rank: skipped, parameters unchanged
            if self.args.logging_nan_inf_filter and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)):
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            else:
                self._tr_loss += tr_loss_step.to(self._tr_loss.device)

            grad_norm = self._optimizer_step(model)
            learning_rate = self._get_learning_rate()
            self.state.global_step += 1
            self.state.epoch = epoch + (step + 1) / steps_in_epoch
            self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
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

        if step < 0:
            logger.warning(
                "There seems not to be a single sample in your epoch_iterator, stopping training at step"
                f" {self.state.global_step}!"
            )
            self.control.should_training_stop = True

        self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
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

    def _run_prefetched_window(self, model: nn.Module, batch_samples: list) -> tuple[torch.Tensor | None, int] | None:
        """Checks on the counted window, then its forward and backward passes.

        Returns ``(logged loss, micro-batches)``, ``(None, micro-batches)`` for a window skipped because it has no
        counted item on any rank, or None when the data ran out on every rank. Every branch here depends only on
        counts gathered from all ranks, so all ranks take it together.
        """
        window = self._window
        assert window is not None
        per_rank = window.num_micro_batches_per_rank
        if max(per_rank) == 0:
            self._window = None
            return None
        if min(per_rank) == 0:
            raise GradAccDataError(
                f"Ranks hold different numbers of micro-batches for this optimizer step ({list(per_rank)}); a "
                "rank with none cannot join the gradient reduction. Keep `dataloader_drop_last=False` with "
                "accelerate's `even_batches=True` (the default), or give every rank the same number of batches."
            )
        if window.global_count(self.primary_denominator) == 0:
            self.num_skipped_windows += 1
            logger.warning(
                f"Optimizer step {self.state.global_step + 1} has no counted {self.primary_denominator} on any "
                f"rank (every label is {self.ignore_index}): skipped, parameters unchanged "
                f"({self.num_skipped_windows} skipped so far)."
            )
            self._window = None
            return None, len(batch_samples)
        self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
        tr_loss_step = self._run_window(model, batch_samples)
        for inputs in batch_samples:
            self.current_flos += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)
        self._window = None
        return tr_loss_step, len(batch_samples)

    def _run_window(self, model: nn.Module, batch_samples: list) -> torch.Tensor:
        """Forward and backward passes of every micro-batch of the window; returns the window's logged loss.

        With ``auto_micro_batch``, an out-of-memory error on any rank makes EVERY rank drop the window's partial
        gradient, halve the rows per micro-batch and run the same samples again: the update is unchanged (the
        global denominator does not depend on the grouping), nothing hangs (no collective runs inside the window
        in that mode), and the smaller size is kept for the rest of training.
        """
        window = self._window
        assert window is not None
        while True:
            micro_batches = batch_samples
            if self._auto_rows is not None:
                micro_batches = split_micro_batches(batch_samples, self._auto_rows)
                if len(micro_batches) != len(batch_samples):
                    self._window = window.with_micro_batches(
                        [self._count(mb) for mb in micro_batches]
                    )
            self._final_backward_done = False
            total = torch.zeros((), device=self.args.device)
            out_of_memory = False
            try:
                for i, inputs in enumerate(micro_batches):
                    is_last = i == len(micro_batches) - 1
                    self.accelerator.gradient_state._set_sync_gradients(is_last)
                    self._micro_batch_index = i
                    try:
                        with self.backend.sync_context(model, is_last=is_last):
                            total = total + self.training_step(model, inputs, None).to(total.device)
                    finally:
                        self._micro_batch_index = None
                    if not is_last:
                        self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)
            except Exception as error:  # noqa: BLE001 - only out-of-memory errors are caught, the rest re-raised
                if not (self._auto_micro_batch and is_out_of_memory(error)):
                    raise
                out_of_memory = True
                release_memory()
            if not self._auto_micro_batch:
                break
            # One flag per rank, agreed before anything else communicates: every rank retries, or none does.
            any_oom = bool(self.backend.all_gather(torch.tensor([int(out_of_memory)], device=self.args.device)).max())
            if not any_oom:
                self.backend.sync_window(model)
                break
            self.backend.zero_grad(model)
            self._term_loss_totals = {}
            largest = max(rows_of(mb) for mb in batch_samples)
            current = self._auto_rows or largest
            if current <= 1:
                raise GradAccDataError(
                    "Out of memory on a micro-batch of ONE sample (auto_micro_batch cannot split further). Shorten "
                    "`max_length` / the longest sample, use gradient checkpointing, or a bigger device."
                )
            self._auto_rows = max(1, current // 2)
            logger.warning(
                f"auto_micro_batch: out of memory on {'this' if out_of_memory else 'another'} rank; micro-batches now "
                f"hold at most {self._auto_rows} row(s) (were {current}). The optimizer step's samples and update are "
                "unchanged; the step is recomputed."
            )
            self.add_log_metrics({"auto_micro_batch_rows": self._auto_rows})
        if not self._final_backward_done:
            raise RuntimeError(
                "The optimizer step's last micro-batch ran no final backward pass: a custom `training_step` must call "
                "`self.backward(loss, final=self.is_last_micro_batch)` (or super().training_step)."
            )
        return total

    def _run_deferred_window(
        self, model: nn.Module, epoch_iterator: Iterator, num_batches: int
    ) -> tuple[torch.Tensor | None, int] | None:
        """`defer_normalization`: fetch micro-batches one at a time, back-propagate SUMS, scale once at the end.

        No prefetch: each micro-batch is loaded, counted, run and dropped. Every backward pass is local; after the
        window ONE collective sums the counts, the backend reduces the gradient once and scales it by
        ``1 / global_count``. Returns ``(logged loss, micro-batches)``, ``(None, n)`` for a skipped window, or None
        when the data ran out on every rank.
        """
        world = self.backend.dp_world_size
        local_tokens = local_samples = local_custom = num_micro_batches = 0
        kind: str | None = None  # the one denominator this rank's micro-batches used
        total = torch.zeros((), device=self.args.device)
        self._final_backward_done = False
        self._window = WindowCounts(micro_batches=(), global_tokens=1, global_samples=1, num_micro_batches_per_rank=())
        for _ in range(num_batches):
            try:
                inputs = next(epoch_iterator)
            except StopIteration:
                break
            counts = self._count(inputs)
            local_tokens += counts.num_tokens
            local_samples += counts.num_samples
            self._window = self._window.with_micro_batches([counts])
            self._micro_batch_index = 0
            self.accelerator.gradient_state._set_sync_gradients(False)
            model.train()
            prepared = self._prepare_inputs(inputs)
            try:
                with self.backend.sync_context(model, is_last=False):
                    num_items = None
                    if self._custom_compute_loss:
                        num_items = torch.tensor(counts.get(self.primary_denominator), device=self.args.device)
                    with self.compute_loss_context_manager():
                        raw = self.compute_loss(model, prepared, num_items_in_batch=num_items)
                    micro_kind, summed, custom_count = self._summed_terms(raw, counts)
                    if kind not in (None, micro_kind):
                        raise GradAccLossError(
                            f"With `defer_normalization=True` every micro-batch of a step must use one denominator "
                            f"(got {kind!r} and {micro_kind!r})."
                        )
                    kind = micro_kind
                    local_custom += custom_count
                    loss = summed * world
                    self.backend.backward(loss, model=self.model_wrapped, is_final=False)
            finally:
                self._micro_batch_index = None
            total = total + loss.detach()
            self.current_flos += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)
            num_micro_batches += 1
        kind_code = -1 if kind is None else _DEFERRED_KINDS.index(kind)
        vector = torch.tensor(
            [local_tokens, local_samples, local_custom, num_micro_batches, kind_code], device=self.args.device
        )
        rows = self.backend.all_gather(vector).reshape(-1, 5).cpu()
        self._window = None
        # accelerate's optimizer wrapper only steps when it believes the gradients are synced.
        self.accelerator.gradient_state._set_sync_gradients(True)
        if int(rows[:, 3].max()) == 0:
            return None
        # The denominator is agreed from every rank's row (a rank without micro-batches has none of its own).
        codes = sorted({int(c) for c in rows[:, 4] if int(c) >= 0})
        if len(codes) != 1:
            raise GradAccLossError(
                "With `defer_normalization=True` every rank must use one denominator in a step (got "
                f"{[_DEFERRED_KINDS[c] for c in codes]})."
            )
        self.backend.sync_window(model)
        global_count = int(rows[:, codes[0]].sum())  # columns 0, 1, 2 hold tokens, samples, custom counts
        if global_count == 0:
            self.backend.zero_grad(model)
            self.num_skipped_windows += 1
            logger.warning(
                f"Optimizer step {self.state.global_step + 1} has no counted item on any rank: skipped, parameters "
                f"unchanged ({self.num_skipped_windows} skipped so far)."
            )
            return None, num_micro_batches
        self.backend.scale_grads(model, 1.0 / global_count)
        return total / global_count, num_micro_batches

    def _summed_terms(self, raw: Any, counts) -> tuple[str, torch.Tensor, int]:
        """For deferred normalisation: the ONE denominator all terms share, the summed loss, and its custom count."""
        if isinstance(raw, tuple):
            raw = raw[0]
        if isinstance(raw, LossTerm):
            raw = {"loss": raw}
        if isinstance(raw, Mapping):
            kinds = {t.normalize_by if isinstance(t.normalize_by, str) else "custom" for t in raw.values()}
            if len(kinds) != 1:
                raise GradAccLossError(
                    f"With `defer_normalization=True` every LossTerm must share one denominator (got {sorted(kinds)}):"
                    " the gradient is scaled once per step. Turn `defer_normalization` off to mix denominators."
                )
            kind = kinds.pop()
            terms = list(raw.values())
            custom_count = 0
            if kind == "custom":
                counts_given = {int(t.normalize_by) for t in terms}
                if len(counts_given) != 1:
                    raise GradAccLossError(
                        f"With `defer_normalization=True` every LossTerm must share one count (got {sorted(counts_given)})"
                    )
                custom_count = counts_given.pop()
            summed = terms[0].total
            for term in terms[1:]:
                summed = summed + term.total
            return kind, summed, custom_count
        if not torch.is_tensor(raw) or raw.dim() != 0:
            raise GradAccLossError("compute_loss must return a scalar tensor or LossTerm(s)")
        local = counts.get(self.primary_denominator)
        return self.primary_denominator, raw * local if local else raw * 0.0, 0

    def _count(self, batch: Mapping[str, Any]):
        head: HeadType = self.head_type or "masked_lm"
        problem_type = self._problem_type(batch.get(LABEL_KEY)) if head == "sequence_classification" else None
        return count_micro_batch(
            batch,
            head,
            ignore_index=self.ignore_index,
            problem_type=problem_type,
            allow_unlabelled=self._custom_compute_loss,
        )

    def _optimizer_step(self, model: nn.Module) -> torch.Tensor:
        """Hooks, norm and clipping, `on_pre_optimizer_step`, the step, the scheduler; returns the pre-clip norm."""
        if self._term_loss_totals:
            self._term_loss_steps += 1
        self._grads_ready = True
        try:
            self._run_accumulated_grad_hooks()
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, GradAccCallback):
                    callback.on_accumulated_grads(self.args, self.state, self.control)
            max_norm = self.args.max_grad_norm
            grad_norm = self.backend.clip_grad_norm(
                model, max_norm if max_norm is not None and max_norm > 0 else float("inf")
            )
            self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        finally:
            self._grads_ready = False
        self.backend.optimizer_step(model, self.optimizer)
        self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
        if not self.accelerator.optimizer_step_was_skipped and not isinstance(
            self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            self.lr_scheduler.step()
        self.backend.zero_grad(model)
        return grad_norm

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

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`, with a LossTerm from an overridden ``compute_loss`` read as its batch mean."""
        if not self._custom_compute_loss:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        user_compute_loss = self.compute_loss

        def mean_compute_loss(*args: Any, **kwargs: Any) -> Any:
            out = user_compute_loss(*args, **kwargs)
            loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            if isinstance(loss, LossTerm):
                loss = {"loss": loss}
            if isinstance(loss, Mapping):
                labels = inputs.get(LABEL_KEY)
                parts = []
                for term in loss.values():
                    if isinstance(term.normalize_by, str):
                        count = count_micro_batch(
                            {k: v for k, v in inputs.items() if k in (LABEL_KEY, SHIFT_LABELS_KEY)},
                            self.head_type or "masked_lm",
                            ignore_index=self.ignore_index,
                            problem_type=self._problem_type(labels),
                        ).get(term.normalize_by)
                    else:
                        count = int(term.normalize_by)
                    parts.append(term.total / max(count, 1))
                loss = torch.stack(parts).sum()
            return (loss, *rest) if rest is not None else loss

        self.compute_loss = mean_compute_loss  # type: ignore[method-assign]
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            del self.compute_loss
