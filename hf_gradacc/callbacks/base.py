"""`GradAccCallback`: a `TrainerCallback` that GradAccTrainer hands itself to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import TrainerCallback

if TYPE_CHECKING:
    from ..trainer import GradAccTrainer


class GradAccCallback(TrainerCallback):
    """Base of the hf_gradacc callbacks: ``self.trainer`` is set when the callback is added to a GradAccTrainer.

    It gives callbacks ``trainer.grads`` (gradient access on every backend) and ``trainer.add_log_metrics``, and
    one extra event, ``on_accumulated_grads``: called once per optimizer step on every rank, after the final
    backward pass and the accumulated-gradient hooks, BEFORE clipping (``on_pre_optimizer_step`` runs after
    clipping, as in `Trainer`).

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

    trainer: GradAccTrainer | None = None

    def bind(self, trainer: GradAccTrainer) -> None:
        self.trainer = trainer

    def on_accumulated_grads(self, args, state, control, **kwargs):
        """The step's gradient is reduced and readable (``self.trainer.grads``), not yet clipped."""

    def _require_trainer(self) -> GradAccTrainer:
        if self.trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} needs a GradAccTrainer: pass it in `callbacks=[...]` or `trainer.add_callback`"
            )
        return self.trainer
