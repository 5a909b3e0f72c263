"""What hf_gradacc's TRL trainers share: the TRL releases their branches depend on, the checks every trainer runs at
construction, the regrouping of preference pairs, and the pieces of a training micro-batch's loss (its window, the
recorded policy forward, the router term).

TRL gathers its metrics across ranks INSIDE ``compute_loss``, once per micro-batch (``entropy``,
``mean_token_accuracy``, rewards, ...): every rank must run the same micro-batches, row for row.
:func:`refuse_uneven_micro_batches` refuses at construction the modes in which ranks may run different numbers (or
sizes) of micro-batches, and :func:`training_window` stops every rank before TRL's first gather in a step in which
the ranks hold different numbers of micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..compat import installed_version, trl_at_least
from ..config import GradAccArguments, given_accumulation, resolve_settings
from ..data.loader import build_train_dataloader, check_train_dataset
from ..errors import GradAccConfigError, GradAccDataError
from ..loss import LossTerm
from ..mixin import GradAccMixin

# What hf_gradacc's trainers read from TRL, by the first release that has it (docs/compatibility.md, "What depends on
# the version"). Older releases in the supported range take the other branch where it exists, or are refused at
# construction naming the feature (:func:`refuse_before`).
# TRL's fused LM head (`model(..., fused_lm_head=True)`: per-token log-probabilities and entropies, no full logits) in
# SFT, DPO and GRPO. Before it, SFT's default `chunked_nll` patches the model's forward, whose loss holds the router
# term; DPO reads the full logits; GRPO computes entropies from the logits inside TRL.
TRL_FUSED_LM_HEAD = "1.15"
# GRPO: `dapo` / `cispo` / `vespo` divided by the generation batch's tokens rescaled to one accumulation window, the
# entropy bonus a token mean / GA for every loss type, `luspo` masked before its per-sequence sum. Before it (1.9) the
# generation batch's tokens are not rescaled and `luspo` with token-level importance sampling sums padded positions.
TRL_GRPO_STEP_NORMALISED = "1.10"


def refuse_before(version: str, feature: str, why: str, way_out: str) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError` when the installed TRL is older than ``version``: ``feature``
    (the setting, by its field) cannot be made exact there."""
    if not trl_at_least(version):
        raise GradAccConfigError(
            f"{feature} needs trl>={version} with hf_gradacc (installed {installed_version('trl')}): {why}. "
            f"{way_out}, or upgrade TRL (pip install 'trl>={version},<2')."
        )


# ---------------------------------------------------------------------------------------------- shared pieces
def check_args_class(args: Any, trl_config: type, ours: type) -> None:
    """TRL converts a `TrainingArguments` that is not its own config with ``to_dict()``, which the GradAcc fields do
    not survive: name the config class to use instead."""
    if isinstance(args, GradAccArguments) and not isinstance(args, trl_config):
        raise GradAccConfigError(
            f"`args` is a {type(args).__name__}, which TRL would rebuild as a {trl_config.__name__} without the "
            f"hf_gradacc fields. Use hf_gradacc.trl.{ours.__name__} (a {trl_config.__name__} with the knobs), or a "
            f"{trl_config.__name__} with `gradacc_args=`."
        )


# On the arguments of GradAccGRPOConfig / GradAccRLOOConfig: whether `steps_per_generation` or
# `generation_batch_size` was given (TRL's `__post_init__` derives both from `gradient_accumulation_steps` otherwise).
GENERATION_GIVEN = "_hf_gradacc_generation_given"


def note_generation_given(args: Any) -> None:
    """Before TRL's ``__post_init__``: record whether the generation batch was given, or is to be derived from
    ``gradient_accumulation_steps`` (:func:`refuse_generation_for_the_given_accumulation`)."""
    given = args.steps_per_generation is not None or args.generation_batch_size is not None
    args.__dict__[GENERATION_GIVEN] = given


