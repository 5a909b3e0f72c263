"""The fused head's weight gradient added straight into the existing float32 ``.grad`` (hf_gradacc/fused/into_grad.py):
exact against the float64 full batch with gradient accumulation (so ``.grad`` exists from the second micro-batch on),
the in-place path actually taken there, autograd's return kept under a hook on the weight; a factor other than the one
guessed, and a DDP backward that synchronises after a ``no_sync`` forward, are corrected; a fused loss never
back-propagated after its write is refused at the next forward."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from hf_gradacc import GradAccConfig, GradAccTrainer, GradAccUsageError
from hf_gradacc.fused import into_grad
from hf_gradacc.fused.head import fused_cross_entropy_sum
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import VOCAB_SIZE, build_tiny_model, make_samples

TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def fresh_stats():
    into_grad.STATS = into_grad.IntoGradStats()
    yield


def _tied() -> torch.nn.Module:
    config = tf.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                            tie_word_embeddings=True)  # fmt: skip
    return tf.LlamaForCausalLM(config)


class _HookOnHead(tf.TrainerCallback):
    """A hook of someone else's on the trained model's head weight: it must see every micro-batch's gradient."""

    def __init__(self) -> None:
        self.calls: list[torch.Size] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.get_output_embeddings().weight.register_hook(lambda g: self.calls.append(g.shape))


def _train(model: torch.nn.Module, hook: bool = False) -> tuple[float, list]:
    samples = make_samples("causal_lm", 8, seed=5, min_length=2, max_length=40, ignore_fraction=0.7)  # masked prompts
    callback = _HookOnHead()
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         fused_lm_head=True)  # fmt: skip
    kwargs = {"callbacks": [callback]} if hook else {}
    update, _ = one_step_update(GradAccTrainer, model, samples, args, trainer_kwargs=kwargs)
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    return comparison.relative_error, callback.calls


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_gradient_accumulation_is_exact_with_the_write_into_grad(name):
    torch.manual_seed(0)
    model = build_tiny_model("causal_lm") if name == "llama" else _tied()
    error, _ = _train(model)
    assert error <= TOLERANCE, error
    # GA 4: micro-batch 1 makes .grad (autograd), 2..4 add into it; one denominator per window: no correction
    assert into_grad.STATS.written == 3 and into_grad.STATS.exact == 3 and into_grad.STATS.corrected == 0, (
        into_grad.STATS
    )
    assert into_grad.STATS.refused == {"no .grad yet": 1}, into_grad.STATS


def test_a_hook_on_the_weight_keeps_autograds_return():
    torch.manual_seed(0)
    model = build_tiny_model("causal_lm")
    error, calls = _train(model, hook=True)
    assert error <= TOLERANCE, error
    assert into_grad.STATS.written == 0 and into_grad.STATS.refused.get("a hook on the weight") == 3, into_grad.STATS
    assert len(calls) == 4  # the hook saw every micro-batch's gradient of the weight


def _head_case(seed: int = 0, rows: int = 40, hidden: int = 16, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    hidden_rows = torch.randn(rows, hidden, generator=g, dtype=torch.float64).float()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::3] = -100
    return hidden_rows, targets


def _accumulate(head: torch.nn.Linear, factors: list[float], into: bool, wrapper=None, sync_at=None) -> torch.Tensor:
    head.weight.grad = None
    for i, factor in enumerate(factors):
        hidden_rows, targets = _head_case(seed=i)
        loss = fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16, into_grad=into,
                                       wrapper=wrapper) * factor  # fmt: skip
        if sync_at == i:  # a forward under no_sync whose backward synchronises (accelerate's trigger_sync_in_backward)
            wrapper.require_backward_grad_sync = True
            wrapper.reducer.prepare_for_backward([])
        loss.backward()
        if wrapper is not None:
            wrapper.require_backward_grad_sync = False
    return head.weight.grad.clone()


