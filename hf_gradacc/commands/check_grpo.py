"""`hf-gradacc check --trainer grpo [--loss-type NAME ...]`: one row per GRPO loss type, TRL's GRPOTrainer and
GradAccGRPOTrainer each against the float64 full-batch step of the loss's definition
(:mod:`hf_gradacc.testing.check_grpo`). Parsing and printing only; :mod:`.check` dispatches here.

Example:
    ```bash
    hf-gradacc check --trainer grpo                       # every loss type of the installed TRL, one row each
    hf-gradacc check --trainer grpo --loss-type dapo bnpo
    torchrun --nproc_per_node 2 -m hf_gradacc check --trainer grpo   # 2 CPU ranks
    ```
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..errors import GradAccConfigError
from ._shared import EXIT_NOT_EXACT, EXIT_OK, EXIT_USAGE, finish_command


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
    from ..testing.grpo_reference import GRPO_LOSS_TYPES

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
    helpers are :mod:`.check`'s (its step keywords, world size, set-up lines and TRL option checks), passed in so that
    this module does not import its caller."""
    from .. import patches
    from ..errors import GradAccError, UnsupportedBackendError
    from ..testing.check_grpo import format_grpo_report, grpo_exact, grpo_loss_type_rows, grpo_summary_line
    from ..testing.check_report import _setup_lines

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
                loss_types, per_device_train_batch_size=opts.per_device_train_batch_size,
                gradient_accumulation_steps=opts.gradient_accumulation_steps, seed=opts.seed,
                step_kwargs=launch, world_size=world_size,
            )  # fmt: skip
    except GradAccError as exc:
        if is_main:
            _error(exc)
        return EXIT_USAGE if isinstance(exc, (GradAccConfigError, UnsupportedBackendError)) else EXIT_NOT_EXACT
    trainer = check.trainer
    described = setup(opts, task="grpo (TRL GRPOTrainer), every loss type", model_name="built-in tiny policy",
                   model=trainer.model, trainer=trainer, world_size=world_size,
                   num_samples=check.completions_per_step)  # fmt: skip
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
                    "relative_error_per_step": {"GRPOTrainer": list(r.stock_steps),
                                                "GradAccGRPOTrainer": list(r.ours_steps)},
                    "clipped_token_fraction": r.clipped_fraction,
                    "stock_vs_per_micro_batch_definition": r.stock_to_per_micro_batch,
                }
                for r in check.rows
            }  # fmt: skip
            payload = {"command": "check", "setup": asdict(described), "tolerance": opts.tolerance, "loss_types": rows,
                       "is_exact": is_exact, "summary": summary}  # fmt: skip
            with open(opts.json, "w") as f:
                json.dump(payload, f, indent=2)
            print(f"Wrote {opts.json}")
        print(f"\n{summary}")
    finish_command()
    return EXIT_OK if is_exact else EXIT_NOT_EXACT


# The run's own values: grpo_loss_type_rows sets the batch layout and seed itself.
_ROW_KEYWORDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
