"""`hf-gradacc bench` from the command line: the help text, `--quick`, `--repeats` with each ratio's median and
[min-max] and the note on noise, CPU time beside wall time; and docs/cli.md naming every command's flags.

The run is the tiny model with `--quick` (about 10 s on a busy 2-core machine); the summary's arithmetic is checked
on hand-made rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_gradacc.commands import hf_gradacc_cli as cli
from hf_gradacc.commands.hf_gradacc_cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_bench_help_is_clean_and_names_the_same_trainers_as_the_top_level_help(capsys):
    """`hf-gradacc bench --help` started with a stray backtick and listed fewer trainers than `hf-gradacc --help`."""
    from hf_gradacc.commands.bench.benchmark import _TRAINER_LABELS, ALL_TRAINERS, describe_trainers

    assert main(["bench", "--help"]) == 0
    bench_help = capsys.readouterr().out
    assert main(["--help"]) == 0
    top_help = _words(capsys.readouterr().out)
    description = _words(bench_help.split("\n\n")[1])
    assert "`" not in description
    assert description.lower().startswith(_words(describe_trainers()).lower())
    assert _words(describe_trainers()) in top_help.replace("- ", "-")  # argparse may wrap at a hyphen
    for name in ALL_TRAINERS[1:]:  # every row a run can name besides the stock Trainer itself, in both
        label = _TRAINER_LABELS[name].split(", ", 1)[-1].replace("GradAccTrainer", "").strip(" +") or "plain"
        assert label in description, (name, description)
    assert "--repeats" in bench_help and "--quick" in bench_help


def test_bench_quick_fills_only_what_was_left_at_its_default():
    from hf_gradacc.commands.bench import QUICK, apply_quick, settings_from_args

    parser = cli.build_parser()
    quick = apply_quick(parser.parse_args(["bench", "--quick", "--steps", "5"]), parser._subparsers._group_actions[0]
                        .choices["bench"])  # fmt: skip
    settings = settings_from_args(quick)
    assert settings.num_steps == 5  # given: wins
    assert (settings.hidden_size, settings.datasets, quick.repeats) == (QUICK["hidden_size"], ("long_tailed",), 2)
    plain = settings_from_args(parser.parse_args(["bench"]))
    assert plain.hidden_size == 64 and plain.num_steps == 6  # without --quick: the defaults


def test_docs_cli_documents_every_command_and_flag():
    """docs/cli.md has a section per `hf-gradacc` command and names each of its flags (it had no bench options)."""
    docs = (REPO_ROOT / "docs" / "cli.md").read_text()
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"check", "bench", "plot"}
    for name, parser in commands.items():
        section = docs.split(f"## `hf-gradacc {name}`", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section, f"docs/cli.md, `hf-gradacc {name}`: {flag} is not documented"


def _bench_row(trainer: str, step_times: list[float], total: float, total_cpu: float = float("nan")):
    from hf_gradacc.commands.bench.benchmark import BenchRow

    return BenchRow(total_cpu_time_ratio=total_cpu,
        dataset="long_tailed", trainer=trainer, vocab_size=96, median_step_time_s=0.1, step_time_ratio=1.0,
        total_time_ratio=total, computed_per_real_token=1.0, peak_memory_bytes=1, peak_memory_ratio=1.0,
        reductions_per_step=None, micro_batches_per_step=2.0, relative_update_difference=0.0,
        step_times_s=tuple(step_times), step_cpu_times_s=tuple(step_times),
    )  # fmt: skip


def test_bench_summary_reports_median_min_max_and_a_note_only_for_noise():
    from hf_gradacc.commands.bench.bench_report import format_summary, summarize

    stock = _bench_row("stock", [1.0, 1.0, 1.0], 1.0)
    noisy = _bench_row("plain", [0.8, 1.2, 1.7], 1.2)  # median 1.2, spread 0.9 > 0.2
    steady = _bench_row("regroup", [1.30, 1.31, 1.29], 1.3)  # median 1.30, spread 0.02 < 0.30
    repeats = [[stock, noisy, steady], [stock, _bench_row("plain", [1.0, 1.1, 1.2], 1.1), steady]]
    summary = {s.trainer: s for s in summarize(repeats)}
    step = summary["plain"].ratios["step time ratio"]
    assert (step.median, step.low, step.high, step.num_values) == pytest.approx((1.15, 0.8, 1.7, 6))
    total = summary["plain"].ratios["total time ratio"]
    assert (total.median, total.low, total.high) == pytest.approx((1.15, 1.1, 1.2))  # one value per repeat
    text = format_summary(list(summary.values()), num_repeats=2)
    assert "| GradAccTrainer | 1.150 [0.800-1.700] |" in text
    assert "| GradAccTrainer + regroup | 1.300 [1.290-1.310] |" in text
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert notes and all("GradAccTrainer:" in n for n in notes), notes  # plain is noise; regroup is a difference
    assert any("step time ratio 1.150 [0.800-1.700]" in n and "wider than the difference" in n for n in notes)


def test_bench_summary_has_the_total_cpu_time_of_every_repeat():
    """The total CPU time ratio (what benchmarks/targets.py judges) is summarised per repeat; rows written before it
    existed (NaN) leave the column empty instead of NaN."""
    from hf_gradacc.commands.bench.bench_report import format_summary, summarize

    stock = _bench_row("stock", [1.0], 1.0, 1.0)
    repeats = [[stock, _bench_row("plain", [1.0], 1.3, 0.9)], [stock, _bench_row("plain", [1.0], 1.1, 0.95)]]
    cpu = {s.trainer: s for s in summarize(repeats)}["plain"].ratios["total CPU time ratio"]
    assert (cpu.median, cpu.low, cpu.high, cpu.num_values) == pytest.approx((0.925, 0.9, 0.95, 2))
    assert "| 0.925 [0.900-0.950] |" in format_summary(summarize(repeats), num_repeats=2)
    old = summarize([[_bench_row("stock", [1.0], 1.0), _bench_row("plain", [1.0], 1.2)]])
    assert "total CPU time ratio" not in {s.trainer: s for s in old}["plain"].ratios


def test_bench_quick_runs_with_repeats_and_cpu_time(tmp_path, capsys):
    """A first look as a user runs it: two repeats of the tiny model, ratios with their spread, CPU time beside wall."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--steps", "2", "--trainers", "stock,plain", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "process CPU time" in text and "CPU time ratio" in text
    assert "median [min-max] over 2 repeat(s)" in text
    summary_rows = [line for line in text.splitlines() if line.startswith("| long_tailed | 96 | GradAccTrainer |")]
    assert re.search(r"\| \d\.\d{3} \[\d\.\d{3}-\d\.\d{3}\] \|", summary_rows[-1]), summary_rows
    payload = json.loads(out.read_text())
    assert (
        payload["repeats"] == 2 and payload["settings"]["hidden_size"] == 32 and payload["settings"]["num_steps"] == 2
    )
    assert sorted({r["repeat"] for r in payload["rows"]}) == [0, 1]
    assert all(len(r["step_cpu_times_s"]) == 2 and min(r["step_cpu_times_s"]) > 0 for r in payload["rows"])
    plain = next(s for s in payload["summary"] if s["trainer"] == "plain")
    assert plain["step time ratio"]["num_values"] == 4  # 2 step pairs x 2 repeats