def refuse_generation_for_the_given_accumulation(trainer: GradAccMixin) -> None:
    """GRPO / RLOO under ``total_train_batch_size``: TRL's config derived ``steps_per_generation`` and
    ``generation_batch_size`` from ``gradient_accumulation_steps`` as given, before the trainer replaced it with the
    accumulation of the total. Its sampler would then generate for the old accumulation (another run than the same
    step count given by hand, or TRL's divisibility error at config time): refused naming both values and the way
    out. A generation batch given by hand (``steps_per_generation`` / ``generation_batch_size``) does not follow the
    accumulation and is kept; so is a derived accumulation equal to the one given."""
    held, args = trainer.global_batch, trainer.args
    if held is None or held.accumulation == held.given:
        return
    given = args.__dict__.get(GENERATION_GIVEN)
    if given is None:  # TRL's own config (gradacc_args=...): TRL's default is steps_per_generation = the given GA
        given = args.steps_per_generation != given_accumulation(args)
    if given:
        return
    raise GradAccConfigError(
        f"`total_train_batch_size` ({held.total}) is not supported by {type(trainer).__name__} with a derived "
        f"generation batch: TRL's config set `steps_per_generation` ({args.steps_per_generation}) from "
        f"`gradient_accumulation_steps` as given ({held.given}) before the trainer derived {held.accumulation} "
        f"({held.describe()}), so it would generate for {held.given} micro-batches per step, not {held.accumulation}. "
        f"Set `gradient_accumulation_steps={held.accumulation}` instead of `total_train_batch_size`, or give "
        f"`steps_per_generation` (e.g. {held.accumulation}) or `generation_batch_size` by hand."
    )


def refuse_uneven_micro_batches(trainer: GradAccMixin, *, rows_gathered: bool) -> None:
    """TRL gathers its metrics across ranks inside ``compute_loss``, once per micro-batch; DPO and the reward trainer
    also gather per-row tensors. Refuse the modes in which ranks may run different numbers of micro-batches (a gather
    would wait forever for a rank that has none left) or micro-batches of different sizes (``rows_gathered``)."""
    settings, name = trainer.gradacc, type(trainer).__name__
    why = (
        "TRL gathers its logged metrics across processes inside `compute_loss`, once per micro-batch, so every "
        "process "
        "must run the same micro-batches"
    )
    if settings.auto_micro_batch:
        raise GradAccConfigError(
            f"`auto_micro_batch=True` is not supported by {name}: {why}, and after an out-of-memory error the "
            "processes "
            "split their micro-batches independently. Turn `auto_micro_batch` off."
        )
    if settings.defer_normalization:
        raise GradAccConfigError(
            f"`defer_normalization=True` is not supported by {name}: {why}, and streamed optimizer steps may hold "
            "different numbers of micro-batches per process. Turn `defer_normalization` off."
        )
    if rows_gathered and settings.regroups and trainer.accelerator.num_processes > 1:
        raise GradAccConfigError(
            f"`regroup_micro_batches` / `max_tokens_per_micro_batch` is not supported by {name} on several processes: "
            f"{why} with the same number of pairs (per-pair rewards and log-probabilities are gathered), and "
            "regrouping gives the processes micro-batches of different sizes. Turn regrouping off."
        )


def planned_train_dataloader(trainer: GradAccMixin, **planning: Any) -> Any:
    """The regrouping / packing training dataloader built with the trainer's own ``planning`` inputs (see
    :func:`~hf_gradacc.data.loader.build_train_dataloader`), or None where the mixin's stock path applies."""
    if not trainer.gradacc.regroups:
        return None
    check_train_dataset(trainer.train_dataset)
    return build_train_dataloader(trainer.train_data, trainer.gradacc, **planning)


def refuse_packed_pairs(name: str, args: Any, gradacc_args: Any) -> None:
    """Preference batches cannot be packed; refused before TRL builds anything (a reward model would otherwise fail
    the causal-LM check of packing first, without the reason that matters here)."""
    if args is not None and not isinstance(args, GradAccArguments):
        args = None  # TRL's own config: the knobs come from `gradacc_args` only
    if resolve_settings(args, gradacc_args).pack_micro_batches:
        raise GradAccConfigError(
            f"`pack_micro_batches=True` is not supported by {name}: a preference micro-batch is its pairs' chosen "
            "rows followed by their rejected rows, which TRL's loss splits in halves and compares row by row, and a "
            "packed micro-batch is ONE row of concatenated samples. Turn `pack_micro_batches` off; "
            "`regroup_micro_batches` / `max_tokens_per_micro_batch` keep every pair whole (one process)."
        )


