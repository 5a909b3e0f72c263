"""Preemption (``save_on_preemption``): a SIGTERM on ANY rank ends EVERY rank at the same optimizer-step boundary,
with one complete checkpoint saved by all ranks together, then the training loop stops.

SLURM (``--signal=TERM@300``, a preemption), Kubernetes (a pod's termination grace period), torchrun stopping its
workers and spot-instance reclaims all send SIGTERM, often to some processes before others. Saving where the signal
lands would save one rank alone (its peers wait in the save's collectives: a hang) or in the middle of a window
(half the step's gradient, lost). So:

- during ``train()`` the handler (:meth:`Preemption.watch`) only records the signal; the previous handler is put back
  when ``train()`` ends, whatever happens;
- at the end of every optimizer step the ranks agree whether ANY rank was signalled: the flag travels in the step's
  non-finite verdict (:func:`~hf_gradacc.step.nonfinite.step_verdict`), the one scalar all-reduce every multi-rank
  step already runs (with ``nonfinite_steps='propagate'``, which runs none, the flag makes it one scalar
  all-reduce per step; nothing on one process);
- once agreed, every rank asks the Trainer to save and stop at that step (``control.should_save``,
  ``control.should_training_stop``): the checkpoint is the Trainer's own, complete on every rank (marker last,
  :mod:`hf_gradacc.checkpoints`), and ``train()`` returns; ``trainer.preempted`` says it stopped early;
- a handler that was installed before ``train()`` (submitit's requeue, a launcher's own) is called after the
  checkpoint, as if the signal had just arrived; the default action (end the process) is not: the script goes on
  after ``train()`` and exits normally.

transformers' own ``enable_jit_checkpoint`` saves on each rank when that rank sees the signal, with no agreement
(and a hang when ranks disagree); with a GradAcc trainer it is replaced by this (see :func:`release_jit_checkpoint`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from transformers.utils import logging

logger = logging.get_logger(__name__)

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)


class Preemption:
    """This rank's side of an agreed preemption checkpoint (see the module docstring).

    Args:
        enabled: ``save_on_preemption``; the same on every rank (it decides whether the flag travels).

    Example:
        ```python
        preemption = trainer.step_engine.preemption
        preemption.signalled     # the signal this rank received during train(), or None
        preemption.stopped_at    # the optimizer step every rank saved and stopped at, or None
        ```
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.signalled: int | None = None  # the first preemption signal this rank received during train()
        self.ranks_signalled = 0  # how many ranks had been signalled at the step the stop was agreed
        self.stop_agreed = False  # every rank knows some rank was signalled (sticky until the next train())
        self.stopped_at: int | None = None  # the optimizer step at which every rank saved and stopped
        self.previous: dict[int, Any] = {}  # the handlers in place before train(), put back after it

    # ------------------------------------------------------------------ during train()
    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around ``train()``: the flag-only handler on :data:`PREEMPTION_SIGNALS`, the previous handlers put back
        after it; then, when a signal arrived and ``train()`` returned, that signal handed on to the previous handler
        (a Python callable only: the default action and ``SIG_IGN`` are not replayed)."""
        self.signalled, self.ranks_signalled, self.stop_agreed, self.stopped_at = None, 0, False, None
        if not self.enabled:
            yield
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "`save_on_preemption=True` is ignored on this rank: `train()` runs outside the main thread (Ray "
                "Train, a notebook's worker thread), where Python cannot install a signal handler. A SIGTERM ends "
                "this process as usual; the other ranks still agree on their own signals at each step's end."
            )
            yield
            return
        self.previous = {sig: signal.signal(sig, self.record) for sig in PREEMPTION_SIGNALS}
        returned = False
        try:
            yield
            returned = True
        finally:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if returned:
            self.hand_on()

    def record(self, signum: int, frame: Any = None) -> None:
        """The signal handler: records the first signal, nothing else (no I/O, no lock: it may run anywhere)."""
        if self.signalled is None:
            self.signalled = signum

    def local_flag(self) -> bool | None:
        """What this rank adds to the step's agreement: None when ``save_on_preemption`` is off (nothing travels),
        else whether this rank was signalled."""
        return None if not self.enabled else self.signalled is not None

    def agreed(self, ranks_signalled: int) -> None:
        """The step's all-reduce said ``ranks_signalled`` ranks (> 0) were signalled: every rank stops after it."""
        if not self.stop_agreed:
            self.stop_agreed, self.ranks_signalled = True, ranks_signalled

    def stop_due(self, global_step: int, world_size: int) -> bool:
        """True once, at the first optimizer step that ended after the agreement: the caller saves and stops there."""
        if not self.stop_agreed or self.stopped_at is not None:
            return False
        self.stopped_at = global_step
        name = signal.Signals(self.signalled).name if self.signalled is not None else "a preemption signal"
        here = f"this rank received {name}" if self.signalled is not None else "this rank received none"
        logger.warning(
            f"Preemption: {self.ranks_signalled} of {world_size} rank(s) were signalled ({here}); every rank saves "
            f"the checkpoint of optimizer step {global_step} together and stops training there "
            "(`save_on_preemption`). An evaluation due at this step is skipped. Resume with "
            "`resume_from_checkpoint=True`."
        )
        return True

    def hand_on(self) -> None:
        """After ``train()`` returned: the signal this rank received handed to the handler that was there before
        (submitit requeues the job from it); nothing when none arrived or that handler is not a Python callable."""
        signum = self.signalled
        previous = self.previous.get(signum) if signum is not None else None
        self.previous = {}
        if callable(previous):
            name = signal.Signals(signum).name
            logger.info(f"Preemption: handing {name} on to the handler installed before train().")
            previous(signum, None)

    @property
    def preempted(self) -> bool:
        """The last ``train()`` stopped early at an agreed preemption checkpoint."""
        return self.stopped_at is not None


def release_jit_checkpoint(callbacks: list[Any]) -> bool:
    """transformers' ``enable_jit_checkpoint`` callback taken out of ``callbacks`` (the Trainer's list, changed in
    place), the SIGTERM handler it installed at construction put back; True when there was one. The GradAcc trainer
    saves the preemption checkpoint itself, agreed over ranks (``save_on_preemption``, turned on by
    :func:`~hf_gradacc.config.resolve_settings` when ``enable_jit_checkpoint`` is set)."""
    found = False
    for callback in list(callbacks):
        if type(callback).__name__ != "JITCheckpointCallback":
            continue
        manager = getattr(callback, "jit_manager", None)
        previous = getattr(manager, "_original_sigterm_handler", None)
        if manager is not None and previous is not None:
            signal.signal(signal.SIGTERM, previous)
        callbacks.remove(callback)
        found = True
    return found
