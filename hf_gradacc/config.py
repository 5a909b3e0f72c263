"""The knobs of exact gradient accumulation: `GradAccArguments`, the configs that carry them, and the one
typed, validated object the trainer reads them from (`GradAccSettings`).

Three ways to set the knobs, all resolved by :func:`resolve_settings` exactly once per trainer:

- ``GradAccConfig(...)`` (a `TrainingArguments` with the knobs), ``GradAccSeq2SeqConfig(...)``, or a config class
  of your own made with :func:`gradacc_config_class`;
- a plain `TrainingArguments` (or any subclass, e.g. TRL's ``SFTConfig``) plus ``gradacc_args=`` given to the
  trainer: a :class:`GradAccArguments` or a ``dict`` of its fields;
- nothing: every knob takes its default.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from transformers import Seq2SeqTrainingArguments, TrainingArguments
from transformers.utils import logging

from .errors import GradAccConfigError
from .loss import HEAD_TYPES, IGNORE_INDEX
from .moe_balance import ROUTER_BALANCES, RouterBalance
from .schedule import AccumulationSchedule, LrScaling, check_lr_scaling

logger = logging.get_logger(__name__)

ZeroReduction = Literal["per_micro_batch", "per_window"]
FsdpSync = Literal["deferred", "every_micro_batch", "defer_all_reduce"]
NonFiniteSteps = Literal["skip", "raise", "propagate"]
ResumeDataMismatch = Literal["error", "accept"]
ZERO_REDUCTIONS: tuple[str, ...] = get_args(ZeroReduction)
FSDP_SYNCS: tuple[str, ...] = get_args(FsdpSync)
NONFINITE_STEPS: tuple[str, ...] = get_args(NonFiniteSteps)
RESUME_DATA_MISMATCHES: tuple[str, ...] = get_args(ResumeDataMismatch)
BatchNormMode = Literal["per_micro_batch", "freeze_stats", "precise"]
BATCHNORM_MODES: tuple[str, ...] = get_args(BatchNormMode)
PRECISE_BN_BATCHES = 100  # default of `precise_bn_batches`


@dataclass
class GradAccArguments:
    """The fields hf_gradacc adds to `TrainingArguments`, on their own.

    Every config class of the project inherits them (``GradAccConfig``, ``GradAccSeq2SeqConfig``, the TRL configs);
    a trainer whose arguments are another `TrainingArguments` class takes them as ``gradacc_args=``.

    Example:
        ```python
        from transformers import Seq2SeqTrainer, TrainingArguments
        from hf_gradacc import GradAccArguments, GradAccMixin

        class MyTrainer(GradAccMixin, Seq2SeqTrainer):
            pass

        trainer = MyTrainer(
            model=model,
            args=TrainingArguments(output_dir="out", gradient_accumulation_steps=8),
            gradacc_args=GradAccArguments(head_type="seq2seq", regroup_micro_batches=True),  # or a dict
            train_dataset=train_ds,
            data_collator=collator,
        )
        ```
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
            "help": "Do not prefetch the optimizer step's micro-batches (streaming data, large inputs): "
            "back-propagate summed losses as the micro-batches arrive and scale the reduced gradient once by the "
            "global count before clipping and the step. Exact; single process and DDP. Allows LossTerms with custom "
            "counts."
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
    nonfinite_steps: str = field(
        default="skip",
        metadata={
            "help": "An optimizer step whose loss or accumulated gradient is NaN/Inf on any rank: 'skip' (every rank "
            "drops it together, parameters and optimizer state unchanged, a warning, `nonfinite_skipped` logged), "
            "'raise' (NonFiniteStepError on every rank) or 'propagate' (take it, as the stock Trainer does)."
        },
    )
    save_on_preemption: bool = field(
        default=False,
        metadata={
            "help": "On SIGTERM to ANY rank (SLURM `--signal=TERM@<s>` or preemption, a Kubernetes pod's grace "
            "period, torchrun stopping its workers, a spot reclaim): every rank finishes the optimizer step in "
            "flight, all ranks save ONE complete checkpoint of that step together, and training stops "
            "(`trainer.preempted` is True); never mid-window, never one rank alone. The handler only sets a flag; "
            "the ranks agree in the step's non-finite all-reduce (no new collective; one scalar all-reduce per step "
            "with `nonfinite_steps='propagate'`). A handler installed before `train()` (submitit's) is called after "
            "the checkpoint. Off by default: SIGTERM ends the process as usual. `enable_jit_checkpoint=True` turns "
            "it on (it replaces transformers' per-rank JIT checkpoint). See docs/elastic.md."
        },
    )
    check_loss_at_start: bool = field(
        default=True,
        metadata={
            "help": "On the first micro-batch, compare the loss hf_gradacc reconstructs with the model's own loss "
            "(one extra forward for an overridden compute_loss) and stop with a clear error when a term would be "
            "dropped or a loss normalised twice."
        },
    )
    fused_lm_head: bool | None = field(
        default=None,
        metadata={
            "help": "Apply the LM head only to the positions whose target counts, in tiles, never materialising "
            "[tokens x vocabulary] logits (exact SUM and gradient). Causal LMs (MoE included) on one process, DDP, "
            "DeepSpeed ZeRO-1/2/3 and FSDP2; seq2seq and masked-LM heads on one process. True: on (an unsupported "
            "model or setup raises); False: off; None (default): automatic, on where a measured cost model predicts "
            "it faster or the full logits large against the model's training state, off (one INFO line says why) "
            "where it loses or cannot run. See docs/memory.md."
        },
    )
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
            "`gradient_accumulation_steps` micro-batches per rank gets more of them, with the same update. With "
            "`pack_micro_batches`: the most tokens of a packed row."
        },
    )
    pack_micro_batches: bool = field(
        default=False,
        metadata={
            "help": "Decoder-only causal LMs, map-style datasets: every micro-batch of an optimizer step is ONE "
            "padding-free row of concatenated samples (position ids restarting per sample; no sample attends to "
            "another), filled up to `max_tokens_per_micro_batch` tokens (default: the step's largest stock "
            "micro-batch, rows x longest row). The step keeps exactly its samples; the update is unchanged."
        },
    )
    accumulation_schedule: str | None = field(
        default=None,
        metadata={
            "help": "Gradient accumulation that changes during training, as 'step:accumulation,...' (0-based "
            "optimizer steps), e.g. '0:1,200:4,1000:8'; steps before the first entry use "
            "`gradient_accumulation_steps`. Every step is exact for its own window; `max_steps`, epochs, the "
            "scheduler and resuming follow the schedule. Not combined with regrouping or packing."
        },
    )
    lr_scaling: str = field(
        default="none",
        metadata={
            "help": "With `accumulation_schedule`: scale the scheduler's learning rate by the step's accumulation "
            "relative to `gradient_accumulation_steps` (the accumulation the rate was set for): 'none', 'linear' "
            "(x GA/base) or 'sqrt' (x sqrt(GA/base)). The logged `learning_rate` is the rate the step used."
        },
    )
    batchnorm: str = field(
        default="per_micro_batch",
        metadata={
            "help": "BatchNorm layers under accumulation: 'per_micro_batch' (stock: each micro-batch is normalised by "
            "its own statistics, so the step is not the full-batch step; a warning says so once), 'freeze_stats' "
            "(BatchNorm layers normalise with their running statistics and never update them during training: the "
            "step is exact) or 'precise' (train as stock, then recompute the running statistics over "
            "`precise_bn_batches` training batches before each evaluation, each save and the end of training)."
        },
    )
    precise_bn_batches: int = field(
        default=PRECISE_BN_BATCHES,
        metadata={
            "help": "`batchnorm='precise'`: training micro-batches (per process) whose statistics, averaged with "
            "equal weight, become the running statistics before each evaluation and save."
        },
    )

    router_balance: str = field(
        default="micro_batch",
        metadata={
            "help": "Mixture-of-experts router load-balancing loss: 'micro_batch' (the model's formula per "
            "micro-batch, weighted by routed tokens: depends on how the step is split) or 'global_batch' (the "
            "formula applied ONCE to the expert fractions and router probabilities of every routed token of the "
            "step on every rank, as Qwen trains; one routing pre-pass without gradient per step). See docs/moe.md."
        },
    )

    total_train_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Samples per optimizer step over every data-parallel rank, held across restarts on another number "
            "of processes (elastic and preemptible training): `gradient_accumulation_steps` is derived at every "
            "(re)start as total / (`per_device_train_batch_size` x data-parallel ranks), and must come out whole "
            "(otherwise GradAccConfigError naming the nearest totals that fit). A resume on another world size trains "
            "the samples the uninterrupted run would have. None (default): `gradient_accumulation_steps` as given. "
            "See docs/elastic.md."
        },
    )

    resume_data_mismatch: str = field(
        default="error",
        metadata={
            "help": "A resumed checkpoint whose data position cannot be carried over to this run (another dataset "
            "length, seed or data_seed, regrouping / packing settings, or a changed batch layout under "
            "`train_sampling_strategy='group_by_length'`): "
            "'error' (GradAccConfigError naming the difference) or 'accept' (resume anyway, skipping the "
            "checkpoint's optimizer steps in this run's layout, with a warning). A changed batch size, "
            "gradient_accumulation_steps, accumulation_schedule or world size alone is carried over exactly."
        },
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> GradAccArguments:
        # Before the dataclass __init__, whose TypeError ("unexpected keyword argument") names no close match.
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise unknown_knobs_error(unknown, where=cls.__name__, known=known)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # TrainingArguments.__post_init__ first, then the cross-field checks
            parent()
        resolve_settings(self)


GRADACC_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GradAccArguments))


