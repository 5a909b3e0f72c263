"""The meshes GradAccTrainer refuses, by name: models sharded at load time by transformers' ``DistributedConfig``
with pipeline parallelism or an expert-parallel layout not shown exact, accelerate's context parallelism outside
FSDP2 (or beside tensor / sequence parallelism), and sequence parallelism outside DeepSpeed Ulysses (ZeRO-1/2;
ZeRO-3 is refused in the DeepSpeed backend). A model sharded at load time that saves checkpoints is told, when the
trainer is built, that they cannot be resumed (:func:`warn_unresumable_checkpoints`).

Apart from :mod:`hf_gradacc.backends.tensor_parallel` so that every backend's ``check_model`` and ``resolve_backend``
can ask it without an import cycle.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import logging

from ..errors import UnsupportedBackendError

logger = logging.get_logger(__name__)

# Why each DistributedConfig field is refused (measured with transformers 5.24.0, accelerate 1.15.0, torch 2.13.0,
# 2 gloo ranks on CPU, the stock Trainer; see docs/backends.md).
_REFUSED = {
    "pp_size": (
        "the transformers 5.24 Trainer does not train a pipeline-parallel model: before the first step "
        "`Trainer._sync_replicated_trainable_parameters` broadcasts every plain trainable parameter from rank 0, but "
        "each pipeline stage holds different layers, so the broadcasts do not match and the ranks abort (measured on "
        "2 CPU ranks); there is no pipeline schedule in the Trainer's step either"
    ),
}


def distributed_config_of(model: torch.nn.Module | None) -> Any | None:
    """The ``DistributedConfig`` a model was sharded with at load time, or None (a model built or wrapped
    otherwise)."""
    from ..heads import unwrap_model

    if model is None:
        return None
    base = unwrap_model(model)
    if not getattr(base, "_is_distributed_loading_by_transformers", False):
        return None
    return getattr(getattr(base, "config", None), "distributed_config", None)


# Expert parallelism shown exact (tests/distributed/test_mesh_ep.py, 2 CPU ranks, a tiny Mixtral and Qwen3-MoE with
# their router term): every expert whole on one rank (`efsdp_size` 1), the expert group either the FSDP2 data ranks
# (`fsdp_size == ep_size`, `tp_size` 1: tokens cross ranks all-to-all, FSDP2 divides the experts' gradients by the
# data size) or the tensor ranks (`tp_size == ep_size`, `fsdp_size` 1: one batch shared by the expert group).
# hf_gradacc counts over the data group only and weights each micro-batch's router term by its routed tokens.
_EP_SHOWN = (
    "expert parallelism is shown exact with GradAccTrainer as `DistributedConfig(fsdp_size=N, ep_size=N)` or "
    "`DistributedConfig(tp_size=N, ep_size=N)` (no HSDP; measured on 2 CPU ranks, a tiny Mixtral and Qwen3-MoE with "
    "their router term: <= 3.7e-07 from the float64 full batch, the stock Trainer 3.6e-03 to 1.5e-02)"
)


def check_expert_parallel(config: Any) -> None:
    """Raise :class:`~hf_gradacc.UnsupportedBackendError` for an expert-parallel ``DistributedConfig`` outside the
    meshes shown exact: ``ep_size`` > 1 needs ``fsdp_size == ep_size`` with ``tp_size`` 1, or ``tp_size == ep_size``
    with ``fsdp_size`` 1, and ``dp_replicate_size`` 1.

    Example:
        ```python
        check_expert_parallel(DistributedConfig(fsdp_size=2, ep_size=2))   # passes (2 ranks)
        check_expert_parallel(DistributedConfig(tp_size=2, ep_size=2))     # passes (2 ranks)
        ```
    """
    ep = int(getattr(config, "ep_size", None) or 1)
    if ep <= 1:
        return
    tp = int(getattr(config, "tp_size", None) or 1)
    fsdp = int(getattr(config, "fsdp_size", None) or 1)
    rep = int(getattr(config, "dp_replicate_size", None) or 1)
    if rep > 1:
        why = f"with `dp_replicate_size` {rep} (HSDP) the experts' all-reduce across replicas is not measured"
    elif fsdp * tp != ep:
        why = (
            f"each expert is FSDP-sharded over `fsdp_size` x `tp_size` / `ep_size` = {fsdp * tp // ep} ranks (a "
            "summed "
            "reduce-scatter divided locally, which transformers sets up for gloo): not measured"
        )
    elif tp > 1 and fsdp > 1:
        why = (
            f"an expert group that spans both the data ranks (`fsdp_size` {fsdp}) and the tensor ranks is not measured"
        )
    else:
        return
    raise UnsupportedBackendError(
        f"`DistributedConfig(ep_size={ep})` with `tp_size={tp}`, `fsdp_size={fsdp}`, `dp_replicate_size={rep}` is not "
        f"supported by GradAccTrainer: {why}. {_EP_SHOWN}. Load the model with `ep_size=1`, or lay the experts out as "
        "one of those."
    )


def uses_expert_parallelism(model: torch.nn.Module | None) -> bool:
    """True for a model sharded at load time with ``DistributedConfig(ep_size > 1)``: it goes to the
    tensor-parallel backend (accelerate sees no mesh when ``tp_size`` is 1)."""
    config = distributed_config_of(model)
    return config is not None and int(getattr(config, "ep_size", None) or 1) > 1


def check_model_sharding(model: torch.nn.Module | None, args: Any = None) -> Any | None:
    """Raise :class:`~hf_gradacc.UnsupportedBackendError` naming the field for a model sharded at load time with a
    parallelism GradAccTrainer does not train (``pp_size`` > 1; ``ep_size`` > 1 outside
    :func:`check_expert_parallel`'s layouts); return its ``DistributedConfig``
    (None for a model not sharded by transformers). With the trainer's ``args``, a run that saves checkpoints is
    told that they cannot be resumed (:func:`warn_unresumable_checkpoints`).

    Example:
        ```python
        check_model_sharding(model)   # after from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))
        ```
    """
    config = distributed_config_of(model)
    if config is None:
        return None
    if args is not None:
        warn_unresumable_checkpoints(config, args)
    for field_name, why in _REFUSED.items():
        size = int(getattr(config, field_name, None) or 1)
        if size > 1:
            raise UnsupportedBackendError(
                f"`DistributedConfig({field_name}={size})` is not supported by GradAccTrainer: {why}. Load the model "
                f"with `{field_name}=1`: what GradAccTrainer trains from a `DistributedConfig` is tensor parallelism "
                "(`tp_size`, alone or with `fsdp_size`) and expert parallelism (`ep_size` equal to `fsdp_size` or "
                "`tp_size`); for FSDP2 / HSDP without tensor parallelism use accelerate's "
                "`parallelism_config` (docs/backends.md)."
            )
    check_expert_parallel(config)
    return config


def warn_unresumable_checkpoints(config: Any, args: Any) -> None:
    """Warn, when the trainer is built, that the checkpoints of a model sharded at load time by ``config`` (a
    ``DistributedConfig``) cannot be resumed, when ``args.save_strategy`` saves any: transformers checkpoints no
    optimizer state for such a model (its Trainer refuses to save one without ``save_only_model=True``), and
    ``resume_from_checkpoint`` refuses a checkpoint without it (:mod:`hf_gradacc.checkpoints`), after the run wrote
    them all.

    Example:
        ```python
        warn_unresumable_checkpoints(DistributedConfig(tp_size=2), args)   # a warning when args.save_strategy saves
        ```
    """
    import transformers

    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "no":
        return
    sizes = {
        name: int(getattr(config, name, None) or 1)
        for name in ("tp_size", "ep_size", "fsdp_size", "dp_replicate_size")
    }
    layout = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1) or "..."
    logger.warning(
        f"`save_strategy={strategy!r}` saves checkpoints that cannot be resumed: the model was sharded at load time "
        f"(`DistributedConfig({layout})`), and transformers {transformers.__version__} saves no optimizer state for "
        "such a model (its Trainer saves checkpoints of it only with `save_only_model=True`: the model weights, "
        "gathered by `save_model`); `resume_from_checkpoint` refuses a checkpoint without its optimizer state (the "
        "stock resume would restart the optimizer's moments silently). To go on from a checkpoint, load it with "
        "`from_pretrained(<checkpoint>, "
        "distributed_config=...)` and train it as a new run without `resume_from_checkpoint` (the optimizer's "
        "moments, the schedule and the data order start afresh); to keep only the trained model, set "
        "`save_strategy='no'` and call `trainer.save_model()` at the end."
    )


def check_context_parallel(parallelism_config: Any, *, distributed_type: Any = None) -> None:
    """Raise :class:`~hf_gradacc.UnsupportedBackendError` for the context- and sequence-parallel meshes GradAccTrainer
    does not train: context parallelism (``cp_size`` > 1) anywhere but under FSDP2 with ``tp_size`` 1 and
    ``sp_size`` 1, and sequence parallelism (``sp_size`` > 1) anywhere but under DeepSpeed with
    ``sp_backend="deepspeed"``.

    Context parallelism is trained through the Trainer's own entry (``Trainer._prepare_context_parallel_inputs`` and
    accelerate's ``maybe_context_parallel``, see :mod:`hf_gradacc.backends.context_parallel`): each rank counts the
    targets of its chunks of every sequence, the count is summed over every rank (data x context), and the loss is
    scaled by the
    ranks FSDP2 averages over (accelerate shards over ``dp_shard_cp``: data x context, every process). The head,
    attention and settings it cannot hold are refused at construction by
    :func:`hf_gradacc.backends.context_parallel.context_parallel_for`.

    DeepSpeed Ulysses sequence parallelism is trained: the Trainer wraps the dataloader in DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` (each rank gets a slice of every sequence and ``shift_labels`` made from the whole
    sequence), GradAccTrainer counts those targets over every rank and scales by the data ranks ZeRO averages over
    (shown exact on 2 CPU ranks, tests/distributed/test_sequence_parallel.py).

    Example:
        ```python
        check_context_parallel(trainer.accelerator.parallelism_config, distributed_type=DistributedType.FSDP)
        ```
    """
    sp_size = int(getattr(parallelism_config, "sp_size", None) or 1)
    sp_backend = getattr(parallelism_config, "sp_backend", None)
    if sp_size > 1 and not (str(distributed_type).endswith("DEEPSPEED") and sp_backend == "deepspeed"):
        raise UnsupportedBackendError(
            f"`parallelism_config.sp_size` ({sp_size}, sequence parallelism with `sp_backend={sp_backend!r}`) is "
            f"supported by GradAccTrainer only under DeepSpeed with `sp_backend: deepspeed` (Ulysses), not with "
            f"{distributed_type}. Use a DeepSpeed config (`distributed_type: DEEPSPEED`), or set "
            "`parallelism_config_sp_size: 1` (`ParallelismConfig(sp_size=1)`)."
        )
    size = int(getattr(parallelism_config, "cp_size", None) or 1)
    if size <= 1:
        return
    tp_size = int(getattr(parallelism_config, "tp_size", None) or 1)
    why = None
    if not str(distributed_type).endswith("FSDP"):
        why = (
            f"context parallelism runs under FSDP2 only (accelerate shards the model over `dp_shard_cp`), not "
            f"{distributed_type}; use an FSDP config with `fsdp_version: 2` "
            "(examples/accelerate_configs/cp_fsdp2.yaml)"
        )
    elif tp_size > 1:
        why = f"with `tp_size` {tp_size} (tensor x context parallelism) the count and loss scale are not shown exact"
    elif sp_size > 1:
        why = f"with `sp_size` {sp_size} (sequence x context parallelism) the count and loss scale are not shown exact"
    elif getattr(parallelism_config, "cp_backend", "torch") not in (None, "torch"):
        why = f"`cp_backend` is {parallelism_config.cp_backend!r}; only torch's `context_parallel` is trained"
    if why is not None:
        raise UnsupportedBackendError(
            f"`parallelism_config.cp_size` ({size}) is not supported by GradAccTrainer here: {why}. Or set "
            "`parallelism_config_cp_size: 1` (`ParallelismConfig(cp_size=1)`)."
        )


def holds_whole_parameters(model: torch.nn.Module) -> bool:
    """True when every parameter of ``model`` is a plain local tensor with data: not on the meta device, not a DTensor
    shard (FSDP2, tensor parallelism), not a DeepSpeed ZeRO-3 partition. A forward pass on one rank then needs no
    collective (the packing probe, :func:`hf_gradacc.data.pack_check.check_packing_support`, runs one)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support has no shards
        DTensor = ()  # noqa: N806
    for param in model.parameters():
        if param.is_meta or hasattr(param, "ds_id") or isinstance(param, DTensor) or isinstance(param.data, DTensor):
            return False
    return True
