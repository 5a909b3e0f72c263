"""`TokenStatsCallback`: what each optimizer step trained on, over every rank, from the step's own counts."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from .callback import GradAccCallback

_clock = time.perf_counter  # the step's wall time (a module attribute, so that tests can drive it)


@dataclass
class StepTokens:
    """What one optimizer step (or several, summed) trained on, over every data-parallel rank.

    Attributes:
        real_tokens: input positions attended to (``attention_mask == 1``; every position without a mask).
        computed_tokens: input positions computed (rows x width of each micro-batch: padding included).
        target_tokens: counted targets (labels that are not ignored, after the causal shift).
        samples: samples (rows; for sequence and image classification, rows whose label is not ignored).
        micro_batches: micro-batches over all ranks.
        seconds: wall time from ``on_step_begin`` to ``on_step_end`` on this rank (forward, backward, optimizer step;
            no data loading, evaluation, checkpointing or logging).
        steps: optimizer steps summed here.
    """

    real_tokens: int = 0
    computed_tokens: int = 0
    target_tokens: int = 0
    samples: int = 0
    micro_batches: int = 0
    seconds: float = 0.0
    steps: int = 0

    def add(self, other: StepTokens) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class TokenStatsCallback(GradAccCallback):
    """Log, per optimizer step and over every rank, the tokens and samples it trained on and how fast.

    The counts come from the step's window (``on_window_counted``: summed over ranks in the step's one collective, no
    collective of its own), so they are equal on every rank. On each training log line it adds, as MEANS PER
    OPTIMIZER STEP over the steps since the previous log line (nothing is lost when ``logging_steps > 1``):

    - ``tokens/real``: input tokens attended to (``attention_mask`` ones), ``tokens/computed``: input positions
      computed (padding included), ``tokens/padding_ratio``: ``1 - real / computed`` (token-input models only);
    - ``tokens/target``: counted target tokens (token-level heads only; for classification heads it is
      ``effective_batch_size``);
    - ``tokens/per_second``: real tokens / seconds, over the same steps, of this rank's wall time from
      ``on_step_begin`` to ``on_step_end`` (forward, backward and optimizer step; no data loading, evaluation,
      checkpointing or logging). Image models: ``samples/per_second`` instead;
    - ``effective_batch_size``: samples per step (rows; sequence and image classification: rows whose label is
      not ignored), ``micro_batches``: micro-batches per step over all ranks.

    Args:
        keep_history: also keep every step's :class:`StepTokens` in ``history`` (one small record per step).

    Example:
        ```python
        from hf_gradacc import GradAccTrainer
        from hf_gradacc.callbacks import TokenStatsCallback

        trainer = GradAccTrainer(model=model, args=args, train_dataset=ds, callbacks=[TokenStatsCallback()])
        trainer.train()
        print(trainer.state.log_history[-2]["tokens/padding_ratio"])
        ```
    """

    def __init__(self, keep_history: bool = False) -> None:
        self.keep_history = keep_history
        self.history: list[StepTokens] = []
        self._pending: StepTokens | None = None
        self._started: float | None = None
        self._since_log = StepTokens()

    def on_window_counted(self, args, state, control, window=None, **kwargs):
        counts = window.counts
        self._pending = StepTokens(
            real_tokens=counts.global_input_tokens,
            computed_tokens=counts.global_positions,
            target_tokens=counts.global_tokens,
            samples=counts.global_samples,
            micro_batches=sum(counts.num_micro_batches_per_rank),
            steps=1,
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = _clock()

    def on_step_end(self, args, state, control, **kwargs):
        step, self._pending = self._pending, None
        if step is not None and self._started is not None:
            step.seconds = _clock() - self._started
            self._since_log.add(step)
            if self.keep_history:
                self.history.append(step)
        self._started = None
        if control.should_log:
            self._log()

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_log:
            self._log()

    def _log(self) -> None:
        totals, self._since_log = self._since_log, StepTokens()
        if totals.steps == 0:
            return
        trainer = self._require_trainer()
        n = totals.steps
        metrics: dict[str, float] = {
            "effective_batch_size": totals.samples / n,
            "micro_batches": totals.micro_batches / n,
        }
        if totals.computed_tokens > 0:
            metrics["tokens/real"] = totals.real_tokens / n
            metrics["tokens/computed"] = totals.computed_tokens / n
            metrics["tokens/padding_ratio"] = 1.0 - totals.real_tokens / totals.computed_tokens
        if not trainer.head.is_sequence_level:
            metrics["tokens/target"] = totals.target_tokens / n
        if totals.seconds > 0:
            if totals.computed_tokens > 0:
                metrics["tokens/per_second"] = totals.real_tokens / totals.seconds
            else:
                metrics["samples/per_second"] = totals.samples / totals.seconds
        trainer.add_log_metrics(metrics)
