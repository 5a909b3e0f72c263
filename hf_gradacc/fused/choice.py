"""``fused_lm_head=None`` (the default): whether the fused LM head (:mod:`hf_gradacc.fused.head`) runs, decided once
per run by a measured cost model, as the packing planner prices attention.

Where the fused head cannot run (an overridden ``compute_loss`` / ``compute_loss_func`` / ``training_step``, a head
or model it does not support, a tensor-parallel ``lm_head``, a seq2seq model that builds its decoder inputs from the
labels, a streamed window), where ``torch.compile`` traces the model (``torch_compile=True``, accelerate's dynamo
plugin, a model compiled before the trainer got it: the fused head would run outside the compiled graph, which the
cost model does not price) or is not guarded (the start-up loss check turned off), automatic means off, with one INFO
line saying why: never an error or a warning (``fused_lm_head=True`` keeps refusing those, but runs under
``torch.compile`` on one process). Elsewhere the first optimizer step's counts, gathered over every rank (so every
rank decides alike), give the rows of one micro-batch: ``counted`` (targets that count: the rows the fused
head projects) and ``positions`` (the rows of the full logits). With the head's ``hidden`` size, ``vocab``, compute
dtype and device, the model predicts the LM head's forward + backward time both ways::

    full  = mm * positions * hidden * vocab + ce * positions * vocab
            + spill * max(0, positions * vocab - cached) + call
    fused = mm' * counted * hidden * vocab + ce' * counted * vocab + (sweep * tiles + buffer) * hidden * vocab + call'

(``spill``: each logit past ``cached``, the fused head's tile size, costs more: the logits no longer stay in cache
between the passes over them; ``tiles``: the fused head's row tiles, whose weight-gradient updates each sweep
``[vocab x hidden]``; ``buffer``: the weight-gradient buffer's one-off cost), and the memory both ways (the full
logits: ``positions x vocab`` in the compute dtype, their float32 copy and the saved log-softmax; the fused head: its
float32 weight-gradient buffer and one tile). The fused head is on where it is predicted faster (at most
``SPEED_MARGIN`` of the full logits' time), or where the full logits would hold at least ``MEMORY_SHARE`` of the
model's training state (parameters, gradients, two Adam moments) more than the fused head and it costs at most
``MEMORY_TIME_ALLOWANCE`` times the full logits' time. The factors were fitted by ``benchmarks/fused_choice_fit.py``
(process CPU time of one thread; docs/memory.md has the rule, the inputs and the factors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ..errors import GradAccConfigError
from .into_grad import compiled_part

logger = logging.get_logger(__name__)

# The fused head must be predicted at most this many times the full logits' time to be on for speed (the fit's error
# at the shapes where both are close; docs/memory.md).
SPEED_MARGIN = 0.9
# Full logits must hold this share of the training state more than the fused head for memory alone to turn it on,
MEMORY_SHARE = 0.5
# and then the fused head may cost up to this many times the full logits' time.
MEMORY_TIME_ALLOWANCE = 1.25
FP32_BYTES = 4
# Logits past this many (the fused head's tile: 32 MiB of float32) leave the cache between the passes over them.
CACHED_LOGITS = 2**23
# Why automatic is off under torch.compile (fused_lm_head=True runs there, on one process: docs/memory.md).
COMPILED_OFF = (
    "the fused head would run outside the compiled graph (a graph break at the output layer), and the cost model was "
    "fitted without torch.compile"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostFactors:
    """Seconds per unit of each term of the cost model (see the module docstring), fitted on one device and dtype."""

    full_matmul: float
    full_softmax: float
    full_spill: float
    full_call: float
    fused_matmul: float
    fused_softmax: float
    fused_sweep: float
    fused_buffer: float
    fused_call: float
    fitted_on: str = ""


# BEGIN FITTED (benchmarks/fused_choice_fit.py --write rewrites this block)
FACTORS: dict[tuple[str, str], CostFactors] = {
    ("cpu", "float32"): CostFactors(
        full_matmul=5.246e-11,
        full_softmax=7.052e-09,
        full_spill=9.033e-09,
        full_call=0.0001865,
        fused_matmul=5.131e-11,
        fused_softmax=5.71e-09,
        fused_sweep=1.883e-09,
        fused_buffer=0,
        fused_call=0.0008699,
        fitted_on="2026-11-26, torch 2.13.0+cpu, 1 thread, 18 shapes",
    ),
}
# END FITTED


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadShape:
    """One micro-batch's LM head: its rows both ways (means over the first optimizer step), and its sizes."""

    counted: float
    positions: float
    hidden: int
    vocab: int
    dtype: str = "float32"
    device: str = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class FusedChoice:
    """The run's decision: ``enabled``, why, and the predicted numbers behind it (None where nothing was priced)."""

    enabled: bool
    reason: str
    shape: HeadShape | None = None
    full_seconds: float | None = None
    fused_seconds: float | None = None
    full_bytes: float | None = None
    fused_bytes: float | None = None

    def message(self) -> str:
        """The one INFO line logged when the run decides."""
        state = "on" if self.enabled else "off"
        if self.shape is None:
            return f"fused_lm_head=None (automatic): off, {self.reason}."
        s = self.shape
        return (
            f"fused_lm_head=None (automatic): {state}, {self.reason}: per micro-batch {s.counted:.0f} counted rows "
            f"of {s.positions:.0f} positions, hidden {s.hidden}, vocabulary {s.vocab}, {s.dtype} on {s.device}; "
            f"LM head predicted {self.fused_seconds * 1e3:.3g} ms fused vs {self.full_seconds * 1e3:.3g} ms full "
            f"logits ({self.fused_seconds / self.full_seconds:.2f}x), {self.fused_bytes / 2**20:.0f} MiB vs "
            f"{self.full_bytes / 2**20:.0f} MiB. Set `fused_lm_head=True` or `False` to choose."
        )


