"""`hf-gradacc check --trainer reward|kto|rloo|distillation`: ONE step of TRL's trainer and of hf_gradacc's on the same
synthetic data, each against a float64 full-batch reference written from the loss's definition
(:mod:`hf_gradacc.testing.trl_steps`, :mod:`hf_gradacc.testing.trl_more_steps`; no TRL code in them).
:mod:`.trl_rows` dispatches here.

- ``reward``: a sequence classifier with one output built from the model's config (seed ``--seed``), Bradley-Terry
  with margins over ``batch x (GA - 1)`` then ``batch - 1`` pairs per process;
- ``kto``: unpaired samples at the same layout, ``beta`` 0.5, a reference model of the same architecture freshly
  initialised (seed + 1) so that KTO's KL estimate is not 0; the step's estimate is over every mismatched pair of the
  step;
- ``rloo`` / ``distillation``: the built-in tiny policy (vocabulary of 8 words: completions of 1 to 8 tokens) generates
  2 completions per prompt (RLOO, deterministic reward) or one (distillation, from a teacher of the same architecture,
  seed + 1, its LM head scaled by 30), ``batch x GA`` per process; the reference is over the completions the trainer
  recorded (every process's).

Example:
    ```python
    from hf_gradacc.commands.check.trl_more_rows import more_one_step

    step = more_one_step("kto", build_tiny_model("causal_lm"), step_kwargs, world_size=1)
    step.results["GradAccKTOTrainer"].relative_error
    ```
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...errors import GradAccConfigError

MORE_TRL_NAMES: dict[str, str] = {"reward": "Reward", "kto": "KTO", "rloo": "RLOO", "distillation": "Distillation"}
ON_POLICY = ("rloo", "distillation")
KTO_BETA = 0.5
TEACHER_HEAD_SCALE = 30.0


def check_more_options(opts: Any) -> None:
    """Refuse what means nothing with ``--trainer reward / kto / rloo / distillation``."""
    if opts.trainer in ON_POLICY and opts.model is not None:
        raise GradAccConfigError(
            f"`--trainer {opts.trainer}` runs on the built-in tiny policy (its word tokenizer and, for rloo, its "
            f"reward); drop `--model {opts.model}`"
        )
    if opts.trainer == "kto" and opts.per_device_train_batch_size < 2:
        raise GradAccConfigError(
            "`--trainer kto` needs `--per_device_train_batch_size` >= 2: TRL's KTO estimates its KL term from the "
            f"mismatched completions of a micro-batch's samples (got {opts.per_device_train_batch_size})"
        )


def _fresh(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A model of ``model``'s architecture and config, freshly initialised with ``seed``."""
    torch.manual_seed(seed)
    return type(model)(copy.deepcopy(model.config))


