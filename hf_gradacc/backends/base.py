"""The interface every backend implements. The trainer talks to backends only through it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from transformers.utils import logging

from ..config import GradAccSettings
from ..errors import GradAccUsageError, UnsupportedBackendError
from ..grads import RunningGradNorm
from ..schedule import scaled_learning_rate
from .mesh import Mesh, mesh_from_accelerator

logger = logging.get_logger(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments


class Backend:
    """How one data-parallel backend syncs, runs backward, reduces gradients and steps.

    Subclasses live in one module each (``ddp.py``, ...) and are picked by
    :func:`hf_gradacc.backends.resolve_backend`. Everything a backend needs is given to its constructor or to
    :meth:`setup` (the prepared model and optimizer); the trainer never sets a backend's attributes.

    Args:
        accelerator: the trainer's accelerator.
        args: the trainer's `TrainingArguments` (batch sizes and clipping, which DeepSpeed's config must match).
        settings: the resolved knobs (``zero_reduction``, ``fsdp_sync``).
        multi_backward: a micro-batch may run several backward passes through one forward pass
            (``backward_per_term``, an overridden ``training_step``, ``auto_micro_batch``, streamed windows):
            forward passes must then not decide the sync, and only the FINAL backward pass of a window reduces.
        model: the model as built (its ``DistributedConfig`` sizes the mesh until :meth:`setup` binds the prepared
            one).
    """

    name: ClassVar[str] = "base"
    # Whether a window can run with NO collective until `sync_window` (streamed windows, auto_micro_batch).
    supports_deferred_sync: ClassVar[bool] = False
    # Whether several backward passes may run through ONE forward pass (retain_graph).
    supports_backward_per_term: ClassVar[bool] = True

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        settings: GradAccSettings | None = None,
        *,
        multi_backward: bool = False,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.args = args
        self.settings = settings = settings or GradAccSettings()
        self.multi_backward = multi_backward
        self.model: torch.nn.Module | None = None
        self._built_model = model
        self._mesh: Mesh | None = None
        for knob in ("defer_normalization", "auto_micro_batch"):
            if getattr(settings, knob) and not self.supports_deferred_sync:
                raise UnsupportedBackendError(
                    f"`{knob}=True` is not supported on the {self.name} backend: its gradient cannot be reduced once "
                    "after a window that ran without any collective. Supported: single process and DDP; turn it off "
                    "(the default prefetching path is exact everywhere)."
                )
        defaults = GradAccSettings()
        for knob, backend in (("zero_reduction", "deepspeed"), ("fsdp_sync", "fsdp2")):
            if getattr(settings, knob) != getattr(defaults, knob) and self.name != backend:
                logger.warning_once(
                    f"`{knob}={getattr(settings, knob)!r}` is ignored: it applies to the {backend} backend, and this "
                    f"run uses {self.name}. Remove it, or launch with a {backend} accelerate config."
                )

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise a clear error, when the trainer is created, for a model this backend cannot prepare."""
        from .sharded_model import check_model_sharding

        check_model_sharding(
            model, getattr(self, "args", None)
        )  # refuses pipeline parallelism; warns of unresumable saves

    def check_resume(self, folder: str) -> None:
        """Raise a clear error, when ``train()`` starts and before anything is loaded, for a checkpoint this backend
        cannot load on this run's ranks (every rank takes the same verdict). Nothing to check here: DDP and FSDP2
        checkpoints (full state dicts, or torch DCP) load on any number of processes."""

    def after_resume_load(self) -> None:
        """Called once after the Trainer loaded a resumed checkpoint, before the first step: mend what the backend's
        own load got wrong. Nothing here (DDP and FSDP2 load as saved)."""

    def kind(self) -> str:
        """Short name of the distributed setup, e.g. ``MULTI_CPU``, ``DeepSpeed ZeRO-2``, ``FSDP2``."""
        return str(self.accelerator.state.distributed_type).split(".")[-1]

    def describe(self) -> str:
        """One line for logs and reports: the setup, the number of ranks and the process-group backend."""
        import torch.distributed as dist

        if self.mesh.dp_world_size <= 1:
            return f"single process ({self.kind()})"
        group = dist.get_backend() if dist.is_available() and dist.is_initialized() else "?"
        return f"{self.kind()}, {self.mesh.dp_world_size} processes, {group}"

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Bind the prepared (wrapped) model once, before the first window; check what the backend built."""
        self.model = model
        self._mesh = None  # read again from the prepared model (FSDP2's DTensor parameters)

    def _bound(self) -> torch.nn.Module:
        if self.model is None:
            raise GradAccUsageError(f"the {self.name} backend is used before setup() bound the prepared model")
        return self.model

    @property
    def mesh(self) -> Mesh:
        """The run's :class:`~hf_gradacc.backends.mesh.Mesh`: which ranks count, average and hold copies (read from
        accelerate's state, its ``parallelism_config``, the model's ``DistributedConfig`` and, once :meth:`setup`
        bound the prepared model, its DTensor parameters)."""
        if self._mesh is None:
            model = self.model if self.model is not None else self._built_model
            self._mesh = mesh_from_accelerator(self.accelerator, model)
        return self._mesh

    @property
    def model_parallelism(self) -> str | None:
        """The model-parallel dimension of this run in words (ranks holding shards or copies of the same tokens:
        tensor or sequence parallelism), or None for data parallelism alone. Features that need whole tokens on a
        rank (the automatic fused head, ``router_balance='global_batch'``) ask this instead of the backend's type."""
        return None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """One collective: every rank's ``tensor`` stacked along a new first dim (every process: data ranks and,
        under sequence parallelism, the sequence shards, which hold different targets)."""
        if self.accelerator.num_processes == 1:
            return tensor.unsqueeze(0)
        return self.accelerator.gather(tensor.unsqueeze(0))

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over EVERY process of the default group (data, sequence, tensor ranks alike), in place;
        ``tensor`` itself on a single process. For verdicts every rank must share (a non-finite step)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tensor)
        return tensor

    def sync_context(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward passes; ``is_last``: the window's last micro-batch."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, is_final: bool, retain_graph: bool = False) -> None:
        """Accumulate ``loss``'s gradient. ``is_final`` marks the backward pass of the window that reduces."""
        raise NotImplementedError

    def sync_window(self) -> None:
        """Reduce the window's locally accumulated gradient (when no backward pass was final)."""
        raise NotImplementedError(f"the {self.name} backend cannot reduce a window after the fact")

    def scale_grads(self, factor: float) -> None:
        """Multiply the reduced, accumulated gradient by ``factor`` (streamed windows)."""
        raise NotImplementedError(f"the {self.name} backend cannot scale its gradient after the window")

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Norm of the accumulated, reduced gradient before clipping; clip when ``max_norm`` is finite."""
        raise NotImplementedError

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, lr_factor: float = 1.0) -> None:
        """Apply the accumulated gradient, at ``lr_factor`` times the learning rate of every parameter group
        (``lr_scaling`` of an accumulation schedule); the groups hold their own rate again afterwards."""
        with scaled_learning_rate(optimizer.param_groups, lr_factor):
            optimizer.step()

    def zero_grad(self) -> None:
        self._bound().zero_grad()

    @property
    def scales_loss(self) -> bool:
        """Whether a dynamic loss scaler (fp16) owns overflow: it skips a non-finite step and lowers its scale."""
        return getattr(self.accelerator, "scaler", None) is not None

    def skip_step(self) -> None:
        """Drop the window's accumulated gradient without stepping (a non-finite step)."""
        self.zero_grad()

    def full_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter of ``model``, whole, detached, on the CPU (a collective on sharded backends: call on every
        rank). Takes the model so that it also serves trainers this backend was never bound to (the stock one)."""
        module = self.accelerator.unwrap_model(model, keep_torch_compile=False)  # names without `_orig_mod.`
        return {n: p.detach().cpu() for n, p in module.named_parameters()}

    # ---- gradient access (valid between the final backward pass and the optimizer step)
    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The full reduced gradient of ``param``. Replicated backends return ``param.grad`` itself."""
        if param.grad is None:
            return torch.zeros_like(param)
        return param.grad

    def local_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's part of the gradient (the whole gradient on replicated backends)."""
        return self.full_grad(param)

    def write_full_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Store a (possibly modified) full gradient back. No-op when ``full_grad`` returned the live tensor."""
        if param.grad is None:
            param.grad = grad
        elif grad is not param.grad:
            param.grad.copy_(grad)

    def grad_sq_norms(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Squared L2 norm of every parameter's full gradient (float64, one entry per parameter)."""
        values = [
            p.grad.detach().double().pow(2).sum() if p.grad is not None else torch.zeros((), dtype=torch.float64)
            for p in params
        ]
        return torch.stack([v.cpu() for v in values]) if values else torch.zeros(0, dtype=torch.float64)

    def running_grad_sq_norm(self, params: list[torch.nn.Parameter]) -> RunningGradNorm:
        """Squared L2 norm of the gradient accumulated so far in the window, read BETWEEN two micro-batches (before the
        final backward pass), without copying it. Raises :class:`~hf_gradacc.UnsupportedBackendError` (on every rank
        alike: the answer depends on the configuration only) where it cannot be read.

        Single process and DDP: ``param.grad`` is this rank's own sum (non-final micro-batches run under ``no_sync``):
        ``reduced=False``, no communication.
        """
        return RunningGradNorm(sq_norm=float(sum_of_squares(p.grad for p in params)), reduced=False)


def sum_of_squares(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Sum of the squares of every element of ``tensors`` (None skipped), in float64, as a CPU scalar: one
    reduction per tensor without a float64 copy of it, and one device-to-host transfer per device."""
    per_device: dict[torch.device, torch.Tensor] = {}
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        square = torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64).square()
        per_device[square.device] = per_device[square.device] + square if square.device in per_device else square
    return sum((v.cpu() for v in per_device.values()), torch.zeros((), dtype=torch.float64))
