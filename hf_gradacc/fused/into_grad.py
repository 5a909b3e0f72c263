"""The fused LM head's weight gradient added straight into the weight's existing float32 ``.grad`` (the micro-batches
of gradient accumulation after the first), instead of into a ``[vocabulary x hidden]`` buffer that autograd then adds
into ``.grad``: no weight-gradient temporary at all (:mod:`hf_gradacc.fused.head` calls this module).

The tiles compute the weight's gradient ``G`` in the FORWARD pass, while the factor the backward pass multiplies it by
(the loss's incoming gradient ``s``: the global denominator, the data-parallel size) is known only in the backward
pass. So the forward pass adds ``e * G`` with ``e`` the factor this weight's previous fused backward pass received (1
before any: the plain sum), and the backward pass settles it:

- ``s == e`` (every micro-batch of a window after the first: one denominator per window) and the write is still
  allowed: nothing to do; the weight gets no gradient from autograd (``None``).
- otherwise (another factor; a DDP backward that synchronises after all, as ``trigger_sync_in_backward`` makes it;
  a hook registered since): ``G`` is computed again from the saved rows (two of the three matmuls) and the update
  corrected: ``.grad += (s - e) * G``, or ``.grad -= e * G`` and ``s * G`` returned through autograd. Exact either way;
  the second way costs time, never correctness.

Where the write is allowed (:func:`into_grad_refusal`, checked in the forward AND the backward pass, from facts every
rank sees alike; neither way runs a collective): a float32 weight on CPU whose ``.grad`` exists and is a plain,
contiguous float32 tensor of its shape; no hook on the weight (``register_hook``, post-accumulate-grad hooks); one
process, or DDP inside ``no_sync`` (its reducer needs the AccumulateGrad hook on the synchronising pass). Refused under
DeepSpeed, FSDP (any version), DTensor parameters (tensor parallel), several processes without DDP, 16-bit or
non-contiguous gradients, and on accelerators (untested there; reading the factor would be a host sync). A weight
tied to the input embedding is fine: the embedding's gradient still reaches ``.grad`` through AccumulateGrad, which
adds it in place.

A fused loss computed with gradient whose backward pass never runs would leave ``e * G`` in ``.grad``: the next fused
forward pass on that weight raises :class:`~hf_gradacc.GradAccUsageError` (unless ``.grad`` was reset or zeroed in
between, as a retried window does).

**The first micro-batch of a window** has no ``.grad`` (``zero_grad(set_to_none=True)`` dropped it after the optimizer
step), so the tiles write the weight's gradient into a new float32 buffer that autograd adopts as ``.grad``. On CPU a
new buffer of that size costs its page faults on first touch (the 250 MiB of hidden 2,048 x vocabulary 32,000: about
0.1-0.2 s of one core, 10 % of the head's time there). Inside :func:`keeping_buffers` (GradAccTrainer's training
loop) the buffer is kept when ``.grad`` is dropped and the next window's first micro-batch writes into it (its first
tile overwrites it: no zeroing pass). It is reused only when nothing else holds its memory (a gradient someone kept
is never overwritten), for a float32 leaf weight on CPU without hooks, in a process without several ranks; it is let
go when a loss runs without the fused head (evaluation, full logits), when a checkpoint save begins, and when training
ends. It costs no peak: the buffer is the ``.grad`` it was, and the fused head makes it again at the end of the next
forward pass; between the two only the optimizer step's end and the next forward's layers run, which hold less.

The fused head is never traced by ``torch.compile`` (``torch.compiler.disable`` in :mod:`hf_gradacc.fused_head`);
:func:`compiled_part` says where a model is compiled, for the choices that depend on it (docs/memory.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from ..backends.wrappers import distributed_grad_write_refusal, several_processes, sharded_by
from ..errors import GradAccConfigError, GradAccUsageError

# the factor each weight's last fused backward pass received: the next forward pass's guess
_LAST_SCALE: WeakIdKeyDictionary = WeakIdKeyDictionary()
# weights whose in-place write was never settled by a backward pass (the value: a description for the error)
_ABANDONED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# each weight's last float32 gradient buffer, kept past `zero_grad(set_to_none=True)` inside keeping_buffers()
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()
_KEEPING = [0]  # nesting depth of keeping_buffers()
_UNFINISHED = [0]  # Written objects dropped without their attributes: the next begin() raises


@dataclass(slots=True)
class IntoGradStats:
    """How often the in-place write was taken (``written``), settled without work (``exact``), corrected in the
    backward pass (``corrected``), or refused in the forward pass (``refused``, by reason); how often a first
    micro-batch reused the buffer kept from the last window (``reused``). For tests and benchmarks."""

    written: int = 0
    exact: int = 0
    corrected: int = 0
    refused: dict[str, int] | None = None
    reused: int = 0  # a first micro-batch wrote into the buffer kept from the last window

    def refuse(self, reason: str) -> None:
        self.refused = self.refused or {}
        self.refused[reason] = self.refused.get(reason, 0) + 1


STATS = IntoGradStats()


def _weight_refusal(weight: torch.Tensor, wrapper: Any, head: Any) -> str | None:
    """What refuses both ways of managing the weight's float32 gradient by hand, whatever its ``.grad``: the device,
    the dtype, a tensor subclass, a hook, a sharded weight or wrapper."""
    if weight.device.type != "cpu":
        return "not on CPU"
    if weight.dtype != torch.float32:
        return "not float32"
    if type(weight) not in (nn.Parameter, torch.Tensor):
        return "a tensor subclass (DTensor)"
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return "a hook on the weight"
    return sharded_by(weight, wrapper, head)  # the backends' answer: a ZeRO / FSDP shard or wrapper


def compiled_part(model: Any) -> str | None:
    """Which part of ``model`` (wrapped or not) ``torch.compile`` traces, in words, or None: a ``torch.compile(model)``
    wrapper (``OptimizedModule``), a module compiled in place (``module.compile()``) or a ``forward`` replaced by a
    compiled function, on the model, its wrappers or any module inside."""
    if not isinstance(model, nn.Module):
        return None
    for name, module in model.named_modules():
        where = f"`{name}`" if name else f"the model ({type(module).__name__})"
        if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            return f"{where} is wrapped by `torch.compile` (an OptimizedModule)"
        if module.__dict__.get("_compiled_call_impl") is not None:
            return f"{where} was compiled in place (`.compile()`)"
        if hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable"):
            return f"{where}'s `forward` is a `torch.compile`d function"
    return None


def refuse_compiled_on_several_processes(model: nn.Module) -> None:
    """At each fused forward: a compiled model on several processes (untested with the fused head) raises, also where
    it was compiled after the trainer's construction checked it."""
    if not several_processes():
        return
    compiled = compiled_part(model)
    if compiled is not None:
        raise GradAccConfigError(
            f"fused_lm_head: {compiled}, on several processes; the fused head runs outside the compiled graph, which "
            "is tested on one process only. Set `fused_lm_head=False`, or do not compile the model (`torch_compile`)."
        )


