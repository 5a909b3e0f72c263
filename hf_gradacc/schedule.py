"""Accumulation schedules: the number of micro-batches per optimizer step growing (or shrinking) during training.

An :class:`AccumulationSchedule` maps an optimizer step to its gradient accumulation steps, as Lightning's
``GradientAccumulationScheduler`` maps epochs and Megatron's batch-size ramp maps samples. It is written as
``"0:1,200:4,1000:8"``: steps 0-199 (0-based, the ``global_step`` before the step) accumulate 1 micro-batch per
rank, steps 200-999 accumulate 4, and every step from 1000 on accumulates 8. Steps before the first milestone use
``gradient_accumulation_steps``.

Each optimizer step stays exact for its own window (the denominator is that window's global count). The learning
rate may follow the effective batch: ``lr_scaling="linear"`` multiplies the scheduler's rate by ``GA / base``,
``"sqrt"`` by ``sqrt(GA / base)``, where ``base`` is ``gradient_accumulation_steps`` (the accumulation the learning
rate was tuned for), ``"none"`` leaves it.

Everything that depends on the number of micro-batches per step is derived here, from the schedule and the number
of micro-batches per epoch, without running anything: the optimizer steps of each epoch (an epoch's last window
is short), ``max_steps`` for ``num_train_epochs``, the epochs for ``max_steps``, and where a resumed run stands
(:meth:`AccumulationSchedule.locate`).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .errors import GradAccConfigError

LrScaling = Literal["none", "linear", "sqrt"]
LR_SCALINGS: tuple[str, ...] = get_args(LrScaling)


@dataclass(frozen=True, slots=True)
class AccumulationSchedule:
    """Gradient accumulation steps per optimizer step: ``milestones`` are ``(first_step, accumulation)`` pairs,
    sorted by step; steps before the first milestone take ``base``.

    Example:
        ```python
        schedule = AccumulationSchedule.parse("0:1,200:4,1000:8", base=8)
        assert [schedule.at(s) for s in (0, 199, 200, 999, 1000, 10**6)] == [1, 1, 4, 4, 8, 8]
        assert schedule.lr_factor(0, "linear") == 1 / 8
        ```
    """

    milestones: tuple[tuple[int, int], ...]
    base: int

    @classmethod
    def parse(cls, spec: Any, *, base: int, field: str = "accumulation_schedule") -> AccumulationSchedule:
        """The schedule written as ``"step:ga,step:ga,..."`` or given as ``{step: ga}``; ``base`` is the
        accumulation the learning rate was set for (``gradient_accumulation_steps``).

        Raises :class:`~hf_gradacc.GradAccConfigError` naming ``field`` and the bad entry."""
        if isinstance(spec, AccumulationSchedule):
            return cls(spec.milestones, base)
        if isinstance(spec, Mapping):
            items = list(spec.items())
        elif isinstance(spec, str):
            items = []
            for entry in (e.strip() for e in spec.split(",")):
                step, sep, ga = entry.partition(":")
                if not sep:
                    raise GradAccConfigError(
                        f"`{field}` ({spec!r}): entry {entry!r} is not 'step:accumulation' (for example "
                        "'0:1,200:4,1000:8')"
                    )
                items.append((step.strip(), ga.strip()))
        else:
            raise GradAccConfigError(
                f"`{field}` must be a string like '0:1,200:4,1000:8' or a dict {{step: accumulation}}, got "
                f"{type(spec).__name__}"
            )
        if not items:
            raise GradAccConfigError(f"`{field}` ({spec!r}) has no entry")
        milestones = []
        for step, ga in items:
            step_int, ga_int = _as_int(step), _as_int(ga)
            if step_int is None or step_int < 0:
                raise GradAccConfigError(f"`{field}` ({spec!r}): step {step!r} must be an int >= 0")
            if ga_int is None or ga_int < 1:
                raise GradAccConfigError(
                    f"`{field}` ({spec!r}): accumulation {ga!r} at step {step_int} must be an int >= 1"
                )
            milestones.append((step_int, ga_int))
        steps = [s for s, _ in milestones]
        if steps != sorted(set(steps)):
            raise GradAccConfigError(f"`{field}` ({spec!r}): the steps must be increasing and distinct, got {steps}")
        return cls(tuple(milestones), base)

    def __str__(self) -> str:
        return ",".join(f"{s}:{g}" for s, g in self.milestones)

    def at(self, step: int) -> int:
        """Micro-batches per rank of optimizer step ``step`` (0-based: the ``global_step`` before the step)."""
        k = bisect.bisect_right([s for s, _ in self.milestones], step) - 1
        return self.base if k < 0 else self.milestones[k][1]

    def lr_factor(self, step: int, rule: str) -> float:
        """The factor ``lr_scaling=rule`` puts on the scheduler's learning rate at ``step``: ``GA / base`` (linear),
        its square root (sqrt), or 1 (none)."""
        ratio = self.at(step) / self.base
        if rule == "linear":
            return ratio
        if rule == "sqrt":
            return math.sqrt(ratio)
        return 1.0

    def windows(self, first_step: int, num_batches: int) -> Iterator[int]:
        """Micro-batches per rank of each optimizer step of an epoch of ``num_batches`` micro-batches per rank that
        begins at step ``first_step``, assuming every window becomes one step; the last window is short."""
        step, left = first_step, num_batches
        while left > 0:
            size = min(self.at(step), left)
            yield size
            left -= size
            step += 1

    def steps_per_epoch(self, first_step: int, num_batches: int) -> int:
        """How many optimizer steps an epoch of ``num_batches`` micro-batches holds from step ``first_step``."""
        steps, step, left = 0, first_step, num_batches
        while left > 0:
            ga = self.at(step)
            last = self._segment_end(step)  # steps step .. last-1 all take `ga`
            n = math.ceil(left / ga) if last is None else min(math.ceil(left / ga), last - step)
            left -= n * ga
            steps += n
            step += n
        return steps

    def micro_batches_before(self, step: int) -> int:
        """Micro-batches per rank in optimizer steps ``0 .. step-1`` when no epoch boundary cuts a window."""
        total = 0
        for start, end, ga in self._segments():
            if start >= step:
                break
            total += ((step if end is None else min(end, step)) - start) * ga
        return total

    def plan(self, batches_per_epoch: int, *, num_train_epochs: float | None = None, max_steps: int | None = None):
        """The run's length: ``(max_steps, num_epochs)`` for ``num_train_epochs`` (a fraction of an epoch takes
        that fraction of the epoch's steps, rounded up, as `Trainer` does) or for ``max_steps``."""
        if batches_per_epoch < 1:
            raise GradAccConfigError(f"an epoch must hold at least one micro-batch, got {batches_per_epoch}")
        step, epoch = 0, 0
        if max_steps is not None and max_steps > 0:
            while step < max_steps:
                step += self.steps_per_epoch(step, batches_per_epoch)
                epoch += 1
            return max_steps, epoch
        assert num_train_epochs is not None
        whole, fraction = int(num_train_epochs), num_train_epochs - int(num_train_epochs)
        for _ in range(whole):
            step += self.steps_per_epoch(step, batches_per_epoch)
        epochs = whole
        if fraction > 0:
            step += math.ceil(fraction * self.steps_per_epoch(step, batches_per_epoch))
            epochs += 1
        return step, epochs

    def locate(self, global_step: int, batches_per_epoch: int | None) -> tuple[int, int]:
        """Where a run that took ``global_step`` optimizer steps stands: ``(epochs done, micro-batches done in the
        current epoch)`` (per rank). ``batches_per_epoch=None``: a dataset without a length, one long epoch."""
        if batches_per_epoch is None:
            return 0, self.micro_batches_before(global_step)
        step, epoch = 0, 0
        while True:
            in_epoch = self.steps_per_epoch(step, batches_per_epoch)
            if step + in_epoch > global_step:
                break
            step += in_epoch
            epoch += 1
        done = 0
        for size in self.windows(step, batches_per_epoch):
            if step == global_step:
                break
            done += size
            step += 1
        return epoch, done

    def _segments(self) -> Iterator[tuple[int, int | None, int]]:
        """``(first step, end step or None, accumulation)`` of each constant stretch, from step 0."""
        bounds = list(self.milestones)
        if not bounds or bounds[0][0] > 0:
            bounds.insert(0, (0, self.base))
        for k, (start, ga) in enumerate(bounds):
            yield start, bounds[k + 1][0] if k + 1 < len(bounds) else None, ga

    def _segment_end(self, step: int) -> int | None:
        for start, end, _ in self._segments():
            if start <= step and (end is None or step < end):
                return end
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledRun:
    """The `Trainer` loop's lengths under a schedule (see :func:`scheduled_training_values`)."""

    num_train_epochs: int
    num_update_steps_per_epoch: int  # of the first epoch (informational: epochs differ)
    num_train_samples: int
    steps_in_epoch: int  # micro-batches per rank of one epoch
    max_steps: int