def factors_for(device: str, dtype: str) -> CostFactors:
    """The fitted factors of ``device`` / ``dtype``; those of the CPU in float32 where none were fitted."""
    return FACTORS.get((device, dtype)) or FACTORS.get((device, "float32")) or FACTORS[("cpu", "float32")]


def tile_of(counted: float, hidden: int, vocab: int) -> int:
    """Rows per tile of the fused head for ``counted`` rows (the kernel's own rule, ``rows_per_tile`` where the
    kernel has one, else a fixed logit budget per tile)."""
    from . import head as fused_head

    rows = max(1, math.ceil(counted))
    per_tile = getattr(fused_head, "rows_per_tile", None)
    return max(1, per_tile(rows, hidden, vocab) if per_tile else fused_head.tile_rows_for(vocab))


def tiles_of(counted: float, hidden: int, vocab: int) -> int:
    """The fused head's row tiles for ``counted`` rows (each one sweep of the weight-gradient buffer)."""
    return max(1, math.ceil(counted / tile_of(counted, hidden, vocab)))


def predict_seconds(shape: HeadShape, factors: CostFactors) -> tuple[float, float]:
    """``(full, fused)``: the LM head's predicted forward + backward seconds per micro-batch."""
    h, v = shape.hidden, shape.vocab
    logits = shape.positions * v
    full = (
        factors.full_matmul * logits * h
        + factors.full_softmax * logits
        + factors.full_spill * max(0.0, logits - CACHED_LOGITS)
    )
    fused = (
        factors.fused_matmul * shape.counted * h * v
        + factors.fused_softmax * shape.counted * v
        + factors.fused_sweep * tiles_of(shape.counted, h, v) * h * v
        + factors.fused_buffer * h * v
    )
    return full + factors.full_call, fused + factors.fused_call


