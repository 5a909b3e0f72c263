"""Context parallelism (accelerate ``cp_size`` > 1) on a mesh simulated in ONE process.

torch 2.13 cannot shard attention on CPU, so the ``cp`` ranks are simulated: one GradAccTrainer per ``cp`` rank, in
threads of this process, each running its micro-batches through the Trainer's real context-parallel entry
(``Trainer._prepare_context_parallel_inputs``) into a stand-in for accelerate's ``maybe_context_parallel`` that does
what torch's ``context_parallel`` does to the buffers (torch's own head-tail load balancer, the buffers cut in place)
and to attention (the model sees the whole sequence with plain causal attention, the mask dropped as accelerate's
hook drops it, and returns this rank's positions only: ring attention's result). The step's one count collective
is an exchange between the threads, and FSDP2's average over ``dp_shard_cp`` the mean of the ranks' updates.

Exactness against hf_gradacc/testing/reference.py (float64, full batch, the padding mask, no code shared with the
trainer): relative gradient error <= 1e-5 in float32, mixed lengths, heavy padding, masked prompts.
The end-to-end run on CUDA ranks is tests/gpu/test_context_parallel.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_callback import TrainerState

from hf_gradacc import GradAccConfig, GradAccTrainer, LossTerm
from hf_gradacc.backends.context_parallel import (
    ContextParallel,
    check_micro_batch,
    check_sequence_parallel_shard,
    context_parallel_for,
)
from hf_gradacc.backends.mesh import Mesh
from hf_gradacc.backends.sharded_model import check_context_parallel
from hf_gradacc.checkpoints import DATA_NAME, POSITION_KEY, check_data_layout
from hf_gradacc.counting import Counter, count_micro_batch
from hf_gradacc.errors import GradAccConfigError, GradAccDataError, GradAccLossError, UnsupportedBackendError
from hf_gradacc.fused.choice import FusedPolicy
from hf_gradacc.heads import Head
from hf_gradacc.step.engine import LossSource
from hf_gradacc.step.window import Window
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare, float64_copy, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

# torch's head-tail load balancer (absent from torch 2.6's `_context_parallel`): a torch without it skips the file.
_create_default_load_balancer = pytest.importorskip(
    "torch.distributed.tensor.experimental._context_parallel._load_balancer",
    reason="this torch has no `torch.distributed.tensor.experimental._context_parallel._load_balancer`",
)._create_default_load_balancer

TOLERANCE = 1e-5
BS, GA = 2, 3
EVAL_BS = 3


# ---------------------------------------------------------------------------------------------- what torch does
def torch_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions ``rank`` holds after torch's ``context_parallel``: the buffer gathered in the order of torch's
    default load balancer (none when the length does not split into 2 x cp chunks), then cut in ``cp`` equal pieces."""
    balancer = _create_default_load_balancer(seq_len, cp, "cpu")
    order = balancer._generate_indices()[0].long() if balancer is not None else torch.arange(seq_len)
    return order.view(cp, -1)[rank]


@contextlib.contextmanager
def simulated_context_parallel(model, cp, rank, buffers, buffer_seq_dims, no_restore_buffers=None):
    """accelerate's ``maybe_context_parallel`` on one simulated rank: the buffers cut in place as torch cuts them
    (position ids are the Trainer's last buffer, input ids its first); attention over the whole sequence, causal,
    without the mask (accelerate's hook), and only this rank's positions out, the model's own loss on them."""
    assert all(d == 1 for d in buffer_seq_dims)
    mine = torch_positions(buffers[0].shape[1], cp, rank)
    full_ids, full_positions = buffers[0].clone(), buffers[-1].clone()
    for buffer in buffers:
        shard = buffer.index_select(1, mine).clone()
        buffer.resize_(shard.shape)
        buffer.copy_(shard)
    stash = {}

    def whole_sequence(_module, args, kwargs):
        stash.clear()
        stash.update({k: kwargs.pop(k) for k in ("labels", "shift_labels") if kwargs.get(k) is not None})
        return args, {**kwargs, "input_ids": full_ids, "position_ids": full_positions, "attention_mask": None}

    def this_ranks_positions(module, _args, output):
        output.logits = output.logits.index_select(1, mine)
        if stash:  # the model's own loss, as on the GPU: from this rank's logits and targets
            output.loss = ForCausalLMLoss(output.logits, stash.get("labels"), module.config.vocab_size,
                                          shift_labels=stash.get("shift_labels"))  # fmt: skip
        return output

    hooks = [model.register_forward_pre_hook(whole_sequence, with_kwargs=True),
             model.register_forward_hook(this_ranks_positions)]  # fmt: skip
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class Exchange:
    """The count collective between the simulated ranks (threads): every rank's tensor, stacked in rank order."""

    def __init__(self, size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=300)

    def all_gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        out = torch.stack([s.to(tensor.device) for s in self.slots])
        self.barrier.wait()
        return out


