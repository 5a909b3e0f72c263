"""`hf-gradacc check`: run ONE accumulated optimizer step with the stock `transformers.Trainer` and with
  :class:`~hf_gradacc.GradAccTrainer` on mixed-length synthetic data, compare both with the float64 full-batch
  reference, print a table, and exit 0 only when GradAccTrainer is exact. Without ``--task``, ``--model``,
  ``--scenario``, ``--trainer`` or ``--plot`` it does so for each built-in tiny head and prints one row per head.
  Runs under ``accelerate launch`` too.

This module parses, runs and prints; what it measures lives in the modules beside it: :mod:`.scenarios` (models,
data), :mod:`.mesh_rows` (``--distributed_config``, sequence and context parallelism), :mod:`.trl_rows`
(``--trainer``), :mod:`.grpo_rows` (``--trainer grpo``), :mod:`.moe_rows`, :mod:`.loss_curves` (``--plot``) and
:mod:`.report` (the report's text).

Example:
    ```bash
    hf-gradacc check                                   # every built-in tiny head, 2 x GA 4
    hf-gradacc check --task sequence_classification --json out.json --plot curves.png
    hf-gradacc check --model ./my-checkpoint --task token_classification
    hf-gradacc check --trainer dpo                     # TRL's DPOTrainer vs GradAccDPOTrainer
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml -m hf_gradacc check   # 2 CPU ranks
    ```
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

from ...errors import GradAccConfigError
from .._shared import EXIT_NOT_EXACT, EXIT_OK, EXIT_USAGE, PlotDependencyError, finish_command, require_matplotlib
from .grpo_rows import add_grpo_arguments, check_grpo

# --trainer: transformers' Trainer vs GradAccTrainer, or TRL's trainer vs hf_gradacc's (hf_gradacc.trl)
TRAINERS: tuple[str, ...] = ("trainer", "sft", "dpo", "reward", "grpo", "rloo", "kto", "distillation")


# ---------------------------------------------------------------------------------------------- argument parsing
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for options whose default means "not set"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def check_command_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to an ``argparse`` subparsers object; :func:`check_command` runs it.

    Example:
        ```python
        parser = argparse.ArgumentParser(prog="hf-gradacc")
        check_command_parser(parser.add_subparsers(dest="command"))
        opts = parser.parse_args(["check", "--task", "masked_lm"])
        ```
    """
    from ...testing.tiny import TASKS
    from .mesh_rows import parse_distributed_config
    from .scenarios import SCENARIOS

    check = subparsers.add_parser(
        "check",
        help="one accumulated step, stock Trainer vs GradAccTrainer, against the float64 full-batch gradient",
        description=(
            "Run ONE optimizer step of N accumulated micro-batches with the stock transformers.Trainer and with "
            "GradAccTrainer (SGD, lr 1, so the update is the accumulated gradient), compare both with the float64 "
            "gradient of one full batch of the same samples, and print the result. Exit status 0 when "
            "GradAccTrainer is exact within --tolerance, 1 when it is not. Under `accelerate launch` the step "
            "covers every process's samples and only the main process prints."
        ),
        formatter_class=_HelpFormatter,
    )
    check.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        metavar="TASK",
        help=f"head family to check, one of: {', '.join(TASKS)}. Default: every built-in tiny head in turn, one row "
        "each (causal_lm with --scenario, --trainer or --plot); read from the config's `architectures` for --model.",
    )
    check.add_argument(
        "--model",
        default=None,
        metavar="PATH_OR_HUB_ID",
        help="a checkpoint to load with the transformers Auto classes (in float32, dropout off) instead of the "
        "built-in tiny model. The synthetic data is drawn within its vocab_size and num_labels.",
    )
    check.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="default",
        help="what to check besides the head: 'no_loss_kwargs' (a causal LM with accepts_loss_kwargs=False, the VLM "
        "case), 'plain_compute_loss' (both trainers' compute_loss overridden to return outputs.loss), 'moe_mixtral' / "
        "'moe_qwen3' (a tiny mixture-of-experts causal LM whose loss includes its router load-balancing term)",
    )
    check.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="trainer",
        help="the trainers to compare: 'trainer' (transformers.Trainer vs GradAccTrainer), 'sft' (TRL's SFTTrainer vs "
        "GradAccSFTTrainer: prompt-completion rows, completion-only loss) or 'dpo' (TRL's DPOTrainer vs "
        "GradAccDPOTrainer: sigmoid loss, beta 0.1, the initial model as reference model); 'reward', 'kto', 'rloo', "
        "'distillation' likewise (docs/preference.md, docs/distillation.md). With sft / dpo every "
        "process's last micro-batch holds one sample less than the others, and the model is the built-in tiny causal "
        "LM or a causal LM --model. Needs TRL: pip install hf_gradacc[trl]",
    )
    check.add_argument(
        "--per_device_train_batch_size",
        type=_positive_int,
        metavar="N",
        default=2,
        help="micro-batch size per process",
    )
    check.add_argument(
        "--gradient_accumulation_steps",
        type=_positive_int,
        metavar="N",
        default=4,
        help="micro-batches per optimizer step",
    )
    check.add_argument(
        "--seed", type=int, default=0, help="seed of the tiny model, the synthetic data and the Trainer"
    )
    check.add_argument(
        "--tolerance",
        type=_positive_float,
        default=1e-5,
        metavar="X",
        help="largest relative gradient error (|update - reference| / |reference|) still called exact",
    )
    check.add_argument(
        "--distributed_config",
        type=parse_distributed_config,
        metavar="NAME=N[,NAME=N]",
        default=None,
        help="load each tiny model with transformers' from_pretrained(..., distributed_config=DistributedConfig(...)) "
        "on every rank (tp_size, fsdp_size, dp_replicate_size, ep_size; e.g. tp_size=2,fsdp_size=2 under torchrun "
        "--nproc_per_node 4): tensor and expert parallelism. A head whose model has no plan for a dimension is "
        "reported as such",
    )
    check.add_argument("--json", metavar="FILE", default=None, help="also write the setup and numbers to FILE as JSON")
    check.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also train --steps steps with stock Trainer + GA, GradAccTrainer + GA and one full batch per step, "
        "and draw the three loss curves to FILE.png (needs matplotlib: pip install hf_gradacc[plot])",
    )
    check.add_argument(
        "--steps", type=_positive_int, metavar="N", default=20, help="optimizer steps of each --plot run"
    )
    check.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="optimizer of the --plot runs. Adam hides an error that only scales the gradient; SGD shows it.",
    )
    check.add_argument(
        "--learning_rate", type=_positive_float, metavar="X", default=1e-3, help="learning rate of the --plot runs"
    )
    check.add_argument(
        "--verbose",
        action="store_true",
        help="show transformers' and accelerate's info logs and the Trainer's printed logs",
    )
    add_grpo_arguments(check)  # --loss-type, for --trainer grpo
    check.set_defaults(handler=check_command)
    return check