def predict_bytes(shape: HeadShape) -> tuple[float, float]:
    """``(full, fused)``: the LM head's predicted transient memory per micro-batch."""
    per_logit = _dtype_bytes(shape.dtype) + 2 * FP32_BYTES  # logits, their float32 copy / gradient, log-softmax
    tile = min(shape.counted, tile_of(shape.counted, shape.hidden, shape.vocab))
    return (
        shape.positions * shape.vocab * per_logit,
        FP32_BYTES * shape.hidden * shape.vocab + tile * shape.vocab * per_logit,
    )


def choose(shape: HeadShape, *, state_bytes: float, factors: CostFactors | None = None) -> FusedChoice:
    """The cost model's verdict for ``shape`` (see the module docstring); ``state_bytes``: the model's parameters,
    gradients and optimizer moments.

    Example:
        ```python
        shape = HeadShape(counted=900, positions=2000, hidden=64, vocab=151936)
        choose(shape, state_bytes=300e6).enabled  # True: the full logits would dwarf the training state
        ```
    """
    factors = factors or factors_for(shape.device, shape.dtype)
    full_s, fused_s = predict_seconds(shape, factors)
    full_b, fused_b = predict_bytes(shape)
    if fused_s <= SPEED_MARGIN * full_s:
        enabled, reason = True, "predicted faster"
    elif full_b - fused_b >= MEMORY_SHARE * state_bytes and fused_s <= MEMORY_TIME_ALLOWANCE * full_s:
        enabled, reason = True, f"the full logits would need {MEMORY_SHARE:g}x the training state or more"
    else:
        enabled, reason = False, "predicted slower, and the full logits are small"
    return FusedChoice(
        enabled=enabled,
        reason=reason,
        shape=shape,
        full_seconds=full_s,
        fused_seconds=fused_s,
        full_bytes=full_b,
        fused_bytes=fused_b,
    )


def _dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype, torch.float32)).element_size()


def compile_setting(*, args: Any, accelerator: Any, model: Any) -> str | None:
    """How ``torch.compile`` will trace the model, in words (``torch_compile=True``, accelerate's dynamo plugin, a
    model compiled before the trainer got it), or None: read at construction, before accelerate wraps it."""
    if getattr(args, "torch_compile", False):
        return f"`torch_compile=True` (backend {args.torch_compile_backend!r})"
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    backend = getattr(getattr(plugin, "backend", None), "value", None)
    if backend and str(backend).upper() != "NO":
        return f"accelerate's dynamo plugin (backend {str(backend).lower()!r})"
    return compiled_part(model)


def check_fused_setting(
    *, model: Any, head_type: Any, backend: Any, source: Any, trainer_name: str, compiled: str | None = None
) -> None:
    """Once, at construction, with ``fused_lm_head=True``: ignored with a warning when the trainer computes its loss
    itself (``source``: :class:`~hf_gradacc.step.engine.LossSource`); else refused with a
    :class:`~hf_gradacc.GradAccConfigError` where it cannot run (the model, the head, the head on several processes,
    ``torch.compile`` on several processes: ``compiled``, from :func:`compile_setting`). The backend needs no check
    here: every backend GradAccTrainer resolves (DDP, DeepSpeed, FSDP2) is one the fused head is tested under."""
    from .head import fused_support_problem

    if source.custom_compute_loss:
        logger.warning(
            f"`fused_lm_head=True` is ignored: {trainer_name} computes its loss itself (an overridden "
            "`compute_loss` or a `compute_loss_func`), so the LM head runs wherever that code runs it. Set "
            "`fused_lm_head=False`, or leave the loss to hf_gradacc's built-in one."
        )
        return
    problem = fused_support_problem(model, head_type, distributed=backend.mesh.dp_world_size > 1)
    if problem is not None:
        raise GradAccConfigError(f"`fused_lm_head=True` cannot run here: {problem}. Set `fused_lm_head=False`.")
    if compiled is None:
        return
    if backend.mesh.dp_world_size > 1 or backend.model_parallelism is not None:
        raise GradAccConfigError(
            f"`fused_lm_head=True` cannot run with {compiled} on several processes: the fused head runs outside the "
            "compiled graph, which is tested on one process only. Set `fused_lm_head=False`, or `torch_compile=False` "
            "(and pass the model uncompiled)."
        )
    logger.info(
        f"`fused_lm_head=True` with {compiled}: the fused LM head runs outside the compiled graph (the model's call "
        "of its output layer is a graph break); the rest of the model is compiled."
    )