class _Counts(TrainerCallback):
    def __init__(self) -> None:
        self.windows = []

    def on_window_counted(self, args, state, control, window=None, **kwargs):
        self.windows.append((window.global_count("tokens"), window.counts.global_samples,
                             [mb.num_tokens for mb in window.counts.micro_batches]))  # fmt: skip


def cp_for(trainer, **kwargs) -> ContextParallel:
    """:func:`context_parallel_for` with ``trainer``'s values, as GradAccMixin calls it at construction."""
    cp, _ = context_parallel_for(
        accelerator=trainer.accelerator, settings=trainer.gradacc, head=trainer.head, model=trainer.model,
        source=trainer.step_engine.source, trainer_class=type(trainer), **kwargs,
    )
    return cp


def simulate_rank(trainer, cp: int, rank: int, exchange: Exchange, *, cp_object=None) -> None:
    """Put ``trainer`` on simulated ``cp`` rank ``rank``: its ContextParallel, the Trainer's real entry with a
    context-parallel accelerator stand-in, the exchange as its count collective, FSDP2's average over ``cp`` ranks
    (the mesh's ``dp_world_size``) and no DDP sync (one process)."""
    engine = trainer.step_engine
    assert engine.cp.size == 1  # a one-process trainer: no context parallelism until simulated
    assert cp_for(trainer, size=cp, rank=rank).size == cp  # the construction-time checks and settings
    engine.fused = FusedPolicy.at_construction(  # the construction-time fused-head decision under cp: automatic is off
        settings=trainer.gradacc, head=trainer.head, backend=trainer.backend, model=trainer.model,
        source=engine.source, args=trainer.args, trainer_name=type(trainer).__name__, cp_size=cp,
    )
    assert not engine.fused.enabled
    engine.cp = engine.counter.cp = cp_object or ContextParallel(size=cp, rank=rank)
    stand_in = SimpleNamespace(
        _attn_mask_causal_checked=False,
        accelerator=SimpleNamespace(
            parallelism_config=SimpleNamespace(cp_enabled=True, cp_backend="torch", cp_size=cp),
            maybe_context_parallel=lambda **kw: simulated_context_parallel(trainer.model, cp, rank, **kw),
        ),
    )
    trainer._prepare_context_parallel_inputs = lambda model, inputs: Trainer._prepare_context_parallel_inputs(
        stand_in, model, inputs
    )
    backend_class = type(trainer.backend)

    class SimulatedFSDP2(backend_class):
        mesh = property(lambda self: Mesh.of({"cp": cp}))  # FSDP2 averages over dp_shard_cp: the cp ranks here

        def sync_context(self, *, is_last):
            return contextlib.nullcontext()

        def all_gather(self, tensor):
            return exchange.all_gather(rank, tensor)

    trainer.backend.__class__ = SimulatedFSDP2


def simulated_trainers(
    model, samples, cp: int, *, cp_class=ContextParallel, collators=None, trainer_class=GradAccTrainer, **gradacc_args
):
    """One GradAccTrainer per simulated ``cp`` rank (``collators``: one per rank; the same padding collator by
    default), with the exchange between them as the count collective."""
    exchange, trainers = Exchange(cp), []
    for rank in range(cp):
        args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, per_device_eval_batch_size=EVAL_BS,
                             train_sampling_strategy="sequential")  # fmt: skip
        counts = _Counts()
        collator = PaddingCollator() if collators is None else collators[rank]
        trainer = trainer_class(model=copy.deepcopy(model), args=args, train_dataset=ListDataset(samples),
                                 data_collator=collator, callbacks=[counts], gradacc_args=gradacc_args)  # fmt: skip
        simulate_rank(trainer, cp, rank, exchange, cp_object=cp_class(size=cp, rank=rank))
        trainers.append((trainer, counts))
    return trainers, exchange


