"""FSDP2 (`torch.distributed.fsdp.fully_shard`, accelerate ``fsdp_version: 2``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers.utils import logging

from ..errors import GradAccConfigError, UnsupportedBackendError
from ..grads import RunningGradNorm
from .base import Backend, sum_of_squares
from .fsdp2_wrap import check_fsdp2_wrapping

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from ..config import GradAccSettings

logger = logging.get_logger(__name__)


def fsdp_root(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost module ``fully_shard`` was applied to (``model`` itself once accelerate prepared it).

    Example:
        ```python
        root = fsdp_root(trainer.model_wrapped)
        root.set_requires_gradient_sync(False)
        ```
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # pre-order: the first FSDP module is the outermost one
        if isinstance(module, FSDPModule):
            return module
    raise GradAccConfigError(
        f"The model ({type(model).__name__}) has no module wrapped by FSDP2 `fully_shard`, yet accelerate reports "
        "FSDP2. Let the Trainer prepare the model (do not pass an already-prepared model), or set `fsdp_version: 2` "
        "in the accelerate config."
    )


# FSDP1 strategies (accelerate's names, in its numbering) and what the FSDP2 accelerate config says instead
_FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_HSDP_LINES = (
    "parallelism_config:\n  parallelism_config_dp_replicate_size: <replicas, e.g. the number of nodes>\n"
    "  parallelism_config_dp_shard_size: <ranks per replica>"
)
_FSDP2_INSTEAD = {
    "SHARD_GRAD_OP": "`fsdp_reshard_after_forward: false` (FSDP2 keeps the parameters unsharded after forward)",
    "NO_SHARD": "`distributed_type: MULTI_GPU` (DDP) instead of FSDP",
    "HYBRID_SHARD": f"accelerate's 2-D mesh:\n{_HSDP_LINES}",
    "HYBRID_SHARD_ZERO2": f"accelerate's 2-D mesh and `fsdp_reshard_after_forward: false`:\n{_HSDP_LINES}",
}


def _strategy_name(value: Any) -> str:
    if value is None:
        return ""
    name = getattr(value, "name", None) or str(value).split(".")[-1].strip().upper()
    if name.isdigit() and 1 <= int(name) <= len(_FSDP1_STRATEGIES):
        return _FSDP1_STRATEGIES[int(name) - 1]
    return name


def check_fsdp2_sharding_strategy(plugin: Any, parallelism_config: Any = None, env: Any = None) -> None:
    """Raise when an ``fsdp_version: 2`` config names an FSDP1 sharding strategy other than ``FULL_SHARD``.

    accelerate 1.15 ignores ``fsdp_sharding_strategy`` under FSDP2 (it only warns that the field is deprecated,
    and not for the launcher's ``FSDP_SHARDING_STRATEGY``): ``HYBRID_SHARD`` gives a flat 1-D mesh over every rank,
    not hybrid sharding. HSDP comes from ``parallelism_config`` (``dp_replicate_size`` x ``dp_shard_size``); when
    that block already builds a 2-D mesh the ignored line is only warned about.

    Example:
        ```python
        check_fsdp2_sharding_strategy(accelerator.state.fsdp_plugin, accelerator.parallelism_config)
        ```
    """
    import os

    env = os.environ if env is None else env
    from_plugin = _strategy_name(getattr(plugin, "sharding_strategy", None))
    strategy = from_plugin or _strategy_name(env.get("FSDP_SHARDING_STRATEGY"))
    if strategy in ("", "FULL_SHARD"):
        return
    where = "fsdp_config['sharding_strategy']" if from_plugin else "`fsdp_sharding_strategy` in the accelerate config"
    replicate = int(getattr(parallelism_config, "dp_replicate_size", None) or 1) if parallelism_config else 1
    shard = int(getattr(parallelism_config, "dp_shard_size", None) or 1) if parallelism_config else 1
    if strategy.startswith("HYBRID_SHARD") and replicate > 1 and shard > 1:
        logger.warning(
            f"{where} ({strategy}) is ignored under `fsdp_version: 2`; the mesh is hybrid because of "
            f"`parallelism_config` (dp_replicate_size={replicate} x dp_shard_size={shard}). Remove the line."
        )
        return
    instead = _FSDP2_INSTEAD.get(strategy, "`fsdp_reshard_after_forward` and `parallelism_config`")
    raise UnsupportedBackendError(
        f"{where} is {strategy}, an FSDP1 strategy that accelerate ignores under `fsdp_version: 2` (it would shard "
        f"fully over a flat 1-D mesh of every rank, silently). Remove it and use {instead}\n(see "
        "examples/accelerate_configs/hsdp.yaml and docs/recipes.md, 'HSDP')."
    )


def is_hsdp(model: torch.nn.Module) -> bool:
    """Whether ``model``'s FSDP2 parameters live on a 2-D (replicate, shard) mesh: hybrid sharding (HSDP)."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in model.parameters():
        if isinstance(param, DTensor):
            return any(isinstance(p, Replicate) for p in param.placements)
    return False


class FSDP2Backend(Backend):
    """FSDP2 through accelerate: one window's gradient is reduced per ``args.fsdp_sync``.

    - ``'deferred'`` (default): every backward pass but the window's final one runs with
      ``set_requires_gradient_sync(False)``; each rank keeps the full (unsharded) gradient of its wrapped blocks
      and the final backward reduce-scatters the sum once. One reduce-scatter per FSDP group per optimizer step;
      unsharded gradient memory.
    - ``'every_micro_batch'``: every backward pass reduce-scatters and only the gradient shard is kept, summed
      across micro-batches. One reduce-scatter per FSDP group per backward pass; sharded gradient memory.
    - ``'defer_all_reduce'``: HSDP only. Every backward reduce-scatters inside the shard group; the all-reduce
      across replicas runs once, in the final backward (``set_requires_all_reduce``). On a 1-D mesh there is no
      all-reduce to defer: it behaves like ``'every_micro_batch'`` (a warning says so once).

    FSDP2 decides the reduction in each parameter group's post-backward hook, so the choice is made per backward
    pass (several backward passes per micro-batch are exact). FSDP2 averages over the data-parallel ranks like DDP,
    so the trainer's normalisation (sum / global count * world size) is exact for every choice. Every backward pass
    runs with ``set_is_last_backward(True)``, FSDP2's default: False would keep its backward-prefetch order across
    micro-batches and cost one mistargeted all-gather per later micro-batch.

    Example:
        ```python
        args = GradAccConfig(
            output_dir="out", gradient_accumulation_steps=8, fsdp=True, fsdp_config={"version": 2},
            fsdp_sync="every_micro_batch",   # sharded gradients only: less memory, GA x the reduce-scatters
        )
        ```
    """

    name = "fsdp2"

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        settings: GradAccSettings | None = None,
        *,
        multi_backward: bool = False,
        model: torch.nn.Module | None = None,
    ) -> None:
        super().__init__(accelerator, args, settings, multi_backward=multi_backward, model=model)
        self.fsdp_sync = self.settings.fsdp_sync
        self._hsdp: bool | None = None

    def kind(self) -> str:
        return "FSDP2"

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise a clear error for a model accelerate's FSDP2 wrapping would reject (see `fsdp2_wrap_problems`)."""
        check_fsdp2_wrapping(model, getattr(self.accelerator.state, "fsdp_plugin", None))

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().setup(model, optimizer)
        root = fsdp_root(model)
        self._hsdp = is_hsdp(root)
        if self.fsdp_sync == "defer_all_reduce" and not self._hsdp:
            logger.warning(
                "`fsdp_sync='defer_all_reduce'` only differs from 'every_micro_batch' under HSDP (a 2-D replicate x "
                "shard mesh); this model is fully sharded on a 1-D mesh, so every micro-batch reduce-scatters. Set "
                "`fsdp_sync='deferred'` for one reduce-scatter per optimizer step."
            )
        logger.info(f"FSDP2 gradient sync: {self.fsdp_sync} (HSDP: {self._hsdp})")

    def _set_sync(self, root: torch.nn.Module, *, is_final: bool) -> None:
        if self._hsdp is None:
            self._hsdp = is_hsdp(root)
        if self.fsdp_sync == "deferred":
            root.set_requires_gradient_sync(is_final)
        elif self.fsdp_sync == "defer_all_reduce" and self._hsdp:
            root.set_requires_gradient_sync(True)
            root.set_requires_all_reduce(is_final)
        else:
            root.set_requires_gradient_sync(True)
        # Every backward pass is marked last (FSDP2's default, what the stock Trainer runs). False on the non-final
        # ones would skip waiting on their reductions (there are none under 'deferred'), but it also keeps FSDP2's
        # backward-prefetch order (`post_forward_order`) across micro-batches: each later micro-batch's backward
        # then prefetches a group it does not need, one extra all-gather per optimizer step at GA 4 (35 collectives
        # per step against the stock 33 before, measured by tests/distributed/test_mesh_dp.py).
        root.set_is_last_backward(True)

    @contextlib.contextmanager
    def _restore_defaults(self) -> Iterator[None]:
        try:
            yield
        finally:
            # upstream defaults again, so that evaluation or user code outside the window never sees a stale setting
            root = fsdp_root(self._bound())
            root.set_requires_gradient_sync(True)
            root.set_is_last_backward(True)

    def sync_context(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        # FSDP2 reads the sync flags in the post-backward hooks, so `backward` sets them per pass (whatever the
        # micro-batch's position); after each micro-batch the upstream defaults are restored.
        return self._restore_defaults()

    def backward(self, loss: torch.Tensor, *, is_final: bool, retain_graph: bool = False) -> None:
        self._set_sync(fsdp_root(self._bound()), is_final=is_final)
        # accelerate's FSDP2 path is a plain loss.backward() (through its grad scaler with fp16); the Trainer keeps
        # accelerate's own accumulation at 1 step, so accelerate does not rescale the loss.
        self.accelerator.backward(loss, retain_graph=retain_graph)

    def scale_grads(self, factor: float) -> None:
        for param in self._bound().parameters():
            if param.grad is not None:
                param.grad.mul_(factor)  # elementwise on each rank's shard: no communication

    def running_grad_sq_norm(self, params: list[torch.nn.Parameter]) -> RunningGradNorm:
        """The gradient accumulated so far, between two micro-batches (see `Backend.running_grad_sq_norm`).

        - ``'every_micro_batch'`` (and ``'defer_all_reduce'`` on a 1-D mesh): ``param.grad`` is this rank's shard of
          the reduced sum so far: the shards' squares, one all-reduce (as `grad_sq_norms`); ``reduced=True``.
        - ``'deferred'``: nothing is reduced and ``param.grad`` is None; FSDP2 keeps each rank's own unsharded
          gradient on its parameter groups (``FSDPParam.unsharded_accumulated_grad``, else the unsharded
          parameter's ``.grad``): read there, ``reduced=False``, no communication. These are FSDP2 internals: a
          clear error if this torch version moved them.
        - ``'defer_all_reduce'`` under HSDP: reduced within each replica's shard group only, neither local nor
          global: refused.
        """
        from torch.distributed.tensor import DTensor

        if self.fsdp_sync == "deferred":
            # Parameters FSDP2 does not manage (plain tensors) keep their own local gradient on `.grad`.
            plain = (p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor))
            unsharded = _unsharded_grads(fsdp_root(self._bound()))
            return RunningGradNorm(sq_norm=float(sum_of_squares([*plain, *unsharded])), reduced=False)
        if self.fsdp_sync == "defer_all_reduce" and self._hsdp:
            raise UnsupportedBackendError(
                "Under HSDP with `fsdp_sync='defer_all_reduce'` the gradient between micro-batches is reduced within "
                "each replica's shard group only, so it cannot be read as a local or a global gradient. Use "
                "`fsdp_sync='every_micro_batch'` or `'deferred'`."
            )
        return RunningGradNorm(sq_norm=float(self.grad_sq_norms(params).sum()), reduced=True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        norm = self.accelerator.clip_grad_norm_(self._bound().parameters(), max_norm)
        if isinstance(norm, DTensor):  # a norm over sharded grads is a DTensor
            norm = norm.full_tensor()
        return norm if torch.is_tensor(norm) else torch.tensor(float(norm))

    # ---- gradient access: grads are DTensors sharded on dim 0 (Replicate x Shard(0) under HSDP)
    def full_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        # DTensor shards are all-gathered (a collective: every rank, same order).
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in fsdp_root(model).named_parameters()
        }

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        grad = param.grad
        if grad is None:
            grad = torch.zeros_like(param)
        return grad.full_tensor() if isinstance(grad, DTensor) else grad

    def local_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        grad = param.grad
        if grad is None:
            return torch.zeros_like(param.to_local() if isinstance(param, DTensor) else param)
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def write_full_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(param, DTensor):
            super().write_full_grad(param, grad)
            return
        # Every rank holds the same full gradient: cut this rank's shard locally (src_data_rank=None: no collective)
        shard = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
        if param.grad is None:
            param.grad = shard
        else:
            param.grad.to_local().copy_(shard.to_local())

    def grad_sq_norms(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        local: list[torch.Tensor] = []
        group = None
        shard_rank = 0
        for param in params:
            grad = param.grad
            if isinstance(grad, DTensor):
                if group is None:
                    # every placement but Replicate / Partial cuts: Shard, and _StridedShard (FSDP2 over a
                    # tensor-parallel dimension), which in torch 2.13 is no Shard subclass and has is_shard() False
                    dims = [i for i, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial())]
                    if dims:
                        group = grad.device_mesh.get_group(dims[0])
                        shard_rank = grad.device_mesh.get_local_rank(dims[0])
                local.append(grad.to_local().detach().double().pow(2).sum())
            elif grad is None:
                local.append(torch.zeros((), dtype=torch.float64, device=param.device))
            else:
                local.append(grad.detach().double().pow(2).sum())
        if not local:
            return torch.zeros(0, dtype=torch.float64)
        squares = torch.stack(local)
        if group is not None:
            # replicated (non-DTensor) grads are whole on every shard rank: count them once
            plain = torch.tensor([not isinstance(p.grad, DTensor) for p in params], device=squares.device)
            if shard_rank != 0:
                squares = torch.where(plain, torch.zeros_like(squares), squares)
            dist.all_reduce(squares, group=group)  # one collective: the shards' sums of squares add up
        return squares.cpu()


