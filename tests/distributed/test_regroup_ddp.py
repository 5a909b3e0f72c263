"""Regrouped micro-batches under DDP on 2 CPU ranks (gloo): same windows, same update as the plain GradAccTrainer.

This file is both the test and its worker: ``run_workers`` starts it as a script on 2 ranks, each rank trains the
plain GradAccTrainer, the regrouped one and the token-budget one from the same model and seed (the stock seeded
random order, so the ranks agree on the windows without talking), records what it saw, and writes one JSON result.
Tolerance: relative L2 difference 1e-5 of the parameter update (SGD one step, and 3 AdamW steps whose last window
is short), and 1e-5 of the one-step update against the float64 full-batch reference.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from pathlib import Path

import pytest

TOLERANCE = 1e-5
NPROC = 2
BS, GA = 2, 4
BUDGET = 40
MODES = {"plain": {}, "regroup": {"regroup_micro_batches": True}, "budget": {"max_tokens_per_micro_batch": BUDGET}}


# ---------------------------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from tests.distributed.launcher import run_workers

    launch = run_workers(Path(__file__), nproc=NPROC, timeout=300, out_dir=tmp_path_factory.mktemp("regroup"))
    ranks = launch.load("regroup")
    for r, payload in enumerate(ranks):
        if "error" in payload:
            pytest.fail(f"rank {r} failed:\n{payload['error']}", pytrace=False)
    return ranks


def merged_windows(ranks: list[dict], run: str) -> list[list[int]]:
    """Sorted sample ids of each optimizer step, over both ranks."""
    per_rank = [r[run]["windows"] for r in ranks]
    assert len({len(w) for w in per_rank}) == 1
    return [sorted(i for w in windows for batch in w for i in batch) for windows in zip(*per_rank)]


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["sgd", "adamw"])
def test_regrouped_ddp_equals_plain(results, run):
    plain = merged_windows(results, f"{run}_plain")
    for mode in ("regroup", "budget"):
        assert merged_windows(results, f"{run}_{mode}") == plain  # the same samples in every optimizer step
        for rank in results:
            out = rank[f"{run}_{mode}"]
            assert out["relative_difference_vs_plain"] <= TOLERANCE
            assert out["max_abs_diff_vs_rank0"] == 0.0  # the replicas agree
            assert out["padded_tokens"] < rank[f"{run}_plain"]["padded_tokens"]
            counts = [len(w) for w in out["windows"]]
            assert counts == [len(w) for w in results[0][f"{run}_{mode}"]["windows"]]  # every rank alike
            # one gradient reduction per optimizer step, on its last micro-batch, as in the plain run
            assert out["reductions_per_step"] == rank[f"{run}_plain"]["reductions_per_step"]
            assert all(mb == count - 1 for mb, count in zip(out["reduced_on_micro_batch"], counts))
    budget = [r[f"{run}_budget"] for r in results]
    assert all(size <= BUDGET for r in budget for size in r["padded_per_micro_batch"])
    if run == "sgd":
        for rank in results:
            for mode in MODES:
                assert rank[f"sgd_{mode}"]["relative_error_vs_reference"] <= TOLERANCE
    else:
        assert [len(w) for w in results[0]["adamw_plain"]["windows"]] == [GA, GA, 1]  # a short last window
        assert max(len(w) for w in budget[0]["windows"]) > GA  # the budget needed more micro-batches somewhere


# ---------------------------------------------------------------------------------------------- the worker
def _worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from transformers import TrainerCallback

    from hf_gradacc import GradAccConfig, GradAccTrainer
    from hf_gradacc.check import compare_with_reference, one_step_args
    from hf_gradacc.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
    from tests.distributed.workers._common import finish_worker, rank, world_size, write_result

    torch.set_num_threads(1)
    world = world_size()

    class Recorder(PaddingCollator):
        def __init__(self, ids: dict[tuple[int, ...], int]) -> None:
            super().__init__()
            self.ids = ids
            self.micro_batches: list[list[int]] = []

        def __call__(self, samples):
            self.micro_batches.append([self.ids[tuple(s["input_ids"])] for s in samples])
            return super().__call__(samples)

    class Probe(GradAccTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
            self.__dict__.setdefault("window_sizes", []).append(len(batches))
            return batches, count

    class ReductionCounter(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Probe | None = None
            self.calls: list[tuple[int, int | None]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.trainer.model_wrapped.register_comm_hook(self, _hook)

    def _hook(counter, bucket):
        counter.calls.append((counter.trainer.state.global_step, counter.trainer._micro_batch_index))
        return default_hooks.allreduce_hook(None, bucket)

    def train(samples, mode, *, sgd, **overrides):
        ids = {tuple(s["input_ids"]): k for k, s in enumerate(samples)}
        assert len(ids) == len(samples), "sample ids must be unique"
        collator = Recorder(ids)
        model = build_tiny_model("causal_lm", seed=0)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = one_step_args(
            args_class=GradAccConfig,
            per_device_train_batch_size=BS,
            gradient_accumulation_steps=GA,
            ddp_backend="gloo",
            ddp_timeout=120,
            seed=0,
            **MODES[mode],
            **overrides,
        )
        # SGD(lr=1): the update IS the accumulated gradient; otherwise the Trainer's AdamW
        optimizers = (torch.optim.SGD(model.parameters(), lr=1.0), None) if sgd else (None, None)
        counter = ReductionCounter()
        trainer = Probe(
            model=model,
            args=args,
            train_dataset=ListDataset(samples),
            data_collator=collator,
            optimizers=optimizers,
            callbacks=[counter],
        )
        counter.trainer = trainer
        trainer.train()
        update = {n: initial[n] - p.detach() for n, p in model.named_parameters()}
        flat = torch.cat([update[n].double().reshape(-1) for n in sorted(update)])
        from_rank0 = flat.clone()
        dist.broadcast(from_rank0, src=0)
        windows, start = [], 0
        for size in trainer.window_sizes:
            windows.append(collator.micro_batches[start : start + size])
            start += size
        steps = sorted({step for step, _ in counter.calls})
        lengths = {k: len(s["input_ids"]) for k, s in enumerate(samples)}
        padded = [len(b) * max(lengths[i] for i in b) for b in collator.micro_batches]
        return (
            {
                "windows": windows,
                "padded_per_micro_batch": padded,
                "padded_tokens": sum(padded),
                "reductions_per_step": [sum(1 for s, _ in counter.calls if s == step) for step in steps],
                "reduced_on_micro_batch": [max(mb for s, mb in counter.calls if s == step) for step in steps],
                "max_abs_diff_vs_rank0": float((flat - from_rank0).abs().max()),
            },
            update,
            model,
        )

    payload: dict = {}
    try:
        one_window = make_samples("causal_lm", BS * GA * world, seed=21)
        three_windows = make_samples("causal_lm", BS * GA * world * 2 + BS * world, seed=22, min_length=16)
        for run, samples, overrides in (
            ("sgd", one_window, {}),
            ("adamw", three_windows, {"max_steps": -1, "num_train_epochs": 1, "learning_rate": 1e-3}),
        ):
            updates = {}
            for mode in MODES:
                out, updates[mode], _ = train(samples, mode, sgd=run == "sgd", **overrides)
                payload[f"{run}_{mode}"] = out
            plain = torch.cat([updates["plain"][n].double().reshape(-1) for n in sorted(updates["plain"])])
            for mode in MODES:
                flat = torch.cat([updates[mode][n].double().reshape(-1) for n in sorted(updates[mode])])
                payload[f"{run}_{mode}"]["relative_difference_vs_plain"] = float((flat - plain).norm() / plain.norm())
                if run == "sgd":
                    model = build_tiny_model("causal_lm", seed=0)
                    comparison = compare_with_reference(copy.deepcopy(updates[mode]), model, samples, "causal_lm")
                    payload[f"{run}_{mode}"]["relative_error_vs_reference"] = comparison.relative_error
    except BaseException:
        write_result("regroup", {"error": traceback.format_exc()})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other rank fails in its next collective instead of waiting forever
    write_result("regroup", payload)
    print(f"[rank {rank()}] regroup done", flush=True)
    finish_worker()


if __name__ == "__main__":
    _worker()
