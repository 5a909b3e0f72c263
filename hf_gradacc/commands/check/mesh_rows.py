"""`hf-gradacc check --distributed_config ...`: the one-step check on a model sharded at load time by transformers'
``DistributedConfig`` (tensor parallel x FSDP2, expert parallel), which ``hf-gradacc check`` cannot get by wrapping a
model it built: the built-in tiny model is saved once and loaded on every rank with
``from_pretrained(..., distributed_config=DistributedConfig(**sizes))``, once per trainer.

The tensor (and expert) ranks hold copies of the same samples: a step covers ``batch x GA x data ranks`` samples,
where the data ranks are ``dp_replicate_size x fsdp_size``. A head whose model has no plan for a requested dimension
(transformers: "`tp_size=2` was requested, but `BertForMaskedLM` has no `tp_plan`") is reported as such, not run.

Under an accelerate launch with DeepSpeed Ulysses sequence parallelism (``parallelism_config_sp_size`` > 1) the
check's collator and trainers come from :mod:`.sp_rows` (:func:`mesh_collator`,
:func:`mesh_trainer_classes`) and the data ranks are the world over ``sp_size``.
Under context parallelism (``parallelism_config_cp_size`` > 1, FSDP2) the collator pads to a multiple of
``2 x cp_size`` and the options are checked by :mod:`.cp_rows`; the data ranks are the world over
``cp_size``.

Example:
    ```bash
    torchrun --nproc_per_node 4 -m hf_gradacc check --distributed_config tp_size=2,fsdp_size=2   # TP 2 x FSDP 2
    torchrun --nproc_per_node 2 -m hf_gradacc check --scenario moe_mixtral --distributed_config fsdp_size=2,ep_size=2
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/sp_zero2_cpu.yaml \\
        -m hf_gradacc check                                                                        # SP 2
    ```
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import GradAccConfigError, UnsupportedBackendError

# DistributedConfig fields `--distributed_config` takes (pipeline parallelism is refused by GradAccTrainer)
FIELDS: tuple[str, ...] = ("tp_size", "fsdp_size", "dp_replicate_size", "ep_size")
_PLAN_NAMES = {"tp": "tensor-parallel", "ep": "expert-parallel", "fsdp": "FSDP"}


def parse_distributed_config(text: str) -> dict[str, int]:
    """``"tp_size=2,fsdp_size=2"`` -> ``{"tp_size": 2, "fsdp_size": 2}`` (an ``argparse`` type).

    Example:
        ```python
        parse_distributed_config("fsdp_size=2,ep_size=2")   # {'fsdp_size': 2, 'ep_size': 2}
        ```
    """
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in FIELDS or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"expected NAME=N[,NAME=N...] with NAME one of {', '.join(FIELDS)} and N >= 1, got {item!r}"
            )
        sizes[name.strip()] = int(value)
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected NAME=N[,NAME=N...] with NAME one of {', '.join(FIELDS)}")
    return sizes


def data_ranks(sizes: dict[str, int] | None, world_size: int, env: dict[str, str] | None = None) -> int:
    """The ranks that hold different samples: ``dp_replicate_size x fsdp_size`` with ``sizes``; else the world over
    the sequence- and context-parallel sizes of the accelerate launch (their ranks hold slices of the same
    samples)."""
    if not sizes:
        from .cp_rows import context_parallel_size
        from .sp_rows import sequence_parallel_size

        return max(1, world_size // (sequence_parallel_size(env) * context_parallel_size(env)))
    return sizes.get("dp_replicate_size", 1) * sizes.get("fsdp_size", 1)


def check_options(opts: argparse.Namespace, env: dict[str, str] | None = None) -> None:
    """Refuse what ``--distributed_config`` cannot be combined with, and what a sequence- or context-parallel launch
    cannot run (raises :class:`GradAccConfigError`)."""
    from .cp_rows import check_context_parallel_options, context_parallel_size
    from .sp_rows import check_sequence_parallel_options, sequence_parallel_size

    cp_size = context_parallel_size(env)
    if cp_size > 1:
        check_context_parallel_options(opts, cp_size)
        return
    sp_size = sequence_parallel_size(env)
    if sp_size > 1:
        check_sequence_parallel_options(opts, sp_size, env)
        return
    if getattr(opts, "distributed_config", None) is None:
        return
    for flag, is_set in (
        ("--plot", bool(opts.plot)),
        ("--model", opts.model is not None),
        (f"--trainer {opts.trainer}", opts.trainer != "trainer"),
    ):
        if is_set:
            raise GradAccConfigError(
                f"`{flag}` is not supported with `--distributed_config` (the built-in tiny models, one step of "
                "transformers' Trainer and GradAccTrainer); drop one of them"
            )


def mesh_collator(collator: Callable, samples: Sequence[dict[str, Any]]) -> Callable:
    """The check's collator on this launch's mesh: under context parallelism every micro-batch right-padded to a
    multiple of ``2 x cp_size``; under Ulysses sequence parallelism one width for every micro-batch (a multiple of
    ``sp_size``, agreed over the ranks) and ``position_ids``; else ``collator``.

    Every rank calls it (under sequence parallelism it agrees the width with a collective).
    """
    from .cp_rows import ContextParallelCollator, context_parallel_size
    from .sp_rows import sequence_parallel_collator, sequence_parallel_size

    cp_size = context_parallel_size()
    if cp_size > 1:
        return ContextParallelCollator(collator, cp_size=cp_size)
    sp_size = sequence_parallel_size()
    return sequence_parallel_collator(collator, samples, sp_size) if sp_size > 1 else collator


def mesh_trainer_classes(classes: Sequence[tuple[str, type]]) -> list[tuple[str, type]]:
    """The trainer classes by name: under context parallelism each refusing a head other than a causal LM by name
    (:func:`hf_gradacc.commands.check.cp_rows.context_parallel_trainer`); under sequence parallelism each set up for it
    (DeepSpeed's groups released between trainers; on a CPU host contiguous inputs:
    :func:`hf_gradacc.commands.check.sp_rows.sequence_parallel_trainer`); else as they are."""
    import torch

    from .cp_rows import context_parallel_size, context_parallel_trainer
    from .sp_rows import sequence_parallel_size, sequence_parallel_trainer

    cp_size = context_parallel_size()
    if cp_size > 1:
        return [(name, context_parallel_trainer(cls, cp_size)) for name, cls in classes]
    if sequence_parallel_size() == 1:
        return list(classes)
    contiguous = not torch.cuda.is_available()
    return [(name, sequence_parallel_trainer(cls, contiguous=contiguous)) for name, cls in classes]


def head_cases(sizes: dict[str, int] | None) -> tuple[Any, ...]:
    """The rows of the default run: every built-in head, and with ``ep_size`` > 1 the tiny mixtures of experts too
    (the only built-in models with an expert-parallel plan)."""
    from .scenarios import HEAD_CASES, HeadCase

    if not sizes or sizes.get("ep_size", 1) == 1:
        return HEAD_CASES
    moe = tuple(
        HeadCase(key=scenario, task="causal_lm", scenario=scenario) for scenario in ("moe_mixtral", "moe_qwen3")
    )
    return HEAD_CASES + moe


def _shared_folder() -> str:
    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix="hf_gradacc_check_mesh_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _full(tensor: Any) -> Any:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone().cpu()


def _load_sharded(model_class: type, path: str, sizes: dict[str, int]) -> Any:
    import torch
    from transformers.distributed import DistributedConfig

    try:
        return model_class.from_pretrained(path, distributed_config=DistributedConfig(**sizes), dtype=torch.float32)
    except ValueError as exc:  # the same on every rank: the model class, not the data, decides it
        text = " ".join(str(exc).split())
        for kind, words in _PLAN_NAMES.items():
            if f"has no `{kind}_plan`" in text:
                raise UnsupportedBackendError(
                    f"no {words} plan: {model_class.__name__} has no `{kind}_plan` (transformers refuses "
                    f"`{kind}_size` {sizes.get(f'{kind}_size', sizes.get('fsdp_size'))})"
                ) from None
        raise


def sharded_trainer_pair(
    model: Any,
    task: str,
    samples: Sequence[dict[str, Any]],
    collator: Callable,
    step_kwargs: dict[str, Any],
    sizes: dict[str, int],
    *,
    trainer_classes: Sequence[tuple[str, type]],
    verbose: bool,
) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """ONE step of each trainer on ``model`` sharded by ``DistributedConfig(**sizes)``: their comparisons with the
    float64 full batch of ``samples`` by name, the first trainer, and its first log's loss entries.

    Every rank calls it (the folder, the loading and the full parameters are collectives).
    """
    import torch.distributed as dist

    from ...patches.parallelism_cpu import enable_parallelism_on_cpu
    from ...testing.one_step import _key, _Recorder, compare_with_reference, one_step_args
    from ...testing.tiny import ListDataset

    if not verbose:
        from transformers.utils import logging

        logging.disable_progress_bar()  # "Loading weights" / "Writing model shards", per load on every rank
    if step_kwargs.get("use_cpu") and sizes.get("tp_size", 1) > 1:
        enable_parallelism_on_cpu()  # accelerate refuses a ParallelismConfig on MULTI_CPU (only that check lifted)
    folder = _shared_folder()
    if dist.get_rank() == 0:
        model.save_pretrained(folder)
    dist.barrier()
    results: dict[str, Any] = {}
    first, logs = None, {}
    for name, trainer_class in trainer_classes:
        sharded = _load_sharded(type(model), folder, sizes)
        initial = {n: _full(p) for n, p in sharded.named_parameters() if p.requires_grad}
        recorder = _Recorder(collator, samples)
        trainer = trainer_class(
            model=sharded,
            args=one_step_args(**step_kwargs),
            train_dataset=ListDataset(samples),
            data_collator=recorder,
        )
        with contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
        update = {n: initial[n] - _full(p).float() for n, p in trainer.model.named_parameters() if n in initial}
        # the tensor / expert ranks ran copies of the data ranks' micro-batches: each once for the router term
        unique = list({repr([_key(s) for s in mb]): mb for mb in recorder.all_ranks()}.values())
        results[name] = compare_with_reference(
            update, model, samples, task, data_collator=collator, micro_batches=unique
        )
        if first is None:
            first = trainer
            logs = {k: v for k, v in trainer.state.log_history[0].items() if k.startswith("loss")}
    return results, first, logs