def on_every_rank(trainers, exchange, work) -> list:
    """``work(trainer, counts)`` on every simulated rank, in threads; each rank's result, or each rank's error."""
    results, errors = [None] * len(trainers), [None] * len(trainers)

    def run(rank):
        try:
            results[rank] = work(*trainers[rank])
        except BaseException as error:  # noqa: BLE001 - handed back to the main thread
            errors[rank] = error
            # A rank that raised unagreed leaves the others a broken barrier, not a hang; a moment later, so that a
            # rank still leaving the collective both just finished (an agreed error) is not broken on its way out.
            time.sleep(1.0)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(trainers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def cp_step(model, samples, cp: int, *, cp_class=ContextParallel, **gradacc_args):
    """One SGD(lr=1) step of GradAccTrainer on ``cp`` simulated ranks; returns the mean update (FSDP2's average) and
    each rank's recorded counts."""
    trainers, exchange = simulated_trainers(model, samples, cp, cp_class=cp_class, **gradacc_args)

    def train(trainer, counts):
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        return {n: initial[n] - p.detach() for n, p in trainer.model.named_parameters()}, counts.windows

    results, errors = on_every_rank(trainers, exchange, train)
    if any(errors):
        raise next(e for e in errors if e is not None)
    mean = {n: sum(r[0][n] for r in results) / cp for n in results[0][0]}
    return mean, [r[1] for r in results]


def full_count(samples) -> int:
    collate = PaddingCollator()
    return sum(count_micro_batch(collate(samples[i : i + BS]), "causal_lm").num_tokens for i in range(0, len(samples), BS))


# ---------------------------------------------------------------------------------------------- the step
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_step_on_simulated_ranks_is_the_full_batch_step(cp):
    """Each rank counts its chunks' targets; the count summed over the cp ranks is the whole step's, every sample
    counted once; the mean of the ranks' updates (FSDP2's average) is the float64 full-batch gradient."""
    model = build_tiny_model("causal_lm")
    assert model.config._attn_implementation == "sdpa"
    samples = make_samples("causal_lm", BS * GA, seed=5)
    update, windows = cp_step(model, samples, cp)
    result = compare(update, reference_gradients(model, samples, "causal_lm", PaddingCollator()))
    assert result.relative_error <= TOLERANCE, result
    assert all(n in update and update[n].abs().sum() > 0 for n, _ in model.named_parameters())
    (global_tokens, global_samples, _), *_ = windows[0]
    assert global_tokens == full_count(samples) and global_samples == len(samples)
    assert all(w[0][:2] == (global_tokens, global_samples) for w in windows)  # every rank: the same global count
    assert len({tuple(w[0][2]) for w in windows}) > 1  # ... from different local counts: each rank its own chunks


class _CountsWholeSequence(ContextParallel):
    """Planted bug: cp dropped from the counted dimensions (each cp rank counts the whole micro-batch)."""

    def count_view(self, batch):
        view = self.pad(batch)
        return {**view, "shift_labels": torch.nn.functional.pad(view["labels"], (0, 1), value=-100)[:, 1:]}


class _ShiftsInsideTheShard(ContextParallel):
    """Planted bug: each rank shifts its own chunks (a chunk's last position counted with the next chunk's first
    label, the target that lives on another rank lost)."""

    def count_view(self, batch):
        view = super().count_view(batch)
        return {k: v for k, v in view.items() if k != "shift_labels"}


@pytest.mark.parametrize(("bug", "low", "high"), [(_CountsWholeSequence, 0.49, 0.51), (_ShiftsInsideTheShard, 1.01, 1.5)])
def test_cp_step_fails_with_the_planted_count_bugs(bug, low, high):
    """Each planted bug moves the update off the reference (the start-up loss check, which would stop the first one
    at once, is off here to see the gradient)."""
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", BS * GA, seed=5)
    update, windows = cp_step(model, samples, 2, cp_class=bug, check_loss_at_start=False)
    result = compare(update, reference_gradients(model, samples, "causal_lm", PaddingCollator()))
    assert result.relative_error > 1e-2
    assert low <= result.norm_ratio <= high
    # the whole sequence counted on both ranks: half the gradient; targets lost at the chunk edges: too large
    assert windows[0][0][0] != full_count(samples)


def test_start_up_check_stops_a_whole_sequence_count_on_a_shard():
    model = build_tiny_model("causal_lm")
    with pytest.raises(GradAccLossError, match="differs from the model's own loss"):
        cp_step(model, make_samples("causal_lm", BS * GA, seed=5), 2, cp_class=_CountsWholeSequence)


# ---------------------------------------------------------------------------------------------- the count view
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_count_view_is_what_the_trainer_entry_and_torch_give_each_rank(cp):
    """ContextParallel.count_view (what a rank counts) equals the Trainer's entry + torch's cut (what it trains on),
    tensor for tensor; the shards' targets add up to the micro-batch's, its samples counted on cp rank 0 only."""
    for seed in range(3):
        batch = PaddingCollator()(make_samples("causal_lm", 5, seed=seed))
        whole = count_micro_batch(batch, "causal_lm")
        tokens = samples = 0
        for rank in range(cp):
            helper = ContextParallel(size=cp, rank=rank)
            view = helper.count_view(batch)
            stand_in = SimpleNamespace(_attn_mask_causal_checked=True, accelerator=SimpleNamespace(
                parallelism_config=SimpleNamespace(cp_enabled=True, cp_backend="torch"),
                maybe_context_parallel=contextlib.nullcontext))  # fmt: skip
            model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
            context, inputs = Trainer._prepare_context_parallel_inputs(stand_in, model, helper.pad(batch))
            mine = torch_positions(inputs["input_ids"].shape[1], cp, rank)
            assert inputs["input_ids"].shape[1] % (2 * cp) == 0
            assert set(view) == set(inputs)
            for key, value in inputs.items():
                torch.testing.assert_close(view[key], value.index_select(1, mine), rtol=0, atol=0, msg=key)
            counts = Counter(Head(type="causal_lm"), cp=helper).count(batch)
            tokens, samples = tokens + counts.num_tokens, samples + counts.num_samples
        assert (tokens, samples) == (whole.num_tokens, whole.num_samples)


def test_padding_to_the_chunk_multiple_changes_no_count():
    batch = PaddingCollator()(make_samples("causal_lm", 4, seed=1))
    width = batch["input_ids"].shape[1]
    padded = ContextParallel(size=4, rank=0).pad(batch)
    assert padded["input_ids"].shape[1] % 8 == 0 and padded["input_ids"].shape[1] - width < 8
    assert count_micro_batch(padded, "causal_lm").num_tokens == count_micro_batch(batch, "causal_lm").num_tokens
    assert padded["input_ids"] is not batch["input_ids"]  # torch cuts buffers in place: never the window's own


# ---------------------------------------------------------------------------------------------- refused by name
def test_micro_batches_cp_cannot_compute_are_refused_by_name():
    batch = PaddingCollator()(make_samples("causal_lm", 3, seed=2))
    check_micro_batch(batch)
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    with pytest.raises(GradAccDataError, match="padding_side"):
        check_micro_batch(left)
    width = batch["input_ids"].shape[1]
    four_d = batch["attention_mask"][:, None, None, :].expand(-1, 1, width, -1).tril()
    with pytest.raises(GradAccDataError, match="2-D padding mask"):  # the entry would keep it whole
        check_micro_batch({**batch, "attention_mask": four_d})
    packed = {**batch, "position_ids": torch.arange(width).remainder(5).expand(3, -1)}
    with pytest.raises(GradAccDataError, match="packed"):
        check_micro_batch(packed)
    with pytest.raises(GradAccDataError, match="token_type_ids"):
        check_micro_batch({**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])})


