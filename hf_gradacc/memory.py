"""Surviving out-of-memory without changing the step (``auto_micro_batch``): the same samples, cut smaller."""

from __future__ import annotations

import gc

import torch

from .counting import rows_of
from .errors import GradAccDataError
from .step.window import Window

# What the allocators say when they run out (older torch raised a plain RuntimeError for CUDA; the CPU, MPS, XPU
# and HIP allocators still do). A RuntimeError that merely mentions memory is NOT one of them.
OUT_OF_MEMORY_MESSAGES = (
    "CUDA out of memory",
    "HIP out of memory",
    "XPU out of memory",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """True for a device (or host) allocator's out-of-memory error, and nothing else."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_MESSAGES)


def release_memory() -> None:
    """Free what an aborted micro-batch left behind (its graph and activations are gone once the error unwound)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def halve_rows(window: Window, current: int | None, cause: BaseException | None = None) -> tuple[int, int]:
    """``(rows before, rows after)``: the cap on rows per micro-batch to retry ``window`` with after an out-of-memory
    error, half the current cap (or of its largest micro-batch). Raises :class:`~hf_gradacc.GradAccDataError`
    (chained to ``cause``, this rank's own out-of-memory error) when one row already ran out of memory."""
    current = current or max(rows_of(mb) for mb in window.micro_batches)
    if current <= 1:
        raise GradAccDataError(
            "Out of memory on a micro-batch of ONE sample (auto_micro_batch cannot split further). Shorten "
            "`max_length` / the longest sample, use gradient checkpointing, or a bigger device."
        ) from cause
    return current, max(1, current // 2)
