"""The `hf-gradacc` command line (also `python -m hf_gradacc`): one subcommand per module or package of
:mod:`hf_gradacc.commands`.

* ``check`` (:mod:`.check`): one accumulated optimizer step, stock `Trainer` vs GradAccTrainer, against the
  float64 full-batch gradient (by default on every built-in tiny head, one row each); exit 0 only when
  GradAccTrainer is exact.
* ``bench`` (:mod:`.bench`): the stock `Trainer` and its variants against GradAccTrainer's (the rows:
  :func:`hf_gradacc.commands.bench.benchmark.describe_trainers`, also the help text), timed in one run;
  ``--repeats`` for each ratio's median and [min-max], ``--quick`` for a first look.
* ``plot`` (:mod:`.plot`): a run's training curves (loss, grad norm, learning rate, tokens/s, padding, effective
  batch, gradient noise scale) from its ``trainer_state.json``, to a PNG.

Example:
    ```bash
    hf-gradacc check                                   # every built-in tiny head, 2 x GA 4
    hf-gradacc check --task sequence_classification --json out.json --plot curves.png
    hf-gradacc bench --quick                           # a first look, with each ratio's spread
    hf-gradacc plot out/                               # out/curves.png from out/[checkpoint-*/]trainer_state.json
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml -m hf_gradacc check   # 2 CPU ranks
    ```
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import _shared
from ._shared import EXIT_NOT_EXACT, EXIT_OK, EXIT_USAGE, finish_command

__all__ = ["EXIT_NOT_EXACT", "EXIT_OK", "EXIT_USAGE", "build_parser", "console_main", "finish_command", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The `hf-gradacc` argument parser (one subparser per subcommand).

    Example:
        ```python
        from hf_gradacc.commands.hf_gradacc_cli import build_parser
        opts = build_parser().parse_args(["check", "--task", "masked_lm"])
        ```
    """
    from .. import __version__
    from .bench import bench_command_parser
    from .check import check_command_parser
    from .plot import plot_command_parser

    parser = argparse.ArgumentParser(
        prog="hf-gradacc",
        description="Exact gradient accumulation for the Hugging Face Trainer: tools to check it on your setup.",
        epilog="Run `hf-gradacc <command> --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    check_command_parser(commands)
    bench_command_parser(commands)
    plot_command_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-gradacc`; returns the exit status (0 ok, 1 not exact, 2 usage error).

    Example:
        ```python
        from hf_gradacc.commands.hf_gradacc_cli import main
        status = main(["check", "--task", "sequence_classification"])
        ```
    """
    parser = build_parser()
    try:
        opts = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits for --help (0) and usage errors (2); report them as a status
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if getattr(opts, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return opts.handler(opts)


def console_main() -> int:
    """The `hf-gradacc` executable: :func:`main`, then an exit that is safe on CPU ranks.

    After a gloo process group, a gloo worker thread may still free the last collective's tensors while the
    interpreter finalises, which aborts the rank (SIGABRT) now and then although every result was printed. Once the
    command is done, this flushes the output and logs and leaves without finalisation in that case. Use
    :func:`main` to call the command from Python.
    """
    status = main()
    if _shared.gloo_group_finished():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