def test_docs_cli_names_every_bench_trainer():
    """docs/cli.md's `--trainers` row names every row a run can ask for (the MoE rows included)."""
    from hf_gradacc.commands.bench.benchmark import ALL_TRAINERS

    docs = (REPO_ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--trainers LIST` |"))
    assert [name for name in ALL_TRAINERS if f"`{name}`" not in row] == []


def test_bench_moe_rows_price_global_batch_against_micro_batch():
    """`--trainers stock,plain,moe_micro,moe_global`: every row trains the tiny Mixtral; `moe_micro` is the plain
    GradAccTrainer's update exactly (router_balance's default), `moe_global` another one (the balance loss over the
    step); the pre-pass's skipped LM head is not counted as computed rows; the global-over-micro table follows."""
    from hf_gradacc.commands.bench.bench_moe import moe_ratios
    from hf_gradacc.commands.bench.bench_report import format_table
    from hf_gradacc.commands.bench.benchmark import BenchSettings, bench_dataset, build_bench_model

    settings = BenchSettings(
        hidden_size=16, num_layers=1, num_heads=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_steps=2, num_warmup_steps=0, median_length=16, max_length=48, trainers=("stock", "plain", "moe_micro", "moe_global"),
    )  # fmt: skip
    assert type(build_bench_model(settings)).__name__ == "MixtralForCausalLM"
    rows = {r.trainer: r for r in bench_dataset(settings, "long_tailed")}
    assert rows["moe_micro"].relative_update_difference == 0.0
    assert rows["moe_global"].relative_update_difference > 1e-6  # router_balance="global_batch" did change the step
    assert rows["moe_global"].lm_head_rows_per_target == pytest.approx(rows["moe_micro"].lm_head_rows_per_target)
    text = format_table(list(rows.values()))
    assert "router_balance global_batch (moe_global) against micro_batch (moe_micro)" in text
    (ratio,) = moe_ratios(list(rows.values()))
    low, high = ratio["cpu_time_ratio_range"]
    assert f"| long_tailed | 96 | {ratio['cpu_time_ratio']:.3f} [{low:.3f}-{high:.3f}] | " in text


def test_bench_moe_ratios_are_global_over_micro_step_by_step():
    from dataclasses import replace

    from hf_gradacc.commands.bench.bench_moe import format_moe_comparison, moe_ratios

    micro = replace(_bench_row("moe_micro", [1.0, 2.0, 4.0], 1.0), peak_memory_bytes=100)
    glob = replace(_bench_row("moe_global", [1.5, 2.0, 4.4], 1.0), peak_memory_bytes=120)
    (ratio,) = moe_ratios([_bench_row("stock", [1.0, 1.0, 1.0], 1.0), glob, micro])
    assert ratio["cpu_time_ratio"] == pytest.approx(1.1)  # median of 1.5, 1.0, 1.1
    assert ratio["cpu_time_ratio_range"] == pytest.approx((1.0, 1.5))
    assert ratio["total_cpu_time_ratio"] == pytest.approx(7.9 / 7.0)
    assert ratio["peak_memory_ratio"] == pytest.approx(1.2)
    assert format_moe_comparison([micro]) == ""  # one MoE row alone: nothing to compare
