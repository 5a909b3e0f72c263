"""Single process and DDP (CPU gloo or GPU nccl)."""

from __future__ import annotations

import contextlib

import torch

from .base import Backend


class DDPBackend(Backend):
    """One process, or DDP through accelerate.

    DDP decides at FORWARD time whether the backward all-reduces: every micro-batch but the last of the
    window runs under ``no_sync``; the last one all-reduces the summed local gradients once.
    """

    name = "ddp"

    def sync_context(self, model: torch.nn.Module, *, is_last: bool) -> contextlib.AbstractContextManager:
        if is_last or self.dp_world_size == 1:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor, *, model: torch.nn.Module, is_final: bool) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return norm if torch.is_tensor(norm) else torch.tensor(float(norm))