def _column(dataset: Any, name: str, trainer_name: str) -> list[Any]:
    """One column of a map-style training dataset (a `datasets.Dataset` or any dataset of dicts)."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        if name in columns:
            return list(dataset[name])
    else:
        samples = [dataset[i] for i in range(len(dataset))]
        if all(isinstance(s, Mapping) and name in s for s in samples):
            return [s[name] for s in samples]
    raise GradAccConfigError(
        f"`regroup_micro_batches` / `max_tokens_per_micro_batch` with {trainer_name} plan micro-batches from each "
        f"pair's tokenized lengths, but the training dataset has no `{name}` column (TRL writes it when it tokenizes "
        "the dataset; vision datasets are tokenized per batch). Turn regrouping off."
    )


def pair_lengths(trainer: GradAccMixin, dataset: Any, *, prompt: str | None, max_length: int | None) -> list[int]:
    """The padded footprint of every preference pair for the planner: TRL pads the chosen AND rejected rows of a
    micro-batch to its longest sequence, so a micro-batch of P pairs computes ``2 P x longest`` token positions. Each
    pair counts as ``2 x`` its longer sequence (``prompt`` ids + completion ids, cut at ``max_length``), so the
    planner's rows x longest row is exactly the micro-batch's padded tokens, and ``max_tokens_per_micro_batch`` caps
    what the forward pass computes."""
    name = type(trainer).__name__
    prompts = _column(dataset, prompt, name) if prompt else None
    chosen, rejected = _column(dataset, "chosen_ids", name), _column(dataset, "rejected_ids", name)
    lengths = []
    for index, (c, r) in enumerate(zip(chosen, rejected, strict=True)):
        extra = len(prompts[index]) if prompts is not None else 0
        longest = max(extra + len(c), extra + len(r))
        lengths.append(2 * (longest if max_length is None else min(longest, max_length)))
    budget = trainer.gradacc.max_tokens_per_micro_batch
    if budget is not None and lengths:
        widest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
        if lengths[widest] > budget:
            raise GradAccConfigError(
                f"Preference pair {widest} needs {lengths[widest]} padded tokens in any micro-batch (its chosen and "
                f"rejected rows, {lengths[widest] // 2} tokens each), more than `max_tokens_per_micro_batch` "
                f"({budget}). Raise `max_tokens_per_micro_batch` to at least {lengths[widest]} or shorten the data "
                "(`max_length`)."
            )
    return lengths


class ForwardRecorder:
    """Stands for the model inside TRL's ``compute_loss`` and keeps the outputs of the policy's forward pass, for the
    router term: the first one that uses the fused LM head (TRL >= 1.15), or the first one at all (older TRL, whose
    SFT and DPO losses run the policy through this model once, and the reference elsewhere). Everything else is the
    model's."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._fused = trl_at_least(TRL_FUSED_LM_HEAD)
        self.outputs: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._model(*args, **kwargs)
        if self.outputs is None and (kwargs.get("fused_lm_head") or not self._fused):
            self.outputs = outputs
        return outputs

    def __getattr__(self, name: str) -> Any:
        if name == "_model":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self._model, name)


def training_window(trainer: GradAccMixin) -> Any:
    """The window of the micro-batch running now, or None (evaluation, prediction).

    Every process must run as many micro-batches as the others (TRL gathers inside ``compute_loss``): a step in which
    they differ (an IterableDataset that runs out sooner on one process) stops every process here, from the counts
    they all gathered, instead of leaving one waiting in TRL's gather."""
    window = trainer.current_window
    if window is None or window.index is None:
        return None
    per_rank = window.counts.num_micro_batches_per_rank
    if len(set(per_rank)) > 1:
        raise GradAccDataError(
            f"The processes hold different numbers of micro-batches in this optimizer step ({list(per_rank)}). "
            f"{type(trainer).__name__} runs TRL's compute_loss, which gathers its metrics across processes once per "
            "micro-batch, so a process with more micro-batches would wait forever. Use a map-style dataset "
            "(accelerate "
            "gives every process the same number of batches) or an IterableDataset that yields as many batches on "
            "every process."
        )
    return window


