"""`hf-gradacc bench` tells the memory truth: the first step counts in the peak, a completion-only dataset masks
every prompt, and the LM-head rows per counted target show what a full-logits head computes for nothing."""

from __future__ import annotations

import argparse

import pytest

from hf_gradacc.commands import bench
from hf_gradacc.testing.benchmark import (
    QWEN_VOCAB_SIZE,
    BenchSettings,
    format_table,
    make_bench_samples,
    run_benchmark,
)


def test_completion_only_samples_mask_the_first_half() -> None:
    settings = BenchSettings(median_length=16, max_length=64)
    for sample in make_bench_samples(settings, "completion_only", 8):
        n = len(sample["input_ids"])
        assert sample["labels"][: n // 2] == [-100] * (n // 2)
        assert -100 not in sample["labels"][n // 2 :]


def test_bench_reports_head_rows_per_target_and_the_first_step_peak() -> None:
    settings = BenchSettings(
        hidden_size=32, num_layers=1, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_steps=1,
        num_warmup_steps=1, median_length=16, max_length=64, datasets=("completion_only",),
        trainers=("stock", "plain", "fused"),
    )  # fmt: skip
    rows = {r.trainer: r for r in run_benchmark(settings)}
    # the fused head projects the counted targets (and, once, the start-up check's row): about 1 per target
    assert 1.0 <= rows["fused"].lm_head_rows_per_target < 0.6 * rows["plain"].lm_head_rows_per_target
    assert rows["fused"].relative_update_difference <= 1e-5
    for row in (rows["stock"], rows["plain"]):
        # half of every row is prompt, one position per row predicts nothing, padding computes too: > 2 rows per target
        assert row.lm_head_rows_per_target > 2.0, row
        assert row.first_step_peak_memory_bytes > 0
        assert row.peak_memory_bytes >= row.first_step_peak_memory_bytes  # the first step is in the peak
    assert rows["plain"].lm_head_rows_per_target == pytest.approx(rows["stock"].lm_head_rows_per_target)
    table = format_table(list(rows.values()))
    assert "LM-head rows per counted target" in table and "peak memory (first step included)" in table


def test_bench_takes_the_qwen_vocabulary_by_name() -> None:
    parser = argparse.ArgumentParser(prog="hf-gradacc")
    bench.bench_command_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--vocab-sizes", "96,qwen", "--datasets", "completion_only"])
    settings = bench.settings_from_args(args)
    assert settings.vocab_sizes == (96, QWEN_VOCAB_SIZE) and settings.datasets == ("completion_only",)
