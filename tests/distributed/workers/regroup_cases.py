"""Worker of ``tests/distributed/test_regroup_ddp.py``: on each of 2 ranks, train the plain GradAccTrainer, the
regrouped one and the token-budget one from the same model and seed (the stock seeded random order, so the ranks
agree on the windows without talking), record what each saw, and write one JSON result ("regroup").

    python regroup_cases.py      # started by tests/distributed/launcher.run_workers
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import (
    DDPCommHookCounter,
    finish_worker,
    pack_rows_always,
    rank,
    world_size,
    write_result,
)

BS, GA = 2, 4
BUDGET = 40
MODES = {
    "plain": {},
    "regroup": {"regroup_micro_batches": True},
    "budget": {"max_tokens_per_micro_batch": BUDGET},
    "pack": {"pack_micro_batches": True},
}


def _worker() -> None:
    torch.set_num_threads(1)
    pack_rows_always()
    world = world_size()

    class Probe(GradAccTrainer):
        """Records, for every micro-batch it fetches, the ids of its samples and the token positions it computes
        (rows x width of a padded batch, the length of a packed row)."""

        ids: dict[tuple[int, ...], int] = {}

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
            self.__dict__.setdefault("window_sizes", []).append(len(batches))
            for batch in batches:
                self.__dict__.setdefault("micro_batches", []).append(self._sample_ids(batch))
                self.__dict__.setdefault("computed", []).append(int(batch["input_ids"].numel()))
                real = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
                self.__dict__.setdefault("real", []).append(int(real))
            return batches, count

        def _sample_ids(self, batch) -> list[int]:
            ids = batch["input_ids"].cpu()
            if "cu_seq_lens_q" in batch:  # one packed row: cut at the sequence offsets
                offsets = batch["cu_seq_lens_q"].tolist()
                return [self.ids[tuple(ids[0, a:b].tolist())] for a, b in zip(offsets[:-1], offsets[1:])]
            lengths = batch["attention_mask"].sum(-1).tolist()
            return [self.ids[tuple(row[:n].tolist())] for row, n in zip(ids, lengths)]

    def train(samples, mode, *, sgd, **overrides):
        ids = {tuple(s["input_ids"]): k for k, s in enumerate(samples)}
        assert len(ids) == len(samples), "sample ids must be unique"
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
        counter = DDPCommHookCounter()
        trainer = Probe(
            model=model,
            args=args,
            train_dataset=ListDataset(samples),
            data_collator=PaddingCollator(),
            optimizers=optimizers,
            callbacks=[counter],
        )
        counter.bind(trainer)
        trainer.ids = ids
        trainer.train()
        update = {n: initial[n] - p.detach() for n, p in model.named_parameters()}
        flat = torch.cat([update[n].double().reshape(-1) for n in sorted(update)])
        from_rank0 = flat.clone()
        dist.broadcast(from_rank0, src=0)
        windows, start = [], 0
        for size in trainer.window_sizes:
            windows.append(trainer.micro_batches[start : start + size])
            start += size
        calls = [(c["step"], c["micro_batch"]) for c in counter.calls]
        steps = sorted({step for step, _ in calls})
        padded = trainer.computed
        return (
            {
                "windows": windows,
                "padded_per_micro_batch": padded,
                "real_per_micro_batch": trainer.real,
                "padded_tokens": sum(padded),
                "reductions_per_step": [sum(1 for s, _ in calls if s == step) for step in steps],
                "reduced_on_micro_batch": [max(mb for s, mb in calls if s == step) for step in steps],
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
