"""The run's length and where it starts: optimizer steps counted as windows, under an accumulation schedule, and
from a resumed checkpoint's recorded position when the stock skip would land elsewhere; a resumed run starts from
every weight its checkpoint holds (:func:`restore_weights`).

`GradAccMixin` calls :func:`training_values` from `Trainer.set_initial_training_values` and :func:`resumed_start`
from `Trainer._init_training_state`; both read and set the trainer's run state (``_batches_per_epoch``,
``_resume_point`` found by :func:`~hf_gradacc.checkpoints.resolve_resume`, ``_resume_at``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from transformers.trainer_utils import has_length
from transformers.utils import logging

from .backends.sharded_model import distributed_config_of
from .checkpoints import _gathered, data_parallel_size, stock_position
from .data.loader import adjust_training_values, find_regroup_sampler, skip_first_samples
from .errors import GradAccConfigError
from .schedule import scheduled_training_values

logger = logging.get_logger(__name__)


def training_values(trainer: Any, args: Any, dataloader: Any, values: tuple) -> tuple:
    """`Trainer.set_initial_training_values`'s ``values`` (epochs, steps per epoch, examples, samples, total batch,
    batches per epoch, max steps) for ``trainer``: steps counted as windows when a token budget gives windows more
    than ``gradient_accumulation_steps`` micro-batches (agreed across ranks), the schedule's lengths, and the rest
    of a resumed epoch (:func:`resume_values`)."""
    world = trainer.backend.dp_world_size
    gather = partial(_gather_on, trainer.backend, args.device) if world > 1 else None
    values = adjust_training_values(dataloader, args, values, gather)
    schedule = trainer.gradacc.accumulation_schedule
    trainer._batches_per_epoch = values[5] if has_length(dataloader) else None
    if schedule is not None:
        run = scheduled_training_values(
            schedule, batches_per_epoch=trainer._batches_per_epoch, num_train_epochs=args.num_train_epochs,
            max_steps=args.max_steps, samples_per_micro_batch=values[4] // args.gradient_accumulation_steps,
        )  # fmt: skip
        logger.info(f"  Accumulation schedule = {schedule} (lr_scaling={trainer.gradacc.lr_scaling!r}), {run.max_steps} steps")
        values = (run.num_train_epochs, run.num_update_steps_per_epoch, values[2], run.num_train_samples, values[4],
                  run.steps_in_epoch, run.max_steps)  # fmt: skip
    return resume_values(trainer, args, dataloader, values)


def resume_values(trainer: Any, args: Any, dataloader: Any, values: tuple) -> tuple:
    """A resume whose checkpoint position (in samples) is not where the stock skip lands (another batch size, GA,
    schedule or world size): the next epoch of ``dataloader`` leaves out the samples the checkpoint trained, and
    the run's length counts the rest of that epoch in this run's layout (the scheduler is built on it)."""
    point = getattr(trainer, "_resume_point", None)
    trainer._resume_at = None
    if point is None or trainer._batches_per_epoch is None:
        return values
    num_train_epochs, steps_per_epoch, num_examples, num_train_samples, total_batch, batches, max_steps = values
    schedule = trainer.gradacc.accumulation_schedule
    epoch, done = stock_position(
        point.global_step, num_update_steps_per_epoch=steps_per_epoch, batches_per_epoch=batches,
        gradient_accumulation_steps=args.gradient_accumulation_steps, schedule=schedule,
    )  # fmt: skip
    stock_samples = min(done * trainer._train_batch_size * data_parallel_size(trainer), len(trainer.train_dataset))
    if not point.changed and (epoch, stock_samples) == (point.epoch, point.num_samples):
        return values  # the stock skip lands on the recorded position: resumed as before, bit for bit
    if not args.ignore_data_skip and not skip_first_samples(dataloader, point.num_samples, point.epoch):
        raise GradAccConfigError(
            f"Resuming at sample {point.num_samples} of epoch {point.epoch} ({', '.join(point.changed)}) needs the "
            f"training dataloader's index sampler, and {type(dataloader).__name__} has none under a BatchSampler. "
            "Resume with the checkpoint's layout, or set `resume_data_mismatch='accept'`."
        )
    trainer._resume_at = point
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
        return (epoch, steps_per_epoch, num_examples, num_train_samples, total_batch, batches, max_steps)
    while epoch < args.num_train_epochs:  # the epochs asked for; a fraction of one takes that part of its steps
        in_epoch = steps_of(step, batches)
        step += in_epoch if args.num_train_epochs - epoch >= 1 else math.ceil((args.num_train_epochs - epoch) * in_epoch)
        epoch += 1
    return (num_train_epochs, steps_per_epoch, num_examples, num_train_samples, total_batch, batches, step)


def resumed_start(
    trainer: Any,
    epochs_trained: int,
    steps_trained: int,
    max_steps: int,
    num_train_epochs: int,
    resume_from_checkpoint: Any,
) -> tuple[int, int]:
    """The epoch a resumed run starts in and the micro-batches it skips there: from the schedule (windows differ in
    size), or from the checkpoint's recorded position (not `global_step` over THIS run's steps per epoch, which is
    wrong after a change of layout), with one warning saying what changed and where training continues. A checkpoint
    at or past the run's last step (``max_steps``) takes no step: ``num_train_epochs``, with a warning (the stock
    Trainer runs one more step when ``max_steps`` was lowered below the checkpoint's step)."""
    if resume_from_checkpoint is not None:
        restore_weights(trainer, resume_from_checkpoint)  # after the Trainer's own load, before the first step
    step = trainer.state.global_step
    if resume_from_checkpoint is not None and step > 0 and step >= max_steps:
        length = (f"`max_steps` ({trainer.args.max_steps})" if trainer.args.max_steps > 0 else
                  f"the run's length ({max_steps} steps from `num_train_epochs`={trainer.args.num_train_epochs})")  # fmt: skip
        logger.warning(
            f"Resuming {resume_from_checkpoint!r}: {length} is not above the checkpoint's step ({step}), so no "
            f"optimizer step is taken and the run ends at once, with the checkpoint's weights. Raise `max_steps` above "
            f"{step} to train on."
        )
        return num_train_epochs, 0  # no epoch left to run
    schedule = trainer.gradacc.accumulation_schedule
    if schedule is not None and trainer.state.global_step > 0:
        epochs_trained, done = schedule.locate(trainer.state.global_step, trainer._batches_per_epoch)
        steps_trained = 0 if trainer.args.ignore_data_skip else done
    point = trainer._resume_at
    if point is None or resume_from_checkpoint is None:
        return epochs_trained, steps_trained
    skipped = "no sample is skipped (`ignore_data_skip=True`)" if trainer.args.ignore_data_skip else (
        f"training continues from sample {point.num_samples} of epoch {point.epoch}'s order, in this run's "
        "layout, every remaining sample once"
    )  # fmt: skip
    by_max_steps = (
        f", as `max_steps` ({trainer.args.max_steps}) sets: the run's length is counted in steps of this run's layout"
        if trainer.args.max_steps > 0 else ""
    )  # fmt: skip
    change = (f"with another data layout ({', '.join(point.changed)})" if point.changed else
              "at the position its record gives (an earlier resume changed the layout)")  # fmt: skip
    logger.warning(
        f"Resuming {resume_from_checkpoint!r} {change}: the checkpoint (step "
        f"{point.global_step}) had trained the first {point.num_samples} samples of epoch {point.epoch}; "
        f"{skipped}; {max_steps} optimizer steps in all ({max_steps - point.global_step} more){by_max_steps}."
    )
    return point.epoch, 0


