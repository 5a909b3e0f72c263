"""`GradientNoiseScaleCallback`: the simple gradient noise scale, from gradients the accumulation already produces.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A: with the squared norms of mean
gradients over two batch sizes ``b < B``,

    |G|^2  ~  (B |G_B|^2 - b |G_b|^2) / (B - b)          tr(S)  ~  (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

are unbiased estimates of the true gradient's squared norm and of the trace of the per-item gradient covariance,
and ``B_simple = tr(S) / |G|^2`` is the batch size (in loss items: samples or tokens) past which a bigger batch stops
buying a proportionally bigger step. Here ``G_B`` is the optimizer step's reduced gradient and ``G_b`` the gradient
after the step's FIRST micro-batch, both of which the accumulation computes anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..errors import GradAccConfigError, UnsupportedBackendError
from .callback import GradAccCallback

logger = logging.get_logger(__name__)

DENOMINATORS = ("tokens", "samples", "input_tokens")


def noise_scale_estimates(
    small_sq_norm: float, small_batch: int, big_sq_norm: float, big_batch: int
) -> tuple[float, float]:
    """The unbiased estimates ``(|G|^2, tr(S))`` from the squared norms of two MEAN gradients over ``small_batch``
    and ``big_batch`` items (McCandlish et al. 2018, appendix A).

    Example:
        ```python
        grad_sq, trace = noise_scale_estimates(small_sq_norm=5.0, small_batch=4, big_sq_norm=2.0, big_batch=16)
        noise_scale = trace / grad_sq   # 16.0 items
        ```
    """
    if not 0 < small_batch < big_batch:
        raise GradAccConfigError(
            f"the noise scale needs 0 < small_batch < big_batch, got small_batch={small_batch}, big_batch={big_batch}"
        )
    grad_sq = (big_batch * big_sq_norm - small_batch * small_sq_norm) / (big_batch - small_batch)
    trace = (small_sq_norm - big_sq_norm) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sq, trace


@dataclass
class _Ema:
    """Exponential moving average with Adam's bias correction (the mean of the values seen so far at first)."""

    decay: float
    total: float = 0.0
    weight: float = 0.0

    def update(self, value: float) -> None:
        self.total = self.decay * self.total + (1.0 - self.decay) * value
        self.weight = self.decay * self.weight + (1.0 - self.decay)

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight > 0 else math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class NoiseScaleStep:
    """One optimizer step's measurement (``GradientNoiseScaleCallback(keep_history=True).history``).

    Attributes:
        step: the optimizer step (1-based, as logged).
        small_sq_norm: ``|G_b|^2``, the squared norm of the MEAN gradient over the first micro-batch (this rank's,
            or every rank's when the backend reduces each micro-batch).
        small_batch: ``b``, its items.
        reduced: whether the small batch is every rank's first micro-batch (a backend that reduces each micro-batch)
            rather than this rank's.
        big_sq_norm: ``|G_B|^2``, the squared norm of the step's reduced (mean) gradient.
        big_batch: ``B``, the step's items over every rank.
        grad_sq: the step's ``|G|^2`` estimate (averaged over ranks when the small batch is per rank).
        trace: the step's ``tr(S)`` estimate (idem).
    """

    step: int
    small_sq_norm: float
    small_batch: int
    reduced: bool
    big_sq_norm: float
    big_batch: int
    grad_sq: float
    trace: float


@dataclass(frozen=True, slots=True)
class _SmallBatch:
    sq_norm: float  # of the mean gradient, loss scale not yet removed
    num_items: int
    reduced: bool


