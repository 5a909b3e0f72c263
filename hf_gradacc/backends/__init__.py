"""The only code that knows DDP / DeepSpeed / FSDP2. `resolve_backend` is the one switch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedBackendError
from .base import Backend
from .ddp import DDPBackend
from .mesh import Mesh, check_launched_world, mesh_from_accelerator
from .sharded_model import check_context_parallel, uses_expert_parallelism

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from ..config import GradAccSettings

__all__ = [
    "Backend",
    "DDPBackend",
    "Mesh",
    "SUPPORTED_BACKENDS",
    "check_launched_world",
    "mesh_from_accelerator",
    "resolve_backend",
]

SUPPORTED_BACKENDS = (
    "single process (NO)",
    "DDP (MULTI_CPU / MULTI_GPU / MULTI_XPU / ...)",
    "DeepSpeed ZeRO-1/2/3",
    "FSDP2",
    "tensor parallel (transformers DistributedConfig tp_size, alone or x FSDP2)",
    "expert parallel (transformers DistributedConfig ep_size equal to fsdp_size or tp_size)",
)


# What `accelerate launch` (and TrainingArguments' `fsdp` / `deepspeed`) ask for, in the environment.
_REQUESTED = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED"}


def check_requested_backend(dist_type: Any) -> None:
    """Raise when the launch asked for FSDP or DeepSpeed but accelerate set up something else on this host.

    On a host without GPU accelerate silently falls back to CPU DDP for an FSDP config: the run would "work" and
    shard nothing. ``HF_GRADACC_CPU_DISTRIBUTED=1`` (:mod:`hf_gradacc.patches`) makes such configs run on CPU ranks.
    """
    for variable, wanted in _REQUESTED.items():
        if (
            os.environ.get(variable, "").strip().lower() in ("1", "true", "yes")
            and str(dist_type).split(".")[-1] != wanted
        ):
            got = str(dist_type).split(".")[-1]
            from ..patches import CPU_DISTRIBUTED_ENV

            if os.environ.get(CPU_DISTRIBUTED_ENV, "").strip().lower() in ("1", "true", "yes"):
                hint = (
                    f"{CPU_DISTRIBUTED_ENV} is set, so the CPU patch is on: an FSDP config on CPU ranks also needs "
                    "`--use_cpu true` (TrainingArguments.use_cpu=True) in the script's arguments, and a DeepSpeed one "
                    "must NOT get it (see docs/recipes.md)."
                )
            else:
                hint = (
                    f"On a host without GPU set {CPU_DISTRIBUTED_ENV}=1 to run the config on CPU ranks (FSDP also "
                    "needs "
                    "`--use_cpu true`); otherwise fix the accelerate config (`distributed_type`)."
                )
            raise UnsupportedBackendError(
                f"The launch asks for {wanted} (`{variable}=true`, from the accelerate config or TrainingArguments) "
                "but "
                f"accelerate set up {got} on this host, so the run would not be what the config says. {hint}"
            )


def _check_joined_world() -> None:
    """Every rank, at trainer construction: the world it joined is the one its launch asked for (see
    `check_launched_world`; no collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # one process without a process group: nothing to compare
        check_launched_world(dist.get_world_size())


def resolve_backend(
    accelerator: Accelerator,
    args: TrainingArguments,
    settings: GradAccSettings | None = None,
    *,
    multi_backward: bool = False,
    model: Any = None,
) -> Backend:
    """The backend for ``accelerator``'s distributed type, or an error listing the supported ones. ``model``: a model
    sharded at load time with expert parallelism (``DistributedConfig(ep_size > 1)``) goes to the tensor-parallel
    backend even where accelerate sees no mesh (``tp_size`` 1 gives it no ``parallelism_config``).

    Example:
        ```python
        backend = resolve_backend(trainer.accelerator, trainer.args)
        print(backend.describe())            # "single process (NO)", "DeepSpeed ZeRO-2, 2 processes, gloo", ...
        ```
    """
    from accelerate.utils import DistributedType

    dist_type = accelerator.distributed_type
    ddp_types = {
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        *(
            getattr(DistributedType, n)
            for n in ("MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU", "MULTI_SDAA", "MULTI_MUSA")
            if hasattr(DistributedType, n)
        ),
    }
    check_requested_backend(dist_type)
    _check_joined_world()
    check_context_parallel(getattr(accelerator, "parallelism_config", None), distributed_type=dist_type)
    if dist_type in ddp_types:
        tp_size = int(getattr(getattr(accelerator, "parallelism_config", None), "tp_size", 1) or 1)
        if tp_size > 1 or uses_expert_parallelism(model):
            from .tensor_parallel import TensorParallelBackend  # a model sharded by transformers' DistributedConfig

            return TensorParallelBackend(accelerator, args, settings, multi_backward=multi_backward, model=model)
        return DDPBackend(accelerator, args, settings, multi_backward=multi_backward, model=model)
    if dist_type == DistributedType.DEEPSPEED:
        from .deepspeed import DeepSpeedBackend  # deepspeed is an optional dependency

        return DeepSpeedBackend(accelerator, args, settings, multi_backward=multi_backward, model=model)
    if dist_type == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise UnsupportedBackendError(
                f"FSDP version {version} is not supported: set `fsdp_version: 2` in the accelerate config "
                "(or `fsdp_config={'version': 2}` in TrainingArguments)."
            )
        from .fsdp2 import FSDP2Backend, check_fsdp2_sharding_strategy

        check_fsdp2_sharding_strategy(accelerator.state.fsdp_plugin, getattr(accelerator, "parallelism_config", None))
        return FSDP2Backend(accelerator, args, settings, multi_backward=multi_backward, model=model)
    raise UnsupportedBackendError(
        f"GradAccTrainer cannot make accumulation exact under distributed type {dist_type!s}. "
        f"Supported: {', '.join(SUPPORTED_BACKENDS)}. Change the accelerate config (`distributed_type`)."
    )