# ---------------------------------------------------------------------------------------------- check
def _runs_every_head(opts: argparse.Namespace) -> bool:
    """The default run: nothing names one model, scenario, trainer pair or plot."""
    return (
        opts.task is None
        and opts.model is None
        and opts.scenario == "default"
        and opts.trainer == "trainer"
        and not opts.plot
    )


def _error(message: Any) -> None:
    print(f"hf-gradacc check: error: {message}", file=sys.stderr)


def _step_kwargs(opts: argparse.Namespace) -> dict[str, Any]:
    # optim="sgd": DeepSpeed builds the optimizer from the args, not one_step_update's SGD(lr=1) (default: AdamW).
    step_kwargs: dict[str, Any] = dict(
        per_device_train_batch_size=opts.per_device_train_batch_size,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        seed=opts.seed,
        optim="sgd",
        use_cpu=_runs_on_cpu(),
    )
    if step_kwargs["use_cpu"] and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        step_kwargs["ddp_backend"] = "gloo"
    return step_kwargs


def _world(step_kwargs: dict[str, Any]) -> tuple[int, bool] | None:
    """(world size, is main process); None (after an error message) when the launch and the Trainer disagree."""
    from ...testing.one_step import one_step_args

    # Building TrainingArguments sets up the process group under a distributed launch: read the world size from it.
    probe = one_step_args(**step_kwargs)
    world_size, is_main = probe.world_size, probe.process_index == 0
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and world_size == 1:
        _error(
            f"launched as one of {launched} processes (WORLD_SIZE), but the Trainer sees {world_size}; each process "
            "would check alone. Check the accelerate config for this host (on a CPU-only host DeepSpeed and FSDP2 "
            "configs need HF_GRADACC_CPU_DISTRIBUTED=1)."
        )
        return None
    if world_size == 1:
        _warn_if_launch_fell_back_to_one_process()
    return world_size, is_main


