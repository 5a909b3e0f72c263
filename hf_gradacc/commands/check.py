"""`hf-gradacc check`: run ONE accumulated optimizer step with the stock `transformers.Trainer` and with
  :class:`~hf_gradacc.GradAccTrainer` on mixed-length synthetic data, compare both with the float64 full-batch
  reference, print a table, and exit 0 only when GradAccTrainer is exact. Runs under ``accelerate launch`` too.

Example:
    ```bash
    hf-gradacc check                                   # built-in tiny causal LM, 2 x GA 4
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
import platform
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import GradAccConfigError
from ._common import EXIT_NOT_EXACT, EXIT_OK, EXIT_USAGE, finish_command

# The Auto class that loads a checkpoint for each task of `hf_gradacc.testing.tiny.TASKS`.
_AUTO_CLASSES: dict[str, str] = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "masked_lm": "AutoModelForMaskedLM",
    "token_classification": "AutoModelForTokenClassification",
    "sequence_classification": "AutoModelForSequenceClassification",
    "regression": "AutoModelForSequenceClassification",
    "multi_label_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}
_PROBLEM_TYPES: dict[str, str] = {
    "sequence_classification": "single_label_classification",
    "regression": "regression",
    "multi_label_classification": "multi_label_classification",
}
_MAX_SAMPLE_LENGTH = 40
SCENARIOS: tuple[str, ...] = ("default", "no_loss_kwargs", "plain_compute_loss", "moe_mixtral", "moe_qwen3")
# --trainer: transformers' Trainer vs GradAccTrainer, or TRL's trainer vs hf_gradacc's (hf_gradacc.trl)
TRAINERS: tuple[str, ...] = ("trainer", "sft", "dpo")
_TRL_NAMES: dict[str, str] = {"sft": "SFT", "dpo": "DPO"}
_DPO_BETA = 0.1


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
    from ..testing.tiny import TASKS

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
        help=f"head family to check, one of: {', '.join(TASKS)}. Default: causal_lm for the built-in tiny model; "
        "read from the config's `architectures` for --model.",
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
        "GradAccDPOTrainer: sigmoid loss, beta 0.1, the initial model as reference model). With sft / dpo every "
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
    check.set_defaults(handler=check_command)
    return check


# ---------------------------------------------------------------------------------------------- check
@dataclass(frozen=True)
class _Setup:
    task: str
    model: str
    model_class: str
    num_parameters: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    num_samples: int
    backend: str
    device: str
    seed: int
    versions: dict[str, str]


def check_command(opts: argparse.Namespace) -> int:
    """Run ``hf-gradacc check`` (see ``hf-gradacc check --help``); returns the exit status."""
    _configure_logging(opts.verbose)
    from transformers import Trainer

    from .. import GradAccTrainer, patches
    from ..errors import GradAccError, UnsupportedBackendError
    from ..testing.one_step import compare_with_reference, one_step_args, one_step_update
    from ..testing.tiny import PaddingCollator

    if opts.plot:
        from ..testing.loss_curves import PlotDependencyError, require_matplotlib

        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            print(f"hf-gradacc check: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        if opts.trainer != "trainer":
            _check_trl_options(opts)
        model, task, model_name, pad_token_id = _load_model(opts)
    except (OSError, ValueError, ImportError, GradAccError) as exc:
        print(f"hf-gradacc check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    collator = PaddingCollator(pad_token_id=pad_token_id)

    # HF_GRADACC_CPU_DISTRIBUTED=1 (DeepSpeed / FSDP2 configs on CPU ranks) must hold for the stock Trainer too.
    patches.maybe_enable_from_env()
    bs, gas = opts.per_device_train_batch_size, opts.gradient_accumulation_steps
    # optim="sgd": DeepSpeed builds the optimizer from the args, not one_step_update's SGD(lr=1) (default: AdamW).
    step_kwargs: dict[str, Any] = dict(
        per_device_train_batch_size=bs, gradient_accumulation_steps=gas, seed=opts.seed, optim="sgd"
    )
    step_kwargs["use_cpu"] = _runs_on_cpu()
    if step_kwargs["use_cpu"] and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        step_kwargs["ddp_backend"] = "gloo"
    # Building TrainingArguments sets up the process group under a distributed launch: read the world size from it.
    probe = one_step_args(**step_kwargs)
    world_size, is_main = probe.world_size, probe.process_index == 0
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and world_size == 1:
        print(
            f"hf-gradacc check: error: launched as one of {launched} processes (WORLD_SIZE), but the Trainer sees "
            f"{world_size}; each process would check alone. Check the accelerate config for this host (on a CPU-only "
            "host DeepSpeed and FSDP2 configs need HF_GRADACC_CPU_DISTRIBUTED=1).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if world_size == 1:
        _warn_if_launch_fell_back_to_one_process()
    # Exactly one window for all ranks: every rank builds the same samples, the reference sees all of them.
    samples = _synthetic_samples(task, bs * gas * world_size, opts.seed, model) if opts.trainer == "trainer" else []
    num_samples, data_note = len(samples), None
    trainer_classes = (("GradAccTrainer", GradAccTrainer), ("Trainer", Trainer)) if opts.trainer == "trainer" else ()
    stock_name, ours_name = ("Trainer", "GradAccTrainer") if opts.trainer == "trainer" else _trl_trainer_names(opts)

    try:
        results: dict[str, Any] = {}
        trainer = backend = None
        # GradAccTrainer first: its set-up checks (e.g. a model FSDP2 cannot wrap) give a clear error where the
        # stock Trainer would fail deep inside torch.
        router_logs: dict[str, float] = {}
        if opts.trainer != "trainer":
            with _quiet_stdout(opts.verbose):
                results, trainer, num_samples, data_note = _trl_one_step(opts.trainer, model, step_kwargs, world_size)
            backend = trainer.backend
            task = f"{opts.trainer} (TRL {stock_name})"
        for name, trainer_class in trainer_classes:
            if opts.scenario == "plain_compute_loss":
                trainer_class = _plain_compute_loss(trainer_class)
            micro_batches: list = []
            with _quiet_stdout(opts.verbose):
                update, trainer = one_step_update(
                    trainer_class, model, samples, one_step_args(**step_kwargs), data_collator=collator,
                    micro_batches=micro_batches,
                )  # fmt: skip
            results[name] = compare_with_reference(
                update, model, samples, task, data_collator=collator, micro_batches=micro_batches
            )
            backend = getattr(trainer, "backend", backend)
            if name == "GradAccTrainer":
                router_logs = {k: v for k, v in trainer.state.log_history[0].items() if k.startswith("loss")}
        results = {name: results[name] for name in (stock_name, ours_name)}  # the report's order
    except GradAccError as exc:
        if is_main:
            print(f"hf-gradacc check: error: {exc}", file=sys.stderr)
        # A setting to change is a usage error; a failed step (data, loss) means GradAccTrainer gave no update.
        return EXIT_USAGE if isinstance(exc, (GradAccConfigError, UnsupportedBackendError)) else EXIT_NOT_EXACT
    assert trainer is not None and backend is not None

    setup = _Setup(
        task=task,
        model=model_name,
        model_class=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=gas,
        world_size=world_size,
        num_samples=num_samples,
        backend=backend.describe(),
        device=str(trainer.args.device),
        seed=opts.seed,
        versions=_versions(),
    )
    ours, stock = results[ours_name], results[stock_name]
    is_exact = ours.is_exact(opts.tolerance)
    summary = _summary_line(ours, stock, opts.tolerance, task, names=(ours_name, stock_name))
    if is_main:
        note = _stock_note(stock, opts.tolerance, task) if opts.trainer == "trainer" else _trl_stock_note(
            opts.trainer, stock, opts.tolerance
        )
        report = _format_report(setup, results, opts.tolerance, stock_note=note, data_note=data_note)
        if "loss/aux" in router_logs:
            aux, total = router_logs["loss/aux"], router_logs["loss"]
            report += "\n\n" + textwrap.fill(
                f"router: the model's load-balancing term is {aux:.4g} of the step's loss {total:.4g} ({aux / total:.1%});"
                " hf_gradacc weights it per micro-batch by routed tokens (logged as loss/aux).",
                width=115, initial_indent="  ", subsequent_indent="  ",
            )  # fmt: skip
        print(report)

    curves = None
    if opts.plot:
        from ..testing.loss_curves import draw_loss_curves, train_loss_curves

        with _quiet_stdout(opts.verbose):
            curves = train_loss_curves(
                model,
                task,
                _synthetic_samples(task, opts.steps * bs * gas * world_size, opts.seed, model),
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

    if is_main and opts.json:
        payload = {
            "command": "check",
            "setup": asdict(setup),
            "tolerance": opts.tolerance,
            "results": {name: {**asdict(c), "is_exact": c.is_exact(opts.tolerance)} for name, c in results.items()},
            "is_exact": is_exact,
            "summary": summary,
        }
        if curves is not None:
            payload["loss_curves"] = curves
        with open(opts.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"Wrote {opts.json}")
    if is_main:
        print(f"\n{summary}")
    finish_command()
    return EXIT_OK if is_exact else EXIT_NOT_EXACT


# ---------------------------------------------------------------------------------------------- model and data
def _load_model(opts: argparse.Namespace) -> tuple[Any, str, str, int]:
    """(model, task, name shown in the report, pad token id for the collator)."""
    from ..testing.tiny import PAD_TOKEN_ID, build_tiny_model

    scenario = getattr(opts, "scenario", "default")
    if scenario in ("no_loss_kwargs", "moe_mixtral", "moe_qwen3"):
        if opts.model is not None or (opts.task or "causal_lm") != "causal_lm":
            raise GradAccConfigError(f"`--scenario {scenario}` builds its own tiny causal LM: drop --model and --task")
        if scenario == "no_loss_kwargs":
            return _no_loss_kwargs_llama(build_tiny_model("causal_lm", seed=opts.seed)), "causal_lm", \
                "built-in tiny model, accepts_loss_kwargs=False", PAD_TOKEN_ID
        from ..testing.tiny import build_tiny_moe

        family = "mixtral" if scenario == "moe_mixtral" else "qwen3_moe"
        return build_tiny_moe(family, seed=opts.seed), "causal_lm", f"built-in tiny {family} MoE", PAD_TOKEN_ID
    if opts.model is None:
        task = opts.task or "causal_lm"
        return build_tiny_model(task, seed=opts.seed), task, "built-in tiny model", PAD_TOKEN_ID

    import torch
    import transformers
    from transformers import AutoConfig

    source = os.path.expanduser(opts.model)
    if source.startswith((".", os.sep)) or os.path.exists(source):
        if not os.path.exists(source):
            raise GradAccConfigError(
                f"`--model` ({opts.model!r}) is a local path that does not exist ({os.path.abspath(source)}): pass a "
                "save_pretrained folder, or a Hub id (owner/name) without a leading './' or '/'"
            )
        if not os.path.isdir(source):
            raise GradAccConfigError(
                f"`--model` ({opts.model!r}) is not a directory; pass a save_pretrained folder or a Hub id"
            )
    config = AutoConfig.from_pretrained(source)
    _disable_dropout(config)
    if opts.task is None:
        model = _load_from_architectures(source, config)
        task = _task_of(model)
    else:
        task = opts.task
        kwargs: dict[str, Any] = {}
        if task in _PROBLEM_TYPES:
            config.problem_type = _PROBLEM_TYPES[task]
            if task == "regression" and getattr(config, "num_labels", 1) != 1:
                # The check is about the gradient, not the head's weights: a fresh 1-output head is fine.
                config.num_labels = 1
                kwargs["ignore_mismatched_sizes"] = True
        auto_class = getattr(transformers, _AUTO_CLASSES[task])
        try:
            model = auto_class.from_pretrained(source, config=config, dtype=torch.float32, **kwargs)
        except ValueError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GradAccConfigError(
                f"{_AUTO_CLASSES[task]} cannot load {opts.model!r} for `--task {task}` ({reason}); pick another --task"
            ) from None
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    pad_token_id = getattr(model.config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = PAD_TOKEN_ID
        # Sequence-classification heads of decoder models find the last token through pad_token_id.
        model.config.pad_token_id = pad_token_id
    return model, task, opts.model, int(pad_token_id)


def _disable_dropout(config: Any) -> None:
    # The reference is deterministic; with dropout on, the trainers' step would differ from it by the masks.
    for name, value in list(vars(config).items()):
        if "dropout" in name and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
    for sub_config in ("text_config", "vision_config", "encoder", "decoder"):
        inner = getattr(config, sub_config, None)
        if inner is not None and hasattr(inner, "to_dict"):
            _disable_dropout(inner)


def _load_from_architectures(path: str, config: Any) -> Any:
    import torch
    import transformers

    from ..testing.tiny import TASKS

    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        model_class = getattr(transformers, name, None)
        if model_class is not None:
            return model_class.from_pretrained(path, config=config, dtype=torch.float32)
    raise GradAccConfigError(
        f"cannot tell which head to load for {path!r} from its config (`architectures` = {architectures or None}); "
        f"pass --task, one of {', '.join(TASKS)}"
    )


def _task_of(model: Any) -> str:
    from ..heads import detect_head_type
    from ..testing.tiny import TASKS

    head = detect_head_type(model)
    if head is None or head not in TASKS:
        raise GradAccConfigError(
            f"cannot tell the task of {type(model).__name__} from its class; pass --task, one of {', '.join(TASKS)}"
        )
    if head != "sequence_classification":
        return head
    problem_type = getattr(model.config, "problem_type", None)
    if problem_type == "regression" or (problem_type is None and model.config.num_labels == 1):
        return "regression"
    if problem_type == "multi_label_classification":
        return "multi_label_classification"
    return "sequence_classification"


def _synthetic_samples(task: str, num_samples: int, seed: int, model: Any) -> list[dict[str, Any]]:
    """`tiny.make_samples`, redrawn within ``model``'s vocabulary and label count when they differ from the tiny's."""
    import torch

    from ..loss import IGNORE_INDEX
    from ..testing.tiny import NUM_LABELS, PAD_TOKEN_ID, VOCAB_SIZE, make_image_samples_for, make_samples

    if task == "image_classification":
        return make_image_samples_for(model, num_samples, seed=seed)
    config = model.config
    vocab_size = int(getattr(config, "vocab_size", None) or VOCAB_SIZE)
    num_labels = int(getattr(config, "num_labels", NUM_LABELS))
    pad = getattr(config, "pad_token_id", PAD_TOKEN_ID)
    max_positions = getattr(config, "max_position_embeddings", None) or _MAX_SAMPLE_LENGTH
    max_length = max(4, min(_MAX_SAMPLE_LENGTH, int(max_positions) - 2))
    samples = make_samples(task, num_samples, seed=seed, max_length=max_length)
    token_task = task in ("causal_lm", "seq2seq", "masked_lm", "token_classification")
    if (
        vocab_size == VOCAB_SIZE
        and (num_labels == NUM_LABELS or token_task and task != "token_classification")
        and (pad is None or not 2 <= pad < VOCAB_SIZE)
        and task != "regression"
    ):
        return samples
    if vocab_size < 4:
        raise GradAccConfigError(f"the model's `vocab_size` ({vocab_size}) is too small for synthetic data (needs >= 4)")

    g = torch.Generator().manual_seed(seed + 1)

    def token_ids(n: int) -> list[int]:
        ids = torch.randint(2, vocab_size, (n,), generator=g)
        if pad is not None and 2 <= pad < vocab_size:
            ids[ids == pad] = 2 if pad != 2 else 3  # a pad id inside a row would be read as padding
        return ids.tolist()

    for sample in samples:
        ids = token_ids(len(sample["input_ids"]))
        sample["input_ids"] = ids
        labels = sample["labels"]
        if task in ("causal_lm", "masked_lm"):
            sample["labels"] = [IGNORE_INDEX if old == IGNORE_INDEX else new for old, new in zip(labels, ids)]
        elif task == "token_classification":
            drawn = torch.randint(0, num_labels, (len(labels),), generator=g).tolist()
            sample["labels"] = [IGNORE_INDEX if old == IGNORE_INDEX else new for old, new in zip(labels, drawn)]
        elif task == "seq2seq":
            sample["labels"] = token_ids(len(labels))
        elif task == "sequence_classification":
            sample["labels"] = int(torch.randint(0, num_labels, (), generator=g))
        elif task == "multi_label_classification":
            sample["labels"] = [float(x) for x in torch.randint(0, 2, (num_labels,), generator=g)]
        elif num_labels != 1:  # regression with several outputs: one target per output
            sample["labels"] = [float(x) for x in torch.randn(num_labels, generator=g)]
    return samples


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


def _versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    from .. import __version__

    return {
        "hf_gradacc": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------- report
def _verdict(comparison: Any, tolerance: float) -> str:
    return "exact" if comparison.is_exact(tolerance) else "WRONG"


def _off_by(comparison: Any) -> str:
    if abs(comparison.cosine - 1.0) < 1e-4 and abs(comparison.norm_ratio - 1.0) >= 0.05:
        return f"off by {comparison.norm_ratio:.1f}x"
    if abs(comparison.norm_ratio - 1.0) < 0.05:
        return f"off by {comparison.relative_error:.1e} (relative)"
    return f"off: cosine {comparison.cosine:.3f}, norm {comparison.norm_ratio:.2f}x"


def _stock_note(stock: Any, tolerance: float, task: str) -> str:
    if stock.is_exact(tolerance):
        return (
            "The stock Trainer is exact here too: for a causal LM with a `labels` key transformers passes "
            "num_items_in_batch to the model's loss. Other heads, an overridden compute_loss or "
            "accepts_loss_kwargs=False models break it (try --task sequence_classification)."
            if task == "causal_lm"
            else "The stock Trainer is exact here too."
        )
    if abs(stock.cosine - 1.0) < 1e-4 and abs(stock.norm_ratio - 1.0) < 0.05:
        scale = abs(1.0 - stock.norm_ratio)
        if abs(stock.relative_error - scale) <= 0.1 * stock.relative_error:  # the error is the step's size alone
            return (
                f"The stock Trainer's step has the full-batch direction but {stock.norm_ratio:.4f}x its size: it "
                "divides the step's loss by another count than the step's counted targets (transformers 5.6 does so "
                "for causal LMs)."
            )
        return (
            f"The stock Trainer's step is {stock.relative_error:.1e} off the full-batch step (relative): a term of the "
            "loss (e.g. a mixture-of-experts router term) is weighted per micro-batch instead of by its share of the step."
        )
    if abs(stock.cosine - 1.0) < 1e-4:
        return (
            f"The stock Trainer's step is {stock.norm_ratio:.1f}x the full-batch step: each micro-batch's mean loss "
            f"counts fully instead of by its share of the step, as if the learning rate were {stock.norm_ratio:.0f}x."
        )
    return (
        "The stock Trainer's step points elsewhere than the full-batch step: micro-batch means are weighted "
        "equally although they hold different numbers of counted items."
    )


def _summary_line(
    ours: Any, stock: Any, tolerance: float, task: str, *, names: tuple[str, str] = ("GradAccTrainer", "Trainer")
) -> str:
    ours_name, stock_name = names
    if ours.is_exact(tolerance):
        head = f"hf-gradacc check: {ours_name} is exact (rel err {ours.relative_error:.1e} <= {tolerance:g})"
    else:
        head = f"hf-gradacc check: {ours_name} is NOT exact (rel err {ours.relative_error:.1e} > {tolerance:g})"
    tail = f"stock {stock_name} is exact too" if stock.is_exact(tolerance) else f"stock {stock_name} is {_off_by(stock)}"
    return f"{head}; {tail}"


def _format_report(
    setup: _Setup, results: dict[str, Any], tolerance: float, *, stock_note: str, data_note: str | None = None
) -> str:
    bs, gas, world = setup.per_device_train_batch_size, setup.gradient_accumulation_steps, setup.world_size
    processes = f"{world} process" + ("es" if world != 1 else "")
    versions = ", ".join(f"{k} {v}" for k, v in setup.versions.items() if k != "python")
    lines = [
        "hf-gradacc check: one accumulated optimizer step vs. the float64 full-batch gradient",
        "",
        f"  task      {setup.task}",
        f"  model     {setup.model_class} ({setup.model}, {setup.num_parameters:,} trainable parameters)",
        f"  batch     {bs} per device x {gas} accumulation steps x {processes} = {setup.num_samples} samples per step",
        *([f"  data      {data_note}"] if data_note else []),
        f"  backend   {setup.backend} on {setup.device}",
        f"  versions  {versions}",
        "",
        f"  {'trainer':<18}{'rel. error':>12}{'cosine':>12}{'norm ratio':>12}   verdict (tolerance {tolerance:g})",
    ]
    for name, c in results.items():
        lines.append(
            f"  {name:<18}{c.relative_error:>12.2e}{c.cosine:>12.6f}{c.norm_ratio:>12.4f}   {_verdict(c, tolerance)}"
        )
    lines += ["", textwrap.fill(stock_note, width=115, initial_indent="  ", subsequent_indent="  ")]
    return "\n".join(lines)


def _no_loss_kwargs_llama(model: Any) -> Any:
    """The tiny causal LM as a class that, like most VLMs, tells the Trainer its loss ignores num_items_in_batch."""
    from transformers import LlamaForCausalLM

    cls = type("LlamaNoLossKwargsForCausalLM", (LlamaForCausalLM,), {"accepts_loss_kwargs": False})
    twin = cls(model.config)
    twin.load_state_dict(model.state_dict())
    return twin


def _plain_compute_loss(trainer_class: type) -> type:
    """``trainer_class`` whose compute_loss returns the model's ``outputs.loss`` (the common override)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    return type(f"PlainLoss{trainer_class.__name__}", (trainer_class,), {"compute_loss": compute_loss})


