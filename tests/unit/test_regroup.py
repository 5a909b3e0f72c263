"""Regrouped micro-batches (hf_gradacc/regroup.py): same samples per optimizer step, less padding, same update."""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import SequentialSampler

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer
from hf_gradacc.compat import has_sampling_strategy, shard_even_batches
from hf_gradacc.data import WindowRegroupBatchSampler, find_regroup_sampler, sample_lengths, stock_windows
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import ListDataset, ListIterableDataset, PaddingCollator, build_tiny_model, make_samples

TOL = 1e-5


def long_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(min(1024, max(4, math.exp(4.6 + 0.9 * float(torch.randn((), generator=g)))))) for _ in range(n)]


def padded(lengths, batch) -> int:
    return len(batch) * max(lengths[i] for i in batch)


def dealt(sampler: WindowRegroupBatchSampler, world: int) -> list[list[list[int]]]:
    """What accelerate's BatchSamplerShard hands each rank, in order (the sampler as the stock loader sees it)."""
    if world == 1:
        return [list(sampler)]
    out = []
    for rank in range(world):
        out.append(list(BatchSamplerShard(sampler, world, rank, even_batches=shard_even_batches(True))))
    return out


# ---------------------------------------------------------------------------------------------- the sampler alone
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("budget", [None, 1100])
@pytest.mark.parametrize("drop_last", [False, True])
def test_windows_keep_the_stock_samples(world, budget, drop_last):
    n, bs, ga = 151, 4, 3
    lengths = long_tailed_lengths(n)
    sampler = WindowRegroupBatchSampler(
        SequentialSampler(range(n)),
        lengths,
        batch_size=bs,
        gradient_accumulation_steps=ga,
        num_processes=world,
        drop_last=drop_last,
        max_tokens_per_micro_batch=budget,
    )
    schedule = sampler.num_micro_batches_per_window
    stock = stock_windows(
        range(n), batch_size=bs, gradient_accumulation_steps=ga, num_processes=world, drop_last=drop_last
    )
    assert len(schedule) == len(stock) == sampler.num_windows
    assert len(sampler) == sum(schedule) * world
    per_rank = dealt(sampler, world)
    assert all(len(batches) == sum(schedule) for batches in per_rank)
    start = 0
    regrouped_padding = stock_padding = real = 0
    for num, window in zip(schedule, stock):
        assert num >= len(window[0])  # never fewer micro-batches than the stock step
        got = [batch for batches in per_rank for batch in batches[start : start + num]]
        want = [batch for rank_batches in window for batch in rank_batches]
        assert Counter(i for b in got for i in b) == Counter(i for b in want for i in b)  # duplicates included
        assert all(len(b) > 0 for b in got)
        if budget is None:
            assert num == len(window[0])
            assert max(padded(lengths, b) for b in got) <= max(padded(lengths, b) for b in want)
        else:
            assert max(padded(lengths, b) for b in got) <= budget
        regrouped_padding += sum(padded(lengths, b) for b in got)
        stock_padding += sum(padded(lengths, b) for b in want)
        real += sum(lengths[i] for b in got for i in b)
        start += num
    assert regrouped_padding / real < 0.75 * stock_padding / real


def test_token_budget_adds_micro_batches_and_balances_ranks():
    n, bs, ga, world = 256, 8, 4, 2
    lengths = long_tailed_lengths(n, seed=3)
    budget = 1100
    sampler = WindowRegroupBatchSampler(
        SequentialSampler(range(n)),
        lengths,
        batch_size=bs,
        gradient_accumulation_steps=ga,
        num_processes=world,
        max_tokens_per_micro_batch=budget,
    )
    schedule = sampler.num_micro_batches_per_window
    assert max(schedule) > ga  # the budget forces extra micro-batches somewhere
    rank0, rank1 = dealt(sampler, world)
    start = 0
    for num in schedule:
        load0 = sum(padded(lengths, b) for b in rank0[start : start + num])
        load1 = sum(padded(lengths, b) for b in rank1[start : start + num])
        assert max(load0, load1) <= 1.25 * min(load0, load1)
        start += num


