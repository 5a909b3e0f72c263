"""`BatchNormCallback`: what BatchNorm layers do under gradient accumulation, made explicit.

A BatchNorm layer in training normalises each forward pass by the statistics of ITS batch. Under accumulation that is
the micro-batch, so the step over N micro-batches is not the full-batch step the rest of hf_gradacc makes exact, and
the running statistics move once per micro-batch. Three modes (``GradAccArguments.batchnorm``):

- ``per_micro_batch`` (stock): train as the stock Trainer does; a warning, once, says what it costs;
- ``freeze_stats``: BatchNorm layers normalise by their running statistics and never update them during training (an
  affine layer per channel): the accumulated step is exact, whatever the micro-batch size;
- ``precise``: train as stock, then recompute the running statistics over ``num_batches`` training micro-batches
  (equal weight per batch, PyTorch's ``momentum=None`` cumulative average) before each evaluation, each save and the
  end of training ("precise BN", as ``torch.optim.swa_utils.update_bn`` and fvcore's ``update_bn_stats`` do).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from transformers.utils import logging

from ..config import BATCHNORM_MODES, PRECISE_BN_BATCHES
from ..errors import GradAccConfigError
from .callback import GradAccCallback

logger = logging.get_logger(__name__)

# Measured with tests/unit/test_batchnorm.py::test_per_micro_batch_step_is_not_the_full_batch_step (tiny ResNet,
# GA 4, synthetic images, seeds 0-3): relative error of the update against the full-batch update.
MEASURED_CONSEQUENCE = (
    "on hf_gradacc's tiny ResNet at GA 4 the update is 0.76-1.16 (relative) off the full-batch update with "
    "micro-batches of 2, 0.40-0.69 with micro-batches of 8"
)
_LABEL_KEYS = ("labels", "shift_labels")


def batchnorm_layers(model: nn.Module | None) -> list[tuple[str, _BatchNorm]]:
    """Every BatchNorm layer of ``model`` (``BatchNorm1d/2d/3d``, their lazy versions, ``SyncBatchNorm``) by name."""
    if model is None:
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, _BatchNorm)]


class BatchNormCallback(GradAccCallback):
    """BatchNorm under gradient accumulation: warn once what it costs, freeze the statistics, or recompute them.

    GradAccTrainer adds one by itself (from ``GradAccArguments.batchnorm`` / ``precise_bn_batches``) when the model
    has a BatchNorm layer or the knob is not the default; pass one in ``callbacks=[...]`` to choose it yourself (the
    trainer then adds none). ``per_micro_batch`` and ``freeze_stats`` work with any `Trainer`; ``precise`` needs a
    GradAccTrainer (it reads the training set through it).

    Args:
        mode: ``"per_micro_batch"`` (stock behaviour, with the warning), ``"freeze_stats"`` (exact step; running
            statistics fixed) or ``"precise"`` (running statistics recomputed before each evaluation and save).
        num_batches: ``precise``: training micro-batches per process whose statistics are averaged (equal weight
            per batch; on several processes the averages are averaged over processes).

    Example:
        ```python
        from hf_gradacc import GradAccConfig, GradAccTrainer

        args = GradAccConfig(output_dir="out", gradient_accumulation_steps=4, batchnorm="freeze_stats")
        trainer = GradAccTrainer(model=resnet, args=args, train_dataset=images, data_collator=collator)
        trainer.train()   # the BatchNorm running statistics are those of the initial model
        ```
    """

    def __init__(self, mode: str = "per_micro_batch", num_batches: int = PRECISE_BN_BATCHES) -> None:
        if mode not in BATCHNORM_MODES:
            raise GradAccConfigError(f"`mode` ({mode!r}) must be one of {BATCHNORM_MODES}")
        if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 1:
            raise GradAccConfigError(f"`num_batches` ({num_batches!r}) must be an int >= 1")
        self.mode = mode
        self.num_batches = num_batches
        self.num_recomputed = 0  # precise: how many times the running statistics were recomputed
        self._warned = False
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        layers = batchnorm_layers(model)
        if not layers:
            if self.mode != "per_micro_batch":
                logger.warning_once(f"`batchnorm={self.mode!r}` is ignored: the model has no BatchNorm layer.")
            return
        if args.gradient_accumulation_steps > 1 and self.mode != "freeze_stats" and not self._warned:
            self._warned = True
            names = ", ".join(name for name, _ in layers[:3]) + (", ..." if len(layers) > 3 else "")
            logger.warning(
                f"{len(layers)} BatchNorm layer(s) ({names}) train with gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps}: each micro-batch is normalised by its OWN statistics (and moves "
                "the running statistics once per micro-batch), so the optimizer step is not the full-batch step: "
                f"{MEASURED_CONSEQUENCE}. Set `batchnorm='freeze_stats'` for an exact step (normalise by the running "
                "statistics, keep them fixed)"
                + (
                    "."
                    if self.mode == "precise"
                    else ", or `batchnorm='precise'` to recompute the running statistics before evaluation and saving."
                )
            )
        if self.mode == "freeze_stats" and not self._hooks:
            # The Trainer calls model.train() before every micro-batch: put the layers back in eval mode each forward.
            self._hooks = [module.register_forward_pre_hook(_eval_mode) for _, module in layers]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.mode == "precise" and (control.should_evaluate or control.should_save):
            self.recompute(model, state)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if self.mode == "precise" and (control.should_evaluate or control.should_save):
            self.recompute(model, state)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.mode == "precise":
            self.recompute(model, state)

    # ------------------------------------------------------------------ precise statistics
    def recompute(self, model: nn.Module, state: Any) -> None:
        """Reset the running statistics of every BatchNorm layer of ``model`` and recompute them over
        :meth:`precise_batches` (on every process: under several processes the result is averaged over them)."""
        trainer = self._require_trainer()
        if not [m for _, m in batchnorm_layers(model) if m.track_running_stats]:
            return
        num_batches = update_running_stats(model, self.precise_batches(state), prepare=trainer.train_data.prepare)
        backend = getattr(trainer, "backend", None)
        if backend is not None and backend.mesh.dp_world_size > 1:
            average_running_stats(model, backend.all_gather)
        self.num_recomputed += 1
        logger.info(f"precise BatchNorm: running statistics recomputed over {num_batches} training batch(es)")

    def precise_batches(self, state: Any) -> Iterator[Any]:
        """The training micro-batches whose statistics become the running statistics: up to ``num_batches`` batches
        of ``per_device_train_batch_size`` rows drawn from the training set with a generator of their own (seeded by
        ``args.seed``, the process index and the step: the training order and the global RNG are untouched)."""
        trainer = self._require_trainer()
        args = trainer.args
        # the Trainer's own column handling, as for the training dataloader
        dataset, collator = trainer.train_data.without_unused_columns("precise BatchNorm")
        sampler = None
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            seed = int(args.seed) + 7919 * int(args.process_index) + int(state.global_step)
            sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=args.per_device_train_batch_size, sampler=sampler, collate_fn=collator
        )
        for index, batch in enumerate(loader):
            if index >= self.num_batches:
                return
            yield batch


def update_running_stats(
    model: nn.Module, batches: Iterable[Any], *, prepare: Any = None, layers: Sequence[_BatchNorm] | None = None
) -> int:
    """Precise BatchNorm: reset the running statistics of ``layers`` (default: every BatchNorm layer of ``model``),
    forward ``batches`` in training mode without gradient with ``momentum=None`` (cumulative average: every batch
    weighs the same), restore each layer's momentum and the model's mode. Returns the number of batches.

    ``running_mean`` becomes the mean over batches of each batch's per-channel mean, ``running_var`` the mean of each
    batch's unbiased per-channel variance. ``prepare`` moves a batch to the model's device (default: as is); labels
    are dropped before the forward pass.

    Example:
        ```python
        from hf_gradacc.callbacks.batchnorm import update_running_stats
        update_running_stats(model, (collate(samples[i : i + 8]) for i in range(0, 64, 8)))
        ```
    """
    layers = [
        m for m in (layers if layers is not None else [m for _, m in batchnorm_layers(model)]) if m.track_running_stats
    ]
    if not layers:
        return 0
    momenta = [m.momentum for m in layers]
    was_training = model.training
    for module in layers:
        module.reset_running_stats()
        module.momentum = None
    num_batches = 0
    try:
        model.train()
        with torch.no_grad():
            for batch in batches:
                inputs = prepare(batch) if prepare is not None else batch
                model(**{k: v for k, v in inputs.items() if k not in _LABEL_KEYS})
                num_batches += 1
    finally:
        for module, momentum in zip(layers, momenta):
            module.momentum = momentum
        model.train(was_training)
    return num_batches


def average_running_stats(model: nn.Module, all_gather: Any) -> None:
    """Average every BatchNorm layer's running statistics over the data-parallel processes (one collective)."""
    layers = [m for _, m in batchnorm_layers(model) if m.track_running_stats]
    if not layers:
        return
    local = torch.cat([torch.cat([m.running_mean.float(), m.running_var.float()]) for m in layers])
    mean = all_gather(local).reshape(-1, local.numel()).mean(dim=0)
    offset = 0
    for module in layers:
        for buffer in (module.running_mean, module.running_var):
            buffer.copy_(mean[offset : offset + buffer.numel()].to(buffer.dtype))
            offset += buffer.numel()


def batchnorm_callback_for(
    model: nn.Module | None, settings: Any, callbacks: Sequence[Any]
) -> BatchNormCallback | None:
    """The :class:`BatchNormCallback` a GradAcc trainer adds from its settings: one when the model has a BatchNorm
    layer or ``settings.batchnorm`` is not the default, none when the user passed one (a warning when its mode
    differs from a non-default knob)."""
    given = [cb for cb in callbacks if isinstance(cb, BatchNormCallback)]
    if given:
        if settings.batchnorm != "per_micro_batch" and given[0].mode != settings.batchnorm:
            logger.warning_once(
                f"`batchnorm={settings.batchnorm!r}` is ignored: the BatchNormCallback passed to the trainer has mode "
                f"{given[0].mode!r}. Set the mode in one place."
            )
        return None
    if settings.batchnorm == "per_micro_batch" and not batchnorm_layers(model):
        return None
    return BatchNormCallback(settings.batchnorm, num_batches=settings.precise_bn_batches)


def _eval_mode(module: nn.Module, args: Any) -> None:
    module.train(False)