def _trainer_pair(
    model: Any,
    task: str,
    samples: list,
    collator: Any,
    step_kwargs: dict[str, Any],
    *,
    scenario: str,
    verbose: bool,
    distributed_config: dict[str, int] | None = None,
) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """ONE step of GradAccTrainer, then of the stock Trainer: their comparisons by name (stock first), GradAccTrainer
    and its first log (the router term's share)."""
    from transformers import Trainer

    from ... import GradAccTrainer
    from ...testing.one_step import compare_with_reference, one_step_args, one_step_update
    from .mesh_rows import mesh_trainer_classes
    from .scenarios import plain_compute_loss

    # GradAccTrainer first: its set-up checks (e.g. a model FSDP2 cannot wrap) give a clear error where the stock
    # Trainer would fail deep inside torch.
    classes = mesh_trainer_classes([("GradAccTrainer", GradAccTrainer), ("Trainer", Trainer)])
    if scenario == "plain_compute_loss":
        classes = [(name, plain_compute_loss(trainer_class)) for name, trainer_class in classes]
    if distributed_config:
        from .mesh_rows import sharded_trainer_pair

        results, ours, logs = sharded_trainer_pair(
            model, task, samples, collator, step_kwargs, distributed_config, trainer_classes=classes, verbose=verbose
        )
        return {"Trainer": results["Trainer"], "GradAccTrainer": results["GradAccTrainer"]}, ours, logs
    results: dict[str, Any] = {}
    ours, logs = None, {}
    for name, trainer_class in classes:
        micro_batches: list = []
        with _quiet_stdout(verbose):
            update, trainer = one_step_update(
                trainer_class,
                model,
                samples,
                one_step_args(**step_kwargs),
                data_collator=collator,
                micro_batches=micro_batches,
            )
        results[name] = compare_with_reference(
            update, model, samples, task, data_collator=collator, micro_batches=micro_batches
        )
        if ours is None:
            ours = trainer
            logs = {k: v for k, v in trainer.state.log_history[0].items() if k.startswith("loss")}
    return {"Trainer": results["Trainer"], "GradAccTrainer": results["GradAccTrainer"]}, ours, logs


def _setup(
    opts: argparse.Namespace,
    *,
    task: str,
    model_name: str,
    model: Any,
    trainer: Any,
    world_size: int,
    num_samples: int,
) -> Any:
    from ...backends.mesh import mesh_from_accelerator
    from .report import Setup, versions

    return Setup(
        task=task,
        model=model_name,
        model_class=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        per_device_train_batch_size=opts.per_device_train_batch_size,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        world_size=world_size,
        num_samples=num_samples,
        backend=trainer.backend.describe(),
        device=str(trainer.args.device),
        seed=opts.seed,
        versions=versions(),
        data_ranks=_data_ranks(opts, world_size),
        mesh=mesh_from_accelerator(trainer.accelerator, getattr(trainer, "model_wrapped", None)).describe(),
    )


def _data_ranks(opts: argparse.Namespace, world_size: int) -> int:
    """The ranks that hold different samples (the tensor / expert ranks of ``--distributed_config`` hold copies)."""
    from .mesh_rows import data_ranks

    return data_ranks(getattr(opts, "distributed_config", None), world_size)


def _comparisons_json(results: dict[str, Any], tolerance: float) -> dict[str, Any]:
    return {name: {**asdict(c), "is_exact": c.is_exact(tolerance)} for name, c in results.items()}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"Wrote {path}")


def check_command(opts: argparse.Namespace) -> int:
    """Run ``hf-gradacc check`` (see ``hf-gradacc check --help``); returns the exit status."""
    _configure_logging(opts.verbose)
    try:
        from .mesh_rows import check_options

        check_options(opts)
    except GradAccConfigError as exc:
        _error(exc)
        return EXIT_USAGE
    if opts.trainer == "grpo" or opts.loss_type:  # one row per GRPO loss type
        return check_grpo(opts, step_kwargs=_step_kwargs, world=_world, setup=_setup, trl_options=_check_trl_options)
    if opts.plot:
        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            _error(exc)
            return EXIT_USAGE
    if _runs_every_head(opts):
        return _check_every_head(opts)
    return _check_one(opts)