@dataclass
class GradAccConfig(GradAccArguments, TrainingArguments):
    """`TrainingArguments` for :class:`~hf_gradacc.GradAccTrainer`: every `TrainingArguments` field keeps its
    meaning, and the :class:`GradAccArguments` fields are added. A plain `TrainingArguments` also works with
    `GradAccTrainer`: the knobs then take their defaults (or come from ``gradacc_args=``).

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


@dataclass
class GradAccSeq2SeqConfig(GradAccArguments, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (``predict_with_generate``, ``generation_max_length``, ...) plus the
    :class:`GradAccArguments` fields, for :class:`~hf_gradacc.GradAccSeq2SeqTrainer`.

    Example:
        ```python
        from hf_gradacc import GradAccSeq2SeqConfig

        args = GradAccSeq2SeqConfig(
            output_dir="out", gradient_accumulation_steps=8, predict_with_generate=True, regroup_micro_batches=True
        )
        ```
    """


def gradacc_config_class(base: type[TrainingArguments], name: str | None = None) -> type[TrainingArguments]:
    """A dataclass that is ``base`` (any `TrainingArguments` subclass) plus the :class:`GradAccArguments` fields,
    usable with `HfArgumentParser`.

    Example:
        ```python
        from transformers import HfArgumentParser, Seq2SeqTrainingArguments
        from hf_gradacc import gradacc_config_class

        MyConfig = gradacc_config_class(Seq2SeqTrainingArguments)
        (args,) = HfArgumentParser(MyConfig).parse_args_into_dataclasses()
        ```
    """
    if not (isinstance(base, type) and issubclass(base, TrainingArguments)):
        raise GradAccConfigError(f"`base` ({base!r}) must be a TrainingArguments subclass")
    if issubclass(base, GradAccArguments):
        return base
    cls = type(name or f"GradAcc{base.__name__}", (GradAccArguments, base), {"__module__": base.__module__})
    return dataclass(cls)