def realign_learning_rate(trainer: Any) -> None:
    """After a resume with another layout: the checkpoint's optimizer holds the rate the OLD schedule set for the
    next step (its length counted in the old layout), and the scheduler only recomputes it after that step. Set the
    rate of THIS run's schedule at ``global_step`` before the first resumed step, so that every step of the run
    follows one schedule. A scheduler other than a `LambdaLR` (transformers' schedules are) is left alone, with a
    warning."""
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)  # accelerate's wrapper
    if scheduler is None or trainer.optimizer is None:
        return
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        logger.warning(
            f"Resuming with another data layout: the first resumed step keeps the learning rate the checkpoint's "
            f"{type(scheduler).__name__} set (from the old run's length); this run's schedule takes over after it."
        )
        return
    rates = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(trainer.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler.load_state_dict({**scheduler.state_dict(), "_last_lr": rates})  # what get_last_lr() reports


def _gather_on(backend: Any, device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return backend.all_gather(tensor.to(device)).cpu()


# ---------------------------------------------------------------------------------------------- the resumed weights
# What `Trainer._load_from_checkpoint` reads as the model's weights, in its order of preference.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_NAMES_SHOWN = 6


def restore_weights(trainer: Any, folder: str) -> None:
    """After `Trainer._load_from_checkpoint`: every tensor of the checkpoint's model weights is in ``trainer.model``.

    The Trainer loads ``model.safetensors`` with ``load_state_dict``, by name, and only logs the names that do not
    match. transformers 5 saves some models in another layout than they train in: a mixture-of-experts model's
    experts train as one tensor per layer (``mlp.experts.gate_up_proj``) and are saved one per expert, Mixtral's under
    another module name too (``block_sparse_moe.experts.0.w1.weight``); resumed, the router and experts kept the values
    they had before the resume. Here the tensors the load by name missed are converted as `from_pretrained` converts
    them (transformers' conversion mapping of the model) and copied into the model's own. A tensor of the model that
    the checkpoint still does not restore, or a saved one that no tensor of the model takes, is a
    :class:`~hf_gradacc.GradAccConfigError` on every rank, naming them, the transformers version and the way out.

    Not checked: FSDP and DeepSpeed checkpoints (their own state dicts, in the model's names), adapters, a model
    sharded at load time (its checkpoints cannot be resumed; see docs/backends.md).

    Example:
        ```python
        restore_weights(trainer, "out/checkpoint-500")   # called by GradAccTrainer on every resume
        ```
    """
    model = trainer.model
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled or distributed_config_of(model) is not None:
        return
    saved = _saved_weights(folder)
    problem = None if saved is None else _restore(model, saved, folder)
    problems = [(rank, p) for rank, p in enumerate(_gathered(problem)) if p is not None]  # every rank raises alike
    if problems:
        rank, message = problems[0]
        raise GradAccConfigError(message + (f" (found by rank {rank}'s load)" if rank else ""))


def _saved_weights(folder: str) -> dict[str, Callable[[], torch.Tensor]] | None:
    """The checkpoint's model tensors by saved name, each read when called, from the file(s) the Trainer loads;
    None without full model weights (an adapter checkpoint)."""
    path = next((p for n in _WEIGHT_FILES if os.path.isfile(p := os.path.join(folder, n))), None)
    if path is None:
        return None
    if not path.endswith(".index.json"):
        return _readers(path)
    with open(path) as f:
        files = set(json.load(f)["weight_map"].values())
    return {key: read for file in sorted(files) for key, read in _readers(os.path.join(folder, file)).items()}


def _readers(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        handle = safe_open(path, framework="pt", device="cpu")
        return {key: partial(handle.get_tensor, key) for key in handle.keys()}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {key: partial(state.__getitem__, key) for key in state}


def _restore(model: torch.nn.Module, saved: dict[str, Callable[[], torch.Tensor]], folder: str) -> str | None:
    """Restore what the Trainer's load by name left out; why the checkpoint does not restore the model, or None."""
    import transformers

    state = model.state_dict()
    others = {key: read for key, read in saved.items() if key not in state}  # the load by name restored the rest
    restored, untaken, failure = {key for key in saved if key in state}, [], ""
    if others:
        try:
            converted = _convert_into(model, state, others, untaken)
        except (ImportError, AttributeError, TypeError, ValueError, KeyError, RuntimeError) as error:
            converted, untaken = set(), list(others)
            failure = f" (converting them failed: {type(error).__name__}: {error})"
        restored |= converted
    missing = _not_restored(model, state, restored)
    name = type(model).__name__
    if not missing and not untaken:
        if others:
            logger.warning(
                f"Resuming {folder!r}: the Trainer loads the checkpoint's weights by name and left {len(converted)} "
                f"tensors of {name} at their values before the resume ({_names(sorted(converted))}; its 'missing "
                f"keys' warning): transformers {transformers.__version__} saves {name} in another layout than it "
                "trains in. hf_gradacc restored them through transformers' conversion mapping, as `from_pretrained` "
                "converts them; every tensor of the checkpoint is restored."
            )
        return None
    saved_by = _saved_version(folder)
    return (
        f"`resume_from_checkpoint` ({folder!r}): the checkpoint's weights do not restore {name}: "
        + (f"{len(missing)} of its tensors are not in it ({_names(missing)})" if missing else "")
        + ("; " if missing and untaken else "")
        + (f"{len(untaken)} saved tensors go to no tensor of the model ({_names(untaken)})" if untaken else "")
        + f"{failure}. The Trainer of transformers {transformers.__version__} (the checkpoint was saved by {saved_by}) "
        "loads the weights by name, and the conversion mapping `from_pretrained` converts saved names with does not "
        "turn these into the model's; resumed, the tensors left out would train on from the values they had before "
        f"the resume, silently. Resume with a transformers version whose conversion mapping covers "
        f"{getattr(model.config, 'model_type', name)!r} (the one that saved the checkpoint, if another), or start a new "
        f"run from its weights, `{name}.from_pretrained({folder!r})`, without `resume_from_checkpoint` (the "
        "optimizer's moments and the schedule then start afresh)."
    )


def _convert_into(
    model: torch.nn.Module, state: dict[str, torch.Tensor], saved: dict[str, Callable[[], torch.Tensor]], untaken: list
) -> set[str]:
    """Convert the saved tensors ``saved`` to the model's names and layout as `from_pretrained` does (the model's
    conversion mapping: renamings, each layer's experts stacked in index order) and copy each into the model's tensor
    of that name; return the names restored. Saved names no tensor of the model takes go to ``untaken``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, Any] = {}
    for key in sorted(saved, key=dot_natural_key):  # the order from_pretrained stacks the experts in
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if target not in state:
            untaken.append(key)
            continue
        transform = groups.setdefault(
            target, copy.deepcopy(by_pattern[pattern]) if pattern is not None else WeightRenaming(key, target)
        )
        transform.add_tensor(target, key, key if pattern is None else pattern, saved[key])
    restored = set()
    with torch.no_grad():
        for first, transform in groups.items():
            for target, value in transform.convert(first, model=model, config=model.config).items():
                value = value[0] if isinstance(value, list) else value
                if target not in state or state[target].shape != value.shape:
                    untaken.append(target)
                    continue
                state[target].copy_(value)
                restored.add(target)
    return restored


def _not_restored(model: torch.nn.Module, state: dict[str, torch.Tensor], restored: set[str]) -> list[str]:
    """The model's tensors not restored: neither sharing memory with a restored one (tied weights are saved once)
    nor left out of every save (``_keys_to_ignore_on_save``)."""

    def place(tensor: torch.Tensor) -> tuple:
        return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)

    covered = {place(state[name]) for name in restored}
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return [n for n, t in state.items() if n not in restored and n not in ignored and place(t) not in covered]


def _saved_version(folder: str) -> str:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return f"transformers {json.load(f)['transformers_version']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown transformers version"


def _names(names: list[str]) -> str:
    return ", ".join(names[:_NAMES_SHOWN]) + (f", ... ({len(names) - _NAMES_SHOWN} more)" if len(names) > _NAMES_SHOWN else "")