def test_sequence_classification_cannot_be_sharded():
    """What CP does to a sequence-level head: its label is one per row, not per position: torch's cut of the
    Trainer's buffers fails on it (and the pooled position would live on one shard). Refused by name instead."""
    batch = PaddingCollator()(make_samples("sequence_classification", 4, seed=1))
    batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, -batch["input_ids"].shape[1] % 4))
    stand_in = SimpleNamespace(_attn_mask_causal_checked=True, accelerator=SimpleNamespace(
        parallelism_config=SimpleNamespace(cp_enabled=True, cp_backend="torch"),
        maybe_context_parallel=contextlib.nullcontext))  # fmt: skip
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    with pytest.raises(IndexError):  # the stock entry shifts the per-row labels as if they were per position
        Trainer._prepare_context_parallel_inputs(stand_in, model, dict(batch))
    with pytest.raises(GradAccConfigError, match="sequence_classification"):
        context_parallel_for(**_fake_trainer(head_type="sequence_classification"))


class _Mesh(dict):
    """A device mesh stand-in: ``mesh["cp"]`` and the global ranks laid out by dimension."""


def _fake_trainer(**changes):
    settings = dict(head_type="causal_lm", attn="sdpa", fused_lm_head=False, pack_micro_batches=False,
                    custom_step=False, router=False)  # fmt: skip
    settings.update(changes)
    config = SimpleNamespace(_attn_implementation=settings["attn"], output_router_logits=settings["router"])
    mesh = _Mesh(cp=SimpleNamespace(get_local_rank=lambda: 1, mesh=torch.tensor([4, 5])))  # cp ranks 4 and 5 of 8
    mesh.mesh, mesh.mesh_dim_names = torch.arange(8).reshape(2, 2, 2), ("dp_replicate", "dp_shard", "cp")
    return dict(
        accelerator=SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=2), torch_device_mesh=mesh),
        trainer_class=type("Entry", (), {"_prepare_context_parallel_inputs": None}),
        settings=SimpleNamespace(fused_lm_head=settings["fused_lm_head"], pack_micro_batches=settings["pack_micro_batches"]),
        head=SimpleNamespace(type=settings["head_type"], ignore_index=-100),
        model=SimpleNamespace(config=config),
        source=LossSource(custom_training_step=settings["custom_step"]),
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"head_type": "masked_lm"}, "masked_lm"),
        ({"attn": "eager"}, "sdpa"),
        ({"fused_lm_head": True}, "fused_lm_head"),
        ({"pack_micro_batches": True}, "pack_micro_batches"),
        ({"custom_step": True}, "training_step"),
        ({"router": True}, "output_router_logits"),
    ],
)
def test_settings_cp_cannot_hold_are_refused_at_construction(change, match):
    with pytest.raises(GradAccConfigError, match=match):
        context_parallel_for(**_fake_trainer(**change))


def test_a_causal_lm_gets_its_rank_in_the_cp_group():
    cp, gather_function = context_parallel_for(**_fake_trainer())
    assert (cp.size, cp.rank, cp.multiple, cp.group_ranks) == (2, 1, 4, (4, 5))
    assert gather_function.args[1] == (0, 2, 4, 6)  # evaluation gathers every cp group's rank 0 only


def test_backend_check_admits_cp_under_fsdp2_only():
    from accelerate.utils import DistributedType

    fsdp = DistributedType.FSDP
    check_context_parallel(SimpleNamespace(cp_size=2, tp_size=1, sp_size=1, cp_backend="torch"), distributed_type=fsdp)
    check_context_parallel(SimpleNamespace(cp_size=2, dp_shard_size=2), distributed_type=fsdp)
    for config, dist_type, match in (
        (SimpleNamespace(cp_size=2), DistributedType.MULTI_GPU, "FSDP2 only"),
        (SimpleNamespace(cp_size=2), DistributedType.DEEPSPEED, "FSDP2 only"),
        (SimpleNamespace(cp_size=2, tp_size=2), fsdp, "tp_size"),
    ):
        with pytest.raises(UnsupportedBackendError, match=match):
            check_context_parallel(config, distributed_type=dist_type)


