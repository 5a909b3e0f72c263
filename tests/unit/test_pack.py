"""Packed micro-batches (hf_gradacc/data/pack.py): the same samples per optimizer step in padding-free rows, the
collation of a row, and the model-level proof that a packed row trains exactly like the same samples padded."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import transformers as tf
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from hf_gradacc import GradAccConfigError
from hf_gradacc.compat import shard_even_batches
from hf_gradacc.counting import input_token_count
from hf_gradacc.data import WindowRegroupBatchSampler, stock_windows
from hf_gradacc.data.attention_cost import AttentionCostModel
from hf_gradacc.data.pack import (
    PackedCollator,
    WindowPackBatchSampler,
    cheapest_plan,
    pack_window,
    packed_sequence_lengths,
    plan_cost,
)
from hf_gradacc.data.pack_check import VERIFIED_PACKED_MODEL_TYPES, check_packing_support
from hf_gradacc.data.regroup import _count_groups, regroup_window
from hf_gradacc.errors import GradAccDataError
from hf_gradacc.loss import causal_targets, token_count, token_cross_entropy_sum
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

# Packed vs padded, relative, float32 (measured: 0 on the loss, 1e-7 sdpa / 1e-9 eager on the gradient).
TOL_FLOAT32 = 1e-5
# The same in float64; the sum-reduced loss casts the logits to float32 (as the Hugging Face losses do), so a float64
# logit that rounds the other way moves the gradient by ~1e-10 (measured: 8e-17 sdpa, 1.1e-10 eager).
TOL_FLOAT64 = 1e-9


def log_normal_lengths(n: int, seed: int = 0, *, median: float = 100.0, sigma: float = 1.0) -> list[int]:
    """Long-tailed lengths: log-normal with that median and sigma, clipped to [8, 1024]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    return [int(min(1024, max(8, round(math.exp(math.log(median) + sigma * float(x)))))) for x in z]


def dealt(sampler, world: int) -> list[list[list[int]]]:
    """What accelerate's BatchSamplerShard hands each rank, in order."""
    if world == 1:
        return [list(sampler)]
    return [
        list(BatchSamplerShard(sampler, world, rank, even_batches=shard_even_batches(True))) for rank in range(world)
    ]


def tokens(lengths, batch) -> int:
    return sum(lengths[i] for i in batch)


# ---------------------------------------------------------------------------------------------- pack_window
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("budget", [256, 1024, 4096])
def test_pack_window_keeps_every_sample_whole_under_the_budget(world, budget):
    lengths = [min(v, 256) for v in log_normal_lengths(400, seed=world)]
    samples = list(range(0, 400, 2)) + [0, 2, 4, 6]  # duplicates (even-batches padding) stay duplicates
    samples = samples[: len(samples) - len(samples) % world]
    per_rank = pack_window(samples, lengths, num_processes=world, max_tokens=budget)
    assert len(per_rank) == world
    assert len({len(rows) for rows in per_rank}) == 1  # the same number of micro-batches on every rank
    rows = [row for rank_rows in per_rank for row in rank_rows]
    assert Counter(i for row in rows for i in row) == Counter(samples)
    assert all(row and tokens(lengths, row) <= budget for row in rows)
    total = sum(lengths[i] for i in samples)
    lower_bound = math.ceil(math.ceil(total / budget) / world)
    assert lower_bound <= len(per_rank[0]) <= lower_bound + 1  # (nearly) the fewest micro-batches
    loads = [sum(tokens(lengths, row) for row in rank_rows) for rank_rows in per_rank]
    assert max(loads) - min(loads) <= max(lengths[i] for i in samples)  # ranks do similar work
    for rank_rows in per_rank:  # each rank's largest row first
        sizes = [tokens(lengths, row) for row in rank_rows]
        assert sizes == sorted(sizes, reverse=True)


def test_pack_window_is_deterministic_and_balances_rows():
    lengths = log_normal_lengths(256, seed=5)
    first = pack_window(range(256), lengths, num_processes=2, max_tokens=4096)
    assert first == pack_window(list(range(256)), list(lengths), num_processes=2, max_tokens=4096)
    sizes = [tokens(lengths, row) for rank_rows in first for row in rank_rows]
    assert max(sizes) - min(sizes) <= max(lengths)  # balanced rows, not first-fit rows and one leftover


