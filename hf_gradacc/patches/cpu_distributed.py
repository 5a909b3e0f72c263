"""Run a DeepSpeed accelerate config on a host without GPU: gloo ranks on CPU, for laptops and CI.

Upstream behaviour worked around (accelerate 1.15, ``accelerate/state.py``): ``PartialState._prepare_backend``
picks a backend only when it finds an accelerator (CUDA, XPU, NPU, ...) or when ``cpu=True``. Under
``accelerate launch`` with a DeepSpeed config on a CPU-only host it returns ``(None, DistributedType.NO)``:
DeepSpeed then initialises its process group on gloo by itself, but accelerate records ``backend=None`` and
``num_processes == 1`` on every rank. Every rank then loads the whole dataset, `TrainingArguments.world_size` is
1 and DeepSpeed's ``train_batch_size`` check fails (or, worse, the counts gathered over ranks are wrong).

:func:`enable_cpu_distributed` wraps ``PartialState._prepare_backend``: when upstream found no backend, the
process was started by a launcher (``LOCAL_RANK`` is set), accelerate was told to use DeepSpeed
(``ACCELERATE_USE_DEEPSPEED=true``) and no CUDA device is visible, it returns ``("gloo", DistributedType.MULTI_CPU)``
instead, which makes accelerate set up the ranks like a CPU DDP job and then switch the state to DeepSpeed. It
also repairs a ``PartialState`` that was already built the upstream way (``TrainingArguments`` builds it in its
``__post_init__``, before any trainer exists). Nothing changes when CUDA is available or when upstream already
chose a backend.

Delete this module when ``accelerate`` returns a gloo / MULTI_CPU state for DeepSpeed launches without an
accelerator (re-check with ``tests/unit/test_patches.py``, which asserts the upstream behaviour it relies on).

FSDP2 on CPU is a separate patch in ``hf_gradacc/patches/fsdp_cpu.py`` (``enable_fsdp_on_cpu() -> bool``,
``disable_fsdp_on_cpu()``, ``is_fsdp_on_cpu_enabled()``). ``enable_cpu_distributed(fsdp=True)`` imports it lazily
and applies it when the module is there.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Oldest accelerate whose `PartialState._prepare_backend(cpu, sagemaker_dp, backend)` this patch was checked with.
MIN_ACCELERATE_VERSION = "1.0.0"
# Newest accelerate the patch was tested with; newer versions are patched too (the wrapper only acts where
# upstream found no backend) but say so in the log.
TESTED_ACCELERATE_VERSION = "1.15.0"

_ORIGINAL_ATTR = "__hf_gradacc_original__"
_state: dict[str, bool] = {"logged_override": False}


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def _launched_as_rank() -> bool:
    return int(os.environ.get("LOCAL_RANK", "-1")) != -1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _should_override(backend: str | None, distributed_type: Any) -> bool:
    from accelerate.utils import DistributedType

    return (
        backend is None
        and distributed_type == DistributedType.NO
        and _launched_as_rank()
        and _env_flag("ACCELERATE_USE_DEEPSPEED")
        and not _cuda_available()
    )


def _make_wrapper(original: Any) -> Any:
    from accelerate.utils import DistributedType

    @functools.wraps(original)
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        result_backend, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if not _should_override(result_backend, distributed_type):
            return result_backend, distributed_type
        if not _state["logged_override"]:
            _state["logged_override"] = True
            logger.warning(
                "hf_gradacc.patches.cpu_distributed: no GPU and a DeepSpeed launch (LOCAL_RANK=%s): accelerate "
                "found no backend, using ('gloo', MULTI_CPU) so that every rank is counted.",
                os.environ.get("LOCAL_RANK"),
            )
        return "gloo", DistributedType.MULTI_CPU

    setattr(_prepare_backend, _ORIGINAL_ATTR, original)
    return _prepare_backend


def _repair_initialized_state() -> bool:
    """Fix a `PartialState` that upstream already built with ``backend=None`` and 1 process under DeepSpeed."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    shared = PartialState._shared_state
    if not shared or shared.get("backend") is not None or shared.get("distributed_type") != DistributedType.DEEPSPEED:
        return False
    if _cuda_available() or not dist.is_available() or not dist.is_initialized() or not _launched_as_rank():
        return False
    world_size = dist.get_world_size()
    if world_size <= 1 or shared.get("num_processes") == world_size:
        return False
    fixed = {
        "backend": dist.get_backend(),
        "num_processes": world_size,
        "process_index": dist.get_rank(),
        "local_process_index": int(os.environ["LOCAL_RANK"]),
    }
    shared.update(fixed)
    if AcceleratorState._shared_state:  # an Accelerator already copied the broken values
        AcceleratorState._shared_state.update(fixed)
    logger.warning(
        "hf_gradacc.patches.cpu_distributed: repaired the accelerate state built before the patch (DeepSpeed on "
        "gloo without GPU): num_processes 1 -> %d, backend None -> %r, process_index -> %d.",
        world_size,
        fixed["backend"],
        fixed["process_index"],
    )
    return True