def _check_every_head(opts: argparse.Namespace) -> int:
    """The default run: one step of both trainers on each built-in tiny head, one row each."""
    from ... import patches
    from ...errors import GradAccError, UnsupportedBackendError
    from ...testing.tiny import PaddingCollator
    from . import report
    from .mesh_rows import head_cases, mesh_collator
    from .scenarios import load_check_model, synthetic_samples

    patches.maybe_enable_from_env()
    step_kwargs = _step_kwargs(opts)
    world = _world(step_kwargs)
    if world is None:
        return EXIT_USAGE
    world_size, is_main = world
    num_samples = opts.per_device_train_batch_size * opts.gradient_accumulation_steps * _data_ranks(opts, world_size)
    rows: list[report.HeadResult] = []
    setup = None
    for case in head_cases(opts.distributed_config):
        loaded = load_check_model(task=case.task, scenario=case.scenario, seed=opts.seed)
        row = report.HeadResult(
            key=case.key, options=case.options, task=case.task, model_class=type(loaded.model).__name__
        )
        samples = synthetic_samples(loaded.task, num_samples, opts.seed, loaded.model)
        collator = mesh_collator(PaddingCollator(pad_token_id=loaded.pad_token_id), samples)  # SP: one width
        try:
            results, trainer, _ = _trainer_pair(
                loaded.model,
                loaded.task,
                samples,
                collator,
                step_kwargs,
                scenario=case.scenario,
                verbose=opts.verbose,
                distributed_config=opts.distributed_config,
            )
        except (GradAccConfigError, UnsupportedBackendError, NotImplementedError) as exc:
            # A head this backend cannot take (a model FSDP2 cannot wrap: hf_gradacc's error for BERT, accelerate's
            # NotImplementedError for ConvNeXt, raised alike on every rank before any collective): the other heads
            # still tell.
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            rows.append(replace(row, skipped=reason if len(reason) <= 140 else reason[:139] + "…"))
            continue
        except GradAccError as exc:
            if is_main:
                _error(f"{case.key}: {exc}")
            return EXIT_NOT_EXACT  # GradAccTrainer's step failed on the data or the loss: no update to call exact
        rows.append(replace(row, stock=results["Trainer"], ours=results["GradAccTrainer"]))
        if setup is None:
            setup = _setup(
                opts,
                task="every built-in head",
                model_name="built-in tiny models",
                model=loaded.model,
                trainer=trainer,
                world_size=world_size,
                num_samples=num_samples,
            )
    if setup is None:
        if is_main:
            _error(
                "no built-in head could run under this set-up:\n" + "\n".join(f"  {r.key}: {r.skipped}" for r in rows)
            )
        finish_command()
        return EXIT_USAGE
    is_exact = report.heads_exact(rows, opts.tolerance)
    summary = report.heads_summary_line(rows, opts.tolerance)
    if is_main:
        print(report.format_heads_report(setup, rows, opts.tolerance))
        if opts.json:
            heads = {
                r.key: {
                    "task": r.task,
                    "options": r.options,
                    "model_class": r.model_class,
                    "skipped": r.skipped or None,
                    "results": _comparisons_json({"Trainer": r.stock, "GradAccTrainer": r.ours}, opts.tolerance)
                    if r.ours is not None
                    else {},
                }
                for r in rows
            }
            setup_json = {k: v for k, v in asdict(setup).items() if k not in ("model_class", "num_parameters")}
            payload = {
                "command": "check",
                "setup": setup_json,
                "tolerance": opts.tolerance,
                "heads": heads,
                "is_exact": is_exact,
                "summary": summary,
            }
            _write_json(opts.json, payload)
        print(f"\n{summary}")
    finish_command()
    return EXIT_OK if is_exact else EXIT_NOT_EXACT