@dataclass(frozen=True, slots=True, kw_only=True)
class GradAccSettings:
    """The knobs, resolved and validated once (see :func:`resolve_settings`). The trainer and the backends read
    this object, never the arguments themselves."""

    head_type: str = "auto"
    ignore_index: int = IGNORE_INDEX
    warn_on_plain_loss: bool = True
    backward_per_term: bool = False
    auto_micro_batch: bool = False
    defer_normalization: bool = False
    zero_reduction: ZeroReduction = "per_micro_batch"
    fsdp_sync: FsdpSync = "deferred"
    nonfinite_steps: NonFiniteSteps = "skip"
    save_on_preemption: bool = False
    check_loss_at_start: bool = True
    fused_lm_head: bool | None = None
    regroup_micro_batches: bool = False
    max_tokens_per_micro_batch: int | None = None
    pack_micro_batches: bool = False
    batchnorm: BatchNormMode = "per_micro_batch"
    precise_bn_batches: int = PRECISE_BN_BATCHES
    accumulation_schedule: AccumulationSchedule | None = None
    lr_scaling: LrScaling = "none"
    resume_data_mismatch: ResumeDataMismatch = "error"
    total_train_batch_size: int | None = None
    router_balance: RouterBalance = "micro_batch"

    @property
    def regroups(self) -> bool:
        """Whether the step's samples are regrouped (``regroup_micro_batches``, a token budget, or packing)."""
        return self.regroup_micro_batches or self.max_tokens_per_micro_batch is not None or self.pack_micro_batches


