"""The meshes GradAccTrainer refuses, by name: models sharded at load time by transformers' ``DistributedConfig``
with pipeline or expert parallelism, and accelerate's context and sequence parallelism.

Apart from :mod:`hf_gradacc.backends.tensor_parallel` so that every backend's ``check_model`` and ``resolve_backend``
can ask it without an import cycle.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedBackendError

# Why each DistributedConfig field is refused (measured with transformers 5.24.0, accelerate 1.15.0, torch 2.13.0,
# 2 gloo ranks on CPU, the stock Trainer; see docs/backends.md).
_REFUSED = {
    "pp_size": (
        "the transformers 5.24 Trainer does not train a pipeline-parallel model: before the first step "
        "`Trainer._sync_replicated_trainable_parameters` broadcasts every plain trainable parameter from rank 0, but "
        "each pipeline stage holds different layers, so the broadcasts do not match and the ranks abort (measured on "
        "2 CPU ranks); there is no pipeline schedule in the Trainer's step either"
    ),
    "ep_size": (
        "with `tp_size` 1 the transformers Trainer hands accelerate no `parallelism_config`, so the FSDP2 mesh the "
        "experts live on is invisible to the backend that accelerate selects (plain DDP); with `tp_size` > 1 it is "
        "not measured. Measured on 2 CPU ranks (fsdp 2 x ep 2, a tiny Mixtral, router term included) before this "
        "refusal: 3.7e-07 from the float64 full batch, the stock Trainer 4.1e-03; routing it to the tensor-parallel "
        "backend needs the model when the backend is chosen"
    ),
}


def distributed_config_of(model: torch.nn.Module | None) -> Any | None:
    """The ``DistributedConfig`` a model was sharded with at load time, or None (a model built or wrapped otherwise)."""
    from ..heads import unwrap_model

    if model is None:
        return None
    base = unwrap_model(model)
    if not getattr(base, "_is_distributed_loading_by_transformers", False):
        return None
    return getattr(getattr(base, "config", None), "distributed_config", None)


def check_model_sharding(model: torch.nn.Module | None) -> Any | None:
    """Raise :class:`~hf_gradacc.UnsupportedBackendError` naming the field for a model sharded at load time with a
    parallelism GradAccTrainer does not train (``pp_size`` > 1); return its ``DistributedConfig``
    (None for a model not sharded by transformers).

    Example:
        ```python
        check_model_sharding(model)   # after from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))
        ```
    """
    config = distributed_config_of(model)
    if config is None:
        return None
    for field_name, why in _REFUSED.items():
        size = int(getattr(config, field_name, None) or 1)
        if size > 1:
            raise UnsupportedBackendError(
                f"`DistributedConfig({field_name}={size})` is not supported by GradAccTrainer: {why}. Load the model "
                f"with `{field_name}=1`: what GradAccTrainer trains from a `DistributedConfig` is tensor parallelism "
                "(`tp_size`, alone or with `fsdp_size`); for FSDP2 / HSDP without tensor parallelism use accelerate's "
                "`parallelism_config` (docs/backends.md)."
            )
    return config


def check_context_parallel(parallelism_config: Any) -> None:
    """Raise :class:`~hf_gradacc.UnsupportedBackendError` for accelerate's context parallelism (``cp_size`` > 1) and
    DeepSpeed-Ulysses sequence parallelism (``sp_size`` > 1).

    The stock Trainer shards each micro-batch's sequences inside its own ``training_step``
    (``Trainer._prepare_context_parallel_inputs`` and accelerate's ``maybe_context_parallel``); GradAccTrainer's
    ``training_step`` replaces that one and does not call them, so every context-parallel rank would compute whole
    sequences: a run that "works", with none of the memory context parallelism is for. The count rule for it is
    ready (:func:`hf_gradacc.counting.context_parallel_shard`, tested on simulated shards).

    Example:
        ```python
        check_context_parallel(trainer.accelerator.parallelism_config)
        ```
    """
    sp_size = int(getattr(parallelism_config, "sp_size", None) or 1)
    if sp_size > 1:
        # The Trainer routes a DeepSpeed-Ulysses step through its own `deepspeed_sp_compute_loss` (a loss gathered
        # over the sequence group) and wraps the dataloader in accelerate's Ulysses adapter; GradAccTrainer's
        # compute_loss replaces that path, and its count over a sequence group is not tested yet.
        raise UnsupportedBackendError(
            f"`parallelism_config.sp_size` ({sp_size}, sequence parallelism with `sp_backend="
            f"{getattr(parallelism_config, 'sp_backend', None)!r}`) is not supported by GradAccTrainer yet: the "
            "Trainer computes a sequence-parallel loss in its own `compute_loss` (`deepspeed_sp_compute_loss`), which "
            "GradAccTrainer's replaces, and the count over the sequence group is not shown exact. Set "
            "`parallelism_config_sp_size: 1` in the accelerate config (or `ParallelismConfig(sp_size=1)`); for long "
            "sequences use `fused_lm_head` or packing meanwhile."
        )
    size = int(getattr(parallelism_config, "cp_size", None) or 1)
    if size > 1:
        raise UnsupportedBackendError(
            f"`parallelism_config.cp_size` ({size}) is not supported by GradAccTrainer yet: its training_step does not "
            "run the Trainer's context-parallel input sharding, so each rank would compute whole sequences (no "
            "context parallelism at all). Set `parallelism_config_cp_size: 1` in the accelerate config (or "
            "`ParallelismConfig(cp_size=1)`); for long sequences use `fused_lm_head` or packing meanwhile."
        )
