"""``fused_lm_head=None`` (the default) is automatic: the cost model of :mod:`hf_gradacc.fused.choice` turns the fused
head on where it is predicted faster or where the full logits would dwarf the training state, off where it loses;
where the fused head cannot run, automatic is off with one INFO line (no error, no warning); the decision is logged
once, with its numbers; when it turns the head on the update is exact and the start-up check guards it."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf

import hf_gradacc.fused.choice as fused_choice
import hf_gradacc.fused.head as fused_head
from hf_gradacc import GradAccConfig, GradAccLossError, GradAccTrainer
from hf_gradacc.fused.choice import HeadShape, choose
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

TOLERANCE = 1e-5
LARGE_VOCAB = 8192


def _args(**extra):
    return one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         **extra)  # fmt: skip


def _large_vocab_llama(**extra) -> torch.nn.Module:
    """A Llama whose head (vocabulary 8192, hidden 16) is most of the model: the full logits dwarf its state."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=LARGE_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0,
                            **extra)  # fmt: skip
    config._attn_implementation = "eager"
    return tf.LlamaForCausalLM(config)


def _large_vocab_samples(n: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(n):
        length = 40 + 17 * i % 50
        ids = torch.randint(2, LARGE_VOCAB, (length,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * (length // 2) + ids[length // 2 :]})  # completion-only
    return samples


@pytest.fixture
def info_logs(caplog: pytest.LogCaptureFixture):
    """hf_gradacc's INFO lines in ``caplog`` (its loggers follow transformers' verbosity, set at trainer setup)."""
    before = tf.logging.get_verbosity()
    tf.logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO, logger="hf_gradacc"):
            yield caplog
    finally:
        tf.logging.set_verbosity(before)


def _choice_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "fused_lm_head=None (automatic)" in r.getMessage() and r.levelno == logging.INFO
    ]


def test_the_cost_model_turns_the_head_on_for_a_large_vocabulary_and_off_for_a_tiny_one() -> None:
    """The held-out probe's shape (vocabulary 151,936, hidden 64, completion-only: half the positions counted) is on;
    equal-length rows at vocabulary 96 (every position but the last counted) are off."""
    qwen = HeadShape(counted=700, positions=1400, hidden=64, vocab=151936)
    choice = choose(qwen, state_bytes=16 * 2 * 151936 * 64)
    assert choice.enabled and choice.fused_bytes < 0.5 * choice.full_bytes, choice
    tiny = HeadShape(counted=4 * 127, positions=4 * 128, hidden=64, vocab=96)
    assert not choose(tiny, state_bytes=16 * 200_000).enabled
    assert "counted rows" in choice.message() and "x)" in choice.message()


def test_memory_alone_turns_it_on_only_within_the_time_allowance() -> None:
    """A shape where the fused head is predicted slower but the full logits are large against the state: on by
    memory while it costs at most MEMORY_TIME_ALLOWANCE times the full logits, off beyond, and off when the saving is
    small against the state."""
    shape = HeadShape(counted=2048, positions=2048, hidden=512, vocab=32000)
    full_b, fused_b = fused_choice.predict_bytes(shape)
    saved = full_b - fused_b
    assert saved > 0.5 * full_b

    def factors(fused_over_full: float) -> fused_choice.CostFactors:  # the full logits take 1 s, the fused head x
        return fused_choice.CostFactors(full_matmul=0, full_softmax=0, full_spill=0, full_call=1.0, fused_matmul=0, fused_softmax=0,
                                        fused_sweep=0, fused_buffer=0, fused_call=fused_over_full)  # fmt: skip

    state = saved / fused_choice.MEMORY_SHARE
    assert choose(shape, state_bytes=state, factors=factors(0.85)).reason == "predicted faster"
    assert choose(shape, state_bytes=state, factors=factors(1.2)).enabled
    assert not choose(shape, state_bytes=1.01 * state, factors=factors(1.2)).enabled
    assert not choose(shape, state_bytes=state, factors=factors(1.3)).enabled
    assert not choose(shape, state_bytes=10 * state, factors=factors(0.95)).enabled  # inside the speed margin


def test_every_tile_costs_one_sweep_of_the_weight_gradient() -> None:
    """The fused head's sweep term counts each row tile's pass over ``[vocabulary x hidden]``: at a fixed tile size
    (vocabulary 8192, hidden 16: 1024-row tiles) 1, 2 and 5 tiles cost 1, 2 and 5 sweeps, and that term alone can
    turn the decision from on to off."""
    only_sweep = fused_choice.CostFactors(full_matmul=0, full_softmax=0, full_spill=0, full_call=0, fused_matmul=0,
                                          fused_softmax=0, fused_sweep=1.0, fused_buffer=0, fused_call=0)  # fmt: skip
    hidden, vocab = 16, 8192
    tile = fused_choice.tile_of(1000, hidden, vocab)
    assert tile == fused_head.tile_rows_for(vocab) == 1024
    for rows, tiles in ((1000, 1), (2048, 2), (4097, 5)):
        shape = HeadShape(counted=rows, positions=rows, hidden=hidden, vocab=vocab)
        assert fused_choice.tiles_of(rows, hidden, vocab) == tiles
        _, fused = fused_choice.predict_seconds(shape, only_sweep)
        assert fused == pytest.approx(tiles * hidden * vocab), (rows, fused)
    # the full logits cost 3 sweeps' worth: one tile is faster, five are not
    three_sweeps = fused_choice.CostFactors(full_matmul=0, full_softmax=0, full_spill=0, full_call=3.0 * hidden * vocab,
                                            fused_matmul=0, fused_softmax=0, fused_sweep=1.0, fused_buffer=0,
                                            fused_call=0)  # fmt: skip
    assert choose(HeadShape(counted=1000, positions=1000, hidden=hidden, vocab=vocab), state_bytes=1e12,
                  factors=three_sweeps).enabled  # fmt: skip
    assert not choose(HeadShape(counted=4097, positions=4097, hidden=hidden, vocab=vocab), state_bytes=1e12,
                      factors=three_sweeps).enabled  # fmt: skip


class _OwnLoss(GradAccTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class _OwnStep(GradAccTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("sequence_classification", "the fused LM head supports"),
        ("own_compute_loss", "computes its loss itself"),
        ("own_training_step", "overrides `training_step`"),
        ("defer_normalization", "defer_normalization"),
        ("no_start_up_check", "check_loss_at_start=False"),
    ],
)
def test_automatic_is_off_quietly_where_the_fused_head_cannot_run(
    case: str, why: str, info_logs: pytest.LogCaptureFixture
) -> None:
    """Each setup ``fused_lm_head=True`` refuses or warns about: the default builds and trains, with one INFO line
    naming the reason and no warning or error."""
    task = "sequence_classification" if case == "sequence_classification" else "causal_lm"
    trainer_class = {"own_compute_loss": _OwnLoss, "own_training_step": _OwnStep}.get(case, GradAccTrainer)
    extra = {"defer_normalization": {"defer_normalization": True},
             "no_start_up_check": {"check_loss_at_start": False}}.get(case, {})  # fmt: skip
    one_step_update(trainer_class, build_tiny_model(task), make_samples(task, 8, seed=3), _args(**extra))
    lines = _choice_lines(info_logs)
    assert len(lines) == 1 and ": off, " in lines[0] and why in lines[0], lines
    warned = [r.getMessage() for r in info_logs.records if r.levelno >= logging.WARNING and "fused" in r.getMessage()]
    assert warned == []


def test_true_still_refuses_what_automatic_turns_off() -> None:
    from hf_gradacc import GradAccConfigError

    with pytest.raises(GradAccConfigError, match=r"fused_lm_head=True.*'sequence_classification'"):
        GradAccTrainer(model=build_tiny_model("sequence_classification"), args=_args(fused_lm_head=True),
                       train_dataset=ListDataset(make_samples("sequence_classification", 4)),
                       data_collator=PaddingCollator())  # fmt: skip


def test_automatic_turns_it_on_for_a_large_vocabulary_exactly_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, info_logs: pytest.LogCaptureFixture
) -> None:
    """Completion-only rows at vocabulary 8192: the default runs the fused head (the head projected only counted
    rows), the update is exact against the float64 reference, and the decision is one INFO line with its numbers."""
    model, samples = _large_vocab_llama(), _large_vocab_samples()
    projected: list[int] = []
    original = fused_head.fused_cross_entropy_sum
    monkeypatch.setattr(fused_head, "fused_cross_entropy_sum",
                        lambda hidden, *a, **k: projected.append(hidden.shape[0]) or original(hidden, *a, **k))  # fmt: skip
    update, trainer = one_step_update(GradAccTrainer, model, samples, _args())
    assert trainer.step_engine.fused.choice.enabled and trainer.step_engine.fused_head_ran
    counted = sum(len(s["labels"]) - len(s["labels"]) // 2 for s in samples)
    assert len(projected) == 5, projected  # 4 micro-batches, and the start-up check's row after the first
    assert sum(projected) - projected[1] == counted, projected
    lines = _choice_lines(info_logs)
    assert len(lines) == 1 and ": on, " in lines[0] and f"vocabulary {LARGE_VOCAB}" in lines[0], lines
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison


def test_false_keeps_the_full_logits_where_automatic_would_fuse() -> None:
    _, trainer = one_step_update(GradAccTrainer, _large_vocab_llama(), _large_vocab_samples(), _args(fused_lm_head=False))
    assert not trainer.step_engine.fused_head_ran


def test_automatic_keeps_the_full_logits_at_a_tiny_vocabulary() -> None:
    samples = make_samples("causal_lm", 8, seed=3, ignore_fraction=0.0)
    _, trainer = one_step_update(GradAccTrainer, build_tiny_model("causal_lm"), samples, _args())
    assert not trainer.step_engine.fused.choice.enabled and not trainer.step_engine.fused_head_ran


def test_the_start_up_check_guards_what_automatic_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A logit transform the fused head misses (a softcap forgotten) stops the first step when automatic fused it."""
    monkeypatch.setattr(fused_head.LogitTransform, "of", classmethod(lambda cls, model: cls(scale=0.5)))
    with pytest.raises(GradAccLossError, match=r"fused_lm_head"):
        one_step_update(GradAccTrainer, _large_vocab_llama(), _large_vocab_samples(), _args())
