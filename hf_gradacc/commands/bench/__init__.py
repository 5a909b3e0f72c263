"""`hf-gradacc bench`: the stock `Trainer` against `GradAccTrainer`, one optimizer step per trainer in turn, in ONE
run (the rows: :func:`.benchmark.describe_trainers`, which is also the command's help).

The measurement itself is :mod:`.benchmark` (its mixture-of-experts rows :mod:`.bench_moe`), what a run prints and
draws :mod:`.bench_report` (the table, the spread over repeats, the plot); this module is its command line.

Example:
    ```bash
    hf-gradacc bench --quick                           # a first look: small shapes, 3 timed steps, 2 repeats
    hf-gradacc bench                                   # CPU defaults: tiny causal LM, bs 8 x GA 8
    hf-gradacc bench --repeats 3 --steps 4 --datasets long_tailed --json bench.json
    hf-gradacc bench --datasets completion_only --vocab-sizes 96,qwen     # where the LM head's memory goes
    ```
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from .bench_report import format_summary, format_table, plot_benchmark, summarize
from .benchmark import (
    ALL_TRAINERS,
    DATASETS,
    QWEN_VOCAB_SIZE,
    TRAINERS,
    BenchSettings,
    describe_trainers,
    environment,
    run_benchmark,
)

# `--quick`: a first look in about a minute on a CPU (small shapes, one dataset, few steps, 2 repeats); a flag given
# with a value other than its default wins over it.
QUICK: dict[str, Any] = {
    "steps": 3,
    "warmup_steps": 1,
    "repeats": 2,
    "batch_size": 4,
    "grad_accum": 2,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "max_length": 128,
    "median_length": 32,
    "equal_length": 32,
    "max_tokens": 128,
    "datasets": ("long_tailed",),
}


def _csv(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v for v in text.split(",") if v)
        bad = sorted(set(values) - set(choices))
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {list(choices)}, got {text!r}")
        return values

    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(QWEN_VOCAB_SIZE if v == "qwen" else int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (or 'qwen'), got {text!r}") from None
    if not values or min(values) < 4:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 4, got {text!r}")
    return values


def bench_command_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``argparse`` subparsers object; :func:`bench_command` runs it.

    Example:
        ```python
        parser = argparse.ArgumentParser(prog="hf-gradacc")
        bench_command_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["bench", "--steps", "2"])
        raise SystemExit(bench_command(args))
        ```
    """
    d = BenchSettings()
    summary = describe_trainers()
    p = subparsers.add_parser(
        "bench",
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}. Prints every ratio against the stock Trainer as its median "
        "and [min-max], with a note where the spread is wider than the difference it reports.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    p.add_argument("--steps", type=int, default=d.num_steps, help="timed optimizer steps per trainer")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the whole comparison N times: each ratio as its median and [min-max] over the repeats' step pairs",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a first look: "
        + ", ".join(f"--{k.replace('_', '-')} {_show(v)}" for k, v in QUICK.items())
        + " (a flag given with another value wins)",
    )
    p.add_argument("--warmup-steps", type=int, default=d.num_warmup_steps, help="untimed first steps")
    p.add_argument("--batch-size", type=int, default=d.per_device_train_batch_size, help="per-device micro-batch size")
    p.add_argument("--grad-accum", type=int, default=d.gradient_accumulation_steps, help="gradient_accumulation_steps")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size, help="the Llama model's hidden size")
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="its decoder layers")
    p.add_argument("--num-heads", type=int, default=d.num_heads, help="its attention heads")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="its vocabulary")
    p.add_argument(
        "--vocab-sizes",
        type=_ints,
        default=None,
        help="comma-separated vocabulary sizes: one model each, measured one after the other (e.g. 96,32000,qwen; "
        f"'qwen' is {QWEN_VOCAB_SIZE:,}, the Qwen models' vocabulary, where the LM head dominates memory)",
    )
    p.add_argument("--max-length", type=int, default=d.max_length, help="longest long-tailed sample")
    p.add_argument("--median-length", type=int, default=d.median_length, help="median long-tailed sample")
    p.add_argument("--sigma", type=float, default=d.sigma, help="log-normal shape of the long-tailed lengths")
    p.add_argument("--equal-length", type=int, default=d.equal_length, help="every sample of the equal dataset")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens_per_micro_batch,
        help="token budget of the 'budget' trainers (raised to the longest sample if below it)",
    )
    p.add_argument(
        "--pack-max-tokens",
        type=int,
        default=d.pack_max_tokens,
        help="token budget of the packed rows ('pack', 'pack_fused'); default: pack_micro_batches' own (per step, the "
        "padded size of the step's largest stock micro-batch)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    p.add_argument("--threads", type=int, default=d.num_threads, help="torch CPU threads (CPU runs)")
    p.add_argument("--datasets", type=_csv(DATASETS), default=d.datasets, help=",".join(DATASETS))
    p.add_argument(
        "--trainers",
        type=_csv(ALL_TRAINERS),
        default=d.trainers,
        help=",".join(ALL_TRAINERS) + f" (default: {','.join(TRAINERS)})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="model, data and trainer seed")
    p.add_argument("--json", default=None, help="also write the rows and the environment to this file")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the step-time and memory distributions")
    p.set_defaults(handler=bench_command, bench_parser=p)
    return p


def _show(value: Any) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def apply_quick(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """With ``--quick``, :data:`QUICK`'s values for every option left at its default."""
    if getattr(args, "quick", False):
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return BenchSettings(
        device=device,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        vocab_size=args.vocab_size,
        vocab_sizes=tuple(args.vocab_sizes or ()),
        bf16=args.bf16,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        num_steps=args.steps,
        num_warmup_steps=args.warmup_steps,
        equal_length=args.equal_length,
        median_length=args.median_length,
        sigma=args.sigma,
        max_length=args.max_length,
        max_tokens_per_micro_batch=args.max_tokens,
        pack_max_tokens=args.pack_max_tokens,
        seed=args.seed,
        num_threads=args.threads,
        datasets=tuple(args.datasets),
        trainers=tuple(args.trainers),
    )


def bench_command(args: argparse.Namespace) -> int:
    """Execute ``hf-gradacc bench``: print the environment, the settings and the table; 0 on success."""
    if getattr(args, "bench_parser", None) is not None:
        args = apply_quick(args, args.bench_parser)
    settings = settings_from_args(args)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "hf-gradacc bench: --device cuda needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    if args.repeats < 1 or settings.num_steps < 1:
        print(
            f"hf-gradacc bench: --repeats ({args.repeats}) and --steps ({settings.num_steps}) must be >= 1",
            file=sys.stderr,
        )
        return 2
    import transformers

    transformers.utils.logging.set_verbosity_error()
    started, cpu_started = time.time(), time.process_time()
    repeats = [run_benchmark(settings) for _ in range(args.repeats)]
    rows = [row for rows in repeats for row in rows]
    env = environment()
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
        print("settings: " + ", ".join(f"{k}={v}" for k, v in asdict(settings).items()) + f", repeats={args.repeats}")
        print(f"wall time: {time.time() - started:.0f}s, process CPU time: {time.process_time() - cpu_started:.0f}s\n")
        for i, repeat in enumerate(repeats):
            if len(repeats) > 1:
                print(f"repeat {i + 1} of {len(repeats)}:")
            print(format_table(repeat) + "\n")
        print(format_summary(summarize(repeats), len(repeats)))
        if args.json:
            payload = {
                "environment": env,
                "settings": asdict(settings),
                "repeats": args.repeats,
                "rows": [dict(asdict(r), repeat=i) for i, repeat in enumerate(repeats) for r in repeat],
                "summary": [
                    {
                        "dataset": s.dataset,
                        "vocab_size": s.vocab_size,
                        "trainer": s.trainer,
                        **{name: asdict(spread) for name, spread in s.ratios.items()},
                    }
                    for s in summarize(repeats)
                ],
            }
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)
        if args.plot:
            plot_benchmark(rows, args.plot)
            print(f"\nWrote the step-time and memory distributions to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``hf-gradacc bench`` from Python, ``argv`` without the command's name (``benchmarks/bench_cpu.py``)."""
    parser = argparse.ArgumentParser(prog="hf-gradacc")
    bench_command_parser(parser.add_subparsers(dest="command", required=True))
    return bench_command(parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])]))