def test_a_factor_other_than_the_guess_is_corrected():
    """Each micro-batch with its own factor (the guess is the previous one's): corrected, as autograd's sum."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    factors = [0.25, 0.5, 0.5, 3.0]
    expected = _accumulate(head, factors, into=False)
    got = _accumulate(head, factors, into=True)
    assert float((got - expected).norm() / expected.norm()) <= 1e-6
    assert into_grad.STATS.written == 3 and into_grad.STATS.corrected == 2 and into_grad.STATS.exact == 1


def test_a_fused_loss_never_back_propagated_after_its_write_is_refused():
    head = torch.nn.Linear(16, 300, bias=False)
    hidden_rows, targets = _head_case()
    fused_cross_entropy_sum(hidden_rows, head.forward, targets).backward()
    loss = fused_cross_entropy_sum(hidden_rows, head.forward, targets)  # written into .grad, then dropped
    assert into_grad.STATS.written == 1
    del loss
    with pytest.raises(GradAccUsageError, match="never back-propagated"):
        fused_cross_entropy_sum(hidden_rows, head.forward, targets)
    head.zero_grad()  # the contribution is gone with the gradient: going on is fine
    fused_cross_entropy_sum(hidden_rows, head.forward, targets).backward()


def test_ddp_writes_only_inside_no_sync_and_corrects_a_synchronising_backward(tmp_path):
    """DDP (one gloo rank): the micro-batches inside ``no_sync`` write into .grad; the synchronising one, and a
    ``no_sync`` forward whose backward synchronises after all, hand the gradient to autograd (DDP's reducer needs its
    AccumulateGrad hook: without it the next synchronised forward fails)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        head = torch.nn.Linear(16, 300, bias=False)
        factors = [0.5, 0.5, 0.5, 0.5]
        expected = _accumulate(head, factors, into=False)
        ddp = torch.nn.parallel.DistributedDataParallel(head)
        with ddp.no_sync():
            got = _accumulate(head, factors, into=True, wrapper=ddp, sync_at=3)
        assert float((got - expected).norm() / expected.norm()) <= 1e-6
        assert into_grad.STATS.written == 3 and into_grad.STATS.corrected == 1, into_grad.STATS
        hidden_rows, targets = _head_case()
        # synchronising: refused in the forward pass; the reducer got every gradient so far (no error here)
        fused_cross_entropy_sum(hidden_rows, head.forward, targets, wrapper=ddp).backward()
        assert into_grad.STATS.refused.get("the synchronising DDP backward") == 1, into_grad.STATS
        ddp(hidden_rows).sum().backward()  # a synchronised forward after a synchronised backward: the reducer is done
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------- the first micro-batch's buffer, kept from window to window
def _windows(head: torch.nn.Linear, windows: int, keep: bool, hold: list | None = None) -> list[torch.Tensor]:
    """``windows`` windows of GA 2 through the fused head (.grad dropped after each, as `zero_grad(set_to_none=True)`
    does); each window's gradient, cloned. ``hold`` keeps each window's ``.grad`` itself (as a user's callback may)."""
    got = []
    context = into_grad.keeping_buffers() if keep else contextlib.nullcontext()
    with context:
        for w in range(windows):
            for i in range(2):
                hidden_rows, targets = _head_case(seed=10 * w + i)
                (fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16) * 0.25).backward()
            got.append(head.weight.grad.clone())
            if hold is not None:
                hold.append(head.weight.grad)
            head.weight.grad = None
    return got


def test_the_next_windows_first_micro_batch_writes_into_the_kept_buffer():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    expected = _windows(head, 3, keep=False)
    assert into_grad.STATS.reused == 0
    pointers = []
    with into_grad.keeping_buffers():
        for w in range(3):
            for i in range(2):
                hidden_rows, targets = _head_case(seed=10 * w + i)
                (fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16) * 0.25).backward()
            pointers.append(head.weight.grad.data_ptr())
            assert torch.equal(head.weight.grad, expected[w]), w  # overwritten, not added to: the same bits
            head.weight.grad = None
    assert into_grad.STATS.reused == 2 and len(set(pointers)) == 1, (into_grad.STATS, pointers)
    assert not into_grad._KEPT  # let go on leaving the outermost context


def test_a_gradient_someone_kept_is_never_overwritten():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    held: list[torch.Tensor] = []
    got = _windows(head, 3, keep=True, hold=held)
    assert into_grad.STATS.reused == 0, into_grad.STATS
    for window, (kept, value) in enumerate(zip(held, got)):
        assert torch.equal(kept, value), window


def test_a_hook_on_the_weight_keeps_no_buffer():
    """The hook's tensor becomes ``.grad``, so the tiles' buffer would be a second [vocabulary x hidden] held for
    nothing: not kept, checked while the buffers are being kept (leaving the context lets every buffer go anyway)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    head.weight.register_hook(lambda g: g * 1.0)  # autograd's .grad is the hook's tensor, not the tiles' buffer
    with into_grad.keeping_buffers():
        for w in range(2):
            for i in range(2):
                hidden_rows, targets = _head_case(seed=10 * w + i)
                (fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16) * 0.25).backward()
                assert head.weight not in into_grad._KEPT, (w, i)
            head.weight.grad = None
    assert into_grad.STATS.reused == 0 and not into_grad._KEPT, into_grad.STATS


def test_a_replaced_grad_lets_the_kept_buffer_go():
    """``.grad`` replaced by another tensor before the next window (as a user's code may): the kept buffer is nobody's
    gradient any more and is let go at the next fused forward, not held until training ends."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    with into_grad.keeping_buffers():
        hidden_rows, targets = _head_case(seed=0)
        fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16).backward()
        assert head.weight in into_grad._KEPT  # the first micro-batch's buffer, kept (it is .grad now)
        head.weight.grad = torch.zeros_like(head.weight)  # replaced, not dropped
        hidden_rows, targets = _head_case(seed=1)
        fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16).backward()
        assert head.weight not in into_grad._KEPT
    assert into_grad.STATS.written == 1, into_grad.STATS  # the second micro-batch wrote into the new .grad