# ---------------------------------------------------------------------------------------------- --trainer sft / dpo
def _check_trl_options(opts: argparse.Namespace) -> None:
    """Refuse the options that mean nothing with ``--trainer sft / dpo``; the model is read as a causal LM."""
    from .. import trl  # noqa: F401  (TRLDependencyError, an ImportError, names the extra)

    if opts.plot:
        raise GradAccConfigError(f"`--plot` draws the loss curves of `--trainer trainer`; drop it with `--trainer {opts.trainer}`")
    if opts.scenario != "default":
        raise GradAccConfigError(f"`--scenario {opts.scenario}` is for `--trainer trainer`; drop it with `--trainer {opts.trainer}`")
    if opts.task not in (None, "causal_lm"):
        raise GradAccConfigError(f"`--trainer {opts.trainer}` trains a causal LM; drop `--task {opts.task}`")
    opts.task = "causal_lm"
    if not opts.verbose:
        import datasets

        datasets.disable_progress_bars()  # TRL maps its datasets (tokenize, add eos) with progress bars


def _trl_trainer_names(opts: argparse.Namespace) -> tuple[str, str]:
    """(TRL's trainer, hf_gradacc's) for ``--trainer sft / dpo``."""
    name = _TRL_NAMES[opts.trainer]
    return f"{name}Trainer", f"GradAcc{name}Trainer"


