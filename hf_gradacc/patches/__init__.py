"""Opt-in, reversible, idempotent patches of upstream libraries. Nothing is patched at import time.

* :func:`enable_cpu_distributed` / :func:`disable_cpu_distributed`: run DeepSpeed (and FSDP2) accelerate configs on
  CPU ranks over gloo, to try a multi-GPU config on a laptop or test it in CI.

Set ``HF_GRADACC_CPU_DISTRIBUTED=1`` to have :class:`~hf_gradacc.GradAccTrainer` apply it when it is created
(:func:`maybe_enable_from_env`); scripts that build their own ``TrainingArguments`` first are repaired then too.

Example:
    ```bash
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml train.py
    ```
"""

from __future__ import annotations

import logging
import os

from .cpu_distributed import disable_cpu_distributed, enable_cpu_distributed, is_cpu_distributed_enabled

logger = logging.getLogger(__name__)

CPU_DISTRIBUTED_ENV = "HF_GRADACC_CPU_DISTRIBUTED"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

__all__ = [
    "CPU_DISTRIBUTED_ENV",
    "disable_cpu_distributed",
    "enable_cpu_distributed",
    "is_cpu_distributed_enabled",
    "maybe_enable_from_env",
]


def maybe_enable_from_env() -> bool:
    """Apply the patches that environment variables ask for; returns whether the CPU-distributed patch is on.

    ``HF_GRADACC_CPU_DISTRIBUTED=1`` (or true / yes / on) calls :func:`enable_cpu_distributed`. An unknown value
    is ignored with a warning. Called by :class:`~hf_gradacc.GradAccTrainer` before it builds its accelerator.

    Example:
        ```python
        import os
        from hf_gradacc.patches import maybe_enable_from_env

        os.environ["HF_GRADACC_CPU_DISTRIBUTED"] = "1"
        maybe_enable_from_env()
        ```
    """
    value = os.environ.get(CPU_DISTRIBUTED_ENV, "").strip().lower()
    if value in _TRUE:
        return enable_cpu_distributed()
    if value not in _FALSE:
        logger.warning(
            f"`{CPU_DISTRIBUTED_ENV}` ({value!r}) is not one of {_TRUE + _FALSE[1:]}; the CPU-distributed patch is "
            "not applied."
        )
    return is_cpu_distributed_enabled()
