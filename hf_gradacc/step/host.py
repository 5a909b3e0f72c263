"""What the step's owner uses of the `transformers.Trainer` it runs in: one declared interface.

:class:`~hf_gradacc.step.engine.StepEngine` never reads a trainer's fields by name outside :class:`TrainerHost`.
The members are the Trainer's public run state (``args``, ``state``, ``control``, the callback handler, the
accelerator, the model, the optimizer and its scheduler) and the hooks users and other libraries override
(``training_step``, ``compute_loss``, ``floating_point_ops``), plus the few private Trainer
members the step rests on, each checked at construction by :mod:`hf_gradacc.compat`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Protocol

import torch
import torch.nn as nn


class TrainerHost(Protocol):
    """The Trainer as the step's owner sees it (a `transformers.Trainer` with :class:`~hf_gradacc.GradAccMixin`)."""

    args: Any  # TrainingArguments
    state: Any  # TrainerState
    control: Any  # TrainerControl
    callback_handler: Any  # CallbackHandler
    accelerator: Any  # accelerate.Accelerator
    model: nn.Module
    model_wrapped: nn.Module
    current_flos: float
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    current_gradient_accumulation_steps: int

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch's forward and backward (an override point: custom training steps)."""

    def training_step_context(self) -> contextlib.AbstractContextManager:
        """A context around each micro-batch's ``training_step`` (TRL's activation offloading)."""

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The micro-batch's loss (an override point)."""

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        """The Trainer's autocast context for the loss."""

    def floating_point_ops(self, inputs: dict[str, Any]) -> float:
        """The micro-batch's FLOPs for ``total_flos`` (an override point)."""

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The micro-batch on the device (TRL's trainers generate here)."""

    def _prepare_context_parallel_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The Trainer's context-parallel entry (``cp_size`` > 1)."""

    def _get_learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""


class Events:
    """Fires callback events on the host's callback handler, as the Trainer does, and hf_gradacc's own events
    (``on_window_counted``, ``on_accumulated_grads``) on the callbacks that define them."""

    def __init__(self, host: TrainerHost) -> None:
        self.host = host

    def fire(self, event: str) -> None:
        """One of the Trainer's events (``on_step_begin``, ``on_substep_end``, ...)."""
        host = self.host
        host.control = getattr(host.callback_handler, event)(host.args, host.state, host.control)

    def fire_ours(self, event: str, **kwargs: Any) -> None:
        """An hf_gradacc event, on the callbacks that define it."""
        host = self.host
        handler = copy.copy(host.callback_handler)
        handler.callbacks = [cb for cb in host.callback_handler.callbacks if callable(getattr(cb, event, None))]
        host.control = handler.call_event(event, host.args, host.state, host.control, **kwargs)