# ---------------------------------------------------------------------------------------------- evaluation
def eval_reference(model, samples) -> float:
    """``eval_loss`` as the evaluation loop forms it, written out in float64: each batch's mean over its counted
    targets (hf_gradacc/testing/reference.py's full-batch loss), weighted by the batch's rows."""
    reference, collate = float64_copy(model), PaddingCollator()
    batches = [samples[i : i + EVAL_BS] for i in range(0, len(samples), EVAL_BS)]
    with torch.no_grad():
        means = [float(full_batch_loss(reference, collate(b), "causal_lm")) for b in batches]
    return sum(m * len(b) for m, b in zip(means, batches, strict=True)) / len(samples)


def peaked_model():
    """The tiny causal LM with a sharp output layer: per-token losses far apart (an untrained one gives every token
    about log(vocabulary), where any mean looks right)."""
    model = build_tiny_model("causal_lm")
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_eval_loss_is_the_unsharded_eval_loss(cp):
    """Under cp every rank's ``eval_loss`` is the unsharded run's: each batch's loss summed and counted over the cp
    ranks' chunks (a shard mean would weigh a shard's few targets like another's many; a shard without a target
    would be NaN and dropped). Mixed lengths, heavy padding, masked prompts, widths that are no multiple of 2 x cp
    (padded as in training). (Whole batches only: the simulated ranks are threads sharing accelerate's GradientState,
    whose end-of-data flag would truncate one rank's gathered losses at another rank's last batch.)"""
    model = peaked_model()
    samples = make_samples("causal_lm", 4 * EVAL_BS, seed=7)
    whole = GradAccTrainer(model=copy.deepcopy(model), args=one_step_args(per_device_train_batch_size=BS,
                           gradient_accumulation_steps=GA, per_device_eval_batch_size=EVAL_BS),
                           data_collator=PaddingCollator())  # fmt: skip
    unsharded = whole.evaluate(ListDataset(samples))["eval_loss"]
    assert unsharded == pytest.approx(eval_reference(model, samples), rel=1e-5)
    trainers, exchange = simulated_trainers(model, samples, cp)
    results, errors = on_every_rank(trainers, exchange, lambda t, _c: t.evaluate(ListDataset(samples))["eval_loss"])
    assert not any(errors), errors
    assert results == pytest.approx([unsharded] * cp, rel=1e-6), (results, unsharded)


