"""What `hf-gradacc bench` prints and draws: the table of one run (:func:`format_table`), with ``--repeats N`` every
ratio against the stock Trainer as its median and [min-max] and a note where the spread is wider than the difference
from the stock Trainer the row reports (:func:`summarize`, :func:`format_summary`), and with ``--plot`` the step-time
and memory distributions (:func:`plot_benchmark`).

The step time and CPU time ratios pool the step pairs of every repeat (trainer's step ``s`` / stock step ``s`` of
the same repeat); the total time and total CPU time ratios take one value per repeat. A row whose spread is wider
than its distance from 1.0 measured noise, not an overhead or a speed-up: more ``--steps`` or ``--repeats`` narrow
it.

Example:
    ```python
    from hf_gradacc.commands.bench.bench_report import format_summary, summarize
    from hf_gradacc.commands.bench.benchmark import BenchSettings, run_benchmark

    repeats = [run_benchmark(BenchSettings(num_steps=3)) for _ in range(3)]
    print(format_summary(summarize(repeats)))
    ```
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .._shared import require_matplotlib
from . import bench_moe
from .benchmark import _TRAINER_LABELS, BenchRow

# (the BenchRow field of each step's time, the column's name); pair ratios against the stock row's same step
_PAIRED = (("step_times_s", "step time ratio"), ("step_cpu_times_s", "CPU time ratio"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """A ratio's median, smallest and largest value, and how many values it has."""

    median: float
    low: float
    high: float
    num_values: int

    @property
    def is_noise(self) -> bool:
        """The spread is wider than the difference from the stock Trainer (1.0) that the median reports."""
        return self.high - self.low > abs(self.median - 1.0)

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}-{self.high:.3f}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryRow:
    """One trainer on one dataset and vocabulary, over every repeat."""

    dataset: str
    vocab_size: int
    trainer: str
    ratios: dict[str, Spread]


def format_table(rows: Sequence[BenchRow]) -> str:
    """A markdown table of ``rows``.

    Example:
        ```python
        print(format_table(run_benchmark(BenchSettings(num_steps=2))))
        ```
    """
    header = (
        "| data | vocab | trainer | step time (median) | step time ratio vs stock (median of pairs) | total time "
        "ratio | "
        "step CPU time (median) | CPU time ratio (median of pairs) | total CPU time ratio | "
        "real tokens / s | computed / real tokens | LM-head rows per counted target | peak memory (first step "
        "included) | peak memory ratio | micro-batches / step | reductions / step | update diff vs GradAccTrainer |"
    )
    lines = [header, "|" + " --- |" * 17]
    for r in rows:
        reductions = "n/a (1 process)" if r.reductions_per_step is None else f"{r.reductions_per_step:.2f}"
        diff = "-" if r.relative_update_difference is None else f"{r.relative_update_difference:.1e}"
        lines.append(
            f"| {r.dataset} | {r.vocab_size} | {_TRAINER_LABELS[r.trainer]} | {r.median_step_time_s * 1e3:.0f} ms | "
            f"{r.step_time_ratio:.3f} | {r.total_time_ratio:.3f} | {r.median_step_cpu_time_s * 1e3:.0f} ms | "
            f"{r.cpu_time_ratio:.3f} | {r.total_cpu_time_ratio:.3f} | {r.real_tokens_per_s:,.0f} | "
            f"{r.computed_per_real_token:.3f} | {r.lm_head_rows_per_target:.2f} | "
            f"{r.peak_memory_bytes / 2**20:,.1f} MiB | {r.peak_memory_ratio:.3f} | {r.micro_batches_per_step:.1f} | "
            f"{reductions} | {diff} |"
        )
    moe = bench_moe.format_moe_comparison(rows)  # router_balance global_batch against micro_batch, where both rows ran
    return "\n".join(lines) + (f"\n\n{moe}" if moe else "")


def _spread(values: Sequence[float]) -> Spread:
    return Spread(median=statistics.median(values), low=min(values), high=max(values), num_values=len(values))


