"""The interface every backend implements. The trainer talks to backends only through it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments


class Backend:
    """How one data-parallel backend syncs, runs backward, reduces gradients and steps.

    Subclasses live in one module each (``ddp.py``, ...) and are picked by
    :func:`hf_gradacc.backends.resolve_backend`.
    """

    name: ClassVar[str] = "base"

    def __init__(self, accelerator: Accelerator, args: TrainingArguments) -> None:
        self.accelerator = accelerator
        self.args = args

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Called once the model and optimizer are prepared (wrapped), before the first window."""

    @property
    def dp_world_size(self) -> int:
        """Number of ranks the backend averages gradients over."""
        return self.accelerator.num_processes

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """One collective: every rank's ``tensor`` stacked along a new first dim."""
        if self.dp_world_size == 1:
            return tensor.unsqueeze(0)
        return self.accelerator.gather(tensor.unsqueeze(0))

    def sync_context(self, model: torch.nn.Module, *, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward passes."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, model: torch.nn.Module, is_final: bool) -> None:
        """Accumulate ``loss``'s gradient. ``is_final`` marks the last backward pass of the window."""
        raise NotImplementedError

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Norm of the accumulated, reduced gradient before clipping; clip when ``max_norm`` is finite."""
        raise NotImplementedError

    def optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Apply the accumulated gradient."""
        optimizer.step()

    def zero_grad(self, model: torch.nn.Module) -> None:
        model.zero_grad()