def test_order_follows_the_base_sampler_once_per_epoch():
    n = 40
    lengths = long_tailed_lengths(n)
    base = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(0))
    sampler = WindowRegroupBatchSampler(
        base, lengths, batch_size=2, gradient_accumulation_steps=4, max_tokens_per_micro_batch=400
    )
    schedule = sampler.num_micro_batches_per_window  # plans epoch 0 from ONE pass over the base sampler
    first = list(sampler)  # ... and iterates that same plan
    assert sum(schedule) == len(first)
    state = base.generator.get_state()
    assert len(sampler) == len(first)  # a query after the iteration reuses the plan ...
    assert torch.equal(base.generator.get_state(), state)  # ... without drawing another order
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(i for b in first for i in b) == sorted(i for b in second for i in b) == list(range(n))
    assert first != second  # a new order for the new epoch


# ---------------------------------------------------------------------------------------------- errors
def test_budget_below_the_longest_sample_names_it():
    lengths = [5, 30, 12]
    with pytest.raises(GradAccConfigError, match=r"`max_tokens_per_micro_batch` \(20\).*sample 1.*30 tokens"):
        WindowRegroupBatchSampler(
            SequentialSampler(range(3)),
            lengths,
            batch_size=1,
            gradient_accumulation_steps=1,
            max_tokens_per_micro_batch=20,
        )


def test_trainer_rejects_a_budget_below_the_longest_sample(helpers):
    samples = make_samples("causal_lm", 8, seed=0, max_length=40)
    longest = max(len(s["input_ids"]) for s in samples)
    args = helpers.make_args(
        args_class=GradAccConfig,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        max_tokens_per_micro_batch=longest - 1,
    )
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=args,
        train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(),
    )
    with pytest.raises(GradAccConfigError, match=rf"\({longest - 1}\).*{longest} tokens"):
        trainer.train()


def test_regrouping_without_lengths_says_which_field():
    dataset = ListDataset([{"features": [1.0, 2.0], "labels": 1}] * 4)
    with pytest.raises(GradAccConfigError, match="`length`.*length_column_name"):
        sample_lengths(dataset)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_tokens_per_micro_batch": 0}, r"`max_tokens_per_micro_batch` \(0\) must be None or an int >= 1"),
        ({"regroup_micro_batches": "yes"}, r"`regroup_micro_batches` \('yes'\) must be a bool"),
        (
            {"regroup_micro_batches": True, "train_sampling_strategy": "batch_rebalance"},
            "batch_rebalance.*regroup_micro_batches",
        ),
    ],
)
def test_bad_settings_are_rejected(overrides, message):
    with pytest.raises(GradAccConfigError, match=message):
        GradAccConfig(output_dir="unused", report_to=[], use_cpu=True, **overrides)


def test_batch_sampler_as_base_is_rejected():
    batches = torch.utils.data.BatchSampler(SequentialSampler(range(4)), 2, False)
    with pytest.raises(GradAccConfigError, match="batch sampler BatchSampler"):
        WindowRegroupBatchSampler(batches, [3] * 4, batch_size=2, gradient_accumulation_steps=1)


def test_iterable_dataset_warns_once_and_trains_exactly(helpers, caplog):
    samples = make_samples("causal_lm", 8, seed=2)
    model = build_tiny_model("causal_lm")
    args = helpers.make_args(
        args_class=GradAccConfig,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        regroup_micro_batches=True,
    )
    with caplog.at_level(logging.WARNING, logger="hf_gradacc.data"):
        update, trainer = one_step_update(
            GradAccTrainer, model, samples, args, train_dataset=ListIterableDataset(samples)
        )
    assert sum("not applied to an IterableDataset" in r.getMessage() for r in caplog.records) == 1
    assert find_regroup_sampler(trainer.get_train_dataloader()) is None
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOL


