"""`hf-gradacc check` under context parallelism (torch's ``context_parallel`` through accelerate's
``parallelism_config_cp_size`` with FSDP2: ``examples/accelerate_configs/cp_fsdp2.yaml``).

Each sequence is cut over the ``cp_size`` ranks of its group (torch's head-tail load balancer), and the dataloader
deals one batch to every rank of a group: a step of ``gradient_accumulation_steps`` micro-batches holds
``batch x GA x data ranks`` samples (data ranks: the world over ``cp_size``). What the check changes for it:

- the data ranks are the world over ``cp_size`` (:func:`hf_gradacc.commands.check.mesh_rows.data_ranks`);
- the collator (:class:`ContextParallelCollator`) right-pads every micro-batch to a multiple of ``2 x cp_size`` (torch
  cuts each sequence into ``2 x cp_size`` equal chunks), so the stock Trainer runs too (GradAccTrainer pads itself);
- heads other than a causal LM are refused by GradAccTrainer when it is created and get a row saying so;
- torch 2.13 has no CPU sharding rule for SDPA ("aten._scaled_dot_product_flash_attention_for_cpu ... does not have a
  sharding strategy registered"): on CPU ranks the check is refused by name (:func:`check_context_parallel_options`)
  unless an attention for context parallelism was installed in the process (the tests' stand-in) or torch has a
  rule; the run with torch's own ring attention is the GPU tier's.

Example:
    ```bash
    # CP 2 x FSDP, 2 GPUs
    accelerate launch --config_file examples/accelerate_configs/cp_fsdp2.yaml -m hf_gradacc check
    ```
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import GradAccConfigError

# `--scenario` values the check runs under context parallelism (both measured on 2 CPU ranks; the others not shown)
SCENARIOS: tuple[str, ...] = ("default", "no_loss_kwargs")


def context_parallel_size(env: Mapping[str, str] | None = None) -> int:
    """``cp_size`` of the accelerate launch (``parallelism_config_cp_size`` in its config), 1 without one.

    Example:
        ```python
        context_parallel_size({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"})  # 2
        ```
    """
    from .sp_rows import launch_parallelism_size

    return launch_parallelism_size("cp", env)


def cpu_attention_can_be_sharded() -> bool:
    """Whether SDPA can run context-parallel on CPU tensors in this process: torch has a sharding rule for its CPU
    kernel, or torch's context-parallel attention dispatch was replaced (the tests' stand-in does so)."""
    import torch

    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return False
    if not getattr(_attention._enable_context_parallel_dispatcher_impl, "__module__", "").startswith("torch."):
        return True
    rules = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in rules


def check_context_parallel_options(
    opts: argparse.Namespace, cp_size: int, *, on_gpu: bool | None = None, cpu_attention: bool | None = None
) -> None:
    """Refuse what the check cannot run under context parallelism (raises :class:`GradAccConfigError` naming the flag
    or line).

    Example:
        ```python
        check_context_parallel_options(opts, 2, on_gpu=False, cpu_attention=False)   # GradAccConfigError on CPU
        ```
    """
    line = f"`parallelism_config_cp_size: {cp_size}` in the accelerate config"
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    if not on_gpu and not (cpu_attention_can_be_sharded() if cpu_attention is None else cpu_attention):
        raise GradAccConfigError(
            f"`hf-gradacc check` under context parallelism ({line}) needs GPUs: torch's context_parallel cannot shard "
            "attention on CPU ranks (torch has no sharding rule for `aten._scaled_dot_product_flash_attention_for_cpu`"
            "), so no trainer can take a step here. Run it on 2 or more CUDA devices (the GPU tier: "
            "tests/gpu/test_context_parallel.py), or launch without the `parallelism_config_cp_size` line"
        )
    from .sp_rows import refuse_mesh_flags

    refuse_mesh_flags(opts, SCENARIOS, f"context parallelism ({line})", "the `parallelism_config_cp_size` line")


class ContextParallelCollator:
    """Wraps a padding collator for context parallelism: every batch right-padded to a multiple of ``2 x cp_size``
    (``input_ids`` with the pad token, per-position ``labels`` with the ignore index, the mask with 0).

    Example:
        ```python
        from hf_gradacc.testing.tiny import PaddingCollator, make_samples
        batch = ContextParallelCollator(PaddingCollator(), cp_size=2)(make_samples("causal_lm", 2))
        batch["input_ids"].shape[1] % 4    # 0
        ```
    """

    def __init__(self, base: Callable, *, cp_size: int) -> None:
        self.base, self.multiple = base, 2 * cp_size
        self.pad_token_id = getattr(base, "pad_token_id", 0)
        self.ignore_index = getattr(base, "ignore_index", -100)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = self.base(samples)
        if "input_ids" not in batch:
            return batch  # image rows: refused under context parallelism before any batch is made
        extra = -batch["input_ids"].shape[1] % self.multiple
        if not extra:
            return batch
        pads = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": self.ignore_index}
        for key, value in pads.items():
            tensor = batch.get(key)
            if torch.is_tensor(tensor) and tensor.dim() == 2:  # per-position tensors only (not a label per row)
                batch[key] = torch.nn.functional.pad(tensor, (0, extra), value=value)
        return batch


def context_parallel_trainer(trainer_class: type, cp_size: int) -> type:
    """``trainer_class`` for one check under context parallelism: a model whose head is not a causal LM is refused
    by name before anything is built (:class:`~hf_gradacc.errors.UnsupportedBackendError`: GradAccTrainer refuses it
    too, but a model FSDP2 cannot wrap would be refused for that first, and the stock Trainer would fail inside
    torch's context-parallel entry). Everything else is ``trainer_class``'s.

    Example:
        ```python
        from transformers import Trainer
        StockTrainer = context_parallel_trainer(Trainer, cp_size=2)   # still named "Trainer"
        ```
    """
    from ...errors import UnsupportedBackendError
    from ...heads import detect_head_type, unwrap_model

    class _ContextParallel(trainer_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, model: Any = None, **kwargs: Any) -> None:
            head = detect_head_type(model) if model is not None else None
            if model is not None and head != "causal_lm":
                raise UnsupportedBackendError(
                    f"{type(unwrap_model(model)).__name__} (head `{head}`) cannot train under context parallelism "
                    f"(`parallelism_config.cp_size` {cp_size}): each rank holds chunks of every sequence and "
                    "attention "
                    "is forced causal, so only causal LMs train exactly (GradAccTrainer refuses the others by name)"
                )
            super().__init__(*args, model=model, **kwargs)

    _ContextParallel.__name__ = _ContextParallel.__qualname__ = trainer_class.__name__
    return _ContextParallel
