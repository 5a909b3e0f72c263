"""Read (and hook) the accumulated gradient on every backend, through the backend.

Under DeepSpeed ZeRO ``param.grad`` is None and under FSDP2 it is a shard; :class:`GradAccess` gives one way to
read it everywhere. Reads are valid between the final backward pass of an optimizer step and the step itself:
in ``on_pre_optimizer_step`` callbacks and in accumulated-gradient hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import GradAccUsageError, GradientsNotReadyError

AccumulatedGradHook = Callable[[str, torch.Tensor], None]

__all__ = ["AccumulatedGradHook", "GradAccess", "GradientsNotReadyError", "RunningGradNorm"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningGradNorm:
    """The squared L2 norm of the gradient accumulated so far in an optimizer step, read between two micro-batches
    (:meth:`GradAccess.running_sq_norm`).

    Attributes:
        sq_norm: the squared norm (a float64 sum; a DeepSpeed fp16 loss scale is removed, a GradScaler's is not,
            as in :meth:`GradAccess.norm`).
        reduced: True when every micro-batch so far was already averaged over the data-parallel ranks (DeepSpeed
            ZeRO-2/3 with ``zero_reduction='per_micro_batch'``, FSDP2 with ``fsdp_sync='every_micro_batch'``): the
            same value on every rank, the norm of the sum over all ranks' micro-batches so far. False: this rank's own
            accumulation, not reduced (single process, DDP, ZeRO-1, ZeRO ``per_window``, FSDP2 ``deferred``): it
            differs from rank to rank.
    """

    sq_norm: float
    reduced: bool


class GradAccess:
    """Gradient access for a :class:`~hf_gradacc.GradAccMixin` trainer (``trainer.grads``).

    Every method that may communicate (``full`` on sharded backends, ``norm``, ``named_norms``) is a collective:
    call it on every rank, with the same arguments, in the same order.

    Cost per call: DDP and single process: none (gradients are replicated). DeepSpeed ZeRO: ``full`` gathers one
    parameter's gradient (an all-reduce of its size); ``norm`` / ``named_norms`` one all-reduce of one float per
    parameter. FSDP2: ``full`` all-gathers one parameter's shards; the norms one all-reduce.

    Example:
        ```python
        from transformers import TrainerCallback

        class LogHeadGrad(TrainerCallback):
            def __init__(self, trainer):
                self.trainer = trainer

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                grad = self.trainer.grads.full("lm_head.weight")   # every rank calls it
                print(state.global_step, grad.norm().item(), self.trainer.grads.norm())
        ```
    """

    def __init__(
        self,
        backend: Any,
        named_parameters: Callable[[], list[tuple[str, torch.nn.Parameter]]],
        current_window: Callable[[], Any],
    ) -> None:
        """``backend``: the run's backend; ``named_parameters()``: the trainable parameters, by name, in one order on
        every rank; ``current_window()``: the optimizer step in flight (None between steps). The step's owner
        (:class:`~hf_gradacc.step.engine.StepEngine`) builds it; users reach it as ``trainer.grads``."""
        self._backend, self._named_parameters, self._window = backend, named_parameters, current_window

    @property
    def is_ready(self) -> bool:
        """True between the final backward pass of an optimizer step and the step."""
        window = self._window()
        return window is not None and window.grads_ready

    def _check(self) -> None:
        if not self.is_ready:
            raise GradientsNotReadyError(
                "The accumulated gradient is readable only between the final backward pass of an optimizer step and "
                "the step: in `on_pre_optimizer_step` callbacks and in accumulated-gradient hooks."
            )

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trainable parameters, by name, in the same order on every rank."""
        return self._named_parameters()

    def _param(self, name: str) -> torch.nn.Parameter:
        for n, p in self.named_parameters():
            if n == name:
                return p
        raise GradAccUsageError(
            f"No trainable parameter named {name!r}; `trainer.grads.named_parameters()` lists the names."
        )

    def full(self, name: str) -> torch.Tensor:
        """The full accumulated, reduced gradient of parameter ``name`` (a collective on sharded backends)."""
        self._check()
        return self._backend.full_grad(self._param(name))

    def local(self, name: str) -> torch.Tensor:
        """This rank's part of the gradient: the whole gradient on DDP, the local shard under ZeRO-3 / FSDP2."""
        self._check()
        return self._backend.local_grad(self._param(name))

    def named_norms(self) -> dict[str, float]:
        """L2 norm of every trainable parameter's full gradient (one collective)."""
        self._check()
        named = self.named_parameters()
        squares = self._backend.grad_sq_norms([p for _, p in named])
        return {n: math.sqrt(max(float(s), 0.0)) for (n, _), s in zip(named, squares.tolist())}

    def norm(self) -> float:
        """Global L2 norm of the accumulated gradient, before clipping (one collective)."""
        self._check()
        squares = self._backend.grad_sq_norms([p for _, p in self.named_parameters()])
        return math.sqrt(max(float(squares.sum()), 0.0))

    def running_sq_norm(self) -> RunningGradNorm:
        """Squared L2 norm of the gradient accumulated SO FAR in the optimizer step, between two of its micro-batches
        (``on_substep_end``), before the final backward pass; read-only, no gradient copy.

        Before the final backward pass the gradient is in a different state on each backend (see
        :class:`RunningGradNorm`): ``reduced`` says whether it was already averaged over the ranks. Where it was
        (sharded backends that reduce every micro-batch) this is a collective, one small all-reduce (one float on
        DeepSpeed, one per parameter on FSDP2): call it on every rank. Elsewhere no communication. Backends whose
        running gradient cannot be read raise :class:`~hf_gradacc.UnsupportedBackendError` on every rank alike
        (:meth:`Backend.running_grad_sq_norm`).

        Example:
            ```python
            class FirstMicroBatchNorm(GradAccCallback):
                def on_substep_end(self, args, state, control, **kwargs):
                    running = self.trainer.grads.running_sq_norm()   # every rank calls it
                    print(running.sq_norm, running.reduced)
            ```
        """
        window = self._window()
        if window is None or window.index is not None or window.final_backward_done or window.grads_ready:
            raise GradientsNotReadyError(
                "The running gradient is readable only between two micro-batches of an optimizer step, before its "
                "final backward pass (in `on_substep_end` callbacks); the step's reduced gradient is read with "
                "`trainer.grads.norm()` in `on_accumulated_grads` / `on_pre_optimizer_step`."
            )
        return self._backend.running_grad_sq_norm([p for _, p in self.named_parameters()])

    def run_hooks(self, hooks: list[tuple[AccumulatedGradHook, bool]]) -> torch.Tensor | None:
        """Call every registered accumulated-gradient hook on every trainable parameter, in one order on every rank;
        a full gradient a hook changed is written back into the backend's storage. Returns whether a hook left a
        non-finite value in what it was given (a 0-d bool tensor, no device sync; None without hooks): under ZeRO a
        NaN written into another rank's partition never reaches the norm, yet the step must be dropped."""
        if not hooks:
            return None
        backend = self._backend
        nonfinite = None
        for name, param in self.named_parameters():
            for hook, local in hooks:
                grad = backend.local_grad(param) if local else backend.full_grad(param)
                hook(name, grad)
                if not local:
                    backend.write_full_grad(param, grad)
                bad = ~torch.isfinite(grad).all()
                nonfinite = bad if nonfinite is None else nonfinite | bad
        return nonfinite
