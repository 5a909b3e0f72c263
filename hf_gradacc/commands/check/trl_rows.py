"""`hf-gradacc check --trainer sft|dpo`: ONE step of TRL's trainer and of hf_gradacc's on the same synthetic rows,
each against the float64 full-batch reference of :mod:`hf_gradacc.testing.trl_steps` (no TRL code in it).

A mixture-of-experts model whose loss holds its router term (``output_router_logits`` on) gets that term in the
reference too, as hf_gradacc weights it (docs/trl.md): each micro-batch's ``router_aux_loss_coef x aux`` by its share
of the step's routed tokens, over every process's micro-batches.

Example:
    ```python
    from hf_gradacc.commands.check.trl_rows import trl_one_step
    from hf_gradacc.testing.tiny import build_tiny_model

    step = trl_one_step("dpo", build_tiny_model("causal_lm"), step_kwargs, world_size=1)
    step.results["GradAccDPOTrainer"].relative_error
    ```
"""

from __future__ import annotations

import copy
from typing import Any

from ...errors import GradAccConfigError
from .trl_gather import TrlStep
from .trl_gather import all_ranks as _all_ranks

TRL_NAMES: dict[str, str] = {"sft": "SFT", "dpo": "DPO"}
DPO_BETA = 0.1


def trl_trainer_names(kind: str) -> tuple[str, str]:
    """(TRL's trainer, hf_gradacc's) for ``--trainer sft / dpo`` (and reward / kto / rloo / distillation)."""
    from .trl_more_rows import MORE_TRL_NAMES

    name = TRL_NAMES.get(kind) or MORE_TRL_NAMES[kind]
    return f"{name}Trainer", f"GradAcc{name}Trainer"


class _RecordBatches:
    """Trainer mixin: keeps every micro-batch the step trains on (on CPU), for the router term's reference."""

    recorded: list[dict[str, Any]]

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not hasattr(self, "recorded"):
            self.recorded = []
        for batch in batches:
            self.recorded.append({k: v.detach().cpu() for k, v in batch.items() if hasattr(v, "detach")})
        return batches, num_items