class _TermLoss(GradAccTrainer):
    """An overridden ``compute_loss`` returning a LossTerm, taking its targets from ``shift_labels`` as cp asks."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels, shift_labels = inputs.pop("labels"), inputs.pop("shift_labels", None)
        outputs = model(**inputs)
        term = LossTerm(total=self.sum_loss_from_logits(outputs.logits, labels, shift_labels), normalize_by="tokens")
        return (term, outputs) if return_outputs else term


def test_cp_eval_loss_of_an_overridden_compute_loss_is_the_unsharded_one():
    model = peaked_model()
    samples = make_samples("causal_lm", 4 * EVAL_BS, seed=7)
    trainers, exchange = simulated_trainers(model, samples, 2, trainer_class=_TermLoss)
    results, errors = on_every_rank(trainers, exchange, lambda t, _c: t.evaluate(ListDataset(samples))["eval_loss"])
    assert not any(errors), errors
    assert results == pytest.approx([eval_reference(model, samples)] * 2, rel=1e-5)


class _ShardMean(ContextParallel):
    """Planted bug: each rank's eval loss is its own chunks' mean (what the evaluation loop got before)."""

    def batch_mean(self, trainer, terms, counts, denominator):
        return ContextParallel(size=1, rank=0).batch_mean(trainer, terms, counts, denominator)


def test_cp_eval_loss_fails_with_shard_means():
    model = peaked_model()
    samples = make_samples("causal_lm", 4 * EVAL_BS, seed=7)
    reference = eval_reference(model, samples)
    trainers, exchange = simulated_trainers(model, samples, 2, cp_class=_ShardMean)
    results, errors = on_every_rank(trainers, exchange, lambda t, _c: t.evaluate(ListDataset(samples))["eval_loss"])
    assert not any(errors), errors
    assert all(abs(r / reference - 1) > 1e-3 for r in results), (results, reference)  # exact: 1e-6


def test_cp_eval_batch_mean_adds_up_its_own_cp_group_only():
    """dp 2 x cp 2 (4 ranks, two cp groups, each evaluating its own batch; the collective runs over every rank): each
    rank's ``batch_mean`` is its OWN batch's mean over whole sequences (the float64 unsharded loss), from its group's
    rows only. Summing every rank's rows would give both groups the mean over both batches."""
    from hf_gradacc.backends.context_parallel import context_parallel_indices
    from hf_gradacc.builtin_loss import MAIN_TERM

    model = peaked_model()
    batches = [PaddingCollator()(make_samples("causal_lm", EVAL_BS, seed=s)) for s in (7, 8)]  # data ranks 0, 1
    with torch.no_grad():
        references = [float(full_batch_loss(float64_copy(model), b, "causal_lm")) for b in batches]
    assert abs(references[0] / references[1] - 1) > 1e-2, references  # a mix of the two is far from either
    head, exchange, results = Head(type="causal_lm"), Exchange(4), [None] * 4

    def rank(r):
        group, cp_rank = divmod(r, 2)  # accelerate's mesh: the cp ranks of a data rank are neighbours
        cp = ContextParallel(size=2, rank=cp_rank, group_ranks=(2 * group, 2 * group + 1))
        padded = cp.pad(batches[group])
        view = cp.count_view(batches[group])
        index = context_parallel_indices(padded["input_ids"].shape[1], 2, cp_rank)
        with torch.no_grad():  # ring attention's result: the whole sequence's logits at this rank's positions
            logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        total = head.sum_loss(logits.index_select(1, index), view["labels"], view["shift_labels"])
        terms = {MAIN_TERM: LossTerm(total=total, normalize_by="tokens")}
        counts = Counter(head).count_batch(view)
        results[r] = float(cp.batch_mean(terms, counts, "tokens", lambda t: exchange.all_gather(r, t)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = [references[0], references[0], references[1], references[1]]
    assert results == pytest.approx(expected, rel=1e-5), (results, expected)


def test_cp_eval_with_logits_is_refused_by_name():
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 4, seed=7)
    trainers, exchange = simulated_trainers(model, samples, 2)
    _, errors = on_every_rank(trainers, exchange, lambda t, _c: t.predict(ListDataset(samples)))
    assert all(isinstance(e, GradAccConfigError) and "compute_metrics" in str(e) for e in errors), errors


# ---------------------------------------------------------------------------------------------- agreed refusals
class LeftPadding(PaddingCollator):
    """A collator that pads on the left (as a tokenizer with ``padding_side="left"``)."""

    def __call__(self, samples):
        batch = super().__call__(samples)
        pads = (batch["attention_mask"] == 0).sum(1).tolist()
        return {k: torch.stack([row.roll(n) for row, n in zip(v, pads, strict=True)]) for k, v in batch.items()}


@pytest.mark.parametrize("phase", ["train", "evaluate"])
def test_a_refused_micro_batch_on_one_rank_stops_every_rank(phase):
    """Rank 1 alone gets left-padded batches: every rank raises GradAccDataError (rank 1 its own, the others one
    naming rank 1) from the same collective, before any forward, none waiting in a later collective (that would
    show here as a broken barrier)."""
    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", BS * GA, seed=5)
    trainers, exchange = simulated_trainers(model, samples, 2, collators=[PaddingCollator(), LeftPadding()])
    run = (lambda t, _c: t.train()) if phase == "train" else (lambda t, _c: t.evaluate(ListDataset(samples)))
    _, errors = on_every_rank(trainers, exchange, run)
    assert isinstance(errors[1], GradAccDataError) and "padding_side" in str(errors[1]), errors
    assert isinstance(errors[0], GradAccDataError) and "Rank(s) [1]" in str(errors[0]), errors


# ---------------------------------------------------------------------------------------------- resume by samples
_TWO_CP_RANKS = Mesh.of({"cp": 2})


class _TwoCpRanksConfig(GradAccConfig):
    """Arguments of a world of 2 processes (this one stands for both: they are the 2 cp ranks of ONE data rank, so
    they train exactly this process's samples)."""

    world_size = property(lambda self: 2)


class _TwoCpRanksTrainer(GradAccTrainer):
    def get_cp_size(self) -> int:  # accelerate's `parallelism_config.cp_size`, as `Trainer.get_cp_size` reads it
        return 2

    def _setup_gradacc(self, gradacc_args):
        super()._setup_gradacc(gradacc_args)
        backend = type(self.backend)  # the mesh of 2 processes that are the 2 cp ranks of one data rank
        self.backend.__class__ = type(backend.__name__, (backend,), {"mesh": property(lambda _: _TWO_CP_RANKS)})


def test_a_cp_resume_by_samples_counts_the_data_ranks_not_the_processes(monkeypatch, tmp_path):
    """A run on 2 processes that are the cp ranks of one data rank records its position in samples over that ONE
    data rank (not `args.world_size`, which would record twice the samples trained), and a resume with another
    `gradient_accumulation_steps` trains every remaining sample once (it would have skipped twice the samples)."""
    from tests.distributed.workers import resume_layout_cases as cases

    monkeypatch.setattr(cases, "GradAccConfig", _TwoCpRanksConfig)
    monkeypatch.setattr(cases, "GradAccTrainer", _TwoCpRanksTrainer)
    assert _TWO_CP_RANKS.data_parallel_size == 1
    a = cases.train_run(str(tmp_path / "a"), batch=2, ga=2)  # 24 samples, 4 a step, a checkpoint after each
    with open(tmp_path / "a" / "checkpoint-2" / DATA_NAME) as f:
        assert json.load(f)["position"]["num_samples"] == 8  # 2 steps x 2 x GA 2 x 1 data rank
    b = cases.train_run(str(tmp_path / "b"), batch=2, ga=4, resume=str(tmp_path / "a" / "checkpoint-2"))
    first = [i for step, ids in a["steps"] if step < 2 for i in ids]
    rest = [i for _, ids in b["steps"] for i in ids]
    assert sorted(first + rest) == list(range(cases.NUM_SAMPLES)), (first, rest)
    assert rest == [i for step, ids in a["steps"] if step >= 2 for i in ids]  # in the checkpoint's order
    same = cases.train_run(str(tmp_path / "c"), batch=2, ga=2, resume=str(tmp_path / "a" / "checkpoint-2"))
    assert not [m for m in same["warnings"] if "had trained the first" in m], same["warnings"]  # the stock resume
    assert [ids for _, ids in same["steps"]] == [ids for step, ids in a["steps"] if step >= 2]


def test_a_change_of_cp_size_on_the_same_processes_resumes_by_samples(tmp_path):
    """cp 2 -> 1 on the same 2 processes: 1 data rank -> 2, the world size unchanged. The record names the change
    and the resume is counted in samples (the stock skip would skip twice the samples trained)."""
    layout = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "accumulation_schedule": None,
              "world_size": 2, "data_parallel_size": 1, "num_train_samples": 24, "seed": 42}  # fmt: skip
    position = {"epoch": 0, "num_samples": 8, "num_micro_batches": 4, "epoch_done": False}
    with open(tmp_path / DATA_NAME, "w") as f:
        json.dump({**layout, POSITION_KEY: position}, f)
    TrainerState(global_step=2).save_to_json(str(tmp_path / "trainer_state.json"))
    point = check_data_layout(str(tmp_path), {**layout, "data_parallel_size": 2})
    assert point is not None and (point.num_samples, point.changed) == (8, ("data_parallel_size 1 -> 2",)), point


