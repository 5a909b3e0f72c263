"""`hf-gradacc check` under DeepSpeed Ulysses sequence parallelism (ALST: accelerate's ``parallelism_config_sp_size``
with ``sp_backend: deepspeed``).

The Trainer wraps the dataloader in DeepSpeed's ``UlyssesSPDataLoaderAdapter``: each rank's batch is all-gathered
over the sequence group and every rank gets a slice of each of them along the sequence, so a step of
``gradient_accumulation_steps`` micro-batches holds ``batch x GA x data ranks`` samples (data ranks: the world over
``sp_size``) and its targets are counted once over the sequence group. What the check changes for it:

- the collator (:class:`SequenceParallelCollator`) right-pads every micro-batch to ONE width, the step's longest row
  rounded up to a multiple of ``sp_size`` (agreed over all ranks), adds ``position_ids`` and drops the attention mask
  (right padding, causal attention: no real token sees a pad; Ulysses does not take the mask);
- on a CPU both trainers get contiguous copies of the adapter's slices (:func:`sequence_parallel_trainer`), as the
  copy to a GPU makes them: the stock Trainer's Ulysses loss fails on a non-contiguous ``shift_labels`` slice of a
  batch of more than one row ("view size is not compatible with input tensor's size and stride");
- heads other than a causal LM are refused by GradAccTrainer when it is created (the adapter cuts every batch tensor
  along the sequence, which a label per row does not allow) and get a row saying so;
- on CPU ranks only one sequence group runs (processes = ``sp_size``): in every other group the stock Trainer's loss
  fails on gloo (torch 2.13's differentiable ``all_gather`` scatters from global ranks), so more is refused by name.

Example:
    ```bash
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/sp_zero2_cpu.yaml \\
        -m hf_gradacc check      # SP 2: every built-in head, the causal LMs measured, the others refused by name
    ```
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ...errors import GradAccConfigError

# `--scenario` values that run under Ulysses: not the mixtures of experts (not shown there), nor `plain_compute_loss`
# (DeepSpeed's adapter hands the model `shift_labels` without `labels`: `outputs.loss` is None, seen on 2 CPU ranks)
SCENARIOS: tuple[str, ...] = ("default", "no_loss_kwargs")


def sequence_parallel_size(env: Mapping[str, str] | None = None) -> int:
    """``sp_size`` of the accelerate launch (``parallelism_config_sp_size`` in its config), 1 without one.

    Example:
        ```python
        sequence_parallel_size({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"})  # 2
        ```
    """
    return launch_parallelism_size("sp", env)


def launch_parallelism_size(dimension: str, env: Mapping[str, str] | None = None) -> int:
    """``parallelism_config_<dimension>_size`` of the accelerate launch (``"sp"``, ``"cp"``), 1 without one."""
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").strip().lower() != "true":
        return 1  # accelerate reads the PARALLELISM_CONFIG_* variables only with this one set
    text = env.get(f"PARALLELISM_CONFIG_{dimension.upper()}_SIZE", "1").strip()
    return int(text) if text.isdigit() and int(text) > 1 else 1


def refuse_mesh_flags(opts: argparse.Namespace, scenarios: Sequence[str], where: str, lines: str) -> None:
    """The flags ``hf-gradacc check`` does not run on a sequence- or context-parallel mesh (``where``): a
    :class:`GradAccConfigError` naming the first one set, and the config ``lines`` to drop instead."""
    for flag, is_set in (
        ("--distributed_config", getattr(opts, "distributed_config", None) is not None),
        ("--plot", bool(getattr(opts, "plot", None))),
        (f"--trainer {opts.trainer}", opts.trainer != "trainer"),
        (f"--scenario {opts.scenario}", opts.scenario not in scenarios),
        (f"--loss-type {getattr(opts, 'loss_type', None)}", bool(getattr(opts, "loss_type", None))),
    ):
        if is_set:
            raise GradAccConfigError(
                f"`{flag}` is not supported under {where}: the check runs one step of transformers' Trainer and "
                "GradAccTrainer on the built-in heads or a causal LM `--model`; drop the flag or launch without "
                f"{lines}"
            )


def check_sequence_parallel_options(
    opts: argparse.Namespace, sp_size: int, env: Mapping[str, str] | None = None, *, on_gpu: bool | None = None
) -> None:
    """Refuse what the check cannot run under Ulysses (raises :class:`GradAccConfigError` naming the flag or line)."""
    env = os.environ if env is None else env
    line = f"`parallelism_config_sp_size: {sp_size}` in the accelerate config"
    world = env.get("WORLD_SIZE", "1").strip()
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    if not on_gpu and world.isdigit() and int(world) > sp_size:
        # torch 2.13's differentiable all_gather (transformers' Ulysses loss) scatters from the group's rank i as if it
        # were global rank i on gloo: every sequence group but the first fails ("Global rank 0 is not part of group")
        raise GradAccConfigError(
            f"`hf-gradacc check` under sequence parallelism on CPU ranks needs one sequence group: {world} processes "
            f"with {line} make {int(world) // sp_size}, and the stock Trainer's Ulysses loss fails on gloo in every "
            "group but the first (torch's differentiable all_gather: 'Global rank 0 is not part of group'). Launch "
            f"{sp_size} processes (`num_processes: {sp_size}`, `parallelism_config_dp_replicate_size: 1`); on GPUs "
            "(NCCL) any number of sequence groups runs"
        )
    refuse_mesh_flags(opts, SCENARIOS, f"sequence parallelism ({line})", "the `parallelism_config_sp_*` lines")
    if opts.gradient_accumulation_steps % sp_size:
        raise GradAccConfigError(
            f"`--gradient_accumulation_steps` ({opts.gradient_accumulation_steps}) must be a multiple of `sp_size` "
            f"({sp_size}, {line}): DeepSpeed's adapter makes {sp_size} micro-batches of each batch, so a step of "
            f"{opts.gradient_accumulation_steps} would end inside one; use "
            f"--gradient_accumulation_steps {sp_size * max(1, opts.gradient_accumulation_steps // sp_size)}"
        )


def step_width(samples: Sequence[dict[str, Any]], sp_size: int) -> int:
    """The one width of every micro-batch: the longest row of ``samples`` (the largest over all ranks) rounded up
    to a multiple of ``sp_size``.

    Example:
        ```python
        step_width([{"input_ids": [1] * 13}], 2)   # 14
        ```
    """
    import torch

    longest = max((len(s["input_ids"]) for s in samples if "input_ids" in s), default=0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # every rank builds the same synthetic samples, but the width must agree on every rank of the sequence group
        # (the adapter all-gathers the batches; gloo needs equal shapes): agree it rather than assume it
        value = torch.tensor([longest], dtype=torch.int64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        longest = int(value.item())
    return -(-max(longest, 1) // sp_size) * sp_size


class SequenceParallelCollator:
    """Wraps a padding collator for Ulysses: every batch right-padded to ``width`` (a multiple of ``sp_size``, the
    same on every rank), ``position_ids`` ``0 .. width - 1`` added, the attention mask dropped.

    Example:
        ```python
        from hf_gradacc.testing.tiny import PaddingCollator, make_samples
        batch = SequenceParallelCollator(PaddingCollator(), width=40, sp_size=2)(make_samples("causal_lm", 2))
        batch["input_ids"].shape, sorted(batch)    # (2, 40), ['input_ids', 'labels', 'position_ids']
        ```
    """

    def __init__(self, base: Callable, *, width: int, sp_size: int) -> None:
        if width % sp_size:
            raise GradAccConfigError(f"the micro-batch width ({width}) must be a multiple of `sp_size` ({sp_size})")
        self.base, self.width, self.sp_size = base, width, sp_size
        self.pad_token_id = getattr(base, "pad_token_id", 0)
        self.ignore_index = getattr(base, "ignore_index", -100)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = self.base(samples)
        if "input_ids" not in batch:
            return batch  # image rows: refused under Ulysses before any batch is made
        extra = self.width - batch["input_ids"].shape[1]
        if extra < 0:
            raise GradAccConfigError(
                f"a micro-batch is {batch['input_ids'].shape[1]} wide, more than the step's width {self.width}"
            )
        if extra:
            batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra), value=self.pad_token_id)
            if torch.is_tensor(batch.get("labels")) and batch["labels"].dim() == 2:  # per-position labels only
                batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=self.ignore_index)
        batch.pop("attention_mask", None)
        batch["position_ids"] = torch.arange(self.width).expand_as(batch["input_ids"]).clone()
        return batch


def sequence_parallel_collator(collator: Callable, samples: Sequence[dict[str, Any]], sp_size: int) -> Callable:
    """``collator`` as :class:`SequenceParallelCollator` at the step's one width (a collective: every rank calls
    it)."""
    return SequenceParallelCollator(collator, width=step_width(samples, sp_size), sp_size=sp_size)


@contextlib.contextmanager
def one_sequence_parallel_set_up() -> Iterator[None]:
    """Lets one trainer of a process that runs several set up DeepSpeed Ulysses, and undoes it afterwards: DeepSpeed
    keeps the sequence-parallel process groups in module globals (a second set-up fails with "sequence parallel group
    is already initialized") and wraps the attention implementation in transformers' global
    ``ALL_ATTENTION_FUNCTIONS`` (a second set-up would wrap its own wrapper). Every rank enters it alike."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _release_sequence_parallel_groups()
    saved = {key: ALL_ATTENTION_FUNCTIONS[key] for key in ALL_ATTENTION_FUNCTIONS}
    try:
        yield
    finally:
        for key, function in saved.items():
            if ALL_ATTENTION_FUNCTIONS[key] is not function:
                ALL_ATTENTION_FUNCTIONS[key] = function
        _release_sequence_parallel_groups()


def _release_sequence_parallel_groups() -> None:
    try:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    except ImportError:
        return
    mpu._SEQUENCE_PARALLEL_GROUP = None
    mpu._SEQUENCE_DATA_PARALLEL_GROUP = None


def sequence_parallel_trainer(trainer_class: type, *, contiguous: bool) -> type:
    """``trainer_class`` for one check under Ulysses: it trains inside :func:`one_sequence_parallel_set_up` (one
    process runs several trainers), and with ``contiguous`` its prepared inputs are made contiguous: on a CPU
    DeepSpeed's adapter hands out slices (``.cpu()`` of a CPU tensor copies nothing) that a copy to a GPU would make
    contiguous. The arithmetic is unchanged.

    Example:
        ```python
        from transformers import Trainer
        StockTrainer = sequence_parallel_trainer(Trainer, contiguous=True)   # still named "Trainer"
        ```
    """
    import torch

    class _SequenceParallel(trainer_class):  # type: ignore[misc, valid-type]
        def train(self, *args, **kwargs):
            with one_sequence_parallel_set_up():
                return super().train(*args, **kwargs)

        def _prepare_inputs(self, inputs):
            inputs = super()._prepare_inputs(inputs)
            if not contiguous:
                return inputs
            return {k: v.contiguous() if torch.is_tensor(v) else v for k, v in inputs.items()}

    _SequenceParallel.__name__ = _SequenceParallel.__qualname__ = trainer_class.__name__
    return _SequenceParallel
