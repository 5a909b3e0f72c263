"""Opt-in, reversible, idempotent patches of upstream libraries. Nothing is patched at import time.

* :func:`enable_cpu_distributed` / :func:`disable_cpu_distributed`: the CPU patch set, every part a shipped CPU recipe
  (``examples/accelerate_configs/*cpu*.yaml``) needs to run on CPU ranks over gloo, to try a multi-GPU config on a
  laptop or test it in CI: DeepSpeed (``cpu_distributed``), FSDP2 (``fsdp_cpu``), and a tensor-parallel
  ``ParallelismConfig`` on MULTI_CPU (``parallelism_cpu``: a ``DistributedConfig(tp_size=...)`` model under
  ``ddp_cpu.yaml`` or ``torchrun``).

Set ``HF_GRADACC_CPU_DISTRIBUTED=1`` to have :class:`~hf_gradacc.GradAccTrainer` apply the whole set when it is
created (:func:`maybe_enable_from_env`); scripts that build their own ``TrainingArguments`` first are repaired then
too.

Example:
    ```bash
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml train.py
    ```
"""

from __future__ import annotations

import logging
import os

from . import cpu_distributed as _cpu_distributed
from .cpu_distributed import is_cpu_distributed_enabled
from .parallelism_cpu import disable_parallelism_on_cpu, enable_parallelism_on_cpu, is_parallelism_on_cpu_enabled

logger = logging.getLogger(__name__)

CPU_DISTRIBUTED_ENV = "HF_GRADACC_CPU_DISTRIBUTED"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

__all__ = [
    "CPU_DISTRIBUTED_ENV",
    "disable_cpu_distributed",
    "disable_parallelism_on_cpu",
    "enable_cpu_distributed",
    "enable_parallelism_on_cpu",
    "is_cpu_distributed_enabled",
    "is_parallelism_on_cpu_enabled",
    "maybe_enable_from_env",
]


def enable_cpu_distributed(*, fsdp: bool = True, parallelism: bool = True) -> bool:
    """Apply the CPU patch set: the DeepSpeed part (:func:`hf_gradacc.patches.cpu_distributed.enable_cpu_distributed`),
    with ``fsdp`` the FSDP2 part, with ``parallelism`` the tensor-parallel ``ParallelismConfig`` part
    (:func:`~hf_gradacc.patches.parallelism_cpu.enable_parallelism_on_cpu`). Each changes nothing on a host with CUDA.
    Idempotent; undo with :func:`disable_cpu_distributed`. Call it before ``TrainingArguments`` is built.

    Returns:
        True when the DeepSpeed part is in effect after the call (False on an accelerate too old to patch).

    Example:
        ```python
        from hf_gradacc.patches import enable_cpu_distributed

        enable_cpu_distributed()  # before TrainingArguments(...)
        ```
    """
    enabled = _cpu_distributed.enable_cpu_distributed(fsdp=fsdp)
    if parallelism:
        enable_parallelism_on_cpu()
    return enabled


def disable_cpu_distributed() -> bool:
    """Undo :func:`enable_cpu_distributed` (every part, whichever were applied). A state already built with the
    patches stays as it is. Returns True when something was restored.

    Example:
        ```python
        from hf_gradacc.patches import disable_cpu_distributed

        disable_cpu_distributed()
        ```
    """
    restored = _cpu_distributed.disable_cpu_distributed()
    if is_parallelism_on_cpu_enabled():
        disable_parallelism_on_cpu()
        restored = True
    return restored


def maybe_enable_from_env() -> bool:
    """Apply the patches that environment variables ask for; returns whether the CPU-distributed patch is on.

    ``HF_GRADACC_CPU_DISTRIBUTED=1`` (or true / yes / on) calls :func:`enable_cpu_distributed`: every part of the
    CPU patch set. An unknown value is ignored with a warning. Called by :class:`~hf_gradacc.GradAccTrainer` before
    it builds its accelerator.

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