# ---------------------------------------------------------------------------------------------- Ulysses: left padding
def ulysses_slices(batch: dict, sp: int) -> list[dict]:
    """The slice each of ``sp`` sequence ranks gets from DeepSpeed's own ``UlyssesSPDataLoaderAdapter`` when every
    rank's loader yields ``batch`` (its collectives answered in one process: each rank's gather returns ``batch``)."""
    ulysses = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")

    class OneProcess:  # deepspeed.comm as the adapter calls it, every rank holding the same batch
        @staticmethod
        def all_gather(out, tensor, group=None):
            for slot in out:
                slot.copy_(tensor)

        @staticmethod
        def all_gather_object(out, value, group=None):
            out[:] = [value] * len(out)

    slices = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ulysses, "dist", OneProcess)
        for rank in range(sp):
            adapter = ulysses.UlyssesSPDataLoaderAdapter([{k: v.clone() for k, v in batch.items()}], sp_rank=rank,
                                                         sp_group=None, sp_world_size=sp, device="cpu")  # fmt: skip
            slices.append(next(adapter))  # the first micro-batch: this rank's slice of rank 0's batch
    return slices


def ulysses_batch(lengths: list[int], width: int, *, left: bool) -> dict:
    """Rows of ``lengths`` tokens padded to ``width`` (right, or left as ``padding_side="left"``), with the mask and
    ``position_ids`` 0 .. width - 1 (Ulysses needs them)."""
    samples = [{"input_ids": [3 + (i * 7 + j) % 20 for j in range(n)], "labels": [-100] * min(2, n) +
                [3 + (i * 7 + j) % 20 for j in range(2, n)]} for i, n in enumerate(lengths)]  # a masked prompt
    batch = PaddingCollator()(samples)
    extra = width - batch["input_ids"].shape[1]
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    batch = {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) for k, v in batch.items()}
    if left:
        pads = (batch["attention_mask"] == 0).sum(1).tolist()
        batch = {k: torch.stack([row.roll(n) for row, n in zip(v, pads, strict=True)]) for k, v in batch.items()}
    batch["position_ids"] = torch.arange(width).expand(len(lengths), -1).clone()
    return batch


def _refusing_ranks(slices: list[dict], sp: int) -> list[int]:
    refused = []
    for rank, piece in enumerate(slices):
        try:
            check_sequence_parallel_shard(piece, sp_size=sp, sp_rank=rank)
        except GradAccDataError as error:
            assert "padding_side" in str(error) and f"sp_size` {sp}" in str(error), error
            refused.append(rank)
    return refused