def test_pack_window_falls_back_to_first_fit_when_balancing_overflows():
    # Least-loaded placement overflows a row of 10 ([6, 3, 2] and [5, 4]); first fit packs [6, 4] and [5, 3, 2].
    lengths = [6, 5, 4, 3, 2]
    per_rank = pack_window(range(5), lengths, num_processes=1, max_tokens=10)
    assert sorted(sorted(row) for row in per_rank[0]) == [[0, 2], [1, 3, 4]]


def test_pack_window_honours_a_requested_count_and_refuses_an_impossible_one():
    lengths = [100] * 8
    assert [len(r) for r in pack_window(range(8), lengths, num_processes=2, max_tokens=1000)] == [1, 1]
    per_rank = pack_window(range(8), lengths, num_processes=2, max_tokens=1000, num_micro_batches_per_rank=3)
    assert [len(r) for r in per_rank] == [3, 3] and all(row for rows in per_rank for row in rows)
    with pytest.raises(GradAccDataError, match="8 samples .*5 micro-batches per rank"):
        pack_window(range(8), lengths, num_processes=2, max_tokens=1000, num_micro_batches_per_rank=5)
    with pytest.raises(GradAccDataError, match="3 samples"):  # three rows of one sample cannot split over 2 ranks
        pack_window(range(3), lengths, num_processes=2, max_tokens=150)


def test_a_sample_longer_than_the_budget_is_named():
    lengths = [5, 30, 12]
    with pytest.raises(GradAccConfigError, match=r"sample 1 has 30 tokens.*`max_tokens_per_micro_batch` \(20\)"):
        pack_window([0, 1, 2], lengths, num_processes=1, max_tokens=20)
    with pytest.raises(GradAccConfigError, match=r"sample 1 has 30 tokens.*`max_tokens_per_micro_batch` \(20\)"):
        WindowPackBatchSampler(
            SequentialSampler(range(3)),
            lengths,
            batch_size=1,
            gradient_accumulation_steps=1,
            max_tokens_per_micro_batch=20,
        )
    with pytest.raises(GradAccConfigError, match=r"`max_tokens_per_micro_batch` \(0\) must be None or an int >= 1"):
        WindowPackBatchSampler(
            SequentialSampler(range(3)),
            lengths,
            batch_size=1,
            gradient_accumulation_steps=1,
            max_tokens_per_micro_batch=0,
        )