def trl_one_step(kind: str, model: Any, step_kwargs: dict[str, Any], world_size: int) -> TrlStep:
    """ONE SGD(lr=1) step of hf_gradacc's TRL trainer, then of TRL's, on the same synthetic rows of every process.

    Every process runs ``batch`` x (GA - 1) then ``batch - 1`` rows (a fixed batch layout, alike on every process as
    TRL's per-row metric gathers need). ``step_kwargs``: :func:`~hf_gradacc.testing.one_step.one_step_args`'
    keywords (batch size, accumulation steps, seed, device).
    """
    from .trl_more_rows import MORE_TRL_NAMES, more_one_step

    if kind in MORE_TRL_NAMES:  # reward, kto, rloo, distillation
        return more_one_step(kind, model, step_kwargs, world_size)
    import trl

    from ... import trl as gradacc_trl
    from ...testing import trl_steps
    from ...testing.one_step import full_parameters, one_step_args
    from ...testing.reference import compare, router_coefficient

    bs, gas, seed = (
        step_kwargs["per_device_train_batch_size"],
        step_kwargs["gradient_accumulation_steps"],
        step_kwargs["seed"],
    )
    layout = trl_steps.uneven_batch_sizes(bs, gas, world_size)
    vocab_size = int(model.config.vocab_size)
    if vocab_size < 4:
        raise GradAccConfigError(
            f"the model's `vocab_size` ({vocab_size}) is too small for synthetic data (needs >= 4)"
        )
    name = TRL_NAMES[kind]
    router_coef = router_coefficient(model)
    if kind == "sft":
        from datasets import Dataset

        rows = trl_steps.sft_rows(sum(layout), seed, vocab_size=vocab_size)
        dataset = Dataset.from_list(rows)
        config: dict[str, Any] = {"completion_only_loss": True, "max_length": None}
        what = "prompt-completion rows (loss on the completions)"
    else:
        pairs = trl_steps.dpo_pairs(sum(layout), seed, vocab_size=vocab_size)
        dataset = trl_steps.dpo_dataset(pairs)
        config = {"beta": DPO_BETA}
        what = f"preference pairs (sigmoid loss, beta {DPO_BETA}, the initial model as reference model)"
    updates: dict[str, Any] = {}
    ours = None
    for module, prefix in ((gradacc_trl, "GradAcc"), (trl, "")):
        config_class = getattr(module, f"{prefix}{name}Config")
        trainer_class = trl_steps.with_batch_layout(getattr(module, f"{prefix}{name}Trainer"), layout)
        if ours is None:
            trainer_class = type(f"Recording{trainer_class.__name__}", (_RecordBatches, trainer_class), {})
        extra_config = dict(config)
        if router_coef is not None and "router_aux_loss_coef" in getattr(config_class, "__dataclass_fields__", {}):
            # TRL 1.9 to 1.13 put their config's default (0.001) in place of the model's coefficient.
            extra_config["router_aux_loss_coef"] = router_coef
        args = one_step_args(args_class=config_class, bf16=False, **step_kwargs, **extra_config)
        extra = {"ref_model": copy.deepcopy(model)} if kind == "dpo" else {}
        policy = copy.deepcopy(model)
        initial = {n: p.detach().clone().cpu() for n, p in policy.named_parameters() if p.requires_grad}
        trainer = trainer_class(
            model=policy,
            args=args,
            train_dataset=dataset,
            processing_class=trl_steps.word_tokenizer(vocab_size),
            **extra,
        )
        trainer.train()
        final = full_parameters(trainer)
        updates[f"{prefix}{name}Trainer"] = {n: initial[n] - final[n].float() for n in initial}
        ours = trainer if ours is None else ours
    # The router term is defined per forward pass: the reference needs the step's micro-batches (every process's).
    micro_batches = _all_ranks(ours.recorded) if router_coef is not None else None
    if kind == "sft":
        reference = trl_steps.sft_reference(model, rows, micro_batches=micro_batches)
    else:
        reference = trl_steps.dpo_reference(model, pairs, beta=DPO_BETA, micro_batches=micro_batches)
    stock_name, ours_name = trl_trainer_names(kind)
    results = {n: compare(updates[n], reference.grads) for n in (stock_name, ours_name)}
    per_process = ", ".join(str(size) for size in layout[::world_size])
    note = f"{sum(layout)} {what}; micro-batches of {per_process} per process"
    if router_coef is not None:
        note += f"; router term on (coefficient {router_coef:g})"
    return TrlStep(results, ours, sum(layout), note)


def trl_stock_note(kind: str, stock: Any, tolerance: float, *, has_router: bool = False) -> str:
    """What the report says about TRL's trainer, exact or not, and why."""
    from .report import off_by
    from .trl_more_rows import MORE_TRL_NAMES, more_stock_note

    if kind in MORE_TRL_NAMES:
        return more_stock_note(kind, stock, tolerance)
    if kind == "sft":
        if stock.is_exact(tolerance):
            return (
                "TRL's SFTTrainer is exact here too: it divides each micro-batch's token sum by the step's token "
                "count, "
                "gathered over the processes. What hf_gradacc adds for SFT (a mixture-of-experts router term weighted "
                "by routed tokens, `average_tokens_across_devices=False`, ...) is in docs/trl.md."
            )
        if has_router:
            return (
                f"TRL's SFTTrainer is {off_by(stock)}: it adds each micro-batch's router term (coefficient x aux) "
                "divided by the accumulation steps, where the full batch weighs it by the micro-batch's share of the "
                "step's routed tokens (docs/trl.md)."
            )
        return f"TRL's SFTTrainer is {off_by(stock)} from the full-batch step here; docs/trl.md says when."
    if stock.is_exact(tolerance):
        return (
            "TRL's DPOTrainer is exact here too: every micro-batch holds the same number of pairs. It averages each "
            "micro-batch's pairs and divides by the accumulation steps, which is off as soon as they differ (try "
            "--per_device_train_batch_size 2 or more)."
        )
    return (
        f"TRL's DPOTrainer is {off_by(stock)}: it averages each micro-batch's pairs and divides by the accumulation "
        "steps, so the pairs of the short micro-batches weigh more than the others (the mean of micro-batch means, "
        "not the mean over all the step's pairs)."
        + (" Its router term is weighted per micro-batch too, not by routed tokens." if has_router else "")
    )
