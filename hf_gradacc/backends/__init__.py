"""The only code that knows DDP / DeepSpeed / FSDP2. `resolve_backend` is the one switch."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedBackendError
from .base import Backend
from .ddp import DDPBackend

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from ..config import GradAccSettings

__all__ = ["Backend", "DDPBackend", "resolve_backend", "SUPPORTED_BACKENDS"]

SUPPORTED_BACKENDS = (
    "single process (NO)",
    "DDP (MULTI_CPU / MULTI_GPU / MULTI_XPU / ...)",
    "DeepSpeed ZeRO-1/2/3",
    "FSDP2",
)


def resolve_backend(
    accelerator: Accelerator,
    args: TrainingArguments,
    settings: GradAccSettings | None = None,
    *,
    multi_backward: bool = False,
) -> Backend:
    """The backend for ``accelerator``'s distributed type, or an error listing the supported ones.

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
        *(getattr(DistributedType, n) for n in ("MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU", "MULTI_SDAA",
                                                  "MULTI_MUSA") if hasattr(DistributedType, n)),
    }
    if dist_type in ddp_types:
        return DDPBackend(accelerator, args, settings, multi_backward=multi_backward)
    if dist_type == DistributedType.DEEPSPEED:
        from .deepspeed import DeepSpeedBackend  # deepspeed is an optional dependency

        return DeepSpeedBackend(accelerator, args, settings, multi_backward=multi_backward)
    if dist_type == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise UnsupportedBackendError(
                f"FSDP version {version} is not supported: set `fsdp_version: 2` in the accelerate config "
                "(or `fsdp_config={'version': 2}` in TrainingArguments)."
            )
        from .fsdp2 import FSDP2Backend

        return FSDP2Backend(accelerator, args, settings, multi_backward=multi_backward)
    raise UnsupportedBackendError(
        f"GradAccTrainer cannot make accumulation exact under distributed type {dist_type!s}. "
        f"Supported: {', '.join(SUPPORTED_BACKENDS)}. Change the accelerate config (`distributed_type`)."
    )


def __getattr__(name: str) -> Any:
    if name == "finish_distributed":  # moved in 0.2: it tears the process group down, it is not a backend
        warnings.warn(
            "`hf_gradacc.backends.finish_distributed` moved to `hf_gradacc.distributed.finish_distributed`; the old "
            "path will be removed in the next release.",
            FutureWarning,
            stacklevel=2,
        )
        from ..distributed import finish_distributed

        return finish_distributed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