# ---------------------------------------------------------------------------------------------- the sampler
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("budget", [None, 1100])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_keeps_the_stock_samples_of_every_step(world, budget, drop_last):
    n, bs, ga = 151, 4, 3
    lengths = log_normal_lengths(n, seed=1)
    sampler = WindowPackBatchSampler(
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
    assert all(len(batches) == sum(schedule) for batches in per_rank)  # the same count on every rank
    start = 0
    for num, window in zip(schedule, stock):
        got = [batch for batches in per_rank for batch in batches[start : start + num]]
        want = [batch for rank_batches in window for batch in rank_batches]
        assert Counter(i for b in got for i in b) == Counter(i for b in want for i in b)  # duplicates included
        if budget is None:  # the window's largest stock micro-batch, padded
            cap = max(len(b) * max(lengths[i] for i in b) for b in want)
            assert num <= len(window[0])
        else:
            cap = budget
        assert all(b and tokens(lengths, b) <= cap for b in got)
        start += num


def test_sampler_plan_depends_only_on_epoch_and_order():
    n = 96
    lengths = log_normal_lengths(n, seed=2)

    def make():
        base = RandomSampler(range(n), generator=torch.Generator().manual_seed(7))
        return WindowPackBatchSampler(base, lengths, batch_size=4, gradient_accumulation_steps=4)

    first, resumed = make(), make()
    epoch0 = list(first)
    assert list(resumed) == epoch0  # a fresh sampler (a resumed run) replays the epoch
    assert len(first) == len(epoch0)  # a query after the iteration reuses the plan ...
    first.set_epoch(1)
    resumed.set_epoch(1)
    schedule = first.num_micro_batches_per_window  # planned before the iteration, kept for it
    epoch1 = list(first)
    assert sum(schedule) == len(epoch1) and list(resumed) == epoch1
    assert epoch1 != epoch0 and sorted(i for b in epoch1 for i in b) == list(range(n))


def test_sampler_is_found_by_the_regrouping_wiring_with_its_own_schedule():
    # The loader finds regrouping samplers with isinstance (find_regroup_sampler); the packed one is one.
    sampler = WindowPackBatchSampler(range(64), [50] * 64, batch_size=8, gradient_accumulation_steps=4)
    assert isinstance(sampler, WindowRegroupBatchSampler)
    # Equal lengths: the default budget (8 x 50 per row) gains nothing over the stock 4 micro-batches per step ...
    assert sampler.num_micro_batches_per_window == (4, 4)
    # ... a budget of a whole step's tokens packs each step into one row.
    sampler = WindowPackBatchSampler(
        range(64), [50] * 64, batch_size=8, gradient_accumulation_steps=4, max_tokens_per_micro_batch=1600
    )
    assert sampler.num_micro_batches_per_window == (1, 1) and len(sampler) == 2


def test_long_tailed_data_packs_without_padding_in_few_micro_batches():
    """Measured case of the report: 512 log-normal samples (median 100, sigma 1, [8, 1024]), bs 8 x GA 8, 1 rank."""
    n, bs, ga = 512, 8, 8
    lengths = log_normal_lengths(n, seed=0)
    real = sum(lengths)
    stock = stock_windows(range(n), batch_size=bs, gradient_accumulation_steps=ga)
    stock_padded = sum(len(b) * max(lengths[i] for i in b) for w in stock for b in w[0])
    assert stock_padded / real > 2.5  # what padding costs here
    for budget in (None, 1024):
        sampler = WindowPackBatchSampler(
            SequentialSampler(range(n)),
            lengths,
            batch_size=bs,
            gradient_accumulation_steps=ga,
            max_tokens_per_micro_batch=budget,
        )
        rows = list(sampler)
        computed = sum(tokens(lengths, row) for row in rows)  # a packed row computes exactly its samples' tokens
        assert computed / real <= 1.02 and sorted(i for r in rows for i in r) == list(range(n))
        schedule = sampler.num_micro_batches_per_window
        if budget is None:
            assert max(schedule) <= 3  # 2-3 rows per step instead of 8 padded micro-batches
        else:
            assert computed / (len(rows) * budget) >= 0.9  # rows are filled to >= 90% of the budget


# ---------------------------------------------------------------------------------------------- the collator
def test_collator_layout():
    batch = PackedCollator(return_seq_idx=True)(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": torch.tensor([8, 9])}, {"input_ids": [4]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 5, 6]
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2]]
    assert "attention_mask" not in batch
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["cu_seq_lens_q"].dtype == batch["seq_idx"].dtype == torch.int32
    plain = PackedCollator(return_flash_attn_kwargs=False)([{"input_ids": [5, 6]}])
    assert sorted(plain) == ["input_ids", "labels", "position_ids"]


@pytest.mark.parametrize("with_labels", [True, False])
def test_collator_matches_transformers_flattening(with_labels):
    samples = make_samples("causal_lm", 5, seed=1)
    if not with_labels:
        samples = [{"input_ids": s["input_ids"]} for s in samples]
    ours = PackedCollator(return_seq_idx=True)(samples)
    theirs = tf.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(samples)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if torch.is_tensor(value):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_collator_counts_what_the_padded_batch_counts():
    samples = make_samples("causal_lm", 7, seed=2)
    padded, packed = PaddingCollator()(samples), PackedCollator()(samples)
    # Targets after the causal shift (the "tokens" denominator) and attended input positions ("input_tokens").
    assert int(token_count(causal_targets(packed["labels"]))) == int(token_count(causal_targets(padded["labels"])))
    assert input_token_count(packed) == input_token_count(padded) == sum(len(s["input_ids"]) for s in samples)
    assert packed["input_ids"].shape[1] < padded["input_ids"].numel()  # and no padding


