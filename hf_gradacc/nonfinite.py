"""Non-finite optimizer steps (``nonfinite_steps``): every rank sees the same verdict without an extra collective.

Each backward pass's loss is multiplied by 1 when it is finite and by NaN when it is not (:func:`poison_nonfinite`,
a tensor operation: no device sync). A non-finite loss on any micro-batch of any rank therefore makes that rank's
gradient NaN; the step's gradient reduction spreads it to every rank, and the global gradient norm that the step
computes anyway (replicated on DDP, all-reduced on DeepSpeed and FSDP2) is non-finite on every rank alike. That norm
is the one verdict: ``skip`` drops the step on every rank, ``raise`` stops every rank, ``propagate`` takes the step
as the stock Trainer would.
"""

from __future__ import annotations

import math

import torch
from transformers.utils import logging

from .errors import NonFiniteStepError

logger = logging.get_logger(__name__)


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` itself when finite (times exactly 1), else ``loss * NaN``: its gradient is NaN wherever it reaches,
    even when the non-finite part of ``loss`` carries no gradient of its own. No device sync."""
    finite = torch.isfinite(loss.detach())
    return loss * torch.where(finite, torch.ones_like(loss.detach()), torch.full_like(loss.detach(), float("nan")))


def nonfinite_micro_batches(losses: list[torch.Tensor]) -> list[int]:
    """Indices of this rank's micro-batches whose loss was NaN or infinite (one device sync)."""
    if not losses:
        return []
    finite = torch.stack([loss.detach().float().reshape(()) for loss in losses]).isfinite().tolist()
    return [i for i, ok in enumerate(finite) if not ok]


def describe(step: int, rank: int, bad: list[int], grad_norm: float) -> str:
    """Where the step went non-finite, from this rank's point of view."""
    if bad:
        where = f"rank {rank}'s micro-batch(es) {[i + 1 for i in bad]} had a NaN/Inf loss"
    else:
        where = f"the accumulated gradient is not finite (norm {grad_norm}); this rank's losses were finite"
    return f"Optimizer step {step}: {where}"


def must_skip(policy: str, grad_norm: torch.Tensor | float, *, step: int, rank: int, losses: list[torch.Tensor]) -> bool:
    """True when the step must be dropped (``skip``: a warning names the step, this rank and its non-finite
    micro-batches), after raising :class:`~hf_gradacc.NonFiniteStepError` for ``raise``; False to take the step."""
    norm = float(grad_norm)
    if policy == "propagate" or math.isfinite(norm):
        return False
    message = describe(step, rank, nonfinite_micro_batches(losses), norm)
    if policy == "raise":
        raise NonFiniteStepError(
            f"{message}. `nonfinite_steps='raise'` stops every rank here; set it to 'skip' to drop such steps."
        )
    logger.warning(
        f"{message}: the step is skipped on every rank, parameters and optimizer state unchanged "
        "(`nonfinite_steps='skip'`; the count is logged as `nonfinite_skipped`)."
    )
    return True
