"""The targets of `hf-gradacc bench`, as ratios between rows of ONE run (never as timed assertions): a machine's
speed cancels out, its noise does not, so repeat a run that looks disturbed.

    hf-gradacc bench --datasets equal,long_tailed --json bench96.json
    python benchmarks/targets.py bench96.json                 # prints every target it can check, exit 1 if one fails
    python benchmarks/targets.py run1.json run2.json          # ... and, per target, whether the runs agree

Each target names the rows it compares; a target whose rows are not in the file is skipped (and said so). Totals
(sum of the timed steps) are compared, not medians of pairs: a stock sampler that moves samples between steps makes
unequal steps that a median hides. Time is the process CPU time (every rank's, summed: ``total_cpu_time_ratio``), which
other processes on a shared machine do not inflate as they inflate the wall time (two wall-time runs of the
vocabulary-96 targets flipped on a busy 2-core machine); ``--wall`` judges the wall time instead, and a file written
before CPU time was recorded is judged on its wall time (said so). Given several files (runs of the same command),
it also prints, per target, each run's verdict, whether they agree, and whether the margin from the limit is inside
the spread of the runs and of their repeats (then the verdict is not settled by them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

STOCK = ("stock", "stock_group_by_length", "stock_batch_rebalance", "stock_flatten")
CPU, WALL = "total_cpu_time_ratio", "total_time_ratio"


@dataclass(frozen=True)
class Target:
    """One ratio target: ``measure(rows of one (dataset, vocabulary))`` gives (ratio, what was compared) or None
    when the rows it needs are missing; met when ratio <= limit."""

    name: str
    dataset: str
    vocab_size: int
    limit: float
    measure: Callable[[dict[str, dict[str, Any]], str], tuple[float, str] | None]


def _ratio(numerator: str, denominator: str):
    def measure(rows: dict[str, dict[str, Any]], key: str) -> tuple[float, str] | None:
        if numerator not in rows or denominator not in rows:
            return None
        return rows[numerator][key] / rows[denominator][key], f"{numerator} / {denominator} ({key})"

    return measure


def _best_gradacc_against_best_stock(time_limit: float, memory_limit: float):
    """The GradAccTrainer row that is within both limits of the fastest stock row's total (CPU) time and the leanest
    stock row's peak memory, if any; else the row closest to them. The ratio reported is the larger of its two ratios,
    each divided by its limit (<= 1: both met)."""

    def measure(rows: dict[str, dict[str, Any]], key: str) -> tuple[float, str] | None:
        stock = [rows[n] for n in STOCK if n in rows]
        ours = {n: r for n, r in rows.items() if n not in STOCK}
        if len(stock) < len(STOCK) or not ours:
            return None
        fastest = min(stock, key=lambda r: r[key])
        leanest = min(stock, key=lambda r: r["peak_memory_bytes"])

        def score(row: dict[str, Any]) -> tuple[float, float, float]:
            t = row[key] / fastest[key]
            m = row["peak_memory_bytes"] / leanest["peak_memory_bytes"]
            return max(t / time_limit, m / memory_limit), t, m

        name = min(ours, key=lambda n: score(ours[n]))
        worst, t, m = score(ours[name])
        return worst, (
            f"{name}: {t:.3f}x the {'CPU' if key == CPU else 'wall'} time of {fastest['trainer']} (limit {time_limit}), "
            f"{m:.3f}x the peak memory "
            f"of {leanest['trainer']} (limit {memory_limit})"
        )

    return measure


# What two runs on a busy 2-core machine say of each target (docs/benchmarks.md, 2026-11-26 evening; `bench_cpu.py
# --datasets equal,long_tailed,completion_only --repeats 2 --steps 7` twice, then `--vocab-size 32000 --datasets
# long_tailed --steps 4` twice; CPU time):
# - packed <= 1.05x plain: 0.969 / 0.967, the same verdict, but each run's two repeats span 0.90-1.03, wider than the
#   0.08 margin: on equal lengths packed and plain compute the same micro-batches, so this guards against packing
#   adding work, and a reading between 1.0 and 1.05 is noise, not a cost.
# - packed no slower than regrouping: 0.996 met / 1.019 NOT met: a tie, not a target two runs can settle (the margin,
#   0.008, is inside the spread: 0.023 between the runs, 0.044 over the repeats). The planner lays long-tailed steps
#   out as padded regrouped micro-batches, the same work as regrouping; a miss here is only a problem well above 1.04.
# - 32,000 long-tailed: 0.920 / 0.936 (token budget 0.460x / 0.468x the CPU time of the fastest stock row, 0.084x the
#   leanest stock peak), the same verdict; margin 0.072 outside the spread 0.016 (on wall time the runs disagreed).
TARGETS: tuple[Target, ...] = (
    Target("packed <= 1.05x plain, equal lengths", "equal", 96, 1.05, _ratio("pack", "plain")),
    Target("packed no slower than regrouping, long-tailed", "long_tailed", 96, 1.0, _ratio("pack", "regroup")),
    Target(
        "best GradAccTrainer row <= 0.5x CPU time and <= 0.15x memory of the best stock row, long-tailed",
        "long_tailed",
        32000,
        1.0,
        _best_gradacc_against_best_stock(0.5, 0.15),
    ),
)


def time_key(rows: Sequence[dict[str, Any]], *, wall: bool = False) -> str:
    """The time every target is judged on: the CPU time, unless ``wall`` or a row has none (an older file)."""
    has_cpu = all(isinstance(r.get(CPU), float) and r[CPU] == r[CPU] for r in rows)
    return WALL if wall or not has_cpu else CPU


def check(
    rows: Sequence[dict[str, Any]], targets: Sequence[Target] = TARGETS, *, wall: bool = False
) -> list[tuple[Target, float, str]]:
    """(target, ratio, what was compared) for every target whose rows are in ``rows`` (the ``rows`` of a ``--json``
    file), on CPU time (see :func:`time_key`). With ``--repeats`` each repeat is measured on its own rows; the ratio is
    the median over the repeats, and what was compared ends with their [min-max]."""
    key = time_key(rows, wall=wall)
    results = []
    for target in targets:
        measured = []
        for repeat in sorted({r.get("repeat", 0) for r in rows}):
            group = {
                r["trainer"]: r
                for r in rows
                if (r["dataset"], r["vocab_size"], r.get("repeat", 0)) == (target.dataset, target.vocab_size, repeat)
            }
            one = target.measure(group, key)
            if one is not None:
                measured.append(one)
        if measured:
            ratios = [ratio for ratio, _ in measured]
            median = statistics.median(ratios)
            what = min(measured, key=lambda m: abs(m[0] - median))[1]  # the repeat nearest the median
            if len(measured) > 1:
                what += f"; {len(measured)} repeats: [{min(ratios):.3f}-{max(ratios):.3f}]"
            results.append((target, median, what))
    return results


@dataclass(frozen=True)
class Agreement:
    """One target over several runs (files): each run's ratio and verdict, whether the verdicts agree, and whether the
    margin (the median ratio's distance from the limit) is inside the spread of the runs' ratios and of every repeat
    within them (``repeats``; then one more run could flip the verdict: the target is level with its limit on this
    machine, not met or missed by a margin)."""

    target: Target
    ratios: tuple[float, ...]
    repeats: tuple[float, ...] = ()

    @property
    def verdicts(self) -> tuple[bool, ...]:
        return tuple(r <= self.target.limit for r in self.ratios)

    @property
    def agree(self) -> bool:
        return len(set(self.verdicts)) == 1

    @property
    def spread(self) -> float:
        values = self.ratios + self.repeats
        return max(values) - min(values)

    @property
    def margin(self) -> float:
        return abs(statistics.median(self.ratios) - self.target.limit)

    @property
    def margin_inside_spread(self) -> bool:
        return self.margin <= self.spread

    def __str__(self) -> str:
        runs = " / ".join(f"{r:.3f} {'met' if v else 'NOT MET'}" for r, v in zip(self.ratios, self.verdicts))
        text = f"{'same verdict' if self.agree else 'VERDICTS DIFFER'} in {len(self.ratios)} runs: {runs} (limit "
        text += f"{self.target.limit}; spread {self.spread:.3f}, margin {self.margin:.3f}"
        return text + (": the margin is inside the spread)" if self.margin_inside_spread else ")")


def agreement(
    runs: Sequence[Sequence[tuple[Target, float, str]]],
    repeats: Sequence[Sequence[tuple[Target, float, str]]] = (),
) -> list[Agreement]:
    """Every target :func:`check` measured in more than one of ``runs`` (one :func:`check` result per file), in the
    order of :data:`TARGETS`; ``repeats``: :func:`check` of each repeat of each file alone (their ratios widen the
    spread)."""
    ratios: dict[str, list[float]] = {}
    within: dict[str, list[float]] = {}
    by_name: dict[str, Target] = {}
    for results in runs:
        for target, ratio, _ in results:
            ratios.setdefault(target.name, []).append(ratio)
            by_name[target.name] = target
    for results in repeats:
        for target, ratio, _ in results:
            within.setdefault(target.name, []).append(ratio)
    return [Agreement(by_name[n], tuple(r), tuple(within.get(n, ()))) for n, r in ratios.items() if len(r) > 1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="files written by `hf-gradacc bench --json`")
    parser.add_argument("--wall", action="store_true", help="judge the wall time (a quiet machine), not the CPU time")
    args = parser.parse_args(argv)
    failed = 0
    runs, repeats = [], []
    for path in args.json:
        with open(path) as f:
            rows = json.load(f)["rows"]
        results = check(rows, wall=args.wall)
        runs.append(results)
        for repeat in sorted({r.get("repeat", 0) for r in rows}):
            repeats.append(check([r for r in rows if r.get("repeat", 0) == repeat], wall=args.wall))
        key = time_key(rows, wall=args.wall)
        if key == WALL and not args.wall:
            print(f"note: {path} has no CPU time (written before it was recorded): judged on the wall time")
        checked = {t.name for t, _, _ in results}
        for target, ratio, what in results:
            met = ratio <= target.limit
            failed += not met
            print(
                f"{'met    ' if met else 'NOT MET'} {ratio:.3f} (limit {target.limit}) {target.name}: {what} [{path}]"
            )
        for target in TARGETS:
            if target.name not in checked:
                print(f"skipped {target.name}: no {target.dataset} rows at vocabulary {target.vocab_size} [{path}]")
    for agreed in agreement(runs, repeats):
        print(f"{agreed.target.name}: {agreed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