# rows' lengths in a 16-wide batch: mixed; a left padding of exactly one slice (sp 2: 8) or of whole slices (sp 4:
# 4, 8, 12), which no rank sees as a rise of its mask: sequence rank 0 sees its rows start with padding
ULYSSES_LENGTHS = [[16, 9, 3], [8, 16], [12, 4, 16], [1, 15, 16]]


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("lengths", ULYSSES_LENGTHS, ids=str)
def test_ulysses_slices_of_a_left_padded_batch_are_refused_right_padded_pass(sp, lengths):
    """The check on the slices DeepSpeed's adapter hands out: every left-padded batch refused by at least one rank
    (always by sequence rank 0, whose rows start with padding), no right-padded one by any."""
    right = ulysses_slices(ulysses_batch(lengths, 16, left=False), sp)
    assert [s["input_ids"].shape[1] for s in right] == [16 // sp] * sp and "shift_labels" in right[0]
    assert _refusing_ranks(right, sp) == []
    refused = _refusing_ranks(ulysses_slices(ulysses_batch(lengths, 16, left=True), sp), sp)
    assert refused and refused[0] == 0, refused


def test_ulysses_check_needs_a_mask_and_refuses_a_row_without_tokens():
    batch = ulysses_batch([16, 5], 16, left=True)
    check_sequence_parallel_shard({k: v for k, v in batch.items() if k != "attention_mask"}, sp_size=2, sp_rank=0)
    empty = {"attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])}
    check_sequence_parallel_shard(empty, sp_size=2, sp_rank=1)  # a later slice of right padding
    with pytest.raises(GradAccDataError, match=r"row\(s\) \[1\]"):
        check_sequence_parallel_shard(empty, sp_size=2, sp_rank=0)
    with pytest.raises(GradAccDataError, match=r"row\(s\) \[0\].*sequence rank 1"):  # a hole inside a later slice
        check_sequence_parallel_shard({"attention_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])}, sp_size=2, sp_rank=1)
    with pytest.raises(GradAccConfigError, match="sp_size"):
        ContextParallel(size=1, rank=0, sp_size=2, sp_rank=2)


def test_a_left_padded_slice_on_one_sequence_rank_stops_every_rank():
    """Left padding of exactly one slice: only sequence rank 0 sees it. Its refusal, raised where the window counts,
    reaches the other rank through the step's count collective: rank 0 raises its own GradAccDataError naming left
    padding, rank 1 one naming rank 0, both before any forward (neither waits in a later collective)."""
    slices = ulysses_slices(ulysses_batch([8, 8], 16, left=True), 2)
    assert _refusing_ranks(slices, 2) == [0]
    exchange = Exchange(2)
    head = Head(type="causal_lm")
    errors: list[BaseException | None] = [None, None]

    def rank(r):
        counter = Counter(head, cp=ContextParallel(size=1, rank=0, sp_size=2, sp_rank=r))
        try:
            Window.prefetched([slices[r]], count=counter.count,
                              all_gather=lambda t: exchange.all_gather(r, t), device="cpu", dp_world_size=1)  # fmt: skip
        except BaseException as error:  # noqa: BLE001 - handed back to the main thread
            errors[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(errors[0], GradAccDataError) and "left padding" in str(errors[0]), errors
    assert isinstance(errors[1], GradAccDataError) and "Rank(s) [0]" in str(errors[1]), errors
    # without the sequence-parallel check the same slices count without a word
    plain = Counter(head, cp=ContextParallel(size=1, rank=0))
    assert sum(plain.count(s).num_tokens for s in slices) > 0


def test_context_parallel_for_places_a_rank_in_its_ulysses_group(monkeypatch):
    import torch.distributed as dist

    trainer = _fake_trainer()
    trainer["accelerator"].parallelism_config.cp_size = 1
    assert context_parallel_for(**trainer)[0].sp_size == 1  # no backend with Ulysses: nothing to check
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    places = []
    for global_rank in range(4):
        monkeypatch.setattr(dist, "get_rank", lambda *a, _r=global_rank, **k: _r)
        cp, _ = context_parallel_for(**trainer, sequence_parallel_size=2)
        places.append((cp.size, cp.sp_size, cp.sp_rank))
    assert places == [(1, 2, 0), (1, 2, 1), (1, 2, 0), (1, 2, 1)]  # DeepSpeed's groups: ranks (0, 1), (2, 3)


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_slices_count_every_target_and_every_row_once_over_the_sequence_group(sp):
    """The counter on the slices DeepSpeed's adapter hands each sequence rank: the targets add up to the full batch's
    and its rows are counted once (on sequence rank 0), so `effective_batch_size`, the token statistics' samples and a
    `LossTerm(normalize_by="samples")` see the step's samples, not ``sp`` times them."""
    batch = ulysses_batch([16, 9, 3], 16, left=False)
    full = Counter(Head.for_model(build_tiny_model("causal_lm"))).count(batch)
    counts = [
        Counter(Head.for_model(build_tiny_model("causal_lm")), cp=ContextParallel(size=1, rank=0, sp_size=sp,
                                                                                 sp_rank=rank)).count(piece)
        for rank, piece in enumerate(ulysses_slices(batch, sp))
    ]  # fmt: skip
    assert sum(c.num_tokens for c in counts) == full.num_tokens
    assert [c.num_samples for c in counts] == [3] + [0] * (sp - 1), [c.num_samples for c in counts]
