"""Single process and DDP (CPU gloo or GPU nccl)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..errors import UnsupportedBackendError
from .base import Backend

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from ..config import GradAccSettings


class DDPBackend(Backend):
    """One process, or DDP through accelerate.

    DDP decides at FORWARD time whether the backward all-reduces: every micro-batch but the last of the
    window runs under ``no_sync``; the last one all-reduces the summed local gradients once.
    """

    name = "ddp"
    supports_deferred_sync = True

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
        import torch.distributed as dist

        if getattr(args, "n_gpu", 1) > 1:
            raise UnsupportedBackendError(
                f"torch.nn.DataParallel over {args.n_gpu} GPUs in one process cannot be made exact; launch one "
                "process per GPU (`accelerate launch` / `torchrun`) or set CUDA_VISIBLE_DEVICES."
            )

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != accelerator.num_processes:
            # accelerate launch with `distributed_type: MULTI_GPU` on a host without GPU starts the ranks, but
            # without `use_cpu` each one reports ONE process: every rank would silently train alone on all the data.
            raise UnsupportedBackendError(
                f"accelerate reports {accelerator.num_processes} process(es) but torch.distributed has "
                f"{dist.get_world_size()} ranks, so every rank would train on its own. On a host without GPU (e.g. "
                "examples/accelerate_configs/ddp_cpu.yaml) set `use_cpu=True` in the TrainingArguments "
                "(`--use_cpu true`)."
            )

    def check_model(self, model: torch.nn.Module) -> None:
        """Also refuse a model FSDP2-sharded by transformers' ``DistributedConfig`` (``fsdp_size`` /
        ``dp_replicate_size``) without tensor parallelism: accelerate then sets up plain DDP (the Trainer passes
        no ``parallelism_config`` when ``tp_size`` is 1), so this backend would drive FSDP2's DTensor gradients
        as DDP replicas (measured: torch's "c10d.allreduce_ ... no sharding strategy" at the first step)."""
        super().check_model(model)
        from torch.distributed.fsdp import FSDPModule

        config = getattr(getattr(model, "config", None), "distributed_config", None)
        if config is None or not any(isinstance(m, FSDPModule) for m in model.modules()):
            return
        replicate = int(getattr(config, "dp_replicate_size", None) or 1)
        shard = int(getattr(config, "fsdp_size", None) or 1)
        raise UnsupportedBackendError(
            f"The model was sharded at load time by `DistributedConfig(dp_replicate_size={replicate}, "
            f"fsdp_size={shard})` (FSDP2 by transformers), and accelerate set up DDP for it: GradAccTrainer does not "
            "drive that combination. Load the model without `distributed_config` and let accelerate shard it: "
            f"`TrainingArguments(fsdp=True, fsdp_config={{'version': 2}}, parallelism_config=ParallelismConfig("
            f"dp_replicate_size={replicate}, dp_shard_size={shard}))`, or the accelerate config "
            "examples/accelerate_configs/hsdp.yaml (`parallelism_config_dp_replicate_size` / "
            "`parallelism_config_dp_shard_size`); see docs/recipes.md, 'HSDP'."
        )

    def sync_context(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        if self.mesh.dp_world_size == 1 or (is_last and not self.multi_backward):
            return contextlib.nullcontext()
        if self.multi_backward:
            return _local_forward_and_backward(self.accelerator, self._bound())
        return self.accelerator.no_sync(self._bound())

    def backward(self, loss: torch.Tensor, *, is_final: bool, retain_graph: bool = False) -> None:
        if is_final and self.multi_backward and self.mesh.dp_world_size > 1:
            # The forward ran under no_sync, so the reducer was told not to expect this backward: re-arm it
            # (reducer.prepare_for_backward) or the final pass is silently not all-reduced. The zero term makes
            # every parameter receive a gradient in this pass, so every bucket is reduced even when the final
            # loss term does not reach all of them (a GAN or VAE term that uses half the model).
            model = self._bound()
            for param in model.parameters():
                if param.requires_grad:
                    loss = loss + param.sum() * 0.0
            with _sync_in_backward(model, loss):
                self.accelerator.backward(loss, retain_graph=retain_graph)
        else:
            self.accelerator.backward(loss, retain_graph=retain_graph)

    def sync_window(self) -> None:
        if self.mesh.dp_world_size == 1:
            return
        model = self._bound()
        # A backward pass of an exact zero through every parameter: the re-armed reducer all-reduces the gradient
        # accumulated locally over the window, once.
        zero = None
        for param in model.parameters():
            if param.requires_grad:
                zero = param.sum() * 0.0 if zero is None else zero + param.sum() * 0.0
        if zero is not None:
            with _sync_in_backward(model, zero):
                self.accelerator.backward(zero)

    def scale_grads(self, factor: float) -> None:
        for param in self._bound().parameters():
            if param.grad is not None:
                param.grad.mul_(factor)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = self.accelerator.clip_grad_norm_(self._bound().parameters(), max_norm)
        return norm if torch.is_tensor(norm) else torch.tensor(float(norm))


@contextlib.contextmanager
def _local_forward_and_backward(accelerator: Accelerator, model: torch.nn.Module):
    """`accelerator.no_sync`, with DDP's buffer broadcast in the forward pass turned off as well.

    When every forward pass of the window runs under no_sync (several backward passes, auto_micro_batch, deferred
    normalisation), DDP still broadcasts buffers in a forward pass that follows one which raised (its post-forward
    never ran): a rank that ran out of memory would wait in that broadcast while the others wait in the trainer's
    all-gather. DDP broadcast the buffers when it wrapped the model; in this mode it would not again anyway.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.require_forward_param_sync = False
    with accelerator.no_sync(model):
        yield


@contextlib.contextmanager
def _sync_in_backward(model: torch.nn.Module, loss: torch.Tensor):
    """`Accelerator.trigger_sync_in_backward`, but arming the reducer with ``loss`` instead of no outputs.

    accelerate calls ``reducer.prepare_for_backward([])``: with ``find_unused_parameters=True`` (the Trainer's
    default for a PreTrainedModel) DDP then finds no parameter in the (empty) graph, marks all of them ready at
    once, and the backward fails with "Expected to mark a variable ready only once". Searching the graph from
    ``loss`` finds every parameter (the zero term above reaches them all).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    old = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([loss])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old