@pytest.mark.parametrize("flash_kwargs", [True, False])
def test_packed_sequence_lengths_count_the_samples_of_a_row(flash_kwargs):
    samples = make_samples("causal_lm", 5, seed=4)
    batch = PackedCollator(return_flash_attn_kwargs=flash_kwargs)(samples)
    assert packed_sequence_lengths(batch) == [len(s["input_ids"]) for s in samples]
    with pytest.raises(GradAccDataError, match="needs a packed row"):
        packed_sequence_lengths(PaddingCollator()(samples))


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"input_ids": [1, 2], "pixel_values": [0.0]}, r"keys \['pixel_values'\]"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "2 labels for 3 input ids"),
        ({"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}, "is padded"),
        ({"input_ids": []}, "no `input_ids`"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, r"shape \(2, 3\)"),
    ],
)
def test_collator_refuses_what_it_cannot_pack(sample, message):
    with pytest.raises(GradAccDataError, match=message):
        PackedCollator()([{"input_ids": [7, 8]}, sample])


def test_sampler_and_collator_feed_a_dataloader():
    samples = make_samples("causal_lm", 24, seed=3)
    lengths = [len(s["input_ids"]) for s in samples]
    sampler = WindowPackBatchSampler(
        SequentialSampler(range(24)), lengths, batch_size=4, gradient_accumulation_steps=2
    )
    rows = list(DataLoader(ListDataset(samples), batch_sampler=sampler, collate_fn=PackedCollator()))
    assert len(rows) == len(sampler) < 24 // 4
    assert sum(row["input_ids"].shape[1] for row in rows) == sum(lengths)
    assert all(row["input_ids"].shape[0] == 1 for row in rows)


# ---------------------------------------------------------------------------------------------- exactness
def exactness_samples() -> list[dict]:
    """Mixed lengths (3 to 25), prompts ignored in some samples, every label counted in others (so that a sample's
    first label is a real token and only the collator's boundary mask keeps the previous sample from predicting it)."""
    samples = make_samples("causal_lm", 6, seed=3)
    for k in (1, 3):
        samples[k]["labels"] = list(samples[k]["input_ids"])
    return samples


def loss_and_grad(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum-reduced causal-LM loss of ``batch`` and its gradient over every parameter (float64, flattened)."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    loss = token_cross_entropy_sum(logits, causal_targets(batch["labels"]))
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    return loss.detach().double(), grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tiny_llama(attn: str, dtype: torch.dtype) -> torch.nn.Module:
    model = build_tiny_model("causal_lm").to(dtype)
    model.set_attn_implementation(attn)
    model.config.use_cache = False  # what Trainer.__init__ does with the default TrainingArguments
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, TOL_FLOAT32), (torch.float64, TOL_FLOAT64)])
def test_packed_row_trains_exactly_like_the_padded_batch(attn, dtype, tol):
    samples = exactness_samples()
    model = tiny_llama(attn, dtype)
    padded_loss, padded_grad = loss_and_grad(model, PaddingCollator()(samples))
    packed_loss, packed_grad = loss_and_grad(model, PackedCollator()(samples))
    assert float(padded_loss) > 0 and float(padded_grad.norm()) > 0
    assert relative(packed_loss, padded_loss) <= tol
    assert relative(packed_grad, padded_grad) <= tol


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_cross_sample_leak_would_be_caught(attn):
    samples = exactness_samples()
    model = tiny_llama(attn, torch.float32)
    padded_loss, padded_grad = loss_and_grad(model, PaddingCollator()(samples))
    no_restart = PackedCollator(return_flash_attn_kwargs=False)(samples)
    no_restart["position_ids"] = torch.arange(no_restart["input_ids"].shape[1])[None]  # one long sequence
    loss, grad = loss_and_grad(model, no_restart)
    assert relative(loss, padded_loss) > 20 * TOL_FLOAT32 and relative(grad, padded_grad) > 0.1
    model.config.use_cache = True  # a cache turns transformers' packed-sequence detection off
    loss, grad = loss_and_grad(model, PackedCollator()(samples))
    assert relative(grad, padded_grad) > 0.1