class GradientNoiseScaleCallback(GradAccCallback):
    """Log the simple gradient noise scale ``gns`` = tr(S) / |G|^2 (McCandlish et al. 2018) of every optimizer step,
    smoothed, with no extra forward or backward pass and no gradient copy.

    Per optimizer step it reads two squared gradient norms: after the step's first micro-batch (``on_substep_end``:
    the small batch ``b``, this rank's first micro-batch, or every rank's when the backend reduces each micro-batch)
    and of the step's reduced gradient (``on_accumulated_grads``: the big batch ``B``, the step's global count of the
    loss's denominator). The accumulated gradient is rescaled into MEAN gradients (the loss is normalised by the
    step's count, not the micro-batch's), the paper's unbiased estimates of ``|G|^2`` and ``tr(S)`` are averaged over
    ranks where each rank has its own small batch, smoothed separately with a bias-corrected exponential moving
    average, and divided. Logged on the steps that are logged: ``gns`` (in items of ``denominator``: samples or
    tokens; left out while the smoothed ``|G|^2`` is not positive), ``gns/grad_sq``, ``gns/trace`` and
    ``gns/batch_size`` (``B``).

    Cost per optimizer step: two reads of the gradient (local sums of squares, no copy); communication: one
    all-gather of 3 floats on DDP; on ZeRO-2/3 ``per_micro_batch`` and FSDP2 ``every_micro_batch`` an all-reduce
    after the first micro-batch (one float on ZeRO, one per parameter on FSDP2) plus the step norm's all-reduce (one
    float per parameter); on ZeRO-1, ZeRO ``per_window`` and FSDP2 ``deferred`` the step norm's all-reduce plus the
    3-float all-gather. Backends where the gradient between micro-batches cannot be read log nothing, with a warning
    saying why (docs/callbacks.md).

    Needs at least 2 micro-batches per optimizer step on every rank (``gradient_accumulation_steps >= 2``), and reads
    the loss as ONE mean over ``denominator`` items (with several loss terms, the gradient is not one mean: a warning).

    Args:
        ema_decay: decay of the moving averages of ``|G|^2`` and ``tr(S)``, in [0, 1) (0: no smoothing).
        denominator: ``"samples"``, ``"tokens"`` or ``"input_tokens"``: what the loss is a mean over; None (default):
            the trainer's own (``trainer.primary_denominator``: samples for sequence classification, else tokens).
        keep_history: keep every step's measurement in ``self.history`` (:class:`NoiseScaleStep`).

    Example:
        ```python
        from hf_gradacc import GradAccTrainer
        from hf_gradacc.callbacks import GradientNoiseScaleCallback

        gns = GradientNoiseScaleCallback()
        trainer = GradAccTrainer(model=model, args=args, train_dataset=ds, callbacks=[gns])
        trainer.train()
        print(gns.noise_scale)   # items (tokens or samples) per step past which accumulation stops paying
        ```
    """

    def __init__(self, ema_decay: float = 0.95, denominator: str | None = None, keep_history: bool = False) -> None:
        if not isinstance(ema_decay, int | float) or isinstance(ema_decay, bool) or not 0.0 <= ema_decay < 1.0:
            raise GradAccConfigError(f"`ema_decay` ({ema_decay!r}) must be a number in [0, 1)")
        if denominator is not None and denominator not in DENOMINATORS:
            raise GradAccConfigError(f"`denominator` ({denominator!r}) must be None or one of {DENOMINATORS}")
        self.ema_decay = float(ema_decay)
        self.denominator = denominator
        self.keep_history = keep_history
        self.history: list[NoiseScaleStep] = []
        self.num_estimates = 0
        self.disabled_reason: str | None = None
        self._reset()

    def _reset(self) -> None:
        self._grad_sq, self._trace = _Ema(self.ema_decay), _Ema(self.ema_decay)
        self._small: _SmallBatch | None = None
        self._micro_batches_done = 0

    # ------------------------------------------------------------------ results
    @property
    def grad_sq(self) -> float:
        """The smoothed estimate of ``|G|^2`` (NaN before the first estimate)."""
        return self._grad_sq.value

    @property
    def trace(self) -> float:
        """The smoothed estimate of ``tr(S)``, the trace of the per-item gradient covariance (NaN before the first)."""
        return self._trace.value

    @property
    def noise_scale(self) -> float | None:
        """``trace / grad_sq``, in items of the loss's denominator; None until the smoothed ``|G|^2`` is positive."""
        grad_sq = self._grad_sq.value
        return self._trace.value / grad_sq if grad_sq > 0 else None

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        self._reset()
        self.num_estimates, self.history = 0, []

    def on_step_begin(self, args, state, control, **kwargs):
        self._small, self._micro_batches_done = None, 0

    def on_substep_end(self, args, state, control, **kwargs):
        # Fired after every micro-batch of the step but the last: the first call follows micro-batch 0.
        self._micro_batches_done += 1
        if self._micro_batches_done != 1 or self.disabled_reason is not None:
            return
        trainer = self._require_trainer()
        window = trainer.current_window
        # Every rank must take the same branch (the read below may be a collective): decided from gathered counts.
        if window is None or (not window.streamed and min(window.counts.num_micro_batches_per_rank) < 2):
            return
        try:
            running = trainer.grads.running_sq_norm()
        except UnsupportedBackendError as error:
            self._disable(str(error))
            return
        denominator = self._denominator(trainer)
        if running.reduced:
            first = window.counts.global_first
            if first is None:
                self._disable("the first micro-batch's count over ranks is not known for this step")
                return
            num_items, ranks = first.get(denominator), 1
        else:
            num_items, ranks = window.counts.micro_batches[0].get(denominator), window.dp_world_size
        # Each micro-batch's loss is its SUM divided by the step's global count N, times the world size W, and the
        # reduction averages over W ranks (a streamed step is divided by N only after its last micro-batch). The mean
        # gradient over the micro-batch's b items is the accumulated one times N / (W b) (reduced: N / b).
        step_count = 1 if window.streamed else window.global_count(denominator)
        factor = step_count / (ranks * num_items) if num_items > 0 else math.nan
        self._small = _SmallBatch(
            sq_norm=running.sq_norm * factor * factor, num_items=num_items, reduced=running.reduced
        )

    def on_accumulated_grads(self, args, state, control, **kwargs):
        small, self._small = self._small, None
        trainer = self._require_trainer()
        window = trainer.current_window
        if self.disabled_reason is not None or window is None:
            return
        if min(window.counts.num_micro_batches_per_rank, default=0) < (1 if window.streamed else 2):
            logger.warning_once(
                "GradientNoiseScaleCallback needs at least 2 micro-batches per optimizer step on every rank (the "
                "first "
                "one is the small batch): steps with fewer are not measured. Set `gradient_accumulation_steps >= 2`."
            )
            return
        denominator = self._denominator(trainer)
        if window.streamed and window.streamed_kind != denominator:
            self._disable(f"the loss is normalised by {window.streamed_kind!r}, not by {denominator!r} items")
            return
        if len(window.term_totals) > 1:
            logger.warning_once(
                f"GradientNoiseScaleCallback: the loss has several terms ({sorted(window.term_totals)}); the noise "
                f"scale reads the step's gradient as ONE mean over {denominator!r} items, which it is only if every "
                "term is normalised by them."
            )
        assert small is not None, "every rank with 2+ micro-batches measured its first one"
        big_batch = window.global_count(denominator)
        big_sq_norm = trainer.grads.norm() ** 2  # reduced, before clipping; a collective on sharded backends
        # A GradScaler (fp16 without DeepSpeed) scales both gradients until clipping unscales them.
        scale_sq = _loss_scale(trainer) ** 2
        small_sq_norm, big_sq_norm = small.sq_norm / scale_sq, big_sq_norm / scale_sq
        valid = 0 < small.num_items < big_batch and math.isfinite(small_sq_norm) and math.isfinite(big_sq_norm)
        grad_sq, trace = (
            noise_scale_estimates(small_sq_norm, small.num_items, big_sq_norm, big_batch) if valid else (0.0, 0.0)
        )
        if not small.reduced and window.dp_world_size > 1:
            # Each rank measured its own small batch: average the ranks' unbiased estimates (one collective).
            local = torch.tensor([grad_sq, trace, float(valid)], dtype=torch.float64, device=args.device)
            rows = trainer.backend.all_gather(local).reshape(-1, 3).cpu()
            measured = rows[:, 2] > 0
            valid = bool(measured.any())
            if valid:
                grad_sq, trace = float(rows[measured, 0].mean()), float(rows[measured, 1].mean())
        if not (valid and math.isfinite(grad_sq) and math.isfinite(trace)):
            return
        self._grad_sq.update(grad_sq)
        self._trace.update(trace)
        self.num_estimates += 1
        if self.keep_history:
            self.history.append(
                NoiseScaleStep(
                    step=state.global_step + 1,
                    small_sq_norm=small_sq_norm,
                    small_batch=small.num_items,
                    reduced=small.reduced,
                    big_sq_norm=big_sq_norm,
                    big_batch=big_batch,
                    grad_sq=grad_sq,
                    trace=trace,
                )
            )
        metrics = {"gns/grad_sq": self.grad_sq, "gns/trace": self.trace, "gns/batch_size": float(big_batch)}
        if self.noise_scale is not None:
            metrics["gns"] = self.noise_scale
        trainer.add_log_metrics(metrics)  # kept for the next logged step

    # ------------------------------------------------------------------ helpers
    def _denominator(self, trainer) -> str:
        return self.denominator or trainer.primary_denominator

    def _disable(self, why: str) -> None:
        self.disabled_reason = why
        logger.warning(f"GradientNoiseScaleCallback is off for this run, nothing is logged: {why}")


def _loss_scale(trainer) -> float:
    """The GradScaler's current scale (fp16 on DDP / FSDP2), 1.0 without one. DeepSpeed's own fp16 scale is removed by
    the backend's gradient reads already."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())