def test_a_window_whose_first_micro_batch_counts_no_target_starts_from_zero():
    """Window 2's first micro-batch counts no target (no row reaches the head): its weight gradient is a zero, written
    into the buffer kept from window 1, which must then be zeroed, not left holding window 1's gradient."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)

    def windows(keep: bool) -> list[torch.Tensor]:
        got = []
        with into_grad.keeping_buffers() if keep else contextlib.nullcontext():
            for w in range(2):
                for i in range(2):
                    hidden_rows, targets = _head_case(seed=10 * w + i)
                    if w == 1 and i == 0:
                        hidden_rows, targets = hidden_rows[:0], targets[:0]  # the counted rows of a prompt-only batch
                    (fused_cross_entropy_sum(hidden_rows, head.forward, targets, tile_rows=16) * 0.25).backward()
                got.append(head.weight.grad.clone())
                head.weight.grad = None
        return got

    expected = windows(keep=False)
    got = windows(keep=True)
    assert into_grad.STATS.reused == 1, into_grad.STATS  # window 2's empty first micro-batch used the kept buffer
    for w in range(2):
        error = float((got[w] - expected[w]).norm() / expected[w].norm())
        assert error <= 1e-6, (w, error)


def test_a_trainer_window_whose_first_micro_batch_counts_no_target_is_exact():
    """The same in an ordinary GradAccTrainer run (GA 2, two optimizer steps, sequential order): step 2's first
    micro-batch is two prompt-only rows; the fused head's updates equal the full logits'."""
    torch.manual_seed(0)
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 8, seed=5, min_length=4, max_length=30, ignore_fraction=0.5)
    for sample in samples:  # every row has a counted target (its last label)
        sample["labels"][-1] = sample["input_ids"][-1]
    for sample in samples[4:6]:  # step 2's first micro-batch: prompt only
        sample["labels"] = [-100] * len(sample["labels"])
    updates = {}
    for fused in (True, False):
        args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                             fused_lm_head=fused, max_steps=2, learning_rate=0.1,
                             train_sampling_strategy="sequential")  # fmt: skip
        into_grad.STATS = into_grad.IntoGradStats()
        updates[fused], _ = one_step_update(GradAccTrainer, model, samples, args)
        if fused:
            assert into_grad.STATS.reused == 1, into_grad.STATS
    for name, full in updates[False].items():
        error = float((updates[True][name] - full).norm() / full.norm().clamp_min(1e-30))
        assert error <= 1e-5, (name, error)


class _Reuses(tf.TrainerCallback):
    def __init__(self) -> None:
        self.reused: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.reused.append(into_grad.STATS.reused)


@pytest.mark.parametrize("between", ["nothing", "evaluate", "save"])
def test_the_trainer_reuses_the_buffer_and_lets_it_go_for_evaluation_and_saves(between):
    """GA 2 x 3 optimizer steps: windows 2 and 3 reuse window 1's buffer (updates as the full logits' within float32
    rounding); an evaluation or a checkpoint save between steps lets the buffer go, so the window after it makes a
    new one."""
    torch.manual_seed(0)
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 12, seed=5, min_length=2, max_length=40, ignore_fraction=0.5)
    evaluate = between == "evaluate"
    extra = {
        "nothing": {},
        "evaluate": dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2),
        "save": dict(save_strategy="steps", save_steps=1),
    }[between]
    updates = {}
    for fused in (True, False):
        callback = _Reuses()
        args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                             fused_lm_head=fused, max_steps=3, learning_rate=0.1, **extra)  # fmt: skip
        into_grad.STATS = into_grad.IntoGradStats()
        kwargs = {"callbacks": [callback], "eval_dataset": samples[:4]} if evaluate else {"callbacks": [callback]}
        updates[fused], _ = one_step_update(GradAccTrainer, model, samples, args, trainer_kwargs=kwargs)
        if fused:
            assert callback.reused == ([0, 1, 2] if between == "nothing" else [0, 0, 0]), callback.reused
        assert not into_grad._KEPT
    for name, full in updates[False].items():
        error = float((updates[True][name] - full).norm() / full.norm().clamp_min(1e-30))
        assert error <= 1e-5, (name, error)
