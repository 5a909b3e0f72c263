"""`hf-gradacc bench`: the stock `Trainer` against `GradAccTrainer` (plain, regrouped, token budget), in ONE run.

The measurement itself is :mod:`hf_gradacc.testing.benchmark`; this module is its command line.

Example:
    ```bash
    hf-gradacc bench                                   # CPU defaults: tiny causal LM, bs 8 x GA 8
    hf-gradacc bench --steps 4 --datasets long_tailed --json bench.json
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

from ..testing.benchmark import (
    ALL_TRAINERS,
    DATASETS,
    QWEN_VOCAB_SIZE,
    TRAINERS,
    BenchSettings,
    environment,
    format_table,
    plot_benchmark,
    run_benchmark,
)


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
    p = subparsers.add_parser(
        "bench",
        help="time the stock Trainer (random, group_by_length, batch_rebalance, flattening) against GradAccTrainer "
        "(plain, regrouped, token budget, packed, with and without the fused LM head) in one run",
        description=__doc__.split("\n\n")[0].strip("`"),
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    p.add_argument("--steps", type=int, default=d.num_steps, help="timed optimizer steps per trainer")
    p.add_argument("--warmup-steps", type=int, default=d.num_warmup_steps, help="untimed first steps")
    p.add_argument("--batch-size", type=int, default=d.per_device_train_batch_size)
    p.add_argument("--grad-accum", type=int, default=d.gradient_accumulation_steps)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument(
        "--vocab-sizes",
        type=_ints,
        default=None,
        help="comma-separated vocabulary sizes: one model each, measured one after the other (e.g. 96,32000,qwen; "
        f"'qwen' is {QWEN_VOCAB_SIZE:,}, the Qwen models' vocabulary, where the LM head dominates memory)",
    )
    p.add_argument("--max-length", type=int, default=d.max_length, help="longest long-tailed sample")
    p.add_argument("--median-length", type=int, default=d.median_length)
    p.add_argument("--sigma", type=float, default=d.sigma, help="log-normal shape of the long-tailed lengths")
    p.add_argument("--equal-length", type=int, default=d.equal_length)
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
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="also write the rows and the environment to this file")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the step-time and memory distributions")
    p.set_defaults(handler=bench_command)
    return p


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
    settings = settings_from_args(args)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "hf-gradacc bench: --device cuda needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    import transformers

    transformers.utils.logging.set_verbosity_error()
    started = time.time()
    rows = run_benchmark(settings)
    env = environment()
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
        print("settings: " + ", ".join(f"{k}={v}" for k, v in asdict(settings).items()))
        print(f"wall time: {time.time() - started:.0f}s\n")
        print(format_table(rows))
        if args.json:
            payload = {"environment": env, "settings": asdict(settings), "rows": [asdict(r) for r in rows]}
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)
        if args.plot:
            plot_benchmark(rows, args.plot)
            print(f"\nWrote the step-time and memory distributions to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hf_gradacc.commands.bench`` (the same as ``hf-gradacc bench``)."""
    parser = argparse.ArgumentParser(prog="hf-gradacc")
    bench_command_parser(parser.add_subparsers(dest="command", required=True))
    return bench_command(parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    raise SystemExit(main())