def _fsdp_module() -> Any | None:
    try:
        return importlib.import_module(f"{__package__}.fsdp_cpu")
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.fsdp_cpu":
            raise
        return None


def is_cpu_distributed_enabled() -> bool:
    """Whether :func:`enable_cpu_distributed` is in effect (the DeepSpeed part).

    Example:
        ```python
        from hf_gradacc.patches import enable_cpu_distributed, is_cpu_distributed_enabled

        enable_cpu_distributed()
        assert is_cpu_distributed_enabled()
        ```
    """
    from accelerate.state import PartialState

    return hasattr(PartialState._prepare_backend, _ORIGINAL_ATTR)


def enable_cpu_distributed(*, fsdp: bool = True) -> bool:
    """Let accelerate run DeepSpeed configs (and, with ``fsdp``, FSDP2 configs) on CPU ranks over gloo.

    Opt-in, idempotent and reversible with :func:`disable_cpu_distributed`. It changes nothing on a host with
    CUDA. Call it before ``TrainingArguments`` is built, or let :class:`~hf_gradacc.GradAccTrainer` call it (it
    does when ``HF_GRADACC_CPU_DISTRIBUTED=1``); a state built before the call is repaired.

    Args:
        fsdp: also apply the FSDP2-on-CPU patch of ``hf_gradacc.patches.fsdp_cpu`` when that module exists.

    Returns:
        True when the DeepSpeed patch is in effect after the call (False on an accelerate too old to patch).

    Example:
        ```python
        # accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml train.py
        from hf_gradacc.patches import enable_cpu_distributed

        enable_cpu_distributed()  # before TrainingArguments(...)
        ```
    """
    from accelerate.state import PartialState

    version = _accelerate_version()
    if _version_tuple(version) < _version_tuple(MIN_ACCELERATE_VERSION) or not hasattr(
        PartialState, "_prepare_backend"
    ):
        logger.warning(
            "hf_gradacc.patches.cpu_distributed: accelerate %s is older than %s (or has no "
            "PartialState._prepare_backend); not patched. Upgrade accelerate to run DeepSpeed on CPU.",
            version,
            MIN_ACCELERATE_VERSION,
        )
        return False
    if not is_cpu_distributed_enabled():
        PartialState._prepare_backend = _make_wrapper(PartialState.__dict__["_prepare_backend"])
        newer = _version_tuple(version) > _version_tuple(TESTED_ACCELERATE_VERSION)
        logger.info(
            "hf_gradacc.patches.cpu_distributed: patched accelerate.PartialState._prepare_backend (accelerate %s%s): "
            "DeepSpeed launches without GPU use gloo on CPU.",
            version,
            f", newer than the tested {TESTED_ACCELERATE_VERSION}" if newer else "",
        )
    _repair_initialized_state()
    if fsdp:
        module = _fsdp_module()
        if module is not None:
            module.enable_fsdp_on_cpu()
    return True


def disable_cpu_distributed() -> bool:
    """Undo :func:`enable_cpu_distributed` (both parts). A state already built with the patch stays as it is.

    Returns:
        True when something was restored.

    Example:
        ```python
        from hf_gradacc.patches import disable_cpu_distributed

        disable_cpu_distributed()
        ```
    """
    from accelerate.state import PartialState

    restored = False
    if is_cpu_distributed_enabled():
        PartialState._prepare_backend = getattr(PartialState._prepare_backend, _ORIGINAL_ATTR)
        _state["logged_override"] = False
        restored = True
        logger.info("hf_gradacc.patches.cpu_distributed: restored accelerate.PartialState._prepare_backend.")
    module = _fsdp_module()
    if module is not None and module.is_fsdp_on_cpu_enabled():
        module.disable_fsdp_on_cpu()
        restored = True
    return restored
