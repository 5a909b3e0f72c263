"""`hf-gradacc check --trainer grpo [--loss-type NAME ...]`: every GRPO ``loss_type``, TRL's GRPOTrainer and
GradAccGRPOTrainer, each against the float64 full-batch step of :mod:`hf_gradacc.testing.grpo_reference` (the loss
written from its definition; no TRL code). The rows (:func:`grpo_loss_type_rows`), their report, and the command's
``--loss-type`` and run (:func:`check_grpo`, which :mod:`hf_gradacc.commands.check` dispatches to).

One row per loss type. Each trainer trains the built-in tiny policy :data:`NUM_STEPS` SGD(lr=1) steps with
``steps_per_generation = 2 x gradient_accumulation_steps`` (half a generation batch per step) and ``num_iterations``
2, so the second step trains on completions the first step's policy generated: the importance ratio is not 1 and
clipping, soft gates and sequence weights act. ``mask_truncated_completions`` masks the completions that reached
``max_completion_length`` (DAPO's overlong filtering): rows with no token in the loss. Every step is compared with its
reference (over every process's completions); a row shows each trainer's worst step.

Example:
    ```bash
    hf-gradacc check --trainer grpo                       # every loss type of the installed TRL, one row each
    hf-gradacc check --trainer grpo --loss-type dapo bnpo
    torchrun --nproc_per_node 2 -m hf_gradacc check --trainer grpo   # 2 CPU ranks
    ```

    ```python
    from hf_gradacc.commands.check.grpo_rows import grpo_loss_type_rows

    check = grpo_loss_type_rows(["dapo", "bnpo"], per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                seed=0, step_kwargs={"use_cpu": True})
    check.rows[0].ours.relative_error  # <= 1e-5
    ```
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import GradAccConfigError
from ...testing.grpo_reference import (
    GRPO_LOSS_TYPES,
    GRPOLossSettings,
    GRPOPolicyRecorder,
    grpo_step_reference,
    step_updates,
    token_ratios,
)
from .._shared import EXIT_NOT_EXACT, EXIT_OK, EXIT_USAGE, finish_command
from .report import _fill, _setup_lines, off_by, verdict

__all__ = [
    "GRPOCheck",
    "GRPORow",
    "add_grpo_arguments",
    "check_grpo",
    "format_grpo_report",
    "grpo_loss_type_rows",
    "grpo_summary_line",
]

NUM_STEPS = 2
NUM_ITERATIONS = 2
NUM_GENERATIONS = 2
MAX_COMPLETION_LENGTH = 8
# What each loss type's full-batch step divides by (the report's column; grpo_reference's module docstring).
NORMALISERS: dict[str, str] = {
    "grpo": "sequences (token mean each)",
    "bnpo": "tokens of the step (*)",
    "dr_grpo": "sequences x max length",
    "dapo": "tokens of the step",
    "cispo": "tokens of the step",
    "sapo": "sequences (token mean each)",
    "luspo": "sequences (token sum each)",
    "vespo": "tokens of the step",
}
# The settings of each loss type's paper (TRL's defaults otherwise).
LOSS_CONFIG: dict[str, dict[str, Any]] = {
    # CISPO caps the ratio at eps_max (TRL's `epsilon_high`, an absolute cap: its default 0.2 caps every ratio).
    # ScaleRL's 5.0 hardly binds on the tiny policy: 1.2 caps a share of step 2's tokens, so the cap is checked.
    "cispo": {"epsilon_high": 1.2},
    "luspo": {"importance_sampling_level": "sequence"},  # LUSPO (TRL warns otherwise)
}


@dataclass(frozen=True, slots=True)
class GRPORow:
    """One loss type: each trainer's worst step (:class:`~hf_gradacc.testing.reference.Comparison`), every step's
    relative error, the share of the last step's completion tokens (GradAccGRPOTrainer's run) whose importance ratio
    is clipped (outside PPO's range ``[1 - epsilon, 1 + epsilon_high]``; ``cispo``: above its cap ``epsilon_high``;
    ``sapo`` and ``vespo``, which gate softly, outside PPO's range too), and stock TRL's distance to ``bnpo`` taken per
    micro-batch (``None`` for the other loss types)."""

    loss_type: str
    stock: Any
    ours: Any
    stock_steps: tuple[float, ...]
    ours_steps: tuple[float, ...]
    clipped_fraction: float
    stock_to_per_micro_batch: float | None = None


@dataclass(frozen=True, slots=True)
class GRPOCheck:
    """The rows, hf_gradacc's last trainer (for the set-up lines), the completions per step over all processes, and the
    lengths of the first step's completions (GradAccGRPOTrainer's last run)."""

    rows: tuple[GRPORow, ...]
    trainer: Any
    completions_per_step: int
    data_note: str
    completion_lengths: tuple[int, ...] = ()


def _all_ranks(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from .trl_gather import all_ranks as gather

    return gather(batches)


def grpo_run(
    trainer_class: type,
    config_class: type,
    policy: Any,
    *,
    loss_type: str,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    seed: int,
    step_kwargs: dict[str, Any],
    world_size: int = 1,
    **config: Any,
) -> tuple[Any, dict[int, Any], list[tuple[int, list[dict[str, Any]]]]]:
    """Train a copy of ``policy`` :data:`NUM_STEPS` steps; return the trainer, ``{step: update}`` and ``[(step, every
    process's micro-batches)]``."""
    from ...testing.grpo_steps import grpo_prompts, grpo_tokenizer, length_reward
    from ...testing.one_step import one_step_args

    gas = gradient_accumulation_steps
    settings = dict(
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gas,
        seed=seed,
        max_steps=NUM_STEPS,
        steps_per_generation=2 * gas,
        num_iterations=NUM_ITERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        beta=0.0,
        bf16=False,
        mask_truncated_completions=True,
        loss_type=loss_type,
        **LOSS_CONFIG.get(loss_type, {}),
    )
    settings.update(step_kwargs)
    settings.update(config)
    args = one_step_args(args_class=config_class, **settings)
    recording = type(f"Recording{trainer_class.__name__}", (GRPOPolicyRecorder, trainer_class), {})
    num_prompts = per_device_train_batch_size * settings["steps_per_generation"] * world_size // NUM_GENERATIONS
    trainer = recording(
        model=copy.deepcopy(policy),
        reward_funcs=length_reward,
        args=args,
        train_dataset=grpo_prompts(max(num_prompts, 8), seed=seed + 3),
        processing_class=grpo_tokenizer(),
    )
    trainer.train()
    steps = [(record.step, _all_ranks(record.micro_batches)) for record in trainer.recorded_steps]
    return trainer, step_updates(trainer.policies_at_step), steps


def grpo_loss_type_rows(
    loss_types: Sequence[str] = GRPO_LOSS_TYPES,
    *,
    per_device_train_batch_size: int = 2,
    gradient_accumulation_steps: int = 4,
    seed: int = 0,
    step_kwargs: dict[str, Any] | None = None,
    world_size: int = 1,
) -> GRPOCheck:
    """For each loss type: GradAccGRPOTrainer's and TRL's :data:`NUM_STEPS` steps, each step against its float64
    full-batch reference. ``step_kwargs``: extra ``GRPOConfig`` fields (``use_cpu``, ``ddp_backend``, ...)."""
    import trl

    from ... import trl as gradacc_trl
    from ...testing.grpo_steps import build_tiny_policy
    from ...testing.reference import compare

    policy = build_tiny_policy(seed)
    common = dict(
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        seed=seed,
        step_kwargs=dict(step_kwargs or {}),
        world_size=world_size,
    )
    rows, ours_trainer, completions, lengths = [], None, 0, ()
    for loss_type in loss_types:
        worst: dict[str, Any] = {}
        errors: dict[str, tuple[float, ...]] = {}
        per_micro_batch = None
        for name, (trainer_class, config_class) in {
            "ours": (gradacc_trl.GradAccGRPOTrainer, gradacc_trl.GradAccGRPOConfig),
            "stock": (trl.GRPOTrainer, trl.GRPOConfig),
        }.items():
            trainer, updates, steps = grpo_run(trainer_class, config_class, policy, loss_type=loss_type, **common)
            settings = GRPOLossSettings.from_args(trainer.args)
            comparisons = []
            for step, micro_batches in steps:
                reference = grpo_step_reference(policy, micro_batches, trainer.policies_at_step, step, settings)
                comparisons.append(compare(updates[step], reference.grads))
                if name == "stock" and loss_type == "bnpo":
                    literal = GRPOLossSettings.from_args(trainer.args, bnpo_scope="micro_batch")
                    by_micro_batch = grpo_step_reference(
                        policy, micro_batches, trainer.policies_at_step, step, literal
                    )
                    error = compare(updates[step], by_micro_batch.grads).relative_error
                    per_micro_batch = max(per_micro_batch or 0.0, error)
            worst[name] = max(comparisons, key=lambda c: c.relative_error)
            errors[name] = tuple(c.relative_error for c in comparisons)
            if name == "ours":
                ours_trainer = trainer
                completions = sum(int(mb["completion_ids"].size(0)) for mb in steps[0][1])
                lengths = tuple(int(n) for mb in steps[0][1] for n in mb["completion_mask"].sum(dim=1))
                last, micro_batches = steps[-1]
                ratios = token_ratios(policy, micro_batches, trainer.policies_at_step, last)
                if loss_type == "cispo":
                    outside = ratios > settings.epsilon_high
                else:
                    outside = (ratios < 1 - settings.epsilon_low) | (ratios > 1 + settings.epsilon_high)
                clipped = float(outside.double().mean()) if ratios.numel() else 0.0
        rows.append(
            GRPORow(
                loss_type, worst["stock"], worst["ours"], errors["stock"], errors["ours"], clipped, per_micro_batch
            )
        )
    note = (
        f"{NUM_STEPS} steps of {completions} completions each ({NUM_GENERATIONS} per prompt, "
        f"{min(lengths, default=0)} to {max(lengths, default=0)} tokens in the loss, truncated ones masked), "
        "steps_per_generation "
        f"{2 * gradient_accumulation_steps}, num_iterations {NUM_ITERATIONS}: step 2 trains on step 1's policy's "
        "completions (ratio != 1)"
    )
    return GRPOCheck(tuple(rows), ours_trainer, completions, note, lengths)


def grpo_exact(check: GRPOCheck, tolerance: float) -> bool:
    """Whether GradAccGRPOTrainer is exact on every loss type (and at least one ran)."""
    return bool(check.rows) and all(r.ours.is_exact(tolerance) for r in check.rows)


def format_grpo_report(setup_lines: Sequence[str], check: GRPOCheck, tolerance: float) -> str:
    """One row per loss type: stock TRL's and GradAccGRPOTrainer's verdict and worst relative error."""
    lines = [
        "hf-gradacc check: GRPO, every loss type, TRL's GRPOTrainer and GradAccGRPOTrainer, each step against the",
        "float64 full-batch step of the loss as its paper / TRL's docstring defines it",
        "",
        *setup_lines,
        "",
        f"  {'loss_type':<11}{'the full batch divides by':<30}{'GRPOTrainer':<20}{'GradAccGRPOTrainer':<20}"
        "step 2 tokens clipped",
    ]
    for r in check.rows:
        lines.append(
            f"  {r.loss_type:<11}{NORMALISERS[r.loss_type]:<30}{verdict(r.stock, tolerance):<8}"
            f"{r.stock.relative_error:<12.1e}{verdict(r.ours, tolerance):<8}{r.ours.relative_error:<12.1e}"
            f"{r.clipped_fraction:.0%}"
        )
    wrong = [r.loss_type for r in check.rows if not r.stock.is_exact(tolerance)]
    note = (
        f"Relative gradient error, worst of the steps (tolerance {tolerance:g}); the last column: the share of step "
        "2's completion tokens whose importance ratio is outside [1 - epsilon, 1 + epsilon_high] (cispo: above its "
        "cap epsilon_high, 1.2 here). TRL is off on "
        f"{', '.join(wrong) if wrong else 'none'} of these loss types here: "
        "dapo, cispo and vespo divide by the generation batch's tokens rescaled to one step (the step's own count "
        "only when a generation batch is exactly one step), bnpo by each micro-batch's tokens; the per-sequence "
        "loss types (grpo, dr_grpo, sapo, luspo) are exact because TRL's micro-batches hold equal numbers of "
        "completions. GradAccGRPOTrainer divides each micro-batch's sum by the step's count over every process."
    )
    lines += ["", _fill(note)]
    bnpo = next((r for r in check.rows if r.stock_to_per_micro_batch is not None), None)
    if bnpo is not None:
        lines += [
            "",
            _fill(
                '(*) bnpo is defined on the split: TRL\'s docstring normalises it "over the local batch only" (one '
                "micro-batch of one process). GradAccGRPOTrainer takes the whole step, over every process, as that "
                "batch "
                f"(then bnpo is dapo). Stock TRL against the definition taken per micro-batch: "
                f"{bnpo.stock_to_per_micro_batch:.1e} "
                f"({'exact' if bnpo.stock_to_per_micro_batch <= tolerance else 'off'})."
            ),
        ]
    return "\n".join(lines)


def grpo_summary_line(check: GRPOCheck, tolerance: float) -> str:
    """The last line of ``--trainer grpo``."""
    worst = max(check.rows, key=lambda r: r.ours.relative_error)
    wrong = [r for r in check.rows if not r.stock.is_exact(tolerance)]
    not_exact = [r.loss_type for r in check.rows if not r.ours.is_exact(tolerance)]
    if not_exact:
        head = (
            f"hf-gradacc check: GradAccGRPOTrainer is NOT exact on {', '.join(not_exact)} "
            f"(largest rel err {worst.ours.relative_error:.1e} > {tolerance:g})"
        )
    else:
        head = (
            f"hf-gradacc check: GradAccGRPOTrainer is exact on all {len(check.rows)} loss types "
            f"(largest rel err {worst.ours.relative_error:.1e} <= {tolerance:g})"
        )
    stock = f"stock GRPOTrainer is off on {len(wrong)} of {len(check.rows)}"
    if wrong:
        stock += f" (largest {off_by(max(wrong, key=lambda r: r.stock.relative_error).stock)})"
    return f"{head}; {stock}"


# ---------------------------------------------------------------------------------------------- the command
def add_grpo_arguments(check: argparse.ArgumentParser) -> None:
    """``--loss-type`` of ``check`` (only with ``--trainer grpo``)."""
    check.add_argument(
        "--loss-type",
        "--loss_type",
        dest="loss_type",
        nargs="+",
        default=None,
        metavar="NAME",
        help="with --trainer grpo (TRL's GRPOTrainer vs GradAccGRPOTrainer, 2 steps of the built-in tiny policy, "
        "steps_per_generation 2 x GA, num_iterations 2): the GRPO loss types to check, one row each. Default: every "
        "loss type of the installed TRL",
    )


def _grpo_options(opts: argparse.Namespace, trl_options: Callable[[argparse.Namespace], None]) -> list[str]:
    """The loss types to check; refuses what means nothing with ``--trainer grpo``."""
    if opts.trainer != "grpo":
        raise GradAccConfigError(f"`--loss-type` is for `--trainer grpo`; drop it with `--trainer {opts.trainer}`")
    if opts.model is not None:
        raise GradAccConfigError(
            "`--trainer grpo` runs on the built-in tiny policy (its word tokenizer and reward); "
            f"drop `--model {opts.model}`"
        )
    sharded = [name for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP") if _env_flag(name)]
    if sharded:
        raise GradAccConfigError(
            f"`--trainer grpo` runs on one process or DDP ({sharded[0]} is set): its float64 reference reads the "
            "policy's full parameters at every step and generation, which DeepSpeed and FSDP2 shard. Launch it with "
            "examples/accelerate_configs/ddp_cpu.yaml (or torchrun), or drop `--trainer grpo`"
        )
    if getattr(opts, "distributed_config", None):
        raise GradAccConfigError("`--distributed_config` is for `--trainer trainer`; drop it with `--trainer grpo`")
    trl_options(opts)
    loss_types = list(dict.fromkeys(opts.loss_type or GRPO_LOSS_TYPES))
    unknown = [name for name in loss_types if name not in GRPO_LOSS_TYPES]
    if unknown:
        raise GradAccConfigError(
            f"`--loss-type` {unknown[0]!r} is not a GRPO loss type; one of {list(GRPO_LOSS_TYPES)}"
        )
    return loss_types


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "y", "on")


def _error(message: Any) -> None:
    print(f"hf-gradacc check: error: {message}", file=sys.stderr)


def check_grpo(
    opts: argparse.Namespace,
    *,
    step_kwargs: Callable[[argparse.Namespace], dict[str, Any]],
    world: Callable[[dict[str, Any]], tuple[int, bool] | None],
    setup: Callable[..., Any],
    trl_options: Callable[[argparse.Namespace], None],
) -> int:
    """Run ``hf-gradacc check --trainer grpo``; returns the exit status (0 only when every row is exact). The launch
    helpers are :mod:`hf_gradacc.commands.check`'s (its step keywords, world size, set-up lines and TRL option
    checks), passed in so that this module does not import its caller (the package imports this module)."""
    from ... import patches
    from ...errors import GradAccError, UnsupportedBackendError

    try:
        loss_types = _grpo_options(opts, trl_options)
    except (ImportError, GradAccError) as exc:
        _error(exc)
        return EXIT_USAGE
    patches.maybe_enable_from_env()
    launch = step_kwargs(opts)
    ranks = world(launch)
    if ranks is None:
        return EXIT_USAGE
    world_size, is_main = ranks
    launch = {k: v for k, v in launch.items() if k not in _ROW_KEYWORDS}
    try:
        with contextlib.redirect_stdout(io.StringIO()) if not opts.verbose else contextlib.nullcontext():
            check = grpo_loss_type_rows(
                loss_types,
                per_device_train_batch_size=opts.per_device_train_batch_size,
                gradient_accumulation_steps=opts.gradient_accumulation_steps,
                seed=opts.seed,
                step_kwargs=launch,
                world_size=world_size,
            )
    except GradAccError as exc:
        if is_main:
            _error(exc)
        return EXIT_USAGE if isinstance(exc, (GradAccConfigError, UnsupportedBackendError)) else EXIT_NOT_EXACT
    trainer = check.trainer
    described = setup(
        opts,
        task="grpo (TRL GRPOTrainer), every loss type",
        model_name="built-in tiny policy",
        model=trainer.model,
        trainer=trainer,
        world_size=world_size,
        num_samples=check.completions_per_step,
    )
    is_exact = grpo_exact(check, opts.tolerance)
    summary = grpo_summary_line(check, opts.tolerance)
    if is_main:
        print(format_grpo_report(_setup_lines(described, check.data_note), check, opts.tolerance))
        if opts.json:
            rows = {
                r.loss_type: {
                    "results": {
                        name: {**asdict(c), "is_exact": c.is_exact(opts.tolerance)}
                        for name, c in (("GRPOTrainer", r.stock), ("GradAccGRPOTrainer", r.ours))
                    },
                    "relative_error_per_step": {
                        "GRPOTrainer": list(r.stock_steps),
                        "GradAccGRPOTrainer": list(r.ours_steps),
                    },
                    "clipped_token_fraction": r.clipped_fraction,
                    "stock_vs_per_micro_batch_definition": r.stock_to_per_micro_batch,
                }
                for r in check.rows
            }
            payload = {
                "command": "check",
                "setup": asdict(described),
                "tolerance": opts.tolerance,
                "loss_types": rows,
                "is_exact": is_exact,
                "summary": summary,
            }
            with open(opts.json, "w") as f:
                json.dump(payload, f, indent=2)
            print(f"Wrote {opts.json}")
        print(f"\n{summary}")
    finish_command()
    return EXIT_OK if is_exact else EXIT_NOT_EXACT


# The run's own values: grpo_loss_type_rows sets the batch layout and seed itself.
_ROW_KEYWORDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