def _check_one(opts: argparse.Namespace) -> int:
    """One model (``--task``, ``--model``, ``--scenario``, ``--trainer``): the full table, and ``--plot``."""
    from ... import patches
    from ...errors import GradAccError, UnsupportedBackendError
    from ...testing.tiny import PaddingCollator
    from . import report
    from .mesh_rows import mesh_collator
    from .scenarios import has_router_term, load_check_model, synthetic_samples

    try:
        if opts.trainer != "trainer":
            _check_trl_options(opts)
        loaded = load_check_model(model=opts.model, task=opts.task, scenario=opts.scenario, seed=opts.seed)
    except (OSError, ValueError, ImportError, GradAccError) as exc:
        _error(exc)
        return EXIT_USAGE
    model, task, model_name = loaded.model, loaded.task, loaded.name
    collator = PaddingCollator(pad_token_id=loaded.pad_token_id)

    # HF_GRADACC_CPU_DISTRIBUTED=1 (DeepSpeed / FSDP2 configs on CPU ranks) must hold for the stock Trainer too.
    patches.maybe_enable_from_env()
    step_kwargs = _step_kwargs(opts)
    world = _world(step_kwargs)
    if world is None:
        return EXIT_USAGE
    world_size, is_main = world
    if is_main:
        for warning in loaded.warnings:
            print(f"hf-gradacc check: warning: {warning}", file=sys.stderr)
    bs, gas = opts.per_device_train_batch_size, opts.gradient_accumulation_steps
    has_router = has_router_term(model)
    router_logs: dict[str, float] = {}
    data_note = None
    try:
        if opts.trainer == "trainer":
            names = ("GradAccTrainer", "Trainer")
            # Exactly one window for all ranks: every rank builds the same samples, the reference sees all of them.
            samples = synthetic_samples(task, bs * gas * _data_ranks(opts, world_size), opts.seed, model)
            collator = mesh_collator(collator, samples)  # under sequence parallelism: one width, position_ids
            num_samples = len(samples)
            if opts.scenario == "moe_global":  # stock, per micro-batch and global-batch balance, against definition B
                from .moe_rows import GLOBAL_NAME, moe_global_results

                names = (GLOBAL_NAME, "Trainer")
                results, trainer, router_logs = moe_global_results(
                    model, samples, collator, step_kwargs, verbose=opts.verbose
                )
            else:
                results, trainer, router_logs = _trainer_pair(
                    model,
                    task,
                    samples,
                    collator,
                    step_kwargs,
                    scenario=opts.scenario,
                    verbose=opts.verbose,
                    distributed_config=opts.distributed_config,
                )
        else:
            from .trl_rows import trl_one_step, trl_trainer_names

            stock_name, ours_name = trl_trainer_names(opts.trainer)
            names = (ours_name, stock_name)
            with _quiet_stdout(opts.verbose):
                step = trl_one_step(opts.trainer, model, step_kwargs, world_size)
            results, trainer, num_samples, data_note = step.results, step.trainer, step.num_samples, step.data_note
            task = f"{opts.trainer} (TRL {stock_name})"
    except GradAccError as exc:
        if is_main:
            _error(exc)
        # A setting to change is a usage error; a failed step (data, loss) means GradAccTrainer gave no update.
        return EXIT_USAGE if isinstance(exc, (GradAccConfigError, UnsupportedBackendError)) else EXIT_NOT_EXACT

    setup = _setup(
        opts,
        task=task,
        model_name=model_name,
        model=model,
        trainer=trainer,
        world_size=world_size,
        num_samples=num_samples,
    )
    ours, stock = results[names[0]], results[names[1]]
    is_exact = ours.is_exact(opts.tolerance)
    summary = report.summary_line(ours, stock, opts.tolerance, names=names)
    if is_main:
        if opts.trainer == "trainer":
            note = report.stock_note(stock, opts.tolerance, task, has_router=has_router)
            if opts.scenario == "moe_global":
                from .moe_rows import moe_global_note

                note, router_logs = moe_global_note(results, router_logs), {}
        else:
            from .trl_rows import trl_stock_note

            note = trl_stock_note(opts.trainer, stock, opts.tolerance, has_router=has_router)
        text = report.format_report(setup, results, opts.tolerance, stock_note=note, data_note=data_note)
        router = report.router_note(router_logs)
        print(text + (f"\n\n{router}" if router else ""))

    curves = (
        _plot(opts, model, task, model_name, collator, step_kwargs, world_size, is_main, stock) if opts.plot else None
    )
    if is_main and opts.json:
        payload = {
            "command": "check",
            "setup": asdict(setup),
            "tolerance": opts.tolerance,
            "results": _comparisons_json(results, opts.tolerance),
            "is_exact": is_exact,
            "summary": summary,
        }
        if curves is not None:
            payload["loss_curves"] = curves
        _write_json(opts.json, payload)
    if is_main:
        print(f"\n{summary}")
    finish_command()
    return EXIT_OK if is_exact else EXIT_NOT_EXACT