def _trl_one_step(
    kind: str, model: Any, step_kwargs: dict[str, Any], world_size: int
) -> tuple[dict[str, Any], Any, int, str]:
    """ONE SGD(lr=1) step of hf_gradacc's TRL trainer, then of TRL's, on the same synthetic rows of every process, each
    compared with the float64 full-batch reference of :mod:`hf_gradacc.testing.trl_steps` (no TRL code in it).

    Every process runs ``batch`` x (GA - 1) then ``batch - 1`` rows (a fixed batch layout, alike on every process as
    TRL's per-row metric gathers need). Returns the comparisons by trainer name, hf_gradacc's trainer, the step's
    samples and a line describing them.
    """
    import copy

    import trl

    from .. import trl as gradacc_trl
    from ..testing import trl_steps
    from ..testing.one_step import full_parameters, one_step_args
    from ..testing.reference import compare

    bs, gas, seed = step_kwargs["per_device_train_batch_size"], step_kwargs["gradient_accumulation_steps"], step_kwargs["seed"]
    layout = trl_steps.uneven_batch_sizes(bs, gas, world_size)
    vocab_size = int(model.config.vocab_size)
    if vocab_size < 4:
        raise GradAccConfigError(f"the model's `vocab_size` ({vocab_size}) is too small for synthetic data (needs >= 4)")
    name, extra = _TRL_NAMES[kind], {}
    if kind == "sft":
        from datasets import Dataset

        rows = trl_steps.sft_rows(sum(layout), seed, vocab_size=vocab_size)
        dataset, reference = Dataset.from_list(rows), trl_steps.sft_reference(model, rows)
        config: dict[str, Any] = {"completion_only_loss": True, "max_length": None}
        what = "prompt-completion rows (loss on the completions)"
    else:
        pairs = trl_steps.dpo_pairs(sum(layout), seed, vocab_size=vocab_size)
        dataset, reference = trl_steps.dpo_dataset(pairs), trl_steps.dpo_reference(model, pairs, beta=_DPO_BETA)
        config = {"beta": _DPO_BETA}
        what = f"preference pairs (sigmoid loss, beta {_DPO_BETA}, the initial model as reference model)"
    results: dict[str, Any] = {}
    ours = None
    for module, prefix in ((gradacc_trl, "GradAcc"), (trl, "")):
        trainer_class = trl_steps.with_batch_layout(getattr(module, f"{prefix}{name}Trainer"), layout)
        args = one_step_args(args_class=getattr(module, f"{prefix}{name}Config"), bf16=False, **step_kwargs, **config)
        if kind == "dpo":
            extra = {"ref_model": copy.deepcopy(model)}
        policy = copy.deepcopy(model)
        initial = {n: p.detach().clone().cpu() for n, p in policy.named_parameters() if p.requires_grad}
        trainer = trainer_class(model=policy, args=args, train_dataset=dataset,
                                processing_class=trl_steps.word_tokenizer(vocab_size), **extra)  # fmt: skip
        trainer.train()
        final = full_parameters(trainer)
        results[f"{prefix}{name}Trainer"] = compare({n: initial[n] - final[n].float() for n in initial}, reference.grads)
        ours = trainer if ours is None else ours
    per_process = ", ".join(str(size) for size in layout[::world_size])
    return results, ours, sum(layout), f"{sum(layout)} {what}; micro-batches of {per_process} per process"


def _trl_stock_note(kind: str, stock: Any, tolerance: float) -> str:
    if kind == "sft":
        if stock.is_exact(tolerance):
            return (
                "TRL's SFTTrainer is exact here too: it divides each micro-batch's token sum by the step's token count, "
                "gathered over the processes. What hf_gradacc adds for SFT (a mixture-of-experts router term weighted "
                "by routed tokens, `average_tokens_across_devices=False`, ...) is in docs/trl.md."
            )
        return f"TRL's SFTTrainer is {_off_by(stock)} from the full-batch step here; docs/trl.md says when."
    if stock.is_exact(tolerance):
        return (
            "TRL's DPOTrainer is exact here too: every micro-batch holds the same number of pairs. It averages each "
            "micro-batch's pairs and divides by the accumulation steps, which is off as soon as they differ (try "
            "--per_device_train_batch_size 2 or more)."
        )
    return (
        f"TRL's DPOTrainer is {_off_by(stock)}: it averages each micro-batch's pairs and divides by the accumulation "
        "steps, so the pairs of the short micro-batches weigh more than the others (the mean of micro-batch means, "
        "not the mean over all the step's pairs)."
    )
