"""The only code that knows DDP / DeepSpeed / FSDP2. `resolve_backend` is the one switch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UnsupportedBackendError
from .base import Backend
from .ddp import DDPBackend

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

__all__ = ["Backend", "DDPBackend", "finish_distributed", "resolve_backend", "SUPPORTED_BACKENDS"]

SUPPORTED_BACKENDS = (
    "single process (NO)",
    "DDP (MULTI_CPU / MULTI_GPU / MULTI_XPU / ...)",
    "DeepSpeed ZeRO-1/2/3",
    "FSDP2",
)


def resolve_backend(accelerator: Accelerator, args: TrainingArguments) -> Backend:
    """The backend for ``accelerator``'s distributed type, or an error listing the supported ones."""
    from accelerate.utils import DistributedType

    dist_type = accelerator.distributed_type
    ddp_types = {
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        *(getattr(DistributedType, n) for n in ("MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU", "MULTI_SDAA",
                                                  "MULTI_MUSA") if hasattr(DistributedType, n)),
    }
    if dist_type in ddp_types:
        return DDPBackend(accelerator, args)
    if dist_type == DistributedType.DEEPSPEED:
        from .deepspeed import DeepSpeedBackend  # deepspeed is an optional dependency

        return DeepSpeedBackend(accelerator, args)
    if dist_type == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise UnsupportedBackendError(
                f"FSDP version {version} is not supported: set `fsdp_version: 2` in the accelerate config "
                "(or `fsdp_config={'version': 2}` in TrainingArguments)."
            )
        from .fsdp2 import FSDP2Backend

        return FSDP2Backend(accelerator, args)
    raise UnsupportedBackendError(
        f"GradAccTrainer cannot make accumulation exact under distributed type {dist_type!s}. "
        f"Supported: {', '.join(SUPPORTED_BACKENDS)}. Change the accelerate config (`distributed_type`)."
    )


def finish_distributed() -> bool:
    """Wait for every rank, destroy the process group, and let gloo's worker threads finish before exit.

    Returns True when it tore down a gloo group (the caller may then leave through ``os._exit``), else False.

    On CPU ranks (gloo) a worker thread frees the last collective's tensors only once it holds the GIL; if the
    interpreter is already shutting down then, the rank aborts ("terminate called without an active exception",
    pytorch issue 190489). A short sleep after destroying the group hands it the GIL; that makes the abort rare, not
    impossible (the `hf-gradacc` executable therefore leaves through ``os._exit``). Delete once torch fixes it.
    """
    import gc
    import time

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    uses_gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if uses_gloo:
        gc.collect()  # a group held only by reference cycles is destroyed now, while the interpreter is alive
        time.sleep(0.25)
    return uses_gloo
