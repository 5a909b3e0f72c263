"""hf_gradacc's loggers follow transformers' verbosity, and one line at the start of training says the library is
active.

hf_gradacc's modules log through ``transformers.utils.logging.get_logger(__name__)``, which gives plain `logging`
loggers named ``hf_gradacc.*``: they are NOT under transformers' library logger (``transformers``), so
``transformers.logging.set_verbosity_info()`` and `TrainingArguments.log_level` would not reach them. Here the
``hf_gradacc`` logger takes transformers' verbosity at the points where the Trainer sets it:

- when a trainer gets hf_gradacc's step (``GradAccMixin``'s setup, :func:`~hf_gradacc.make_exact`): right after
  `Trainer.__init__` applied ``log_level`` (main process) or ``log_level_replica`` (the other processes);
- when training begins (a verbosity changed between construction and ``train()`` is followed).

Records still propagate to the root logger (the user's ``logging.basicConfig`` handlers, pytest's ``caplog``). Where
the root logger has no handler (a script that never configured `logging`), :class:`_WhereNothingElsePrints` writes
them to stderr, as transformers' own handler does for its records; before, Python's last-resort handler printed only
warnings there.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from transformers.utils import logging as hf_logging

from .callbacks.callback import GradAccCallback

LOGGER_NAME = "hf_gradacc"
logger = hf_logging.get_logger(__name__)


class _WhereNothingElsePrints(logging.Handler):
    """stderr, only while the root logger has no handler (no user configuration): otherwise the record propagates
    to the user's handlers and is printed there, once."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # as logging.StreamHandler: a closed stream must not stop training
            self.handleError(record)


def follow_transformers_verbosity() -> int:
    """Set the ``hf_gradacc`` logger to transformers' current verbosity (which the Trainer sets from
    ``log_level`` / ``log_level_replica``); returns that level.

    Example:
        ```python
        import transformers
        from hf_gradacc.log import follow_transformers_verbosity

        transformers.logging.set_verbosity_info()
        follow_transformers_verbosity()  # hf_gradacc's INFO lines now show, as transformers' do
        ```
    """
    root = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(handler, _WhereNothingElsePrints) for handler in root.handlers):
        root.addHandler(_WhereNothingElsePrints())
    level = hf_logging.get_verbosity()
    root.setLevel(level)
    return level


def active_line(trainer: Any) -> str:
    """The line logged beside the Trainer's ``***** Running training *****`` banner, for a trainer with
    :class:`~hf_gradacc.GradAccMixin` (its settings, head, backend and arguments).

    Example:
        ```python
        print(active_line(trainer))
        # hf_gradacc: exact gradient accumulation, single process (NO), causal_lm, GA 4 x 1 ranks, count by tokens
        ```
    """
    settings, head, backend = trainer.gradacc, trainer.head, trainer.backend
    family = head.type or "loss family unknown (own compute_loss)"
    accumulation = (
        f"GA schedule {settings.accumulation_schedule}"
        if settings.accumulation_schedule is not None
        else f"GA {trainer.args.gradient_accumulation_steps}"
    )
    held = getattr(trainer, "global_batch", None)
    if held is not None:
        accumulation += f" (total_train_batch_size {held.total} over {held.data_ranks} data ranks)"
    return (
        f"hf_gradacc: exact gradient accumulation, {backend.describe()}, {family}, {accumulation} x "
        f"{backend.mesh.dp_world_size} ranks, count by {head.denominator()}"
    )


class ActiveLineCallback(GradAccCallback):
    """Logs :func:`active_line` (INFO) when training begins: right after the Trainer's banner, on the processes whose
    log level shows the banner."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        follow_transformers_verbosity()
        if self.trainer is not None:
            logger.info(active_line(self.trainer))


def announce_active(trainer: Any) -> None:
    """Part of the trainer's setup: the loggers follow transformers' verbosity from now on, and the active line will
    be logged when training begins.

    Example:
        ```python
        announce_active(trainer)  # GradAccMixin's setup and make_exact run it
        ```
    """
    follow_transformers_verbosity()
    if not any(isinstance(callback, ActiveLineCallback) for callback in trainer.callback_handler.callbacks):
        trainer.callback_handler.add_callback(ActiveLineCallback())