# ---------------------------------------------------------------------------------------------- which models
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
MODELS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **TINY)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **TINY)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=4, **TINY)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=96, n_embd=32, n_head=4, n_layer=2)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, **TINY)),
    "bert_decoder": lambda: tf.BertLMHeadModel(tf.BertConfig(is_decoder=True, **TINY)),
    "bert_masked_lm": lambda: tf.BertForMaskedLM(tf.BertConfig(**TINY)),
    "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=96, hidden_size=32, n_head=4, n_layer=2)),
    "t5": lambda: build_tiny_model("seq2seq"),
}
# None: packing is exact; else the reason check_packing_support gives (measured leaks in the comments).
EXPECTED = {
    "llama": None,
    "qwen2": None,
    "mistral": None,  # sliding-window layers too
    "gpt2": None,  # absolute positions: the restarting position_ids are the padded ones
    "opt": "attend to each other",  # takes position_ids, but builds its mask without them (1e-1 relative)
    "bert_decoder": "attend to each other",  # ditto (3.7e-3 relative)
    "bert_masked_lm": "not a causal LM",
    "bloom": "takes no `position_ids`",  # ALiBi
    "t5": "encoder-decoder",
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_check_packing_support(name, attn):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.set_attn_implementation(attn)
    model.config.use_cache = False
    if EXPECTED[name] is None:
        check_packing_support(model)
        assert model.training  # the probe leaves the training mode as it was
    else:
        with pytest.raises(GradAccConfigError, match=EXPECTED[name]):
            check_packing_support(model)


def test_check_packing_support_refuses_a_cache_and_other_attention():
    model = build_tiny_model("causal_lm")
    assert model.config.use_cache  # the config default: a cache, so no packed-sequence detection
    with pytest.raises(GradAccConfigError, match=r"use_cache=True.*TrainingArguments.use_cache"):
        check_packing_support(model)
    model.config.use_cache = False
    tf.AttentionInterface.register("hf_gradacc_test_plain", tf.integrations.sdpa_attention.sdpa_attention_forward)
    model.set_attn_implementation("hf_gradacc_test_plain")
    with pytest.raises(GradAccConfigError, match="'hf_gradacc_test_plain'"):
        check_packing_support(model)


def test_check_packing_support_without_a_probe_trusts_verified_types_only():
    with torch.device("meta"):
        llama, opt = MODELS["llama"](), MODELS["opt"]()
    for model in (llama, opt):
        model.config.use_cache = False
    assert "llama" in VERIFIED_PACKED_MODEL_TYPES and "opt" not in VERIFIED_PACKED_MODEL_TYPES
    check_packing_support(llama)  # cannot run a forward pass on the meta device: the verified type is trusted
    with pytest.raises(GradAccConfigError, match="'opt'.*cannot be probed"):
        check_packing_support(opt)
    check_packing_support(opt, probe=False)  # the caller vouches for it


# ---------------------------------------------------------------------------------------------- the attention cost
# The benchmark model's calibration (hidden 64, 2 layers, vocabulary 96, sdpa on CPU): what the trainer derives.
BENCH_COST = AttentionCostModel(per_score=1.38e-3, per_micro_batch=300.0)


def test_cost_model_prices_a_dense_row_against_the_padded_batch():
    assert not BENCH_COST.packs([100] * 8)  # 800^2 scores against 8 x 100^2: padding pays
    assert BENCH_COST.packs([300, 20, 10])  # 570 padded positions saved for 2.5x the scores: packing pays
    assert BENCH_COST.packs([1000])  # one sample: the layouts are the same
    assert BENCH_COST.cost([100] * 8) == BENCH_COST.padded_cost([100] * 8) < BENCH_COST.packed_cost([100] * 8)
    varlen = AttentionCostModel(per_score=1.38e-3, per_micro_batch=300.0, dense=False)
    assert varlen.packs([100] * 8) and varlen.packed_cost([100] * 8) == pytest.approx(
        BENCH_COST.padded_cost([100] * 8)
    )
    always = AttentionCostModel(per_score=1.38e-3, padded_layout=False)
    assert always.packs([100] * 8)  # a collator that cannot pad: every micro-batch is one row


@pytest.mark.parametrize("field", ["per_score", "per_micro_batch"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "1", True])
def test_cost_model_refuses_a_bad_coefficient(field, value):
    kwargs = {"per_score": 1e-3, field: value}
    with pytest.raises(GradAccConfigError, match=f"`{field}`"):
        AttentionCostModel(**kwargs)


def _padded_positions(lengths, batch) -> int:
    return len(batch) * max(lengths[i] for i in batch)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("budget", [None, 1024])
def test_cheapest_plan_never_costs_more_than_the_padded_regrouping(world, budget):
    """Every sample once, each micro-batch within the budget in the layout the collator will pick, every rank the
    same count, and (by the model) never costlier than regrouping the window's samples padded."""
    lengths = log_normal_lengths(64 * world * 6, seed=world)
    for window in stock_windows(range(len(lengths)), batch_size=8, gradient_accumulation_steps=8, num_processes=world):
        samples = [i for rank in window for batch in rank for i in batch]
        cap = budget or max(_padded_positions(lengths, b) for rank in window for b in rank)
        count = len(window[0])
        if budget is not None:  # what the sampler gives a window under a budget
            needed = _count_groups(sorted((lengths[i] for i in samples), reverse=True), cap)
            count = max(count, math.ceil(needed / world))
        padded = regroup_window(
            samples, lengths, num_processes=world, num_micro_batches_per_rank=count, max_tokens=cap
        )
        plan = cheapest_plan(
            samples, lengths, BENCH_COST, num_processes=world, max_tokens=cap, num_padded_micro_batches_per_rank=count
        )
        assert sorted(i for rank in plan for b in rank for i in b) == sorted(samples)
        assert len({len(rank) for rank in plan}) == 1
        assert plan_cost(plan, lengths, BENCH_COST) <= plan_cost(padded, lengths, BENCH_COST)
        for rank in plan:
            for b in rank:
                sizes = [lengths[i] for i in b]
                laid_out = sum(sizes) if BENCH_COST.packs(sizes) else _padded_positions(lengths, b)
                assert laid_out <= cap


def test_a_row_that_would_be_padded_past_the_budget_is_not_planned():
    # One row of the four samples (310 tokens) fits a budget of 350, but its layout would be padded (the scores of
    # [4, 100] are less than those of [1, 310]) to 400 positions: the plan takes two micro-batches instead.
    cost = AttentionCostModel(per_score=1e-2, per_micro_batch=300.0)
    lengths = [100, 70, 70, 70]
    assert not cost.packs(lengths) and len(lengths) * max(lengths) > 350 >= sum(lengths)
    plan = cheapest_plan(range(4), lengths, cost, num_processes=1, max_tokens=350, num_padded_micro_batches_per_rank=2)
    for b in plan[0]:
        sizes = [lengths[i] for i in b]
        assert (sum(sizes) if cost.packs(sizes) else len(sizes) * max(sizes)) <= 350, plan


def test_equal_lengths_are_padded_not_packed_into_dense_rows():
    lengths = [100] * 64
    plan = cheapest_plan(
        range(64), lengths, BENCH_COST, num_processes=1, max_tokens=800, num_padded_micro_batches_per_rank=8
    )
    assert [len(b) for b in plan[0]] == [8] * 8  # the stock [8, 100] micro-batches
    assert not any(BENCH_COST.packs([lengths[i] for i in b]) for b in plan[0])


def test_without_dense_attention_the_sampler_packs_the_fewest_rows():
    lengths = log_normal_lengths(128, seed=5)
    kwargs = dict(batch_size=8, gradient_accumulation_steps=8, max_tokens_per_micro_batch=1024)
    varlen = AttentionCostModel(per_score=1.38e-3, per_micro_batch=300.0, dense=False)
    fewest = list(WindowPackBatchSampler(SequentialSampler(range(128)), lengths, **kwargs))
    assert list(WindowPackBatchSampler(SequentialSampler(range(128)), lengths, cost_model=varlen, **kwargs)) == fewest
    dense = WindowPackBatchSampler(SequentialSampler(range(128)), lengths, cost_model=BENCH_COST, **kwargs)
    assert list(dense) != fewest and len(list(dense)) == sum(dense.num_micro_batches_per_window)
    with pytest.raises(GradAccConfigError, match="`cost_model`"):
        WindowPackBatchSampler(SequentialSampler(range(128)), lengths, cost_model="dense", **kwargs)


def test_collator_pads_what_the_cost_model_prices_cheaper_padded():
    samples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}]
    model = AttentionCostModel(per_score=1.0)  # attention dominates: two samples cost less padded
    batch = PackedCollator(cost_model=model, pad_token_id=3)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    packed = PackedCollator()(samples)
    assert int(token_count(causal_targets(packed["labels"]))) == int(token_count(causal_targets(batch["labels"])))
    assert input_token_count(packed) == input_token_count(batch) == 5
    assert PackedCollator(cost_model=AttentionCostModel(per_score=0.0))(samples)["input_ids"].shape == (1, 5)


