"""Resuming from the newest checkpoint that was saved completely.

`Trainer._save_checkpoint` writes the model, the optimizer, the scheduler and the RNG states, then
``trainer_state.json`` LAST. A run killed while saving leaves a ``checkpoint-N`` folder without a readable
``trainer_state.json``; `transformers.trainer_utils.get_last_checkpoint` still picks it (the highest N), and
``train(resume_from_checkpoint=True)`` then fails deep inside loading, or resumes from half-written files.
"""

from __future__ import annotations

import json
import os
import re

from transformers.utils import logging

from .errors import GradAccConfigError

logger = logging.get_logger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a ``trainer_state.json`` that parses (the Trainer writes it last)."""
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "global_step" in state


def latest_complete_checkpoint(output_dir: str) -> str:
    """The ``checkpoint-N`` folder of ``output_dir`` with the highest N that was saved completely; newer incomplete
    ones are passed over with a warning. Raises :class:`~hf_gradacc.GradAccConfigError` when there is none.

    Example:
        ```python
        trainer.train(resume_from_checkpoint=latest_complete_checkpoint(args.output_dir))
        ```
    """
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted(
        (int(m.group(1)), name) for name in names if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    skipped = []
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if is_complete_checkpoint(path):
            if skipped:
                logger.warning(
                    f"Resuming from {path}: the newer {skipped} were not saved completely (no readable "
                    f"{TRAINER_STATE_NAME}, which the Trainer writes last: the run was likely killed while saving)."
                )
            return path
        skipped.append(name)
    raise GradAccConfigError(
        f"`resume_from_checkpoint=True` found no complete checkpoint in `output_dir` ({output_dir!r})"
        + (f"; incomplete ones: {skipped}" if skipped else "")
        + ". Pass a checkpoint folder, or start without `resume_from_checkpoint`."
    )