# ---------------------------------------------------------------------------------------------- training
class RecordingCollator(PaddingCollator):
    """Pads, and records each micro-batch's samples (by their token ids) and its padded / real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.micro_batches: list[list[tuple[int, ...]]] = []

    def __call__(self, samples):
        self.micro_batches.append([tuple(s["input_ids"]) for s in samples])
        return super().__call__(samples)


class WindowSizes(GradAccTrainer):
    """Records how many micro-batches each optimizer step took."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.__dict__.setdefault("window_sizes", []).append(len(batches))
        return batches, count


def windows_of(collator: RecordingCollator, sizes: list[int]) -> list[Counter]:
    out, start = [], 0
    for size in sizes:
        out.append(Counter(s for batch in collator.micro_batches[start : start + size] for s in batch))
        start += size
    return out


def padding_ratio(collator: RecordingCollator) -> float:
    padded_tokens = sum(len(b) * max(len(s) for s in b) for b in collator.micro_batches)
    return padded_tokens / sum(len(s) for b in collator.micro_batches for s in b)


def flat_update(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([update[n].double().reshape(-1) for n in sorted(update)])


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    fa, fb = flat_update(a), flat_update(b)
    return float((fa - fb).norm() / fb.norm())


MODES = {
    "regroup": {"regroup_micro_batches": True},
    "budget": {"max_tokens_per_micro_batch": 48},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_sgd_step_equals_plain_and_reference(mode):
    samples = make_samples("causal_lm", 16, seed=4)  # bs 4 x GA 4: one window, mixed lengths
    model = build_tiny_model("causal_lm")
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, args_class=GradAccConfig)
    plain_collator, collator = RecordingCollator(), RecordingCollator()
    plain, _ = one_step_update(GradAccTrainer, model, samples, one_step_args(**common), data_collator=plain_collator)
    update, trainer = one_step_update(
        GradAccTrainer, model, samples, one_step_args(**common, **MODES[mode]), data_collator=collator
    )
    assert find_regroup_sampler(trainer.get_train_dataloader()) is not None
    assert [len(b) for b in collator.micro_batches] != [len(b) for b in plain_collator.micro_batches]
    assert padding_ratio(collator) < padding_ratio(plain_collator)
    assert relative_difference(update, plain) <= TOL
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOL
    assert all(float(u.abs().max()) > 0 for u in update.values())


def train_adamw(model, samples, collator, trainer_class=WindowSizes, **overrides):
    model = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    kwargs = dict(
        output_dir="unused",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        optim="adamw_torch",
    )
    args = GradAccConfig(**{**kwargs, **overrides})
    trainer = trainer_class(model=model, args=args, train_dataset=ListDataset(samples), data_collator=collator)
    trainer.train()
    update = {n: initial[n] - p.detach() for n, p in model.named_parameters()}
    return update, trainer


@pytest.mark.parametrize("mode", sorted(MODES))
def test_adamw_steps_equal_plain_with_the_same_windows(mode):
    samples = make_samples("causal_lm", 20, seed=5)  # windows of 8, 8 and a short last one of 4
    model = build_tiny_model("causal_lm")
    plain_collator, collator = RecordingCollator(), RecordingCollator()
    plain, plain_trainer = train_adamw(model, samples, plain_collator, num_train_epochs=2)
    update, trainer = train_adamw(model, samples, collator, num_train_epochs=2, **MODES[mode])
    assert trainer.state.global_step == plain_trainer.state.global_step == 6
    assert trainer.state.epoch == pytest.approx(2.0)
    assert windows_of(collator, trainer.window_sizes) == windows_of(plain_collator, plain_trainer.window_sizes)
    if mode == "budget":
        assert max(trainer.window_sizes) > 4  # some window needed more micro-batches under the budget
        assert all(len(b) * max(len(s) for s in b) <= 48 for b in collator.micro_batches)
    assert padding_ratio(collator) < padding_ratio(plain_collator)
    assert relative_difference(update, plain) <= TOL


def test_length_column_of_a_datasets_dataset_is_used():
    datasets = pytest.importorskip("datasets")
    samples = make_samples("causal_lm", 6, seed=6)
    rows = [{**s, "length": 1000 + k} for k, s in enumerate(samples)]
    dataset = datasets.Dataset.from_list(rows)
    assert sample_lengths(dataset) == [1000 + k for k in range(6)]
    assert sample_lengths(datasets.Dataset.from_list(samples)) == [len(s["input_ids"]) for s in samples]


def test_resume_mid_epoch_with_a_token_budget_replays_the_same_steps(tmp_path):
    """Checkpoint after step 4 (inside the second epoch), resume: the skipped micro-batches follow the schedule."""
    samples = make_samples("causal_lm", 20, seed=8, min_length=16)
    model = build_tiny_model("causal_lm")
    overrides = dict(num_train_epochs=2, max_tokens_per_micro_batch=40, save_strategy="steps", save_steps=4)
    full, trainer = train_adamw(model, samples, RecordingCollator(), output_dir=str(tmp_path), **overrides)
    assert trainer.state.global_step == 6 and max(trainer.window_sizes) > 4
    resumed_model = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in resumed_model.named_parameters()}
    args = copy.deepcopy(trainer.args)
    collator = RecordingCollator()
    resumed = WindowSizes(model=resumed_model, args=args, train_dataset=ListDataset(samples), data_collator=collator)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed.state.global_step == 6
    assert resumed.window_sizes == trainer.window_sizes[4:]
    update = {n: initial[n] - p.detach() for n, p in resumed_model.named_parameters()}
    assert relative_difference(update, full) <= TOL