def summarize(repeats: Sequence[Sequence[BenchRow]]) -> list[SummaryRow]:
    """Every (dataset, vocabulary, trainer) of ``repeats`` (each the rows of one :func:`run_benchmark`), its ratios
    against the stock row of the same repeat as :class:`Spread`."""
    keys = list(dict.fromkeys((r.dataset, r.vocab_size, r.trainer) for rows in repeats for r in rows))
    summary = []
    for dataset, vocab, trainer in keys:
        values: dict[str, list[float]] = {name: [] for _, name in _PAIRED}
        values["total time ratio"], values["total CPU time ratio"] = [], []
        for rows in repeats:
            by_trainer = {r.trainer: r for r in rows if (r.dataset, r.vocab_size) == (dataset, vocab)}
            row, stock = by_trainer.get(trainer), by_trainer.get("stock")
            if row is None or stock is None:
                continue
            for field, name in _PAIRED:
                values[name] += [t / s for t, s in zip(getattr(row, field), getattr(stock, field)) if s > 0]
            values["total time ratio"].append(row.total_time_ratio)
            if row.total_cpu_time_ratio == row.total_cpu_time_ratio:  # not NaN (rows written before it existed)
                values["total CPU time ratio"].append(row.total_cpu_time_ratio)
        ratios = {name: _spread(v) for name, v in values.items() if v}
        summary.append(SummaryRow(dataset=dataset, vocab_size=vocab, trainer=trainer, ratios=ratios))
    return summary


def format_summary(summary: Sequence[SummaryRow], num_repeats: int = 1) -> str:
    """A markdown table of the ratios (median [min-max]) and, below it, a note for each ratio whose spread is wider
    than the difference from the stock Trainer it reports."""
    names = ["step time ratio", "CPU time ratio", "total time ratio", "total CPU time ratio"]
    lines = [
        f"ratios vs the stock Trainer, median [min-max] over {num_repeats} repeat(s) (step and CPU time: every timed "
        "step pair of every repeat; totals: one value per repeat)",
        "",
        "| data | vocab | trainer | " + " | ".join(names) + " |",
        "|" + " --- |" * (3 + len(names)),
    ]
    notes = []
    for row in summary:
        cells = [str(row.ratios[n]) if n in row.ratios else "-" for n in names]
        lines.append(
            f"| {row.dataset} | {row.vocab_size} | {_TRAINER_LABELS[row.trainer]} | " + " | ".join(cells) + " |"
        )
        if row.trainer == "stock":
            continue
        for name in names:
            spread = row.ratios.get(name)
            if spread is not None and spread.num_values > 1 and spread.is_noise:
                notes.append(
                    f"note: {row.dataset}, vocab {row.vocab_size}, {_TRAINER_LABELS[row.trainer]}: {name} {spread}: "
                    f"the spread ({spread.high - spread.low:.3f}) is wider than the difference from the stock Trainer "
                    f"it reports ({abs(spread.median - 1.0):.3f}): noise, not a measured difference; more --steps or "
                    "--repeats (on a quieter machine) narrow it"
                )
    return "\n".join(lines + ([""] + notes if notes else []))


def plot_benchmark(rows: Sequence[BenchRow], path: str) -> None:
    """Draw, per dataset and vocabulary, the distribution of every trainer's step times and peak memory (box plots)
    into ``path`` (a PNG). Needs matplotlib (``pip install "hf_gradacc[plot]"``)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.dataset, r.vocab_size) for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 3.2 * len(groups) + 0.6), squeeze=False)
    for (dataset, vocab), (times_ax, memory_ax) in zip(groups, axes):
        group = [r for r in rows if (r.dataset, r.vocab_size) == (dataset, vocab)]
        labels = [_TRAINER_LABELS[r.trainer] for r in group]
        times_ax.boxplot([[t * 1e3 for t in r.step_times_s] for r in group], vert=False, tick_labels=labels)
        times_ax.set_xlabel("step time (ms)")
        times_ax.set_title(f"{dataset}, vocabulary {vocab}: step time")
        memory_ax.boxplot([[b / 2**20 for b in r.step_peaks_bytes] for r in group], vert=False, tick_labels=labels)
        memory_ax.set_xlabel("peak memory within a step (MiB)")
        memory_ax.set_title(f"{dataset}, vocabulary {vocab}: peak memory")
        memory_ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
