"""What the TRL rows of `hf-gradacc check` share: the result of one step (:class:`TrlStep`) and every process's
recorded micro-batches gathered (:func:`all_ranks`). Its own module, so that :mod:`.trl_rows` and
:mod:`.trl_more_rows` both import it and neither imports the other back.

Example:
    ```python
    from hf_gradacc.commands.check.trl_gather import all_ranks

    batches = all_ranks(trainer.recorded_micro_batches)  # this process's alone outside a launch
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TrlStep:
    """The comparisons by trainer name (TRL's first), hf_gradacc's trainer, the step's samples, a line on the data."""

    results: dict[str, Any]
    trainer: Any
    num_samples: int
    data_note: str


def all_ranks(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every process's ``batches``, rank by rank (this process's alone outside a launch)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return batches
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, batches)
    return [batch for rank_batches in gathered for batch in rank_batches]