@pytest.mark.parametrize(
    ("attn", "dense"), [("sdpa", True), ("eager", True), ("flash_attention_2", False), ("flex_attention", False)]
)
def test_cost_model_of_a_model_follows_its_attention_and_size(attn, dense):
    model = build_tiny_model("causal_lm")
    model.config._attn_implementation = attn
    cost = AttentionCostModel.for_model(model)
    assert cost.dense is dense and cost.padded_layout
    assert not AttentionCostModel.for_model(model, padded_layout=False).padded_layout
    wider = build_tiny_model("causal_lm")
    wider.config._attn_implementation = attn
    wider.resize_token_embeddings(64 * model.config.vocab_size)  # a costlier position: scores weigh less
    assert AttentionCostModel.for_model(wider).per_score < cost.per_score


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_padded_micro_batch_of_the_collator_trains_exactly_like_the_packed_row(attn):
    # The exactness samples cut to at most 5 tokens: close lengths, which a dense kernel computes cheaper padded.
    samples = [{key: value[:5] for key, value in sample.items()} for sample in exactness_samples()]
    model = tiny_llama(attn, torch.float64)
    padded = PackedCollator(cost_model=AttentionCostModel(per_score=1.0))(samples)
    assert "attention_mask" in padded and padded["input_ids"].shape[0] == len(samples)
    stock = PaddingCollator(pad_token_id=0)(samples)  # the padded batch it stands for: same layout, same targets
    assert torch.equal(padded["input_ids"], stock["input_ids"])
    assert torch.equal(padded["attention_mask"], stock["attention_mask"])
    assert torch.equal(causal_targets(padded["labels"]), causal_targets(stock["labels"]))
    padded_loss, padded_grad = loss_and_grad(model, padded)
    packed_loss, packed_grad = loss_and_grad(model, PackedCollator()(samples))
    # The loss is summed in float32 (as the Hugging Face losses do), in another order: within float32 rounding
    # (measured 6e-8 on the loss, 3e-8 eager / 1e-16 sdpa on the gradient).
    assert float(padded_grad.norm()) > 0
    assert relative(padded_loss, packed_loss) <= TOL_FLOAT32 and relative(padded_grad, packed_grad) <= TOL_FLOAT32


def test_flex_attention_prices_a_packed_row_per_document():
    """Flex attention over a packed row runs on the block mask of its documents (transformers' masking_utils builds it
    from the restarting position ids): a row of eight 100-token documents costs their 8 x 100^2 scores, like the
    variable-length kernels, never the 800^2 of a dense row, so the sampler packs such rows instead of padding
    them."""
    model = build_tiny_model("causal_lm")
    model.set_attn_implementation("flex_attention")
    flex = AttentionCostModel.for_model(model)
    lengths = [100] * 8
    assert flex.packed_cost(lengths) == pytest.approx(flex.per_micro_batch + 800 + flex.per_score * 8 * 100**2)
    assert flex.packs(lengths) and flex.cost(lengths) == flex.padded_cost(lengths)  # the same positions and scores
    model.set_attn_implementation("sdpa")
    dense = AttentionCostModel.for_model(model)
    assert dense.per_score == flex.per_score  # the same model: only the score count differs
    assert dense.packed_cost(lengths) == pytest.approx(dense.per_micro_batch + 800 + dense.per_score * 800**2)
    assert not dense.packs(lengths)  # a dense row of 800 costs more than the eight rows padded