def unknown_knobs_error(
    unknown: Iterable[str], *, where: str, known: Iterable[str] = GRADACC_FIELDS
) -> GradAccConfigError:
    """The error for knob names that do not exist: each with its closest known name (difflib), then hf_gradacc's
    knobs. ``known``: the names accepted where they were given (default: the :class:`GradAccArguments` fields).

    Example:
        ```python
        raise unknown_knobs_error(["regroup_microbatches"], where="gradacc_args")
        # GradAccConfigError: `gradacc_args` has an unknown field `regroup_microbatches` (did you mean
        # `regroup_micro_batches`?); hf_gradacc's knobs are: head_type, ignore_index, ...
        ```
    """
    known = list(known)
    names = []
    for name in sorted(set(unknown)):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        names.append(f"`{name}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    fields = "an unknown field " if len(names) == 1 else "unknown fields "
    others = "" if set(known) <= set(GRADACC_FIELDS) else " (or another field of the arguments)"
    return GradAccConfigError(
        f"`{where}` has {fields}{', '.join(names)}; hf_gradacc's knobs are: {', '.join(GRADACC_FIELDS)}{others}."
    )


def _knobs_of(source: Any, *, where: str) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, GradAccArguments):
        return {name: getattr(source, name) for name in GRADACC_FIELDS}
    if isinstance(source, Mapping):
        unknown = [name for name in source if name not in GRADACC_FIELDS]
        if unknown:
            raise unknown_knobs_error(unknown, where=where)
        return dict(source)
    raise GradAccConfigError(f"`{where}` must be a GradAccArguments or a dict, got {type(source).__name__}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise GradAccConfigError(f"`{name}` ({value!r}) must be a bool")


def resolve_settings(args: TrainingArguments | GradAccArguments, overrides: Any = None) -> GradAccSettings:
    """The knobs of ``args`` (its :class:`GradAccArguments` fields, if any) updated by ``overrides``, validated
    against each other and against the `TrainingArguments` fields they interact with.

    Raises :class:`~hf_gradacc.GradAccConfigError` naming the field and the value; warns about settings that
    are ignored.

    Example:
        ```python
        settings = resolve_settings(TrainingArguments("out"), {"head_type": "causal_lm"})
        assert settings.head_type == "causal_lm"
        ```
    """
    knobs = _knobs_of(args if isinstance(args, GradAccArguments) else None, where="args")
    extra = _knobs_of(overrides, where="gradacc_args")
    if extra and isinstance(args, GradAccArguments):
        raise GradAccConfigError(
            f"Knobs were given twice: `args` is a {type(args).__name__} (it carries them) and `gradacc_args` sets "
            f"{sorted(extra)}. Set them in one place."
        )
    knobs.update(extra)
    settings = GradAccSettings(**knobs)

    if settings.head_type != "auto" and settings.head_type not in HEAD_TYPES:
        raise GradAccConfigError(f"`head_type` ({settings.head_type!r}) must be 'auto' or one of {HEAD_TYPES}")
    if not isinstance(settings.ignore_index, int) or isinstance(settings.ignore_index, bool):
        raise GradAccConfigError(f"`ignore_index` ({settings.ignore_index!r}) must be an int")
    for name in (
        "warn_on_plain_loss",
        "backward_per_term",
        "auto_micro_batch",
        "defer_normalization",
        "regroup_micro_batches",
        "check_loss_at_start",
        "pack_micro_batches",
        "save_on_preemption",
    ):
        _check_bool(name, getattr(settings, name))
    for name, choices in (
        ("zero_reduction", ZERO_REDUCTIONS),
        ("fsdp_sync", FSDP_SYNCS),
        ("nonfinite_steps", NONFINITE_STEPS),
        ("resume_data_mismatch", RESUME_DATA_MISMATCHES),
        ("router_balance", ROUTER_BALANCES),
    ):
        if getattr(settings, name) not in choices:
            raise GradAccConfigError(f"`{name}` ({getattr(settings, name)!r}) must be one of {choices}")
    if settings.fused_lm_head is not None:
        _check_bool("fused_lm_head", settings.fused_lm_head)
    budget = settings.max_tokens_per_micro_batch
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise GradAccConfigError(f"`max_tokens_per_micro_batch` ({budget!r}) must be None or an int >= 1")
    if settings.defer_normalization and (settings.auto_micro_batch or settings.backward_per_term):
        raise GradAccConfigError(
            "`defer_normalization=True` cannot be combined with `auto_micro_batch` or `backward_per_term`; turn one "
            "of them off."
        )
    _check_batchnorm(settings)
    settings = _resolve_schedule(settings, args)
    _check_total_train_batch_size(settings, args)

    if isinstance(args, TrainingArguments):
        _check_training_arguments(args, settings)
        settings = _resolve_preemption(settings, args)
    return settings


def _resolve_preemption(settings: GradAccSettings, args: TrainingArguments) -> GradAccSettings:
    """``enable_jit_checkpoint=True`` (transformers' SIGTERM checkpoint, saved by each rank when it sees the signal,
    with no agreement) is served by ``save_on_preemption``: the agreed checkpoint wins, transformers' callback is
    taken out (:func:`~hf_gradacc.step.preemption.release_jit_checkpoint`)."""
    if settings.save_on_preemption and getattr(args, "save_only_model", False):
        logger.warning_once(
            "`save_on_preemption=True` with `save_only_model=True`: the checkpoint saved on SIGTERM holds no "
            "optimizer, scheduler or RNG state, so the run cannot resume from it (hf_gradacc refuses such a resume). "
            "Set `save_only_model=False`."
        )
    if not getattr(args, "enable_jit_checkpoint", False):
        return settings
    both = "`save_on_preemption=True` and " if settings.save_on_preemption else ""
    logger.warning_once(
        f"{both}`enable_jit_checkpoint=True`: hf_gradacc's agreed preemption checkpoint wins. On SIGTERM to any rank, "
        "every rank finishes the optimizer step in flight and saves that step's checkpoint together, then training "
        "stops; transformers' JITCheckpointCallback (a save by each rank when it sees the signal, mid-step and "
        "without agreement) is removed. Set `enable_jit_checkpoint=False` to silence this."
    )
    return dataclasses.replace(settings, save_on_preemption=True)


def _check_training_arguments(args: TrainingArguments, settings: GradAccSettings) -> None:
    gas = args.gradient_accumulation_steps
    if not isinstance(gas, int) or isinstance(gas, bool) or gas < 1:
        raise GradAccConfigError(f"`gradient_accumulation_steps` ({gas!r}) must be an int >= 1")
    if args.auto_find_batch_size:
        logger.warning_once(
            "`auto_find_batch_size=True` shrinks the per-device batch without raising `gradient_accumulation_steps`, "
            "so the effective batch of each optimizer step changes when it triggers. GradAccTrainer keeps every "
            "step exact, but the step covers fewer samples after a shrink."
        )
    if args.average_tokens_across_devices is False:
        logger.warning_once(
            "`average_tokens_across_devices=False` is ignored by GradAccTrainer: the denominator is always counted "
            "over every micro-batch and every data-parallel rank, which is what makes the step exact."
        )
    tokens_seen = args.include_num_input_tokens_seen
    if tokens_seen not in ("no", "all", "non_padding"):
        raise GradAccConfigError(
            f"`include_num_input_tokens_seen` ({tokens_seen!r}) must be 'no', 'all', 'non_padding' or a bool; the "
            "Trainer would read any other value as 'all'."
        )
    if settings.regroups and getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise GradAccConfigError(
            "`train_sampling_strategy='batch_rebalance'` regroups micro-batches itself (with its own sample order), "
            "so it cannot be combined with `regroup_micro_batches` / `max_tokens_per_micro_batch`: set "
            "`train_sampling_strategy='random'` to keep the stock windows, or turn regrouping off."
        )


def _check_batchnorm(settings: GradAccSettings) -> None:
    if settings.batchnorm not in BATCHNORM_MODES:
        raise GradAccConfigError(f"`batchnorm` ({settings.batchnorm!r}) must be one of {BATCHNORM_MODES}")
    batches = settings.precise_bn_batches
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise GradAccConfigError(f"`precise_bn_batches` ({batches!r}) must be an int >= 1")
    if settings.batchnorm != "precise" and batches != PRECISE_BN_BATCHES:
        logger.warning_once(
            f"`precise_bn_batches` ({batches}) is ignored: it is used only with `batchnorm='precise'` (got "
            f"{settings.batchnorm!r})."
        )


def _resolve_schedule(settings: GradAccSettings, args: Any) -> GradAccSettings:
    """Parse ``accumulation_schedule`` against ``gradient_accumulation_steps`` (the base of ``lr_scaling``)."""
    check_lr_scaling(settings.lr_scaling)
    spec = settings.accumulation_schedule
    if spec is None or spec == "":
        if settings.lr_scaling != "none":
            logger.warning_once(
                f"`lr_scaling` ({settings.lr_scaling!r}) is ignored: it scales the learning rate only with an "
                "`accumulation_schedule`."
            )
        return dataclasses.replace(settings, accumulation_schedule=None)
    base = getattr(args, "gradient_accumulation_steps", 1)
    schedule = AccumulationSchedule.parse(spec, base=base if isinstance(base, int) and base >= 1 else 1)
    if settings.regroups:
        raise GradAccConfigError(
            f"`accumulation_schedule` ({str(schedule)!r}) cannot be combined with `regroup_micro_batches`, "
            "`max_tokens_per_micro_batch` or `pack_micro_batches`, whose windows are planned for a fixed "
            "`gradient_accumulation_steps`: turn one of them off."
        )
    return dataclasses.replace(settings, accumulation_schedule=schedule)


def _check_total_train_batch_size(settings: GradAccSettings, args: Any) -> None:
    total = settings.total_train_batch_size
    if total is None:
        return
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise GradAccConfigError(f"`total_train_batch_size` ({total!r}) must be None or an int >= 1")
    if settings.accumulation_schedule is not None:
        raise GradAccConfigError(
            f"`total_train_batch_size` ({total}) cannot be combined with `accumulation_schedule` "
            f"({str(settings.accumulation_schedule)!r}): the schedule sets the accumulation of each step, the total "
            "derives one accumulation for the whole run. Turn one of them off."
        )
    if getattr(args, "auto_find_batch_size", False):
        raise GradAccConfigError(
            f"`total_train_batch_size` ({total}) cannot be combined with `auto_find_batch_size=True`, which shrinks "
            "the per-device batch after the accumulation was derived (the step would cover fewer samples). Set "
            "`auto_find_batch_size=False`, or use `auto_micro_batch=True` (same samples per step, smaller "
            "micro-batches on out-of-memory)."
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalBatch:
    """``total_train_batch_size`` resolved on this (re)start: ``total = micro_batch x accumulation x data_ranks``.

    Attributes:
        total: ``total_train_batch_size``, samples per optimizer step over every data-parallel rank.
        micro_batch: samples per micro-batch per process (`TrainingArguments.train_batch_size`).
        data_ranks: ranks holding different samples (the mesh's ``data_parallel_size``: not the tensor-, context- or
            sequence-parallel ranks).
        accumulation: the derived ``gradient_accumulation_steps``.
        given: ``gradient_accumulation_steps`` as the arguments gave it (replaced by ``accumulation``).
    """

    total: int
    micro_batch: int
    data_ranks: int
    accumulation: int
    given: int

    def describe(self) -> str:
        """``"total_train_batch_size 16 = 2 per device x GA 4 x 2 data ranks"``."""
        return (
            f"total_train_batch_size {self.total} = {self.micro_batch} per device x GA {self.accumulation} x "
            f"{self.data_ranks} data rank{'s' if self.data_ranks != 1 else ''}"
        )


def accumulation_for_total(total: int, *, micro_batch: int, data_ranks: int) -> int:
    """The ``gradient_accumulation_steps`` that makes ``micro_batch`` x GA x ``data_ranks`` = ``total``.

    Ranks never take unequal numbers of micro-batches: a total that is not a multiple of ``micro_batch`` x
    ``data_ranks`` raises :class:`~hf_gradacc.GradAccConfigError` naming the value, the field, the nearest totals
    that fit this world and the data-rank counts on which this total fits.

    Example:
        ```python
        accumulation_for_total(16, micro_batch=2, data_ranks=2)   # 4
        accumulation_for_total(16, micro_batch=2, data_ranks=1)   # 8
        accumulation_for_total(16, micro_batch=2, data_ranks=3)   # GradAccConfigError: ... 12 or 18 ...
        ```
    """
    per_step = micro_batch * data_ranks
    if total % per_step == 0:
        return total // per_step
    below, above = (total // per_step) * per_step, (total // per_step + 1) * per_step
    nearest = f"{below} (GA {below // per_step}) or {above} (GA {above // per_step})" if below else f"{above} (GA 1)"
    fits = ""
    if total % micro_batch == 0:
        ranks = [d for d in range(1, total // micro_batch + 1) if (total // micro_batch) % d == 0]
        fits = f"; {total} fits on {_listed(ranks)} data ranks at this per-device batch"
    raise GradAccConfigError(
        f"`total_train_batch_size` ({total}) is not a multiple of `per_device_train_batch_size` x data-parallel "
        f"ranks ({micro_batch} x {data_ranks} = {per_step}): every rank takes the same number of micro-batches, so "
        f"no `gradient_accumulation_steps` gives {total} samples per step on this world. The nearest totals that fit "
        f"are {nearest}{fits}. Change `total_train_batch_size`, `per_device_train_batch_size` or the number of "
        "processes."
    )


def _listed(values: list[int]) -> str:
    shown = [str(v) for v in values[:8]] + (["..."] if len(values) > 8 else [])
    return ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]


_GIVEN_ACCUMULATION = "_hf_gradacc_given_accumulation"  # on the arguments: the GA they had before the first derivation


def given_accumulation(args: Any) -> int:
    """``gradient_accumulation_steps`` as the arguments were given it, before ``total_train_batch_size`` replaced it
    (:func:`hold_total_train_batch_size`); the current value when nothing was derived."""
    return args.__dict__.get(_GIVEN_ACCUMULATION, args.gradient_accumulation_steps)


def hold_total_train_batch_size(args: Any, settings: GradAccSettings, *, data_ranks: int) -> GlobalBatch | None:
    """With ``total_train_batch_size``: set ``args.gradient_accumulation_steps`` to the accumulation that gives that
    many samples per step on ``data_ranks`` (the mesh's ``data_parallel_size``), before anything reads it (the
    backend's DeepSpeed config, the run's length, the scheduler, the logs), and return what was derived (logged at
    INFO). A ``gradient_accumulation_steps`` other than 1 (its default) that differs is replaced, with a warning
    naming both. Deriving again with the same arguments (another trainer, a restart) starts from the value they
    were given. None without ``total_train_batch_size``.

    Example:
        ```python
        args = GradAccConfig("out", per_device_train_batch_size=2, total_train_batch_size=16)
        hold_total_train_batch_size(args, resolve_settings(args), data_ranks=2).accumulation   # 4
        args.gradient_accumulation_steps                                                        # 4
        ```
    """
    total = settings.total_train_batch_size
    if total is None:
        return None
    given = args.__dict__.setdefault(_GIVEN_ACCUMULATION, args.gradient_accumulation_steps)
    micro_batch = int(args.train_batch_size)
    accumulation = accumulation_for_total(total, micro_batch=micro_batch, data_ranks=data_ranks)
    held = GlobalBatch(
        total=total, micro_batch=micro_batch, data_ranks=data_ranks, accumulation=accumulation, given=given
    )
    if given not in (1, accumulation):
        logger.warning_once(
            f"`gradient_accumulation_steps` ({given}) is replaced by {accumulation}: `total_train_batch_size` "
            f"({total}) sets the accumulation on every (re)start ({held.describe()}). Drop "
            "`gradient_accumulation_steps`, or `total_train_batch_size` to keep the accumulation fixed."
        )
    args.gradient_accumulation_steps = accumulation
    logger.info(f"hf_gradacc: {held.describe()} (derived from `total_train_batch_size`)")
    return held
