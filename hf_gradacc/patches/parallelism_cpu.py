"""Opt-in patch: let accelerate accept a tensor-parallel ``ParallelismConfig`` on CPU ranks (gloo, MULTI_CPU).

Upstream behaviour (accelerate 1.15, ``ParallelismConfig._validate_accelerator``): a ``ParallelismConfig`` of more
than one rank is refused unless the distributed type is FSDP2, DeepSpeed or a multi-DEVICE type, so on a CPU-only
host the transformers Trainer cannot be built for a model loaded with ``DistributedConfig(tp_size=...)`` (it creates
``ParallelismConfig(tp_size, dp_shard_size)`` itself): "ParallelismConfig is only compatible DistributedType.FSDP
(version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU".
transformers' tensor-parallel Llama itself runs on gloo (measured 2026-11-26: the stock Trainer trains TP 2 and
TP 2 x FSDP 2 once this one check lets it).

The patch wraps ``_validate_accelerator`` and lets exactly that refusal pass when the state is MULTI_CPU and the
config is tensor parallel (``tp_size`` > 1, as the Trainer builds it for a ``DistributedConfig(tp_size=...)`` model)
without context / sequence parallelism (``cp_size`` / ``sp_size`` still need a device). A config without ``tp_size``
(an HSDP block under a DDP launch) stays refused as upstream refuses it. Every other check of accelerate's stays. Part
of the CPU patch set :func:`hf_gradacc.patches.enable_cpu_distributed` (``HF_GRADACC_CPU_DISTRIBUTED=1``). Delete
this module once accelerate accepts MULTI_CPU (tested with accelerate 1.15.0).

Example:
    ```python
    from hf_gradacc.patches.parallelism_cpu import enable_parallelism_on_cpu

    enable_parallelism_on_cpu()      # before the Trainer is created; torchrun --nproc_per_node 4 train.py
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))
    ```
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["disable_parallelism_on_cpu", "enable_parallelism_on_cpu", "is_parallelism_on_cpu_enabled"]

TESTED_ACCELERATE = "1.15.0"
_REFUSAL = "ParallelismConfig is only compatible"

_original: Any = None


def is_parallelism_on_cpu_enabled() -> bool:
    """Whether :func:`enable_parallelism_on_cpu` is in effect."""
    return _original is not None


def enable_parallelism_on_cpu() -> bool:
    """Let a tensor-parallel ``ParallelismConfig`` run on MULTI_CPU (gloo). Idempotent; undo with
    :func:`disable_parallelism_on_cpu`. Returns True when the patch is in effect.

    Example:
        ```python
        enable_parallelism_on_cpu()
        ```
    """
    global _original
    if _original is not None:
        return True
    import accelerate
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    if accelerate.__version__.split(".")[:2] != TESTED_ACCELERATE.split(".")[:2]:
        logger.warning(
            f"hf_gradacc.patches.parallelism_cpu was tested with accelerate {TESTED_ACCELERATE}; this is "
            f"{accelerate.__version__}. If accelerate accepts MULTI_CPU by itself, the patch does nothing."
        )
    original = ParallelismConfig._validate_accelerator

    @functools.wraps(original)
    def _validate_accelerator(self: Any, accelerator: Any) -> Any:
        try:
            return original(self, accelerator)
        except ValueError as error:
            on_cpu = accelerator.distributed_type == DistributedType.MULTI_CPU
            tensor_parallel_only = self.tp_size > 1 and self.cp_size == 1 and self.sp_size == 1
            if not (on_cpu and _REFUSAL in str(error) and tensor_parallel_only):
                raise
            logger.info("hf_gradacc.patches.parallelism_cpu: accepted a ParallelismConfig on MULTI_CPU (gloo).")
            return None

    ParallelismConfig._validate_accelerator = _validate_accelerator
    _original = original
    return True


def disable_parallelism_on_cpu() -> None:
    """Undo :func:`enable_parallelism_on_cpu` (idempotent).

    Example:
        ```python
        disable_parallelism_on_cpu()
        ```
    """
    global _original
    if _original is None:
        return
    from accelerate.parallelism_config import ParallelismConfig

    ParallelismConfig._validate_accelerator = _original
    _original = None