def router_term(trainer: Any, recorder: ForwardRecorder | None, window: Any) -> tuple[torch.Tensor, LossTerm] | None:
    """``(what TRL added to its loss, the exact term)`` for the router load-balancing loss of the policy forward, or
    None when the trainer has none. The exact term weights ``coef x aux`` by the micro-batch's routed tokens
    (``"input_tokens"``), the rule of :mod:`hf_gradacc.auxiliary`."""
    if recorder is None or not trainer.aux_loss_enabled:
        return None
    aux = getattr(recorder.outputs, "aux_loss", None)
    if not torch.is_tensor(aux):
        return None
    coef = getattr(trainer, "router_aux_loss_coef", None)  # TRL < 1.15's SFTTrainer keeps it in its args only
    weighted = (trainer.args.router_aux_loss_coef if coef is None else coef) * aux.reshape(())
    routed = window.current_counts.num_input_tokens
    return weighted, LossTerm(total=weighted * routed, normalize_by="input_tokens")


def with_outputs(result: Any, return_outputs: bool, outputs: Any) -> Any:
    return (result, outputs) if return_outputs else result


def split_outputs(out: Any, return_outputs: bool) -> tuple[torch.Tensor, Any]:
    return (out[0], out[1]) if return_outputs else (out, None)


# ---------------------------------------------------------------------------------------------- on-policy trainers
def agree_on_micro_batches(trainer: Any, num_local: int) -> None:
    """Every process must prepare as many micro-batches as the others before an on-policy trainer generates (TRL
    gathers rewards and lengths across processes): one small collective BEFORE generating, so that a process with
    fewer batches stops every process instead of leaving one waiting in TRL's gather (RLOO, Distillation)."""
    if trainer.accelerator.num_processes == 1:
        return
    local = torch.tensor([num_local], dtype=torch.int64, device=trainer.args.device)
    per_rank = [int(n) for n in trainer.backend.all_gather(local).reshape(-1).tolist()]
    if len(set(per_rank)) > 1:
        raise GradAccDataError(
            f"The processes hold different numbers of micro-batches in this optimizer step ({per_rank}). "
            f"{type(trainer).__name__} generates each micro-batch's completions with TRL, which gathers across "
            "processes, so a process with more would wait forever. Use a map-style dataset (accelerate gives every "
            "process the same number of batches) or an IterableDataset that yields as many batches on every process."
        )


class GeneratesAtFetch:
    """For hf_gradacc's on-policy TRL trainers (RLOO, Distillation), after :class:`~hf_gradacc.GradAccMixin` in the
    bases: the step's micro-batches are generated when the step fetches them (``get_batch_samples``)."""

    def _generate_at_fetch(self, prepare: Any, generation_batches: list[Any]) -> list[dict[str, Any]]:
        """The step's micro-batches, each generated and sliced by TRL's ``prepare`` (the TRL class's own
        ``_prepare_inputs``) in order, with ``labels`` marking the counted completion tokens: the processes agree on
        the number first, TRL's micro-batch counter and step timer advance as TRL's ``training_step`` would (the mixin
        replaces it)."""
        import time

        agree_on_micro_batches(self, len(generation_batches))
        self.model.train()  # TRL keys generation, its buffer and its metrics on `model.training`
        start = time.perf_counter()
        batches = []
        for generation_batch in generation_batches:
            inputs = prepare(self, generation_batch)
            self._step += 1
            batches.append(with_completion_labels(inputs, ignore_index=self.head.ignore_index))
        self._current_train_step_time += time.perf_counter() - start
        return batches


def with_completion_labels(inputs: Mapping[str, Any], *, ignore_index: int) -> dict[str, Any]:
    """An on-policy micro-batch (``prompt_ids`` / ``prompt_mask`` / ``completion_ids`` / ``completion_mask``, and
    ``tool_mask`` when tools ran) plus ``labels``: a leading ignored column (dropped by the causal count's shift), then
    the completion ids where ``completion_mask x tool_mask`` is 1 and ``ignore_index`` elsewhere, so the window counts
    exactly the tokens of the loss; plus the forward pass's ``attention_mask`` (prompt then completion). TRL's losses
    read neither key."""
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    targets = inputs["completion_ids"].masked_fill(mask == 0, ignore_index)
    first = torch.full_like(targets[:, :1], ignore_index)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return {**inputs, "labels": torch.cat([first, targets], dim=1), "attention_mask": attention_mask}
