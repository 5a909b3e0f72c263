"""The LM head applied only where a target counts, in tiles: the causal LM's SUM-reduced cross-entropy without ever
materialising [tokens x vocabulary] logits (``GradAccArguments.fused_lm_head``).

The model's backbone runs as usual (through its wrappers, so DDP's sync decisions and hooks are kept), its last
hidden states are taken at the positions whose target counts (labels other than ``ignore_index`` after the causal
shift), and those rows go through the model's own output layer ``tile_rows`` at a time. Each tile's gradients (with
respect to its hidden rows and the head's parameters) are computed as soon as its logits are, and the logits freed:
the head holds at most one tile of logits, and nothing is recomputed in the backward pass, which only scales the
gradients by the loss's incoming gradient (the loss is a SUM, linear in each tile's). For a plain ``nn.Linear`` head
the weight's gradient is added into one buffer per micro-batch (or, where its float32 ``.grad`` exists and nothing
else needs autograd to deliver it, straight into ``.grad``: :mod:`hf_gradacc.fused.into_grad`); any other output
layer (PEFT adapters on the head) is called as a module and differentiated by autograd, tile by tile, so tied
embeddings, a bias and adapters work as in the model's forward. The transforms transformers' causal LMs apply to
their logits before the loss are applied per tile, in the model's dtype, before the float32 upcast (as the models
and ``ForCausalLMLoss`` do): ``logit_scale`` (Cohere), ``logits_scaling`` (Granite divides by it) and
``final_logit_softcapping`` (Gemma 2 and 3). The start-up loss check compares the result with the model's own loss
on one row, so a transform not listed here stops training at the first micro-batch instead of training a different
loss.

Why not ``torch.nn.functional.linear_cross_entropy`` (torch 2.13, chunked when given ``LinearCrossEntropyOptions``):
it takes a weight, not a module, so softcapping (a non-linear transform between the matmul and the loss) and PEFT
adapters on the head cannot go through it; and on a 2-core x86 CPU (``benchmarks/fused_head.py``, docs/benchmarks.md)
it was 2-20x slower than the full logits, where these tiles take 0.76-0.90x of their CPU time (docs/memory.md), with
a hidden-state gradient 17x further from float64. Its memory is lower when rows are few compared with the hidden
size, where the tiles' weight-gradient buffer (``[vocabulary x hidden]``, which the weight's gradient needs anyway)
is the larger part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..errors import GradAccLossError, GradAccUsageError
from ..loss import IGNORE_INDEX, model_labels
from .into_grad import Written, keep_buffer, kept_buffer, refuse_compiled_on_several_processes
from .into_grad import begin as into_grad_begin
from .into_grad import observe as into_grad_observe

# Elements of one tile's logits: 2**23 float32 values are 32 MiB (55 rows at a 151,936-token vocabulary, 262 at
# 32,000); of 2**21 to 2**25, the fastest on the 2-core CPU at both vocabularies (docs/benchmarks.md). Far fewer rows
# per tile make each tile's weight-gradient update (one pass over [vocabulary x hidden]) the cost.
TILE_ELEMENTS = 2**23
# A weight gradient of at least this many elements (16 MiB in float32) does not stay in cache: each tile's update of
# it is a pass over memory, so where the element budget gives few rows (a large vocabulary) the tiles are widened
# (:func:`rows_per_tile`). Smaller heads keep ``tile_rows_for``'s tiles.
WIDEN_ABOVE_ELEMENTS = 2**22


@dataclass(frozen=True, slots=True, kw_only=True)
class LogitTransform:
    """What a causal LM does to its head's output before the loss: ``logits * scale``, then, with ``softcap``,
    ``softcap * tanh(logits / softcap)``."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> LogitTransform:
        """The transform of ``model`` (an unwrapped transformers causal LM), read where its forward reads it."""
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = getattr(model, "logit_scale", None)  # Cohere sets it from the config at __init__
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            scale = getattr(text, "logit_scale", None)
        if scale is None and getattr(text, "logits_scaling", None):
            scale = 1.0 / float(text.logits_scaling)  # Granite: logits / logits_scaling
        softcap = getattr(text, "final_logit_softcapping", None)
        return cls(scale=1.0 if scale is None else float(scale), softcap=float(softcap) if softcap else None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def tile_rows_for(vocab_size: int, tile_elements: int = TILE_ELEMENTS) -> int:
    """Rows per tile so that one tile's logits hold about ``tile_elements`` values (at least 1 row)."""
    return max(1, tile_elements // max(int(vocab_size), 1))


def rows_per_tile(rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per tile of the plain linear head for ``rows`` counted rows through a ``[vocab_size x hidden_size]``
    weight: ``tile_rows_for(vocab_size)`` (a fixed logit budget), widened where the weight is large to
    ``min(rows, max(hidden_size // 2, rows // 4), sqrt(rows * hidden_size / 4))``.

    Why: each tile adds its ``tile x vocabulary`` gradient into the ``[vocabulary x hidden]`` weight gradient, one
    read and one write of that buffer per tile, while the tile's logits buffer is paged in once per call. The two
    costs, ``(rows / tile) * vocabulary * hidden`` and ``tile * vocabulary`` (measured on the 2-core CPU: a buffer pass
    about a quarter of a first touch per element), balance near ``sqrt(rows * hidden / 4)`` rows (256 at 512 rows x
    512 hidden: 0.83x the full logits' CPU time at vocabulary 151,936 where 55-row tiles took 1.07x). The cap keeps a
    tile's logits within half the weight gradient's memory or a quarter of the full logits', whichever is larger.

    Example:
        ```python
        rows_per_tile(512, 512, 151936)  # 256 (the element budget alone: 55)
        ```
    """
    base = tile_rows_for(vocab_size)
    if vocab_size * hidden_size < WIDEN_ABOVE_ELEMENTS:
        return base
    balanced = math.isqrt(max(rows, 1) * hidden_size // 4)
    return max(base, min(rows, max(hidden_size // 2, rows // 4), balanced), 1)


def _tile_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable,
    transform: LogitTransform,
    ignore_index: int,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    return _cross_entropy_sum(head(hidden), targets, transform, ignore_index, label_smoothing)


def _cross_entropy_sum(
    raw: torch.Tensor, targets: torch.Tensor, transform: LogitTransform, ignore_index: int, label_smoothing: float
) -> torch.Tensor:
    """The loss of the head's output ``raw``: transformed in the model's dtype, then float32, summed."""
    return F.cross_entropy(
        transform(raw).float(), targets, ignore_index=ignore_index, reduction="sum", label_smoothing=label_smoothing
    )


@torch.compiler.disable  # never traced by torch.compile (see _Capture.__call__): it runs eagerly where it is called
def fused_cross_entropy_sum(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    transform: LogitTransform | None = None,
    ignore_index: int = IGNORE_INDEX,
    tile_rows: int | None = None,
    label_smoothing: float = 0.0,
    wrapper: Any = None,
    into_grad: bool = True,
) -> torch.Tensor:
    """SUM over the rows of ``hidden`` (``[rows, hidden]``) of the cross-entropy of ``transform(head(row))`` against
    ``targets`` (``[rows]``), a tile of rows at a time. With gradient, each tile's gradients (with respect to its rows
    of ``hidden`` and to the head's trainable parameters) are computed as soon as its logits are, and the logits freed;
    the backward pass only scales them by the loss's incoming gradient (the SUM is linear in each tile's loss).
    ``label_smoothing``: as ``torch.nn.functional.cross_entropy``'s (the Trainer's ``label_smoothing_factor``).
    ``into_grad``: a float32 ``nn.Linear`` weight whose ``.grad`` exists gets its gradient added straight into it
    where that is the same update (:mod:`hf_gradacc.fused.into_grad`; ``wrapper``: the model as the training step
    called it, DDP for instance); False keeps autograd's return everywhere.

    Pass only the rows whose target counts: the cost is proportional to the rows given. With no row the result is an
    exact zero that still depends on the head's parameters and ``hidden`` (every parameter gets a gradient).

    Example:
        ```python
        mask = targets != -100
        total = fused_cross_entropy_sum(last_hidden[mask], model.lm_head, targets[mask])
        ```
    """
    transform = transform or LogitTransform()
    module = getattr(head, "__self__", head)  # a module, or a module's bound forward
    weight = getattr(module, "weight", None)
    vocab = int(weight.shape[0]) if torch.is_tensor(weight) and weight.dim() == 2 else 32768
    step = tile_rows or tile_rows_for(vocab)
    targets = targets.to(hidden.device)
    rows = hidden.shape[0]
    params = [p for p in module.parameters() if p.requires_grad] if isinstance(module, nn.Module) else []
    if not torch.is_grad_enabled() or not (hidden.requires_grad or params):
        with torch.no_grad():
            parts = [
                _tile_loss(hidden[i : i + step], targets[i : i + step], head, transform, ignore_index, label_smoothing)
                for i in range(0, max(rows, 1), step)
            ]
        return torch.stack(parts).sum()
    wants_hidden = hidden.requires_grad
    linear = _plain_linear(head, module, hidden, params)
    if linear and transform.softcap is None and label_smoothing == 0.0:  # the softmax written by hand, wider tiles
        step = tile_rows or rows_per_tile(rows, int(hidden.shape[-1]), vocab)
        rows_in, scale = hidden.detach(), transform.scale
        written = kept = None
        if into_grad and module.weight.requires_grad:
            written = into_grad_begin(
                module.weight,
                wrapper,
                module,
                lambda: _linear_tiles(rows_in, targets, module, scale, ignore_index, step, False)[1][1],
            )
            kept = None if written is not None else kept_buffer(module.weight, wrapper, module)
        total, grads = _linear_tiles(rows_in, targets, module, scale, ignore_index, step, wants_hidden, written, kept)
        if into_grad and written is None and module.weight.requires_grad:
            keep_buffer(module.weight, grads[1], wrapper, module)  # for the next window's first micro-batch
        return _ScaledGradients.apply(total, grads, (written, module.weight), hidden, *params)
    grad_hidden = torch.zeros_like(hidden) if wants_hidden else None
    grad_params: list[torch.Tensor | None] = [None] * len(params)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, max(rows, 1), step):  # at least one (possibly empty) tile: every parameter gets a gradient
        part_hidden, part_targets = hidden[start : start + step].detach(), targets[start : start + step]
        if linear:  # the weight's gradient added into one buffer, with no temporary [vocabulary x hidden] per tile
            loss = _linear_tile(
                part_hidden,
                part_targets,
                module,
                transform,
                ignore_index,
                label_smoothing,
                grad_hidden[start : start + step] if wants_hidden else None,
                grad_params,
            )
        else:
            with torch.enable_grad():
                part_hidden.requires_grad_(wants_hidden)
                loss = _tile_loss(part_hidden, part_targets, head, transform, ignore_index, label_smoothing)
                grads = torch.autograd.grad(loss, ([part_hidden] if wants_hidden else []) + params, allow_unused=True)
            if wants_hidden:
                grad_hidden[start : start + step] = grads[0]
                grads = grads[1:]
            for i, grad in enumerate(grads):
                if grad is not None:
                    grad_params[i] = _accumulate(grad_params[i], grad)
            del grads
        total += loss.detach()
        del loss
    return _ScaledGradients.apply(total, (grad_hidden, *grad_params), (None, None), hidden, *params)


def _is_linear(head: Callable, module: Any) -> bool:
    return getattr(head, "__func__", None) is nn.Linear.forward and isinstance(module, nn.Linear)


def _plain_linear(head: Callable, module: Any, hidden: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """True when ``head`` is ``torch.nn.Linear``'s own forward (also under FSDP2's subclass) and its weight, bias and
    ``hidden`` share one dtype (no autocast between them): its gradients can then be written by hand."""
    if not _is_linear(head, module):
        return False
    if torch.is_autocast_enabled(hidden.device.type):
        return False
    tensors = [module.weight] + ([module.bias] if module.bias is not None else [])
    return all(t.dtype == hidden.dtype for t in tensors) and all(any(p is t for t in tensors) for p in params)


def _linear_tile(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    module: nn.Linear,
    transform: LogitTransform,
    ignore: int,
    smoothing: float,
    grad_hidden: torch.Tensor | None,
    grad_params: list[torch.Tensor | None],
) -> torch.Tensor:
    """One tile through a plain linear head with softcapping or label smoothing (autograd on the tile's logits): the
    loss, the hidden rows' gradient written into ``grad_hidden`` and the weight's (and bias's) added into
    ``grad_params`` (in ``module.parameters()`` order, trainable ones only)."""
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    with torch.enable_grad():
        raw = F.linear(hidden, weight, bias).requires_grad_(True)
        loss = _cross_entropy_sum(raw, targets, transform, ignore, smoothing)
        (grad_raw,) = torch.autograd.grad(loss, [raw])
    if grad_hidden is not None:  # in the weight's dtype, as autograd's matmul backward computes it
        torch.matmul(grad_raw.to(weight.dtype), weight, out=grad_hidden)
    # the parameters' gradients are summed over the tiles in float32, with tile-sized casts only: no
    # [vocabulary x hidden] temporary, also for 16-bit weights
    grad32 = grad_raw.float()
    slots = [p for p in (module.weight, module.bias) if p is not None and p.requires_grad]
    for i, param in enumerate(slots):
        if param is module.weight:
            rows = hidden.float()
            if grad_params[i] is None:
                grad_params[i] = grad32.t() @ rows
            else:
                grad_params[i].addmm_(grad32.t(), rows)
        else:
            grad_params[i] = _accumulate(grad_params[i], grad32.sum(dim=0))
    return loss


def _linear_tiles(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    module: nn.Linear,
    scale: float,
    ignore: int,
    step: int,
    wants_hidden: bool,
    into: Written | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """Every tile of ``step`` rows through a plain linear head, the softmax written by hand: the cross-entropy SUM of
    ``head(hidden) * scale`` (scaled in the weight's dtype, then float32, as the models and their loss do), and the
    gradients ``(hidden, weight, bias)`` (None for what does not require one; the weight's and bias's in float32).

    One float32 logits buffer (and, for a 16-bit weight, one in its dtype) serves every tile: each tile's matmul
    writes into it, ``log_softmax`` runs in place (the loss of a row is minus its target's entry, as
    ``F.cross_entropy`` computes it), ``exp_`` turns it into the softmax and the target's entry loses 1: that is the
    gradient of the tile's logits, which two matmuls turn into the hidden rows' gradient (written in place) and the
    weight's (added into one buffer). A row whose target is ``ignore`` gets a zero gradient and no loss. No tensor of
    the tile's size is allocated per tile: a fresh one costs its page faults again, a tenth of the tile's time at
    151,936 tokens. With ``into``, the weight's gradient is added into ``into.grad`` (times ``into.alpha``), its slot
    None; with ``out`` (float32, the weight's shape, any contents), written into ``out`` instead of a new buffer."""
    weight = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach()
    wants_weight = module.weight.requires_grad and into is None
    wants_bias = bias is not None and module.bias.requires_grad
    rows, vocab, device = hidden.shape[0], weight.shape[0], hidden.device
    low = weight.dtype != torch.float32
    size = max(1, min(step, rows))
    logits = torch.empty(size, vocab, dtype=torch.float32, device=device)
    raw = torch.empty(size, vocab, dtype=weight.dtype, device=device) if low else logits
    grad_hidden = torch.empty_like(hidden) if wants_hidden else None  # every row is written below
    grad_weight = None
    if wants_weight and not rows:  # no tile: a zero gradient (in the kept buffer when there is one)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if out is None else out.zero_()
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if wants_bias else None
    ignored = torch.nonzero(targets == ignore)[:, 0]  # once, not per tile (a host sync on an accelerator)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for start in range(0, rows, size):
        part, part_targets = hidden[start : start + size], targets[start : start + size]
        n = part.shape[0]
        z, r = logits[:n], raw[:n]
        if bias is None:
            torch.mm(part, weight.t(), out=r)
        else:
            torch.addmm(bias, part, weight.t(), out=r)
        if scale != 1.0:
            r.mul_(scale)  # in the weight's dtype
        if low:
            z.copy_(r)
        torch.log_softmax(z, 1, out=z)  # row by row, in place: read before written
        kept = part_targets != ignore
        safe = torch.where(kept, part_targets, 0)
        total -= z.gather(1, safe[:, None])[:, 0].where(kept, 0.0).sum()
        z.exp_()
        z[torch.arange(n, device=device), safe] -= 1.0
        here = ignored[(ignored >= start) & (ignored < start + n)] - start
        if here.numel():
            z.index_fill_(0, here, 0.0)
        if scale != 1.0:
            z.mul_(scale)
        if grad_hidden is not None:  # in the weight's dtype, as autograd's matmul backward computes it
            if low:
                r.copy_(z)
            torch.mm(r, weight, out=grad_hidden[start : start + n])
        if into is not None:  # straight into the existing float32 .grad: no [vocabulary x hidden] temporary
            into.grad.addmm_(z.t(), part, alpha=into.alpha)
        elif wants_weight:  # summed over the tiles in float32, also for a 16-bit weight
            part32 = part.float()
            if grad_weight is None:  # the first tile writes every element: a kept buffer needs no zeroing
                grad_weight = torch.mm(z.t(), part32) if out is None else torch.mm(z.t(), part32, out=out)
            else:
                grad_weight.addmm_(z.t(), part32)
        if grad_bias is not None:
            grad_bias += z.sum(dim=0)
    if into is not None:
        into.done_writing()
    weight_slot = (grad_weight,) if wants_weight or into is not None else ()
    grads = (grad_hidden,) + weight_slot + ((grad_bias,) if wants_bias else ())
    return total, grads


def _accumulate(total: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``total + grad``, in float32 when ``grad`` is a 16-bit float (each tile's gradient rounded once, the sum over
    tiles not rounded again: as autograd sums micro-batches into a float32 ``.grad``)."""
    if grad.dtype in (torch.bfloat16, torch.float16):
        grad = grad.float()
    return grad if total is None else total.add_(grad)


class _ScaledGradients(torch.autograd.Function):
    """The fused loss sum as a function of ``hidden`` and the head's parameters, whose gradients were computed tile by
    tile in the forward pass: the backward pass hands them on, times the incoming gradient (a scalar)."""

    @staticmethod
    def forward(
        ctx: Any,  # noqa: ANN401
        total: torch.Tensor,
        grads: tuple,
        into: tuple,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        # Kept on ctx, not saved for backward: neither inputs nor outputs, and the backward pass drops them at once
        # (also under retain_graph), so the gradient it returns is the only reference and autograd can adopt it as
        # `.grad` without a copy.
        ctx.grads = list(grads)
        ctx.dtypes = [t.dtype for t in inputs]
        # (a Written of fused_into_grad or None, the linear head's weight or None): the weight's slot is settled there
        ctx.into = into
        ctx.weight_slot = next((i for i, t in enumerate(inputs) if t is into[1]), None)
        return total.detach().clone()

    @staticmethod
    @once_differentiable  # the gradients were computed without a graph: no second-order gradient
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # noqa: ANN401
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise GradAccUsageError(
                "fused_lm_head=True: a second backward pass through the same fused LM-head loss. The fused head "
                "computes its gradients once, in the forward pass, and hands them on in ONE backward pass. Put every "
                "term that contains the LM loss into one backward pass, run the forward pass again for the second "
                "one, or set `fused_lm_head=False`."
            )
        # scaled in place, so no second [vocabulary x hidden] tensor exists; the scalar stays float32 (not rounded
        # to a 16-bit gradient's dtype): each element is rounded once
        written, weight = ctx.into
        ctx.into = (None, None)
        if written is None and weight is not None:
            into_grad_observe(weight, grad)  # the next micro-batch's guess of the factor
        if grad.device.type == "cpu" and bool(grad == 1):  # the plain sum: no pass over the weight's gradient
            result = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        else:
            result = [None if g is None else g.mul_(grad).to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        if written is not None:  # its gradient is in .grad already, or corrected and handed on here
            result[ctx.weight_slot] = written.settle(grad)
        return (None, None, None, *result)


# ---------------------------------------------------------------------------------------------- the causal LM
FUSED_HEADS: tuple[str, ...] = ("causal_lm", "seq2seq", "masked_lm")
# the heads tested on several processes (tests/distributed/test_fused_head.py); the others on one process only
DISTRIBUTED_FUSED_HEADS: tuple[str, ...] = ("causal_lm",)


@dataclass(frozen=True, slots=True)
class FusedOutput:
    """The fused head's result: its loss SUM over the counted targets, and the model's outputs (their ``logits`` a
    ``[batch, positions, 1]`` placeholder; the rest, such as router logits, as the model returned them)."""

    sum_loss: torch.Tensor
    backbone: Any = None


def fused_support_problem(model: nn.Module, head_type: str | None, *, distributed: bool = False) -> str | None:
    """Why ``fused_lm_head`` cannot run on ``model`` (wrapped or not), or None when it can: a causal LM with an output
    layer, on one process or (``distributed``) under any backend GradAccTrainer resolves (DDP, DeepSpeed ZeRO-1/2/3,
    FSDP2; mixtures of experts included); a seq2seq or masked LM whose output layer projects every position, on one
    process."""
    from ..heads import unwrap_model

    base = unwrap_model(model)
    if head_type not in FUSED_HEADS:
        return f"the head is {head_type!r}; the fused LM head supports {FUSED_HEADS} for now"
    get = getattr(base, "get_output_embeddings", None)
    output = get() if callable(get) else None
    if not isinstance(output, nn.Module):
        return f"{type(base).__name__} has no output layer (`get_output_embeddings()` is {output!r})"
    bias = getattr(base, "final_logits_bias", None)  # BART / Marian / Pegasus add it to the head's output
    if torch.is_tensor(bias) and bool((bias != 0).any()):
        return (
            f"{type(base).__name__} adds a non-zero `final_logits_bias` to its logits, which the fused head does not"
        )
    if distributed and head_type not in DISTRIBUTED_FUSED_HEADS:
        return f"the {head_type!r} head is tested on one process only; on several, {DISTRIBUTED_FUSED_HEADS}"
    from ..multimodal import fused_head_problem  # its start-up check runs one row of the micro-batch

    return fused_head_problem(base)


def _rows_of(inputs: dict[str, Any], row: int, batch_size: int) -> dict[str, Any]:
    return {
        k: v[row : row + 1] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == batch_size else v
        for k, v in inputs.items()
    }


class _GradientBox:
    """The gradient of the fused loss, handed from :class:`_FromLogits` (where the backward pass starts) to
    :class:`_ThroughLogits` (inside the head), which passes it on to the tiles."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _ThroughLogits(torch.autograd.Function):
    """Inside the head: a zero ``[batch, positions, 1]`` placeholder for the logits that depends on the tiles' loss
    sum. Its backward passes the fused loss's gradient (from the box) to the sum, whatever the model did to the
    placeholder: the tiles are back-propagated only after the gradient went through the model's logits."""

    @staticmethod
    def forward(
        ctx: Any,  # noqa: ANN401
        sum_loss: torch.Tensor,
        like: torch.Tensor,
        box: _GradientBox,
    ) -> torch.Tensor:
        ctx.box = box
        return like.new_zeros((*like.shape[:-1], 1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:  # noqa: ANN401
        given, ctx.box.grad = ctx.box.grad, None
        if given is None:  # the model's logits reached the loss by another way: no gradient for the tiles
            given = torch.zeros((), dtype=torch.float32, device=grad.device)
        return given, None, None


class _FromLogits(torch.autograd.Function):
    """Outside the model: the fused loss sum (its value), as a function of the model's returned ``logits`` (the
    placeholder, after the model's own transforms), so that the backward pass enters the model through its output.
    Under FSDP2 the root module's pre-backward hook sits on that output, and under DeepSpeed ZeRO-3 the head module's
    (it gathers the head's weight again); the tiles' gradients then reach a whole weight, as a full-logits loss's
    would, and the wrapper reduces them from there."""

    @staticmethod
    def forward(
        ctx: Any,  # noqa: ANN401
        logits: torch.Tensor,
        value: torch.Tensor,
        box: _GradientBox,
    ) -> torch.Tensor:
        ctx.box, ctx.shape, ctx.dtype = box, logits.shape, logits.dtype
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:  # noqa: ANN401
        ctx.box.grad = grad
        return grad.new_zeros(ctx.shape, dtype=ctx.dtype), None, None


class _Capture:
    """Stands in for the output layer's ``forward`` while one model call runs (an instance attribute of the head
    module, so the model's own forward, and whatever wraps it — accelerate's autocast, DDP — runs unchanged): it
    computes the tiles' loss sum from the hidden states it is given and returns a ``[batch, positions, 1]`` zero
    placeholder instead of the logits (the model's transforms of its logits then cost nothing; no labels are given,
    so the model computes no loss of its own). With gradient, the placeholder depends on the sum
    (:class:`_ThroughLogits`)."""

    def __init__(
        self,
        head: nn.Module,
        forward: Any,
        targets: torch.Tensor,
        transform: LogitTransform,
        ignore: int,
        smoothing: float = 0.0,
    ):
        self.head, self.forward, self.targets, self.transform, self.ignore = head, forward, targets, transform, ignore
        self.smoothing, self.wrapper = smoothing, None  # wrapper: the model as called (DDP...), for into_grad
        self.sum_loss: torch.Tensor | None = None
        self.box = _GradientBox()
        self.rows = 0

    @torch.compiler.disable  # never traced: dynamo lost the tiles' gradients (every parameter's was 0, issue 36)
    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.sum_loss is not None or hidden.shape[:-1] != self.targets.shape:
            raise GradAccLossError(
                f"fused_lm_head: the output layer was called with hidden states of shape {tuple(hidden.shape)} for "
                f"targets of shape {tuple(self.targets.shape)} (or twice in one forward); this model's head is not "
                "one projection of every position. Set `fused_lm_head=False`."
            )
        targets = self.targets.to(hidden.device)
        counted = targets != self.ignore
        self.rows = int(counted.sum())
        self.sum_loss = fused_cross_entropy_sum(
            hidden[counted],
            self.forward,
            targets[counted],
            transform=self.transform,
            ignore_index=self.ignore,
            label_smoothing=self.smoothing,
            wrapper=self.wrapper,
        )
        if self.sum_loss.requires_grad:
            placeholder = _ThroughLogits.apply(self.sum_loss, hidden.detach(), self.box)
        else:
            placeholder = hidden.new_zeros((*hidden.shape[:-1], 1))
        placeholder.fused_rows = self.rows  # what the LM head projected (hf-gradacc bench counts it)
        return placeholder


def fused_causal_lm_sum(
    model: nn.Module,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
) -> FusedOutput:
    """One forward of ``model`` (wrapped or not; no labels in ``inputs``) with the fused head: the SUM of the
    cross-entropy over the causal ``targets`` (already shifted: position ``i`` predicts ``targets[i]``) that are not
    ``ignore_index`` (with ``label_smoothing``, the smoothed cross-entropy).

    With gradient the sum is computed from the model's returned ``logits`` (a placeholder): its backward pass goes
    through the model's output and the head's output before the tiles, as a full-logits loss's would, so the hooks
    of DDP, DeepSpeed ZeRO-3 and FSDP2 on those outputs run first and the head's weight is whole again when the
    tiles' gradients (computed in the forward pass) reach it."""
    from ..heads import unwrap_model

    refuse_compiled_on_several_processes(model)
    base = unwrap_model(model)
    head = base.get_output_embeddings()
    missing = object()
    before = head.__dict__.get("forward", missing)
    capture = _Capture(head, head.forward, targets, LogitTransform.of(base), ignore_index, label_smoothing)
    capture.wrapper = model
    head.forward = capture  # type: ignore[method-assign]
    try:
        outputs = model(**inputs)
    finally:
        if before is missing:
            del head.forward
        else:
            head.forward = before  # type: ignore[method-assign]
    if capture.sum_loss is None:
        raise GradAccLossError(
            f"fused_lm_head: {type(base).__name__}'s forward never called its output layer; set `fused_lm_head=False`."
        )
    sum_loss = capture.sum_loss
    if sum_loss.requires_grad:
        logits = outputs.get("logits") if hasattr(outputs, "get") else None
        if not (torch.is_tensor(logits) and logits.requires_grad):
            raise GradAccLossError(
                f"fused_lm_head: {type(base).__name__} returned no `logits` computed from its output layer's result; "
                "set `fused_lm_head=False`."
            )
        sum_loss = _FromLogits.apply(logits, sum_loss.detach(), capture.box)
    return FusedOutput(sum_loss=sum_loss, backbone=outputs)


# ------------------------------------------------------------------------------------ the start-up check's row
# The check (:func:`fused_row_check`) runs the model's own forward with the labels on one row: the FULL logits of that
# row, ``positions x vocabulary`` in float32, plus the model's log-probabilities of them. Given a whole micro-batch
# row it projects every padding position and, in a packed row, every sample of the row (476 positions at a
# 151,936-token vocabulary: 0.28 GB of logits and as much again of log-probabilities; the first step's peak was
# 3.3-4.3x that of the fused steps after it, docs/benchmarks.md). A causal model's loss on the first ``n`` positions
# depends on those positions only, so the check's row (the first with a counted target) is cut after its first
# :data:`CHECK_TARGETS` counted targets (:func:`check_row`): the same comparison on fewer positions (the prompt before
# the first target stays: it is their context). Inputs the cut cannot follow (images, 4-D masks: any key but the
# per-position ones below) keep the whole row.
CHECK_TARGETS = 32
"""Counted targets the start-up check compares on (a logit transform the fused head misses shows on every one)."""

_PER_POSITION = frozenset(
    {"input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids", "seq_idx", "cache_position"}
)
_SEQUENCE_OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")  # packed rows' sample offsets, [0, n0, n0 + n1, ..., T]
_SEQUENCE_MAX = ("max_length_q", "max_length_k")


class CheckRow(NamedTuple):
    inputs: dict[str, Any]
    targets: torch.Tensor
    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None


def check_row(
    inputs: dict[str, Any],
    targets: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    *,
    ignore_index: int,
    num_targets: int = CHECK_TARGETS,
) -> CheckRow | None:
    """One row of a causal-LM micro-batch for the fused head's start-up check: the first row with a counted target
    (the row :func:`~hf_gradacc.fused.head.fused_row_check` takes), cut right after its ``num_targets``-th counted
    target (or its last, if it has fewer); the targets (and the
    ``shift_labels``) at the cut's last position set to ``ignore_index``, since the model's own loss sees no label
    past the cut. None where nothing needs cutting or the inputs hold a key the cut cannot follow (the caller then
    checks the whole first row, as before).

    Example:
        ```python
        row = check_row(inputs, targets, labels, shift_labels, ignore_index=-100)
        one = row or CheckRow(inputs, targets, labels, shift_labels)
        pair = fused_row_check(model, one.inputs, one.targets, labels=one.labels, shift_labels=one.shift_labels,
                               ignore_index=-100)
        ```
    """
    if targets.dim() != 2:
        return None
    rows, width = targets.shape
    for key, value in inputs.items():
        if not torch.is_tensor(value) or key in _SEQUENCE_MAX:
            continue
        if key in _SEQUENCE_OFFSETS:
            if rows != 1 or value.dim() != 1:
                return None
        elif key not in _PER_POSITION or value.dim() < 2 or tuple(value.shape[:2]) != (rows, width):
            return None
    for given in (labels, shift_labels):
        if given is not None and tuple(given.shape) != (rows, width):
            return None
    counted = targets != ignore_index
    totals = counted.sum(dim=-1)
    if not bool((totals > 0).any()):
        return None
    row = int(torch.nonzero(totals > 0)[0, 0])  # the row the check always took: the first with a counted target
    need = min(int(totals[row]), num_targets)
    last = int(((counted[row].cumsum(dim=-1) >= need) & counted[row]).int().argmax())  # its need-th counted target
    length = last + 2  # the model's own loss needs the label one past the last target it scores
    if length >= width:
        if rows == 1:
            return None
        length = width
    cut = slice(row, row + 1), slice(0, length)
    one = {}
    for key, value in inputs.items():
        if key in _SEQUENCE_OFFSETS and torch.is_tensor(value):
            kept = value[value < length]
            one[key] = torch.cat([kept, kept.new_tensor([length])])
        elif torch.is_tensor(value) and key not in _SEQUENCE_MAX:
            one[key] = value[cut]
        else:
            one[key] = value
    for key in _SEQUENCE_MAX:  # the longest sample left (an int, as the packing collator gives it)
        offsets = one.get(key.replace("max_length", "cu_seq_lens"))
        if key in one and torch.is_tensor(offsets):
            one[key] = int(offsets.diff().max())
    one_targets = targets[cut].clone()
    one_shift = shift_labels[cut].clone() if shift_labels is not None else None
    if length < width:
        one_targets[0, -1] = ignore_index
        if one_shift is not None:
            one_shift[0, -1] = ignore_index
    return CheckRow(one, one_targets, labels[cut] if labels is not None else None, one_shift)


def fused_row_check(
    model: nn.Module,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    *,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    ignore_index: int,
) -> tuple[float, float] | None:
    """The start-up check of the fused head on ONE row (the first with a counted target; for a causal LM cut after its
    first 32 counted targets by :func:`check_row`), without gradient: the model's own loss of that
    row (its forward with the labels: the full logits of one row, no graph; minus the router terms it adds, for a
    mixture of experts) and the fused reconstruction of the same row (its sum over its count). None when no row has
    a counted target or the model computes no loss.

    Every rank of a sharded model (ZeRO-3, FSDP2) must run the same collectives, so the two forwards always run: a
    micro-batch without a counted target runs them on its first row, and the result is None."""
    from ..auxiliary import _router_losses
    from ..heads import unwrap_model

    counts = (targets != ignore_index).sum(dim=-1)
    rows = torch.nonzero(counts > 0).flatten()
    row, batch_size = (int(rows[0]) if rows.numel() else 0), int(targets.shape[0])
    one = _rows_of(inputs, row, batch_size)
    # the model's own loss knows only -100 as ignored: another ``ignore_index`` (-1) would be an out-of-range target
    given = {"labels": model_labels(labels[row : row + 1], ignore_index)} if labels is not None else {}
    if shift_labels is not None:
        given["shift_labels"] = model_labels(shift_labels[row : row + 1], ignore_index)
    base = unwrap_model(model)
    with torch.no_grad():
        own = base(**one, **given)
        ours = fused_causal_lm_sum(base, one, targets[row : row + 1], ignore_index=ignore_index).sum_loss
    loss = own.get("loss") if hasattr(own, "get") else None
    if rows.numel() == 0 or not torch.is_tensor(loss):
        return None
    router = sum(coef * float(value) for _, value, coef in _router_losses(base, own))
    return float(ours) / int(counts[row]), float(loss.float()) - router
