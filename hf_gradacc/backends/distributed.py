"""Process-group utilities that are not a backend: the timeout that ends a run whose peer froze, recognising a
failed collective (inside a step, or while a checkpoint is saved), and ending a distributed run safely."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from transformers.utils import logging

from ..errors import GradAccDistributedError

logger = logging.get_logger(__name__)

# torch's default timeout of a non-NCCL process group (distributed_c10d.default_pg_timeout).
_TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)
# What gloo (and the DDP reducer wrapping it) say when a peer froze, died or closed the connection.
COLLECTIVE_FAILURES = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "Connection closed by peer",
    "Connection reset by peer",
    "Socket Timeout",
)


def apply_ddp_timeout(args: Any) -> timedelta | None:
    """Give the default process group the timeout of `TrainingArguments.ddp_timeout` when it still has torch's default.

    With ``use_cpu=True`` transformers 5.23 creates the gloo group without the ``ddp_timeout`` it passes to every
    other backend (`TrainingArguments._setup_devices`), so a frozen peer made the other ranks wait 30 minutes. A group
    the user created with a timeout of their own is left alone. Returns the timeout set, or None. Uses torch's
    ``_set_pg_timeout`` (private); delete once transformers passes the timeout on the CPU path.
    """
    import torch
    import torch.distributed as dist

    wanted = getattr(args, "ddp_timeout_delta", None)
    if not (dist.is_available() and dist.is_initialized()) or wanted is None or dist.get_backend() != "gloo":
        return None
    try:
        current = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
        if current != _TORCH_DEFAULT_TIMEOUT or current == wanted:
            return None
        dist.distributed_c10d._set_pg_timeout(wanted)
    except (AttributeError, RuntimeError, ValueError) as error:  # an older / newer torch: say so, do not fail
        logger.warning_once(f"Could not apply `ddp_timeout` ({wanted}) to the gloo process group: {error}")
        return None
    return wanted


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its peer (gloo / the DDP reducer)."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistBackendError", ())):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in COLLECTIVE_FAILURES)


def _lost_peer(args: Any) -> str:
    """What every failed collective's error says happened."""
    return (
        f"a collective got no answer within `ddp_timeout` ({args.ddp_timeout} s) or lost its peer; another rank "
        "froze, died or failed"
    )


def collective_failure(step: int, micro_batch: int | None, args: Any) -> GradAccDistributedError:
    """The error that replaces a failed collective: which optimizer step, micro-batch and rank, and why."""
    where = "" if micro_batch is None else f", micro-batch {micro_batch + 1}"
    return GradAccDistributedError(
        f"Optimizer step {step}{where} on rank {args.process_index}: {_lost_peer(args)} (see its log)."
    )


def failure_outside_step(step: int, args: Any) -> GradAccDistributedError:
    """The error that replaces a collective that failed in `Trainer.train` outside an optimizer step: the Trainer's
    own (the logged loss's gather, evaluation, the end of training) or a callback's, after optimizer ``step``."""
    return GradAccDistributedError(
        f"After optimizer step {step} on rank {args.process_index}, outside the step (the Trainer's logging, "
        f"evaluation or a callback): {_lost_peer(args)} (see its log). Restart from the last complete checkpoint with "
        "`resume_from_checkpoint=True` (torchrun elastic and Ray Train restart the workers themselves: "
        "docs/elastic.md)."
    )


def save_failure(step: int, folder: str, previous: str | None, args: Any) -> GradAccDistributedError:
    """The error that replaces a collective failed while checkpoint ``folder`` was saved at optimizer ``step``: which
    rank, that the folder is left incomplete, and which checkpoint the next resume takes (``previous``, or None)."""
    then = (
        f"the previous complete one, {previous}"
        if previous is not None
        else "none: this rank's disk holds no complete older checkpoint, so start without `resume_from_checkpoint`"
    )
    return GradAccDistributedError(
        f"Saving the checkpoint of optimizer step {step} on rank {args.process_index}: {_lost_peer(args)} while "
        f"saving (see its log: a full disk, a kill). {folder} is left incomplete (no hf_gradacc_complete.json); the "
        f"next `resume_from_checkpoint=True` passes it over and takes {then}."
    )


def finish_distributed() -> bool:
    """Wait for every rank, destroy the process group, and let gloo's worker threads finish before exit.

    Returns True when it tore down a gloo group (the caller may then leave through ``os._exit``), else False.

    On CPU ranks (gloo) a worker thread frees the last collective's tensors only once it holds the GIL; if the
    interpreter is already shutting down then, the rank aborts ("terminate called without an active exception",
    pytorch issue 190489). A short sleep after destroying the group hands it the GIL; that makes the abort rare, not
    impossible (the `hf-gradacc` executable therefore leaves through ``os._exit``). Delete once torch fixes it.
    """
    import gc
    import time

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    uses_gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if uses_gloo:
        gc.collect()  # a group held only by reference cycles is destroyed now, while the interpreter is alive
        time.sleep(0.25)
    return uses_gloo


def gather_objects(value: Any) -> list[Any]:
    """``value`` (any picklable object) of every rank of the default group, in rank order (``[value]`` on one
    process): one collective, for verdicts every rank must share before it acts (a checkpoint's problems, its record).

    Example:
        ```python
        problems = gather_objects(local_problems)   # every rank calls it, in the same order
        ```
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