def _reward_model(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(model.config)
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def _one_update(
    trainer_class: type, model: torch.nn.Module, **trainer_kwargs: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    from ...testing.one_step import full_parameters

    policy = copy.deepcopy(model)
    initial = {n: p.detach().clone().cpu() for n, p in policy.named_parameters() if p.requires_grad}
    trainer = trainer_class(model=policy, **trainer_kwargs)
    trainer.train()
    final = full_parameters(trainer)
    return {n: initial[n] - final[n].float() for n in initial}, trainer


def more_one_step(kind: str, model: Any, step_kwargs: dict[str, Any], world_size: int) -> Any:
    """ONE SGD(lr=1) step of hf_gradacc's trainer, then of TRL's, for ``kind``; a
    :class:`~hf_gradacc.commands.check.trl_gather.TrlStep` (comparisons by trainer name, ours, samples, a line on
    the data)."""
    import trl

    from ... import trl as gradacc_trl
    from ...testing import trl_more_steps as more
    from ...testing import trl_steps
    from ...testing.one_step import one_step_args
    from ...testing.reference import compare
    from .trl_gather import TrlStep
    from .trl_gather import all_ranks as _all_ranks

    name = MORE_TRL_NAMES[kind]
    bs, gas, seed = (step_kwargs[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "seed"))
    on_policy = kind in ON_POLICY
    if on_policy:
        from ...testing.grpo_steps import build_tiny_policy, grpo_prompts, grpo_tokenizer, length_reward

        model = build_tiny_policy(seed)
        tokenizer, dataset = grpo_tokenizer(), grpo_prompts(bs * gas * world_size * 2, seed=seed + 3)
        layout = None
    else:
        vocab_size = int(model.config.vocab_size)
        if vocab_size < 4:
            raise GradAccConfigError(f"the model's `vocab_size` ({vocab_size}) is too small for synthetic data")
        tokenizer = trl_steps.word_tokenizer(vocab_size)
        layout = trl_steps.uneven_batch_sizes(bs, gas, world_size)
    config: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if kind == "reward":
        model = _reward_model(model, seed)
        rows = trl_steps.reward_rows(sum(layout), seed, vocab_size=vocab_size)
        from datasets import Dataset

        dataset = Dataset.from_list(rows)
        what = "preference pairs (Bradley-Terry with margins), a 1-output sequence classifier from the model's config"
    elif kind == "kto":
        ref_model = _fresh(model, seed + 1)
        rows = more.kto_rows(sum(layout), seed, vocab_size=vocab_size)
        dataset = more.kto_dataset(rows)
        config = {"beta": KTO_BETA, "train_sampling_strategy": "sequential"}
        extra = {"ref_model": ref_model}
        what = (
            f"unpaired samples (beta {KTO_BETA}, a freshly initialised reference model; the KL estimate over "
            "every mismatched pair of the step)"
        )
    elif kind == "rloo":
        config = {"num_generations": 2, "max_completion_length": 8, "beta": 0.0, "steps_per_generation": gas}
        extra = {"reward_funcs": length_reward}
        what = "completions of the built-in tiny policy, 2 per prompt, a deterministic reward"
    else:
        teacher = _fresh(model, seed + 1)
        with torch.no_grad():
            teacher.get_output_embeddings().weight.mul_(TEACHER_HEAD_SCALE)
        config = {"beta": 0.5, "max_completion_length": 8, "gradient_checkpointing": False}
        extra = {"teacher_model": teacher}
        what = "completions of the built-in tiny policy distilled from a teacher (generalized JSD, beta 0.5)"
    updates: dict[str, Any] = {}
    ours = None
    for module, prefix in ((gradacc_trl, "GradAcc"), (trl, "")):
        config_class = getattr(module, f"{prefix}{name}Config")
        trainer_class = getattr(module, f"{prefix}{name}Trainer")
        if layout is not None:
            trainer_class = trl_steps.with_batch_layout(trainer_class, layout)
        if on_policy:
            trainer_class = type(f"Recording{trainer_class.__name__}", (more.CompletionRecorder, trainer_class), {})
        args = one_step_args(args_class=config_class, bf16=False, **step_kwargs, **config)
        kwargs = {k: copy.deepcopy(v) if isinstance(v, torch.nn.Module) else v for k, v in extra.items()}
        update, trainer = _one_update(
            trainer_class, model, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs
        )
        # Each run's own completions (on-policy): compared with the reference over them.
        reference = _reference(kind, model, trainer, extra, rows if not on_policy else None, bs, _all_ranks)
        updates[f"{prefix}{name}Trainer"] = compare(update, reference.grads)
        ours = trainer if ours is None else ours
    if on_policy:
        num_samples = len(more.recorded_completions(_all_ranks(ours.recorded_micro_batches)))
        size = sum(p.numel() for p in model.parameters())
        note = (
            f"{num_samples} {what} (not the model above: a {size:,}-parameter Llama over 8 words); micro-batches "
            f"of {bs} per process"
        )
    else:
        num_samples = sum(layout)
        note = f"{num_samples} {what}; micro-batches of {', '.join(str(s) for s in layout[::world_size])} per process"
    return TrlStep(updates, ours, num_samples, note)


def _reference(kind: str, model: Any, trainer: Any, extra: dict[str, Any], rows: Any, bs: int, all_ranks: Any) -> Any:
    from ...testing import trl_more_steps as more
    from ...testing import trl_steps

    if kind == "reward":
        return trl_steps.reward_reference(model, rows, center=0.0)
    if kind == "kto":
        return more.kto_reference(model, extra["ref_model"], rows, beta=KTO_BETA, per_device_train_batch_size=bs)
    micro_batches = all_ranks(trainer.recorded_micro_batches)
    completions = more.recorded_completions(micro_batches)
    if kind == "distillation":
        return more.distillation_reference(model, extra["teacher_model"], completions, beta=0.5)
    advantages = [float(a) for mb in micro_batches for a in mb["advantages"]]
    return more.rloo_reference(model, [(p, c, a) for (p, c), a in zip(completions, advantages, strict=True)])


def more_stock_note(kind: str, stock: Any, tolerance: float) -> str:
    """What the report says about TRL's trainer, exact or not, and why."""
    from .report import off_by

    name = f"{MORE_TRL_NAMES[kind]}Trainer"
    if kind in ON_POLICY:
        why = (
            "it generates once per step and divides by the generation batch's completion tokens over every process, "
            "which is the step's count"
            if kind == "distillation"
            else "its loss is per sequence and it slices its generation buffer into micro-batches of equal rows, so "
            "the mean of micro-batch means over the accumulation steps is the step's mean"
        )
        if stock.is_exact(tolerance):
            return f"TRL's {name} is exact here too: {why}."
        return f"TRL's {name} is {off_by(stock)} from the full-batch step here."
    if stock.is_exact(tolerance):
        return (
            f"TRL's {name} is exact here too: every micro-batch holds the same number of samples (try "
            "--per_device_train_batch_size 2 or more)."
        )
    kl = (
        " and estimates KTO's KL term per micro-batch, where the full batch has one estimate over the step"
        if kind == "kto"
        else ""
    )
    return (
        f"TRL's {name} is {off_by(stock)}: it averages each micro-batch's samples and divides by the accumulation "
        f"steps{kl}, so the samples of the short micro-batches weigh more (docs/preference.md)."
    )