def into_grad_refusal(weight: torch.Tensor, wrapper: Any, head: Any = None) -> str | None:
    """Why the fused head may NOT add its weight gradient straight into ``weight.grad`` now, or None when it may.
    ``wrapper``: the model as the training step called it (DDP, DeepSpeed's engine, ...; None: no wrapper known, then
    only a process without ``torch.distributed``); ``head``: the output layer module."""
    if not weight.is_leaf:  # a computed weight (parametrizations): autograd delivers its gradient
        return "not a leaf"
    grad = weight.grad
    if grad is None:
        return "no .grad yet"
    reason = _weight_refusal(weight, wrapper, head)
    if reason is not None:
        return reason
    if grad.dtype != torch.float32:
        return "not float32"
    if type(grad) is not torch.Tensor:
        return "a tensor subclass (DTensor)"
    if grad.layout != torch.strided or not grad.is_contiguous() or grad.shape != weight.shape:
        return "a non-contiguous .grad"
    return distributed_grad_write_refusal(wrapper, head)  # the backends' answer: DDP's state, several processes


@contextlib.contextmanager
def keeping_buffers() -> Iterator[None]:
    """Inside, each fused weight gradient's float32 buffer is kept when ``.grad`` is dropped, for the next window's
    first micro-batch (see the module docstring); leaving the outermost one lets every kept buffer go.

    Example:
        ```python
        with keeping_buffers():
            for window in windows:
                for batch in window:
                    fused_causal_lm_sum(model, batch, targets).sum_loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)  # the head's buffer stays for the next window
        ```
    """
    _KEEPING[0] += 1
    try:
        yield
    finally:
        _KEEPING[0] -= 1
        if not _KEEPING[0]:
            release_buffers()


def release_buffers() -> None:
    """Let every kept gradient buffer go (evaluation, a checkpoint save, a micro-batch without the fused head)."""
    _KEPT.clear()


def _storage_refs(tensor: torch.Tensor) -> int | None:
    """How many tensors hold ``tensor``'s memory (None where torch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = tensor.untyped_storage()  # this Python object holds one reference of its own
    return int(count(storage._cdata)) - 1


def _may_keep(weight: torch.Tensor, wrapper: Any, head: Any) -> bool:
    """A kept buffer's conditions on the weight: a float32 leaf on CPU, no hook, not sharded, in one process."""
    return weight.is_leaf and _weight_refusal(weight, wrapper, head) is None and not several_processes()


def kept_buffer(weight: torch.Tensor, wrapper: Any, head: Any) -> torch.Tensor | None:
    """In a first micro-batch's forward pass (``weight.grad`` None): the float32 buffer kept from the weight's last
    gradient, to write the new gradient into (every element overwritten), or None (then a new buffer is made)."""
    kept = _KEPT.pop(weight, None)
    if kept is None or weight.grad is not None or not _KEEPING[0]:
        return None
    if kept.shape != weight.shape or kept.dtype != torch.float32 or kept.device != weight.device:
        return None
    if not _may_keep(weight, wrapper, head):
        return None
    if _storage_refs(kept) != 1:  # someone kept the last gradient (a callback, a hook's list): never overwrite it
        return None
    STATS.reused += 1
    return kept


