"""What the distributed backends' wrappers do to a weight's gradient, for code outside ``backends/`` that must know
(the fused LM head writing a weight gradient into ``.grad`` by hand, :mod:`hf_gradacc.fused.into_grad`).

A model as the training step calls it may be wrapped (DDP, DeepSpeed's engine, FSDP, accelerate's wrappers,
``torch.compile``, PEFT): :func:`wrapper_chain` lists the layers; :func:`sharded_by` names a wrapper or weight that
shards; :func:`distributed_grad_write_refusal` says why a process group forbids writing a weight's ``.grad`` by hand
now (a DDP backward that synchronises, DDP's python reducer, several processes without DDP), or None.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

# Attributes DeepSpeed ZeRO and FSDP(1) put on the parameters they shard.
_SHARDED_PARAMETER_ATTRIBUTES = ("ds_id", "ds_tensor", "_fsdp_flattened")


def wrapper_chain(model: Any) -> list[Any]:
    """``model`` and what it wraps (``.module``: DDP, DeepSpeed's engine, accelerate's wrappers; ``torch.compile``'s
    ``_orig_mod``; PEFT's base), outermost first.

    Example:
        ```python
        wrapper_chain(ddp_model)   # [DistributedDataParallel, LlamaForCausalLM]
        ```
    """
    seen = []
    while isinstance(model, nn.Module) and all(model is not m for m in seen):
        seen.append(model)
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = model.__dict__.get("_modules", {}).get("_orig_mod")
        if not isinstance(inner, nn.Module):
            base = getattr(model, "base_model", None)
            inner = getattr(base, "model", None) if base is not None and base is not model else None
        model = inner
    return seen


def sharded_by(weight: torch.Tensor, wrapper: Any, head: Any = None) -> str | None:
    """The backend that shards ``weight`` (``"a sharded weight"``: a ZeRO / FSDP parameter) or wraps it in a sharding
    wrapper (``"DeepSpeed"``, ``"FSDP"``), looking through ``wrapper``'s chain and the output layer ``head``; None."""
    if any(hasattr(weight, attr) for attr in _SHARDED_PARAMETER_ATTRIBUTES):
        return "a sharded weight"
    for module in wrapper_chain(wrapper) + ([head] if isinstance(head, nn.Module) else []):
        names = {cls.__name__ for cls in type(module).__mro__}
        if "DeepSpeedEngine" in names:
            return "DeepSpeed"
        if names & {"FSDPModule", "FullyShardedDataParallel"}:
            return "FSDP"
    return None


def several_processes() -> bool:
    """Whether this process is one of several in torch.distributed's default group."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def distributed_grad_write_refusal(wrapper: Any, head: Any = None) -> str | None:
    """Why the process group forbids writing a weight's gradient into ``.grad`` by hand in this forward pass, or None
    (no process group, one process, or DDP's C++ reducer in a backward that does not synchronise: ``no_sync``).
    ``wrapper``: the model as the training step called it (None: no wrapper known, then only a process without
    ``torch.distributed``); ``head``: the output layer module."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if wrapper is None:
        return "torch.distributed without a known wrapper"
    modules = wrapper_chain(wrapper) + ([head] if isinstance(head, nn.Module) else [])
    ddp = next((m for m in modules if isinstance(m, nn.parallel.DistributedDataParallel)), None)
    if ddp is None:
        return "several processes without DDP" if several_processes() else None
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return "DDP's python reducer"
    if ddp.require_backward_grad_sync:
        return "the synchronising DDP backward"
    return None
