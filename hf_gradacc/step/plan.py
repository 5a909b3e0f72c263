"""The run's length and where it starts: optimizer steps counted as windows, under an accumulation schedule, and
from a resumed checkpoint's recorded position when the stock skip would land elsewhere.

:class:`RunPlan` is the step's owner's record of the run (:class:`~hf_gradacc.step.engine.StepEngine` ``.plan``):
micro-batches per epoch, the checkpoint position a resume starts from, and where the data stands after each step
(recorded by every checkpoint). `GradAccMixin` asks it from `Trainer.set_initial_training_values`
(:meth:`RunPlan.training_values`) and `Trainer._init_training_state` (:meth:`RunPlan.resumed_start`), handing it the
values it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers.trainer_utils import has_length
from transformers.utils import logging

from ..checkpoints import DataPosition, ResumePoint, stock_position
from ..data.loader import adjust_training_values, find_regroup_sampler, skip_first_samples
from ..errors import GradAccConfigError
from ..schedule import scheduled_training_values

logger = logging.get_logger(__name__)


@dataclass
class RunPlan:
    """The run's length and its place in the data.

    Attributes:
        batches_per_epoch: micro-batches per rank of an epoch (None: the dataloader has no length).
        resume_point: where the checkpoint being resumed stands in the data, when its layout differs from this run's
            (found by :func:`~hf_gradacc.checkpoints.resolve_resume` when ``train()`` starts).
        resume_at: ``resume_point``, once the run's layout shows that the stock skip lands elsewhere (None: the stock
            resume is right, bit for bit).
        data_position: where the data stands after the last optimizer step (recorded by every checkpoint).
    """

    batches_per_epoch: int | None = None
    resume_point: ResumePoint | None = None
    resume_at: ResumePoint | None = None
    data_position: DataPosition | None = None

    def training_values(
        self,
        args: Any,
        dataloader: Any,
        values: tuple,
        *,
        settings: Any,
        backend: Any,
        samples_per_micro_batch: int,
        num_train_samples: int | None,
    ) -> tuple:
        """`Trainer.set_initial_training_values`'s ``values`` (epochs, steps per epoch, examples, samples, total
        batch, batches per epoch, max steps): steps counted as windows when a token budget gives windows more than
        ``gradient_accumulation_steps`` micro-batches (agreed across ranks), the schedule's lengths, and the rest of a
        resumed epoch (:meth:`resume_values`). ``samples_per_micro_batch``: the micro-batch's rows times the data
        ranks."""
        gather = partial(_gather_on, backend, args.device) if backend.mesh.dp_world_size > 1 else None
        values = adjust_training_values(dataloader, args, values, gather)
        schedule = settings.accumulation_schedule
        self.batches_per_epoch = values[5] if has_length(dataloader) else None
        if schedule is not None:
            run = scheduled_training_values(
                schedule,
                batches_per_epoch=self.batches_per_epoch,
                num_train_epochs=args.num_train_epochs,
                max_steps=args.max_steps,
                samples_per_micro_batch=values[4] // args.gradient_accumulation_steps,
            )
            logger.info(
                f"  Accumulation schedule = {schedule} (lr_scaling={settings.lr_scaling!r}), {run.max_steps} steps"
            )
            values = (
                run.num_train_epochs,
                run.num_update_steps_per_epoch,
                values[2],
                run.num_train_samples,
                values[4],
                run.steps_in_epoch,
                run.max_steps,
            )
        return self.resume_values(
            args,
            dataloader,
            values,
            schedule=schedule,
            samples_per_micro_batch=samples_per_micro_batch,
            num_train_samples=num_train_samples,
        )

    def resume_values(
        self,
        args: Any,
        dataloader: Any,
        values: tuple,
        *,
        schedule: Any,
        samples_per_micro_batch: int,
        num_train_samples: int | None,
    ) -> tuple:
        """A resume whose checkpoint position (in samples) is not where the stock skip lands (another batch size,
        GA, schedule or world size): the next epoch of ``dataloader`` leaves out the samples the checkpoint trained,
        and the run's length counts the rest of that epoch in this run's layout (the scheduler is built on it)."""
        point = self.resume_point
        self.resume_at = None
        if point is None or self.batches_per_epoch is None:
            return values
        num_train_epochs, steps_per_epoch, num_examples, num_train_samples_, total_batch, batches, max_steps = values
        epoch, done = stock_position(
            point.global_step,
            num_update_steps_per_epoch=steps_per_epoch,
            batches_per_epoch=batches,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            schedule=schedule,
        )
        stock_samples = min(done * samples_per_micro_batch, num_train_samples or 0)
        if not point.changed and (epoch, stock_samples) == (point.epoch, point.num_samples):
            return values  # the stock skip lands on the recorded position: resumed as before, bit for bit
        if not args.ignore_data_skip and not skip_first_samples(dataloader, point.num_samples, point.epoch):
            raise GradAccConfigError(
                f"Resuming at sample {point.num_samples} of epoch {point.epoch} ({', '.join(point.changed)}) needs "
                "the "
                f"training dataloader's index sampler, and {type(dataloader).__name__} has none under a BatchSampler. "
                "Resume with the checkpoint's layout, or set `resume_data_mismatch='accept'`."
            )
        self.resume_at = point
        remaining = len(dataloader) if not args.ignore_data_skip else batches  # micro-batches per rank left
        regrouped = find_regroup_sampler(dataloader)

        def steps_of(first_step: int, num_batches: int) -> int:
            if schedule is not None:
                return schedule.steps_per_epoch(first_step, num_batches)
            return math.ceil(num_batches / args.gradient_accumulation_steps)

        left = regrouped.num_windows if regrouped is not None else steps_of(point.global_step, remaining)
        step, epoch = point.global_step + left, point.epoch + 1
        if args.max_steps > 0:  # the steps asked for; as many epochs as they take
            while step < args.max_steps:
                step, epoch = step + steps_of(step, batches), epoch + 1
            return (epoch, steps_per_epoch, num_examples, num_train_samples_, total_batch, batches, max_steps)
        while epoch < args.num_train_epochs:  # the epochs asked for; a fraction of one takes that part of its steps
            in_epoch = steps_of(step, batches)
            step += (
                in_epoch
                if args.num_train_epochs - epoch >= 1
                else math.ceil((args.num_train_epochs - epoch) * in_epoch)
            )
            epoch += 1
        return (num_train_epochs, steps_per_epoch, num_examples, num_train_samples_, total_batch, batches, step)

    def resumed_start(
        self,
        args: Any,
        global_step: int,
        epochs_trained: int,
        steps_trained: int,
        *,
        max_steps: int,
        num_train_epochs: int,
        resume_from_checkpoint: Any,
        schedule: Any,
    ) -> tuple[int, int]:
        """The epoch a resumed run starts in and the micro-batches it skips there: from the schedule (windows differ
        in size), or from the checkpoint's recorded position (not ``global_step`` over THIS run's steps per epoch,
        which is wrong after a change of layout), with one warning saying what changed and where training
        continues. A checkpoint at or past the run's last step (``max_steps``) takes no step:
        ``num_train_epochs``, with a warning (the stock Trainer runs one more step when ``max_steps`` was lowered
        below the checkpoint's step)."""
        step = global_step
        if resume_from_checkpoint is not None and step > 0 and step >= max_steps:
            length = (
                f"`max_steps` ({args.max_steps})"
                if args.max_steps > 0
                else f"the run's length ({max_steps} steps from `num_train_epochs`={args.num_train_epochs})"
            )
            logger.warning(
                f"Resuming {resume_from_checkpoint!r}: {length} is not above the checkpoint's step ({step}), so no "
                f"optimizer step is taken and the run ends at once, with the checkpoint's weights. Raise `max_steps` "
                f"above {step} to train on."
            )
            return num_train_epochs, 0  # no epoch left to run
        if schedule is not None and step > 0:
            epochs_trained, done = schedule.locate(step, self.batches_per_epoch)
            steps_trained = 0 if args.ignore_data_skip else done
        point = self.resume_at
        if point is None or resume_from_checkpoint is None:
            return epochs_trained, steps_trained
        skipped = (
            "no sample is skipped (`ignore_data_skip=True`)"
            if args.ignore_data_skip
            else (
                f"training continues from sample {point.num_samples} of epoch {point.epoch}'s order, in this run's "
                "layout, every remaining sample once"
            )
        )
        by_max_steps = (
            f", as `max_steps` ({args.max_steps}) sets: the run's length is counted in steps of this run's layout"
            if args.max_steps > 0
            else ""
        )
        change = (
            f"with another data layout ({', '.join(point.changed)})"
            if point.changed
            else "at the position its record gives (an earlier resume changed the layout)"
        )
        logger.warning(
            f"Resuming {resume_from_checkpoint!r} {change}: the checkpoint (step "
            f"{point.global_step}) had trained the first {point.num_samples} samples of epoch {point.epoch}; "
            f"{skipped}; {max_steps} optimizer steps in all ({max_steps - point.global_step} more){by_max_steps}."
        )
        return point.epoch, 0


def realign_learning_rate(lr_scheduler: Any, optimizer: Any) -> None:
    """After a resume with another layout: the checkpoint's optimizer holds the rate the OLD schedule set for the
    next step (its length counted in the old layout), and the scheduler only recomputes it after that step. Set the
    rate of THIS run's schedule at the scheduler's step before the first resumed step, so that every step of the run
    follows one schedule. A scheduler other than a `LambdaLR` (transformers' schedules are) is left alone, with a
    warning."""
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper
    if scheduler is None or optimizer is None:
        return
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        logger.warning(
            f"Resuming with another data layout: the first resumed step keeps the learning rate the checkpoint's "
            f"{type(scheduler).__name__} set (from the old run's length); this run's schedule takes over after it."
        )
        return
    rates = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler.load_state_dict({**scheduler.state_dict(), "_last_lr": rates})  # what get_last_lr() reports


def _gather_on(backend: Any, device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return backend.all_gather(tensor.to(device)).cpu()
