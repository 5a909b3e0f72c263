"""Opt-in patch: let accelerate run an FSDP (v2) config on a CPU-only host, over gloo.

Upstream behaviour (accelerate 1.15, `AcceleratorState.__init__`): the FSDP branch is only reached for the
MULTI_GPU-like distributed types, so on a host without an accelerator a run launched with an FSDP config (or a
`TrainingArguments(fsdp=..., use_cpu=True)`) silently trains with DDP over gloo (MULTI_CPU): nothing is sharded and
an FSDP-specific code path is never exercised. FSDP2 itself (`fully_shard`) works on CPU tensors with gloo.

The patch wraps `AcceleratorState.__init__`: when the state comes out MULTI_CPU while an FSDP plugin was given, it
switches the state to FSDP with that plugin, and writes the switch into PartialState's shared state too (otherwise
the next `AcceleratorState()`, e.g. inside `Accelerator.prepare`, reads MULTI_CPU back). It changes nothing when
CUDA is available, when no FSDP plugin is given, or when accelerate already picked FSDP.

Delete this module once accelerate selects FSDP for ``distributed_type: FSDP`` + ``use_cpu: true`` on its own
(tested with accelerate 1.15.0; nothing is patched at import time).

Two ways to start 2 CPU ranks with it (see ``examples/accelerate_configs/fsdp2_cpu.yaml``):

    accelerate launch --config_file examples/accelerate_configs/fsdp2_cpu.yaml train.py
    torchrun --nproc_per_node 2 train.py   # with TrainingArguments(fsdp=True, fsdp_config={"version": 2},
                                            #                        use_cpu=True, ddp_backend="gloo")

where ``train.py`` calls :func:`enable_fsdp_on_cpu` before building `TrainingArguments` / the trainer.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["enable_fsdp_on_cpu", "disable_fsdp_on_cpu", "is_fsdp_on_cpu_enabled"]

TESTED_ACCELERATE = "1.15.0"

_original_init: Any = None


def is_fsdp_on_cpu_enabled() -> bool:
    """Whether :func:`enable_fsdp_on_cpu` is in effect."""
    return _original_init is not None


def _switch_to_fsdp(state: Any, fsdp_plugin: Any) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if fsdp_plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return
    state.distributed_type = DistributedType.FSDP
    if getattr(state, "_mixed_precision", "no") != "no":
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    # AcceleratorState keeps its own shared dict; PartialState's is what the next AcceleratorState() starts from
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    logger.warning(
        f"hf_gradacc.patches.fsdp_cpu: accelerate chose MULTI_CPU (DDP) for an FSDP config on this CPU-only host; "
        f"switched to FSDP (fsdp_version {getattr(fsdp_plugin, 'fsdp_version', '?')}) over "
        f"{getattr(state, 'backend', None)} on {state.num_processes} processes."
    )


def enable_fsdp_on_cpu() -> bool:
    """Make accelerate honour an FSDP config on a CPU-only host (gloo). Idempotent; undo with
    :func:`disable_fsdp_on_cpu`.

    Returns True when the patch is in effect, False when it was not applied (CUDA is available: accelerate selects
    FSDP there by itself). Call it before the `TrainingArguments` and the trainer are created. It is meant for
    trying an FSDP2 setup on a laptop or in CI before renting GPUs; numbers (speed, memory) on CPU say nothing about
    GPUs.

    Example:
        ```python
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
        args = GradAccConfig(output_dir="out", fsdp=True, fsdp_config={"version": 2}, use_cpu=True,
                             ddp_backend="gloo", gradient_accumulation_steps=4)
        ```
    """
    global _original_init
    if torch.cuda.is_available():
        logger.info("hf_gradacc.patches.fsdp_cpu: CUDA is available, accelerate selects FSDP itself; not patched.")
        return False
    if _original_init is not None:
        return True
    import accelerate
    from accelerate.state import AcceleratorState

    if accelerate.__version__.split(".")[0] != TESTED_ACCELERATE.split(".")[0]:
        logger.warning(
            f"hf_gradacc.patches.fsdp_cpu was tested with accelerate {TESTED_ACCELERATE}; this is "
            f"{accelerate.__version__}. If accelerate now selects FSDP on CPU by itself, the patch does nothing."
        )
    original = AcceleratorState.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        bound = signature.bind_partial(self, *args, **kwargs)
        _switch_to_fsdp(self, bound.arguments.get("fsdp_plugin"))

    AcceleratorState.__init__ = __init__
    _original_init = original
    logger.info("hf_gradacc.patches.fsdp_cpu: enabled (AcceleratorState.__init__ wrapped).")
    return True


def disable_fsdp_on_cpu() -> None:
    """Undo :func:`enable_fsdp_on_cpu` (idempotent). An accelerator state created in between keeps its type.

    Example:
        ```python
        from hf_gradacc.patches.fsdp_cpu import disable_fsdp_on_cpu

        disable_fsdp_on_cpu()
        ```
    """
    global _original_init
    if _original_init is None:
        return
    from accelerate.state import AcceleratorState

    AcceleratorState.__init__ = _original_init
    _original_init = None
    logger.info("hf_gradacc.patches.fsdp_cpu: disabled (AcceleratorState.__init__ restored).")