def scheduled_training_values(
    schedule: AccumulationSchedule,
    *,
    batches_per_epoch: int | None,
    num_train_epochs: float,
    max_steps: int,
    samples_per_micro_batch: int,
) -> ScheduledRun:
    """What `Trainer.set_initial_training_values` computes from a fixed ``gradient_accumulation_steps``, computed
    from the schedule instead: ``max_steps`` for ``num_train_epochs`` (or the epochs ``max_steps`` needs), the
    micro-batches of one epoch, the samples of the run.

    ``batches_per_epoch=None`` (a dataset without a length) needs ``max_steps > 0``: one epoch of the micro-batches
    that ``max_steps`` steps take."""
    if batches_per_epoch is None:
        total = schedule.micro_batches_before(max_steps)
        return ScheduledRun(
            num_train_epochs=sys.maxsize,
            num_update_steps_per_epoch=max_steps,
            num_train_samples=total * samples_per_micro_batch,
            steps_in_epoch=total,
            max_steps=max_steps,
        )
    steps, epochs = schedule.plan(
        batches_per_epoch, num_train_epochs=num_train_epochs, max_steps=max_steps if max_steps > 0 else None
    )
    epochs_done, in_epoch = schedule.locate(steps, batches_per_epoch)
    return ScheduledRun(
        num_train_epochs=max(epochs, 1),
        num_update_steps_per_epoch=schedule.steps_per_epoch(0, batches_per_epoch),
        num_train_samples=(epochs_done * batches_per_epoch + in_epoch) * samples_per_micro_batch,
        steps_in_epoch=batches_per_epoch,
        max_steps=steps,
    )


@contextlib.contextmanager
def scaled_learning_rate(param_groups: Sequence[dict[str, Any]], factor: float) -> Iterator[None]:
    """Multiply every group's ``lr`` by ``factor`` for the duration of the block (the optimizer step), then put
    back the value each group held, so that the LR scheduler, the checkpoint and the next step see the
    scheduler's own rate. Nothing happens for ``factor == 1``.

    Example:
        ```python
        with scaled_learning_rate(optimizer.param_groups, 0.5):
            optimizer.step()   # at half the scheduler's rate
        scheduler.step()
        ```
    """
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in param_groups]
    for group, lr in zip(param_groups, saved, strict=True):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(param_groups, saved, strict=True):
            group["lr"] = lr


def check_lr_scaling(rule: Any) -> None:
    """A clear error for an ``lr_scaling`` that is not one of :data:`LR_SCALINGS`."""
    if rule not in LR_SCALINGS:
        raise GradAccConfigError(f"`lr_scaling` ({rule!r}) must be one of {LR_SCALINGS}")


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return int(value)
    return None