def _unsharded_grads(root: torch.nn.Module) -> list[torch.Tensor]:
    """Every FSDP2 parameter's unsharded local gradient accumulated while gradient sync is off (``deferred``): the
    reduce-dtype accumulator when FSDP2 keeps one, else the unsharded parameter's ``.grad``."""
    from torch.distributed.fsdp import FSDPModule

    grads: list[torch.Tensor] = []
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # older torch: one parameter group per module
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    grad = fsdp_param.unsharded_accumulated_grad
                    if grad is None:
                        grad = fsdp_param._unsharded_param.grad if hasattr(fsdp_param, "_unsharded_param") else None
                    if grad is not None:
                        grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
        except AttributeError as error:
            raise UnsupportedBackendError(
                f"This torch version's FSDP2 keeps the unsharded gradient elsewhere ({error}), so the gradient "
                "between "
                "micro-batches cannot be read with `fsdp_sync='deferred'`; use `fsdp_sync='every_micro_batch'`."
            ) from error
    return grads


def warn_if_no_full_model(accelerator: Any, output_dir: str) -> None:
    """After `Trainer.save_model` under FSDP: with a sharded state dict transformers writes no model (and raises
    nothing), so say so and how to get a full one."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        logger.warning(
            f"save_model({output_dir!r}) wrote no model: under FSDP with "
            f"state_dict_type={str(plugin.state_dict_type).split('.')[-1]} transformers saves nothing from "
            "save_model. Set `fsdp_state_dict_type: FULL_STATE_DICT` in the accelerate config (or "
            "fsdp_config={'state_dict_type': 'FULL_STATE_DICT'}) to get a full model (see docs/recipes.md)."
        )