# ---------------------------------------------------------------------------------------------- the benchmark
def test_bench_runs_interleaved_and_reports_exact_updates(tmp_path):
    from hf_gradacc.commands.bench.bench_report import format_table, plot_benchmark
    from hf_gradacc.commands.bench.benchmark import BenchSettings, run_benchmark

    settings = BenchSettings(
        hidden_size=32,
        num_layers=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_steps=2,
        num_warmup_steps=1,
        median_length=16,
        equal_length=16,
        max_length=64,
        max_tokens_per_micro_batch=64,
        datasets=("long_tailed",),
    )
    rows = {r.trainer: r for r in run_benchmark(settings)}
    rebalance = {"stock_batch_rebalance"} if has_sampling_strategy("batch_rebalance") else set()  # 5.24 has it
    assert set(rows) == {"stock", "stock_group_by_length", *rebalance, "stock_flatten", "plain", "regroup",
                         "budget", "pack"}  # fmt: skip
    assert all(len(r.step_times_s) == 2 == len(r.step_peaks_bytes) for r in rows.values())
    assert rows["regroup"].computed_per_real_token < rows["plain"].computed_per_real_token
    assert rows["plain"].computed_per_real_token == rows["stock"].computed_per_real_token  # same grouping
    assert rows["pack"].computed_per_real_token == rows["stock_flatten"].computed_per_real_token == 1.0  # no padding
    for name in ("regroup", "budget", "pack"):  # the same samples per step: the same update
        assert rows[name].relative_update_difference <= TOL, name
    if rebalance:
        assert rows["stock_batch_rebalance"].relative_update_difference > 0.01  # it moves samples between steps
    assert rows["stock"].reductions_per_step is None  # one process: n/a
    table = format_table(list(rows.values()))
    assert "GradAccTrainer + packed" in table and "n/a" in table
    assert ("Trainer, batch_rebalance" in table) == bool(rebalance)
    plot_benchmark(list(rows.values()), str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_cli_parser_and_gpu_script_without_cuda(capsys):
    import argparse
    import importlib.util
    from pathlib import Path

    from hf_gradacc.commands import bench

    parser = argparse.ArgumentParser(prog="hf-gradacc")
    bench.bench_command_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--steps", "3", "--datasets", "equal", "--trainers", "stock,pack",
                              "--vocab-sizes", "96,32000"])  # fmt: skip
    settings = bench.settings_from_args(args)
    assert (settings.num_steps, settings.datasets, settings.trainers) == (3, ("equal",), ("stock", "pack"))
    assert settings.vocab_sizes == (96, 32000)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--trainers", "stock,nope"])
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", script)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    if not torch.cuda.is_available():
        assert gpu.main([]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err