def auto_problem(
    *,
    settings: Any,
    head: Any,
    backend: Any,
    model: Any,
    source: Any,
    trainer_name: str,
    cp_size: int = 1,
    compiled: str | None = None,
) -> str | None:
    """Why automatic cannot turn the fused head on (at construction), or None: each of the setups
    ``fused_lm_head=True`` refuses or ignores, in words. ``source``: where the loss comes from
    (:class:`~hf_gradacc.step.engine.LossSource`)."""
    from ..heads import unwrap_model
    from .head import fused_support_problem

    if source.custom_compute_loss:
        return f"{trainer_name} computes its loss itself (an overridden `compute_loss` or a `compute_loss_func`)"
    if source.custom_training_step:
        return f"{trainer_name} overrides `training_step`"
    if not settings.check_loss_at_start:
        return "`check_loss_at_start=False`: nothing would stop a logit transform the fused head does not apply"
    if settings.defer_normalization:
        return "`defer_normalization=True` streams the micro-batches: the step's counts are not known before they run"
    if cp_size > 1:
        return f"context parallelism (`cp_size` {cp_size}): the fused head's start-up check runs one row per rank"
    if backend.model_parallelism is not None:
        return f"the run uses {backend.model_parallelism} (the fused head needs whole tokens and a whole head)"
    problem = fused_support_problem(model, head.type, distributed=backend.mesh.dp_world_size > 1)
    if problem is not None:
        return problem
    if compiled is not None:
        return f"{compiled}: {COMPILED_OFF}"
    base = unwrap_model(model)
    if head.type == "seq2seq" and not hasattr(base, "prepare_decoder_input_ids_from_labels"):
        return f"{type(base).__name__} builds its decoder inputs from the labels"
    return None


def shape_of(window: Any, *, model: Any, head: Any, args: Any) -> HeadShape:
    """The LM head of ``model`` on one micro-batch of ``window`` (a prefetched window, counted over every rank)."""
    from ..heads import unwrap_model

    base = unwrap_model(model)
    counts = window.counts
    num = max(sum(counts.num_micro_batches_per_rank), 1)
    counted = counts.global_tokens / num
    # the full logits' rows: every input position of a causal or masked LM; a seq2seq model's decoder rows are not
    # counted, so there the counted targets stand for them (the fused head then wins only by its tiles)
    positions = (counts.global_positions / num if head.type != "seq2seq" else 0) or counted
    weight = getattr(base.get_output_embeddings(), "weight", None)
    if torch.is_tensor(weight) and weight.dim() == 2 and weight.numel() > 0:
        vocab, hidden = (int(n) for n in weight.shape)
    else:  # sharded or adapted: the config's sizes
        text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        vocab, hidden = int(text.vocab_size), int(text.hidden_size)
    dtype = (
        "bfloat16"
        if args.bf16
        else "float16"
        if args.fp16
        else str(weight.dtype if torch.is_tensor(weight) else torch.float32)
    )
    return HeadShape(
        counted=counted,
        positions=positions,
        hidden=hidden,
        vocab=vocab,
        dtype=dtype.removeprefix("torch."),
        device=torch.device(args.device).type,
    )


def training_state_bytes(model: torch.nn.Module) -> float:
    """Parameters, gradients and two optimizer moments of ``model``'s trainable parameters (float32 moments)."""
    total = 0.0
    for p in model.parameters():
        if p.requires_grad:
            total += p.numel() * (2 * p.element_size() + 2 * FP32_BYTES)
    return total


