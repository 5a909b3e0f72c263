"""`hf-gradacc plot RUN_DIR`: draw a run's training curves from its ``trainer_state.json``.

Reads ``RUN_DIR/trainer_state.json`` (written by ``trainer.save_state()``), or the newest complete
``RUN_DIR/checkpoint-*/trainer_state.json`` when the run folder has none, and draws one panel per logged quantity
that the run has: loss (and eval loss), grad norm, learning rate, tokens per second, padding ratio and effective
batch (the last three logged by :class:`~hf_gradacc.callbacks.TokenStatsCallback`), the gradient noise scale
beside the step's batch (logged by :class:`~hf_gradacc.callbacks.GradientNoiseScaleCallback`), and a
mixture-of-experts model's expert load ``moe/load_max_over_mean`` (see docs/moe.md).

Example:
    ```bash
    hf-gradacc plot out/                      # -> out/curves.png
    hf-gradacc plot out/ --output run.png
    ```
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..checkpoints import TRAINER_STATE_NAME, is_complete_checkpoint
from ..errors import GradAccConfigError, GradAccError
from ._shared import EXIT_OK, EXIT_USAGE, PlotDependencyError

# (panel title, log keys drawn in it, y label); a panel is drawn when the run logged one of its keys.
PANELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("loss", ("loss", "eval_loss"), "loss"),
    ("grad norm", ("grad_norm",), "norm (before clipping)"),
    ("learning rate", ("learning_rate",), "learning rate"),
    ("throughput", ("tokens/per_second", "samples/per_second"), ""),  # y label: the key drawn
    ("padding ratio", ("tokens/padding_ratio",), "1 - real / computed tokens"),
    ("effective batch", ("effective_batch_size",), "samples per optimizer step"),
    ("accumulation", ("accumulation_steps",), "micro-batches per rank per step"),  # an accumulation schedule
    # GradientNoiseScaleCallback: B_simple beside the batch B of the step, both in the loss's items
    ("gradient noise scale", ("gns", "gns/batch_size"), "items (samples or tokens)"),
    # a mixture-of-experts model's expert load, logged in both router_balance modes (hf_gradacc.moe_balance.LOAD_KEY)
    ("expert load", ("moe/load_max_over_mean",), "most loaded expert / mean load (1.0: balanced)"),
)
# Keys without which a panel says nothing: the batch size alone is no noise scale.
_PANEL_NEEDS: dict[str, str] = {"gradient noise scale": "gns"}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def plot_command_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plot`` subcommand to an ``argparse`` subparsers object; :func:`plot_command` runs it.

    Example:
        ```python
        parser = argparse.ArgumentParser(prog="hf-gradacc")
        plot_command_parser(parser.add_subparsers(dest="command"))
        opts = parser.parse_args(["plot", "out/"])
        ```
    """
    plot = subparsers.add_parser(
        "plot",
        help="draw a run's loss, grad norm, learning rate, tokens/s, padding ratio, effective batch, gradient noise "
        "scale and MoE expert load to a PNG",
        description=(
            "Read RUN_DIR/trainer_state.json (or the newest complete RUN_DIR/checkpoint-*/trainer_state.json) and "
            "draw one panel per logged quantity the run has: loss (and eval loss), grad norm, learning rate, tokens "
            "per second, padding ratio, effective batch (these three come from TokenStatsCallback), and the gradient "
            "noise scale `gns` beside the step's batch `gns/batch_size` (GradientNoiseScaleCallback), and a "
            "mixture-of-experts model's expert load `moe/load_max_over_mean`. Needs "
            "matplotlib (pip install hf_gradacc[plot])."
        ),
    )
    plot.add_argument(
        "run_dir", metavar="RUN_DIR", help="a Trainer output_dir, a checkpoint folder or a trainer_state.json"
    )
    plot.add_argument(
        "--output", metavar="FILE.png", default=None, help="where to write the image (default: RUN_DIR/curves.png)"
    )
    plot.set_defaults(handler=plot_command)
    return plot


