"""`GradAccCallback`: a `TrainerCallback` that GradAccTrainer hands itself to."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..errors import GradAccUsageError


class GradAccCallback(TrainerCallback):
    """Base of the hf_gradacc callbacks: ``self.trainer`` is set when the callback is added to a trainer with
    :class:`~hf_gradacc.GradAccMixin` (e.g. GradAccTrainer).

    It gives callbacks ``trainer.grads`` (gradient access on every backend) and ``trainer.add_log_metrics``, and
    two extra events, dispatched like the Trainer's own (any callback that defines them receives them):
    ``on_window_counted`` (the step's counts over every rank are known) and ``on_accumulated_grads`` (called once
    per optimizer step on every rank, after the final backward pass and the accumulated-gradient hooks, BEFORE
    clipping; ``on_pre_optimizer_step`` runs after clipping, as in `Trainer`).

    Example:
        ```python
        from hf_gradacc.callbacks import GradAccCallback

        class PrintNorm(GradAccCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                norm = self.trainer.grads.norm()      # collective: runs on every rank
                if state.is_world_process_zero:
                    print(state.global_step, norm)
        ```
    """

    trainer: Any = None  # the GradAccMixin trainer the callback was added to

    def bind(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_window_counted(self, args, state, control, window=None, **kwargs):
        """The optimizer step's micro-batches are counted over every rank: ``window.counts`` holds this rank's
        per-micro-batch counts and the global sums (a prefetched step: before its first forward pass; a streamed one,
        ``defer_normalization``: after its last backward pass). Called for skipped steps too."""

    def on_accumulated_grads(self, args, state, control, **kwargs):
        """The step's gradient is reduced and readable (``self.trainer.grads``), not yet clipped."""

    def _require_trainer(self) -> Any:
        if self.trainer is None:
            raise GradAccUsageError(
                f"{type(self).__name__} needs a GradAccTrainer: pass it in `callbacks=[...]` or `trainer.add_callback`"
            )
        return self.trainer
