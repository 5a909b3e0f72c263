"""`GradAccConfig`: `TrainingArguments` plus the knobs of exact gradient accumulation."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .errors import GradAccConfigError
from .loss import HEAD_TYPES, IGNORE_INDEX

logger = logging.getLogger(__name__)

ZERO_REDUCTIONS: tuple[str, ...] = ("per_micro_batch", "per_window")
FSDP_SYNCS: tuple[str, ...] = ("deferred", "every_micro_batch", "defer_all_reduce")


@dataclass
class GradAccConfig(TrainingArguments):
    """`TrainingArguments` for :class:`~hf_gradacc.GradAccTrainer`.

    Every `TrainingArguments` field keeps its meaning. A plain `TrainingArguments` also works with
    `GradAccTrainer`: the fields below then take their defaults.

    Example:
        ```python
        from hf_gradacc import GradAccConfig

        args = GradAccConfig(
            output_dir="out",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=8,
            head_type="auto",        # or "causal_lm", "seq2seq", "masked_lm", ...
            ignore_index=-100,
        )
        ```

    On the command line (`HfArgumentParser`), the same fields are flags: `--head_type causal_lm`.
    """

    head_type: str = field(
        default="auto",
        metadata={
            "help": "Loss family of the model: 'auto' (read from the model class) or one of "
            + ", ".join(HEAD_TYPES)
            + ". It decides the denominator: tokens for LM and token heads, samples for sequence classification.",
        },
    )
    ignore_index: int = field(
        default=IGNORE_INDEX,
        metadata={"help": "Label value that is not a target and not counted (Hugging Face default: -100)."},
    )
    warn_on_plain_loss: bool = field(
        default=True,
        metadata={
            "help": "Warn once when an overridden `compute_loss` returns a plain tensor, which GradAccTrainer can "
            "only treat as a mean over the micro-batch's counted items. Return an `hf_gradacc.LossTerm` instead."
        },
    )

    backward_per_term: bool = field(
        default=False,
        metadata={
            "help": "When compute_loss returns several LossTerms, run one backward pass per term (in order) instead "
            "of one on their sum. Exact on every backend; the final backward pass of the step triggers the "
            "gradient reduction."
        },
    )
    auto_micro_batch: bool = field(
        default=False,
        metadata={
            "help": "On out-of-memory in a micro-batch, every rank halves the rows per micro-batch and recomputes "
            "the optimizer step with the same samples: the update is unchanged. The size found is kept and logged "
            "(`auto_micro_batch_rows`). Single process and DDP."
        },
    )
    defer_normalization: bool = field(
        default=False,
        metadata={
            "help": "Do not prefetch the optimizer step's micro-batches (streaming data, large inputs): back-propagate "
            "summed losses as the micro-batches arrive and scale the reduced gradient once by the global count "
            "before clipping and the step. Exact; single process and DDP. Allows LossTerms with custom counts."
        },
    )
    zero_reduction: str = field(
        default="per_micro_batch",
        metadata={
            "help": "DeepSpeed ZeRO-2/3 gradient reduction: 'per_micro_batch' (upstream default: reduce-scatter "
            "after every micro-batch, less memory) or 'per_window' (one reduction per optimizer step, less "
            "communication). ZeRO-1 always reduces once per window."
        },
    )
    fsdp_sync: str = field(
        default="deferred",
        metadata={
            "help": "FSDP2 gradient sync: 'deferred' (accumulate unsharded, reduce-scatter once per window: less "
            "communication, more memory), 'every_micro_batch' (reduce-scatter each micro-batch, sharded grads "
            "only), 'defer_all_reduce' (HSDP: defer only the cross-replica all-reduce)."
        },
    )

    # ---- throughput: regrouped micro-batches (hf_gradacc/regroup.py) ----
    regroup_micro_batches: bool = field(
        default=False,
        metadata={
            "help": "Map-style datasets: keep each optimizer step's samples (the stock windows) but regroup them into "
            "micro-batches sorted by length, with minimal padding and balanced over ranks. The update is unchanged "
            "(the loss is normalised by the step's global count); not applied to IterableDatasets."
        },
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={
            "help": "Cap on padded tokens (rows x longest row, from `length_column_name` or `input_ids`) per "
            "micro-batch; implies regrouping. Rows per micro-batch vary; a step whose samples do not fit in "
            "`gradient_accumulation_steps` micro-batches per rank gets more of them, with the same update."
        },
    )
    # ---- end throughput ----

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_gradacc_args(self)


def validate_gradacc_args(args: TrainingArguments) -> None:
    """Cross-field checks shared by `GradAccConfig.__post_init__` and `GradAccTrainer` (for plain args)."""
    gas = args.gradient_accumulation_steps
    if not isinstance(gas, int) or isinstance(gas, bool) or gas < 1:
        raise GradAccConfigError(f"`gradient_accumulation_steps` ({gas!r}) must be an int >= 1")
    head_type = getattr(args, "head_type", "auto")
    if head_type != "auto" and head_type not in HEAD_TYPES:
        raise GradAccConfigError(f"`head_type` ({head_type!r}) must be 'auto' or one of {HEAD_TYPES}")
    ignore_index = getattr(args, "ignore_index", IGNORE_INDEX)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise GradAccConfigError(f"`ignore_index` ({ignore_index!r}) must be an int")
    for name, choices in (("zero_reduction", ZERO_REDUCTIONS), ("fsdp_sync", FSDP_SYNCS)):
        value = getattr(args, name, choices[0])
        if value not in choices:
            raise GradAccConfigError(f"`{name}` ({value!r}) must be one of {choices}")
    if getattr(args, "auto_find_batch_size", False):
        logger.warning(
            "`auto_find_batch_size=True` shrinks the per-device batch without raising `gradient_accumulation_steps`, "
            "so the effective batch of each optimizer step changes when it triggers. GradAccTrainer keeps every "
            "step exact, but the step covers fewer samples after a shrink."
        )
    if getattr(args, "average_tokens_across_devices", True) is False:
        logger.warning(
            "`average_tokens_across_devices=False` is ignored by GradAccTrainer: the denominator is always counted "
            "over every micro-batch and every data-parallel rank, which is what makes the step exact."
        )
    # ---- throughput: regrouped micro-batches ----
    regroup = getattr(args, "regroup_micro_batches", False)
    if not isinstance(regroup, bool):
        raise GradAccConfigError(f"`regroup_micro_batches` ({regroup!r}) must be a bool")
    budget = getattr(args, "max_tokens_per_micro_batch", None)
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise GradAccConfigError(f"`max_tokens_per_micro_batch` ({budget!r}) must be None or an int >= 1")
    if (regroup or budget is not None) and getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise GradAccConfigError(
            "`train_sampling_strategy='batch_rebalance'` regroups micro-batches itself (with its own sample order), "
            "so it cannot be combined with `regroup_micro_batches` / `max_tokens_per_micro_batch`: set "
            "`train_sampling_strategy='random'` to keep the stock windows, or turn regrouping off."
        )