class FusedPolicy:
    """The run's fused-head decision (``fused_lm_head``): fixed at construction (``True`` / ``False``, or automatic
    where the fused head cannot run, logged), or, automatic, made by :meth:`decide` on the first optimizer step's
    counts, gathered over every rank (every rank decides alike), logged once on the main process.

    Example:
        ```python
        policy = FusedPolicy.at_construction(settings=settings, head=head, backend=backend, model=model,
                                             source=source, args=args, trainer_name="GradAccTrainer")
        policy.decide(window)     # the step's owner, when the first optimizer step's counts are known
        policy.enabled            # whether the built-in loss runs the fused head in training
        ```
    """

    def __init__(self, choice: FusedChoice | None, *, model: Any = None, head: Any = None, args: Any = None) -> None:
        self.choice, self._model, self._head, self._args = choice, model, head, args

    @classmethod
    def at_construction(
        cls,
        *,
        settings: Any,
        head: Any,
        backend: Any,
        model: Any,
        source: Any,
        args: Any,
        trainer_name: str,
        cp_size: int = 1,
        accelerator: Any = None,
    ) -> FusedPolicy:
        """The decision where the setting or the setup makes it: ``fused_lm_head=True`` checked (ignored with a
        warning when the trainer computes its loss itself, refused where it cannot run), ``False``, or automatic
        (off where :func:`auto_problem` names a reason, torch.compile included, logged; else decided on the first
        optimizer step)."""
        setting = settings.fused_lm_head
        compiled = compile_setting(args=args, accelerator=accelerator, model=model)
        if setting:
            check_fused_setting(
                model=model,
                head_type=head.type,
                backend=backend,
                source=source,
                trainer_name=trainer_name,
                compiled=compiled,
            )
        if setting is not None:
            return cls(FusedChoice(enabled=bool(setting), reason=f"`fused_lm_head={setting}`"))
        problem = auto_problem(
            settings=settings,
            head=head,
            backend=backend,
            model=model,
            source=source,
            trainer_name=trainer_name,
            cp_size=cp_size,
            compiled=compiled,
        )
        if problem is None:
            return cls(None, model=model, head=head, args=args)
        choice = FusedChoice(enabled=False, reason=problem)
        logger.info(choice.message())
        return cls(choice)

    def decide(self, window: Any, *, wrapped: Any = None) -> FusedChoice:
        """Automatic, on the first optimizer step: the cost model on that step's counts (off when the model as the
        step calls it, ``wrapped``, was compiled since construction); the decision made before, otherwise."""
        if self.choice is None:
            self.choice = decide(window, model=self._model, head=self._head, args=self._args, wrapped=wrapped)
        return self.choice

    @property
    def enabled(self) -> bool:
        """Whether the fused head runs on a training micro-batch (the run's decision)."""
        return self.decide(None).enabled if self.choice is None else self.choice.enabled


def decide(window: Any, *, model: Any, head: Any, args: Any, wrapped: Any = None) -> FusedChoice:
    """Automatic, on the first optimizer step: the cost model on that step's counts (gathered over every rank, so
    every rank decides alike), logged once on the main process; off when ``wrapped`` (the model as the step calls it)
    was compiled since construction (accelerate's)."""
    compiled = compiled_part(wrapped)
    if compiled is not None:
        choice = FusedChoice(enabled=False, reason=f"{compiled}: {COMPILED_OFF}")
    elif window is None or window.streamed:
        choice = FusedChoice(enabled=False, reason="the step's counts are not known before its micro-batches run")
    elif window.counts.weighted:  # hf_gradacc.weights: the tiles sum unweighted targets
        choice = FusedChoice(
            enabled=False, reason="the step's batches carry `loss_weights`, which the fused head does not weigh"
        )
    else:
        choice = choose(shape_of(window, model=model, head=head, args=args), state_bytes=training_state_bytes(model))
    if args.process_index == 0:
        logger.info(choice.message())
    return choice