def plot_command(opts: argparse.Namespace) -> int:
    """Run ``hf-gradacc plot`` (see ``hf-gradacc plot --help``); returns the exit status (0 ok, 2 usage error)."""
    try:
        state_path = find_trainer_state(opts.run_dir)
        folder = opts.run_dir if os.path.isdir(opts.run_dir) else os.path.dirname(state_path)
        output = opts.output or os.path.join(folder, "curves.png")
        drawn = plot_run(state_path, output)
    except GradAccError as exc:
        print(f"hf-gradacc plot: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"Wrote {output} ({', '.join(drawn)}) from {state_path}")
    return EXIT_OK


def find_trainer_state(run_dir: str) -> str:
    """``run_dir/trainer_state.json``, else the newest complete ``run_dir/checkpoint-N/trainer_state.json`` (highest
    N), or ``run_dir`` itself when it is such a file. Raises :class:`~hf_gradacc.GradAccConfigError` when none exists.

    Example:
        ```python
        state = find_trainer_state("out")      # "out/checkpoint-20/trainer_state.json"
        ```
    """
    path = Path(run_dir)
    if path.is_file() and path.suffix == ".json":
        return str(path)
    if not path.is_dir():
        raise GradAccConfigError(f"RUN_DIR ({run_dir!r}) is not a directory; pass a Trainer output_dir")
    if (path / TRAINER_STATE_NAME).is_file():
        return str(path / TRAINER_STATE_NAME)
    checkpoints = sorted(
        (int(m.group(1)), child) for child in path.iterdir() if (m := _CHECKPOINT.match(child.name)) and child.is_dir()
    )
    for _, child in reversed(checkpoints):
        if is_complete_checkpoint(str(child)):
            return str(child / TRAINER_STATE_NAME)
    raise GradAccConfigError(
        f"RUN_DIR ({run_dir!r}) has no {TRAINER_STATE_NAME}, nor a checkpoint-*/ folder with a complete one. The "
        "Trainer writes it with every checkpoint (save_strategy) and with `trainer.save_state()`."
    )


def plot_run(state_path: str, output: str, *, title: str | None = None) -> list[str]:
    """Draw the curves of the ``trainer_state.json`` at ``state_path`` into the image ``output``; returns the titles of
    the panels drawn (those whose keys the run logged).

    Example:
        ```python
        from hf_gradacc.commands.plot import find_trainer_state, plot_run
        plot_run(find_trainer_state("out"), "out/curves.png")     # ["loss", "grad norm", "learning rate", ...]
        ```
    """
    try:
        with open(state_path) as f:
            history = json.load(f).get("log_history", [])
    except (OSError, ValueError, AttributeError) as exc:
        raise GradAccConfigError(f"cannot read the log history of {state_path!r}: {exc}") from None
    series = {key: _series(history, key) for _, keys, _ in PANELS for key in keys}
    panels = [(name, [k for k in keys if series[k][0]], ylabel) for name, keys, ylabel in PANELS]
    panels = [p for p in panels if p[1] and _PANEL_NEEDS.get(p[0], p[1][0]) in p[1]]
    if not panels:
        raise GradAccConfigError(
            f"{state_path!r} holds no logged training metric to plot (its log_history has none of "
            f"{sorted(series)}); log at least one step (logging_steps)."
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise PlotDependencyError(
            "hf-gradacc plot needs matplotlib, which is not installed: pip install hf_gradacc[plot]"
        ) from exc

    columns = 1 if len(panels) == 1 else 2
    rows = (len(panels) + columns - 1) // columns
    fig = Figure(figsize=(5.2 * columns, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).reshape(-1)
    for ax, (name, keys, ylabel) in zip(axes, panels):
        for key in keys:
            steps, values = series[key]
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_ylabel(ylabel or " / ".join(keys))
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(keys) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[max(len(panels) - columns, 0) : len(panels)]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(title or _run_name(state_path))
    try:
        fig.savefig(output, dpi=100)
    except OSError as exc:
        raise GradAccConfigError(f"cannot write `--output` ({output!r}): {exc}") from None
    return [name for name, _, _ in panels]


def _run_name(state_path: str) -> str:
    """``run`` for ``run/trainer_state.json``, ``run/checkpoint-N`` for ``run/checkpoint-N/trainer_state.json``."""
    folder = Path(state_path).resolve().parent
    return f"{folder.parent.name}/{folder.name}" if _CHECKPOINT.match(folder.name) else folder.name


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the log lines that hold it as a number."""
    points = [
        (int(entry["step"]), float(entry[key]))
        for entry in history
        if isinstance(entry, dict) and isinstance(entry.get(key), (int, float)) and "step" in entry
    ]
    return [s for s, _ in points], [v for _, v in points]
