"""Non-finite optimizer steps (``nonfinite_steps``): every rank takes the same verdict.

Each backward pass's loss is multiplied by 1 when it is finite and by NaN when it is not (:func:`poison_nonfinite`,
a tensor operation: no device sync). A non-finite loss on any micro-batch of any rank therefore makes that rank's
gradient NaN, and the step's gradient reduction spreads it to every rank. But what runs AFTER the reduction (an
accumulated-gradient hook, an ``on_accumulated_grads`` callback, a ``training_step`` override) can write NaN on one
rank only, where DDP's norm is computed from the local replica: the ranks would decide apart (one steps, one skips)
and the next collective mismatches (gloo aborts). So the verdict is taken from the global gradient norm after the
hooks, agreed across ranks with one scalar all-reduce per step (:func:`agreed_flags`, which also carries
the preemption flag of ``save_on_preemption``, :mod:`hf_gradacc.step.preemption`): ``skip`` drops the step on
every rank, ``raise`` stops every rank, ``propagate`` takes the step as the stock Trainer would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..errors import NonFiniteStepError

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


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What every rank does at the end of an optimizer step, agreed over ranks.

    Attributes:
        skip: drop the step (a NaN/Inf loss or gradient on some rank, ``nonfinite_steps='skip'``).
        ranks_signalled: ranks that received a preemption signal (``save_on_preemption``): > 0 saves and stops.
    """

    skip: bool = False
    ranks_signalled: int = 0


def agreed_flags(
    grad_norm: torch.Tensor | float,
    hooks_nonfinite: torch.Tensor | None = None,
    *,
    agree: Callable[[torch.Tensor], torch.Tensor],
    check_nonfinite: bool = True,
    signalled: bool | None = None,
) -> tuple[bool, bool, int]:
    """(non-finite on any rank, on this rank, ranks signalled), from ONE ``agree``.

    This rank's non-finite verdict is its norm, or a non-finite value an accumulated-gradient hook left
    (``hooks_nonfinite``); ``check_nonfinite=False`` (``propagate``) sends 0 without reading the norm. ``signalled``:
    whether this rank received a preemption signal (None: ``save_on_preemption`` off, nothing more travels); it rides
    in the same tensor. ``agree`` sums the flags over every rank (the backend's
    :meth:`~hf_gradacc.backends.Backend.sum_over_processes`: one all-reduce, none on a single process)."""
    norm = torch.as_tensor(grad_norm).detach().reshape(-1)[:1]
    if check_nonfinite:
        flag = ~torch.isfinite(norm)
        if hooks_nonfinite is not None:
            flag = flag | hooks_nonfinite.to(flag.device).reshape(1)
        flag = flag.to(torch.float32)
    else:
        flag = torch.zeros(1, dtype=torch.float32, device=norm.device)
    if signalled is not None:
        flag = torch.cat([flag, torch.tensor([float(signalled)], device=flag.device)])
    summed = agree(flag.clone())  # a SUM of flags (in place, hence the copy): never loses a NaN as a MAX of norms can
    # the agreed flags and this rank's own in one read of the device (the step's one read besides the count gather's)
    values = torch.cat([summed.reshape(-1).to(flag.device), flag[:1]]).tolist()
    return bool(values[0]), bool(values[-1]), int(values[1]) if signalled is not None else 0


def step_verdict(
    policy: str,
    grad_norm: torch.Tensor | float,
    *,
    step: int,
    rank: int,
    losses: list[torch.Tensor],
    agree: Callable[[torch.Tensor], torch.Tensor],
    hooks_nonfinite: torch.Tensor | None = None,
    signalled: bool | None = None,
) -> StepVerdict:
    """The step's verdict, the same on every rank (:func:`agreed_flags`): ``skip`` when the step must be dropped
    (``skip``: a warning names the step, this rank and its non-finite micro-batches), after raising
    :class:`~hf_gradacc.NonFiniteStepError` for ``raise``; ``ranks_signalled`` > 0 when some rank received a
    preemption signal (``signalled`` not None: ``save_on_preemption``). No collective with ``propagate`` and no
    preemption flag."""
    check = policy != "propagate"
    if not check and signalled is None:
        return StepVerdict()
    anywhere, here, ranks_signalled = agreed_flags(
        grad_norm, hooks_nonfinite, agree=agree, check_nonfinite=check, signalled=signalled
    )
    if not anywhere:
        return StepVerdict(ranks_signalled=ranks_signalled)
    norm = float(grad_norm)
    message = describe(step, rank, nonfinite_micro_batches(losses), norm)
    if here and math.isfinite(norm):
        message = (
            f"Optimizer step {step}: an accumulated-gradient hook left rank {rank}'s gradient not finite "
            f"(NaN/Inf where the norm, {norm}, does not show it: another rank's ZeRO partition)"
        )
    elif not here:
        message = (
            f"Optimizer step {step}: the accumulated gradient is not finite on another rank (written after the "
            f"reduction: a gradient hook, a callback or a `training_step` override); this rank's norm is {norm}"
        )
    if policy == "raise":
        raise NonFiniteStepError(
            f"{message}. `nonfinite_steps='raise'` stops every rank here; set it to 'skip' to drop such steps."
        )
    logger.warning(
        f"{message}: the step is skipped on every rank, parameters and optimizer state unchanged "
        "(`nonfinite_steps='skip'`; the count is logged as `nonfinite_skipped`)."
    )
    return StepVerdict(skip=True, ranks_signalled=ranks_signalled)