def _plot(opts, model, task, model_name, collator, step_kwargs, world_size, is_main, stock) -> dict[str, Any]:
    """``--plot``: train --steps steps three ways and draw the loss curves (main process); returns the curves."""
    from .loss_curves import draw_loss_curves, train_loss_curves
    from .scenarios import synthetic_samples

    bs, gas = opts.per_device_train_batch_size, opts.gradient_accumulation_steps
    with _quiet_stdout(opts.verbose):
        curves = train_loss_curves(
            model,
            task,
            synthetic_samples(task, opts.steps * bs * gas * world_size, opts.seed, model),
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=gas,
            data_collator=collator,
            optimizer=opts.optimizer,
            learning_rate=opts.learning_rate,
            seed=opts.seed,
            args_overrides={k: v for k, v in step_kwargs.items() if k in ("use_cpu", "ddp_backend")},
            show_progress=is_main,
        )
    if is_main:
        title = (
            f"{task}: {model_name}, batch {bs} x GA {gas}"
            + (f" x {world_size} processes" if world_size > 1 else "")
            + f", {opts.optimizer} lr {opts.learning_rate:g}"
        )
        draw_loss_curves(curves, opts.plot, title=title)
        print(f"\nWrote the loss curves of {opts.steps} steps to {opts.plot}")
        if opts.optimizer == "adamw" and not stock.is_exact(opts.tolerance) and abs(stock.cosine - 1) < 1e-4:
            print(
                "  The stock Trainer's error here only scales the gradient, which Adam normalises away: "
                "`--optimizer sgd` shows it in the curves."
            )
    return curves


def _check_trl_options(opts: argparse.Namespace) -> None:
    """Refuse the options that mean nothing with ``--trainer sft / dpo``; the model is read as a causal LM."""
    from ... import trl  # noqa: F401  (TRLDependencyError, an ImportError, names the extra)

    if opts.plot:
        raise GradAccConfigError(
            f"`--plot` draws the loss curves of `--trainer trainer`; drop it with `--trainer {opts.trainer}`"
        )
    if opts.scenario != "default":
        raise GradAccConfigError(
            f"`--scenario {opts.scenario}` is for `--trainer trainer`; drop it with `--trainer {opts.trainer}`"
        )
    if opts.task not in (None, "causal_lm"):
        raise GradAccConfigError(f"`--trainer {opts.trainer}` trains a causal LM; drop `--task {opts.task}`")
    opts.task = "causal_lm"
    from .trl_more_rows import check_more_options

    check_more_options(opts)  # reward / kto / rloo / distillation
    if not opts.verbose:
        import datasets

        datasets.disable_progress_bars()  # TRL maps its datasets (tokenize, add eos) with progress bars


# ---------------------------------------------------------------------------------------------- environment
def _configure_logging(verbose: bool) -> None:
    import torch
    import transformers

    if verbose:
        transformers.utils.logging.set_verbosity_info()
        logging.getLogger("accelerate").setLevel(logging.INFO)
    else:
        transformers.utils.logging.set_verbosity_error()
        logging.getLogger("accelerate").setLevel(logging.ERROR)
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
        if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
            # What DeepSpeed would pick itself, minus its warning when the Trainer imports it.
            os.environ["DS_ACCELERATOR"] = "cpu"


@contextlib.contextmanager
def _quiet_stdout(verbose: bool) -> Iterator[None]:
    """Hide the Trainer's printed log dicts (PrinterCallback) unless --verbose."""
    if verbose:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "y", "on")


def _runs_on_cpu() -> bool:
    import torch

    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return False  # `use_cpu` would bypass DeepSpeed; on a CPU host hf_gradacc.patches picks gloo
    return _env_flag("ACCELERATE_USE_CPU") or not torch.cuda.is_available()


def _warn_if_launch_fell_back_to_one_process() -> None:
    # `accelerate launch --cpu --num_processes N` (or a MULTI_CPU config) spawns N processes only through mpirun;
    # without --mpirun_hostfile it starts ONE process and only sets MASTER_ADDR/MASTER_PORT.
    world_keys = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    launched_for_many = "MASTER_ADDR" in os.environ and not any(k in os.environ for k in world_keys)
    if launched_for_many and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        print(
            "hf-gradacc check: warning: running as ONE process. `accelerate launch --cpu` (or a MULTI_CPU config) "
            "starts several CPU processes only through mpirun (--mpirun_hostfile). On a host without CUDA use "
            "`accelerate launch --multi_gpu --num_processes N` (or a MULTI_GPU config), or "
            "`torchrun --nproc_per_node N -m hf_gradacc check`.",
            file=sys.stderr,
        )