def keep_buffer(weight: torch.Tensor, grad: torch.Tensor, wrapper: Any, head: Any) -> None:
    """After the tiles: remember ``grad`` (the weight's new float32 gradient, not yet ``.grad``) for the next window,
    as another tensor over the same memory (not a view, which would hold ``grad``), so that autograd still adopts
    ``grad`` itself as ``.grad``."""
    if _KEEPING[0] and grad.dtype == torch.float32 and grad.shape == weight.shape and _may_keep(weight, wrapper, head):
        _KEPT[weight] = grad.detach()  # no view of `grad` (a view holds it: autograd would copy it, not adopt it)


class Written:
    """One in-place write: ``alpha * G`` added into ``grad`` (``weight.grad`` then) in the forward pass; ``recompute``
    gives ``G`` again (float32) for a correction."""

    __slots__ = ("weight", "grad", "alpha", "wrapper", "head", "recompute", "version", "settled", "__weakref__")

    def __init__(
        self, weight: torch.Tensor, alpha: float, wrapper: Any, head: Any, recompute: Callable[[], torch.Tensor]
    ) -> None:
        self.weight, self.grad, self.alpha, self.wrapper, self.head = weight, weight.grad, alpha, wrapper, head
        self.recompute, self.version, self.settled = recompute, -1, False

    def done_writing(self) -> None:
        self.version = self.grad._version
        STATS.written += 1

    def settle(self, incoming: torch.Tensor) -> torch.Tensor | None:
        """In the backward pass, with the loss's incoming gradient: None when ``.grad`` already holds the update;
        else the correction is made and the gradient autograd must still deliver is returned."""
        self.settled = True
        scale = float(incoming)
        _LAST_SCALE[self.weight] = scale
        same_grad = self.weight.grad is self.grad
        allowed = same_grad and into_grad_refusal(self.weight, self.wrapper, self.head) is None
        if allowed and scale == self.alpha:
            STATS.exact += 1
            return None
        STATS.corrected += 1
        again = self.recompute()
        if allowed:
            self.grad.add_(again, alpha=scale - self.alpha)
            return None
        if same_grad:  # take the write back; autograd delivers the gradient (DDP's reducer sees it)
            self.grad.sub_(again, alpha=self.alpha)
        return again.mul_(scale)

    def __del__(self) -> None:
        try:
            abandoned = (
                not self.settled
                and self.version >= 0
                and self.weight.grad is self.grad
                and self.grad._version == self.version
            )
        except AttributeError:  # made without __init__ (a tracer's copy): the next begin() raises, never silently
            _UNFINISHED[0] += 1
            return
        if abandoned:
            _ABANDONED[self.weight] = True


def begin(weight: torch.Tensor, wrapper: Any, head: Any, recompute: Callable[[], torch.Tensor]) -> Written | None:
    """In the forward pass: a :class:`Written` when the weight gradient may go straight into ``weight.grad`` (the
    caller then adds ``written.alpha * G`` into ``written.grad`` and calls ``done_writing``), else None."""
    if _UNFINISHED[0]:
        _UNFINISHED[0] = 0
        raise GradAccUsageError(
            "fused_lm_head: a write of the fused LM head's weight gradient into `.grad` was made by an object whose "
            "set-up never ran (torch.compile tracing the fused head does this), so the last update may be wrong. Run "
            "the fused head outside compiled code (hf_gradacc disables torch.compile on it; a tracer that ignores "
            "that cannot run it), or set `fused_lm_head=False`."
        )
    if _ABANDONED.pop(weight, None):
        raise GradAccUsageError(
            "fused_lm_head: a fused LM-head loss was computed with gradient and never back-propagated, after its "
            "weight "
            "gradient had been added into the head's `.grad` (done in the forward pass for the micro-batches after "
            "the "
            "first). Back-propagate every fused loss computed with gradient, compute it under `torch.no_grad()`, or "
            "zero the gradients (`model.zero_grad()`) before going on."
        )
    kept = _KEPT.get(weight)
    if kept is not None and weight.grad is not None and kept.data_ptr() != weight.grad.data_ptr():
        del _KEPT[weight]  # .grad was replaced: the kept memory is nobody's gradient now
    reason = into_grad_refusal(weight, wrapper, head)
    if reason is not None:
        STATS.refuse(reason)
        return None
    return Written(weight, _LAST_SCALE.get(weight, 1.0), wrapper, head, recompute)


def observe(weight: torch.Tensor, incoming: torch.Tensor) -> None:
    """Remember the factor a fused backward pass of ``weight`` received (CPU only: no host sync elsewhere)."""
    if incoming.device.type == "cpu":
        _LAST_SCALE[weight] = float(incoming)
