"""One rank of the TRL tests: ONE optimizer step of TRL's SFT / DPO / reward trainer, with hf_gradacc in front or
stock, on 2 CPU ranks (gloo) under DDP, DeepSpeed ZeRO-2 or FSDP2.

    # started by tests/distributed/test_trl.py
    torchrun --nproc_per_node 2 trl_cases.py --backend ddp --cases sft,sft_stock,dpo,dpo_stock,reward,reward_stock
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        trl_cases.py --backend deepspeed --cases sft,dpo

Every case trains one step of SGD(lr=1) (``optim="sgd"``: DeepSpeed and FSDP2 build the optimizer themselves; constant
schedule, no clipping, ``bf16=False``), so the parameter update is minus the accumulated gradient. The step holds 14
samples (SFT prompt-completion rows, DPO or reward pairs) dealt by a fixed batch layout: every rank runs micro-batches
of 2 + 2 + 2 + 1 (batch 2 x GA 4, the last one short, alike on both ranks, as TRL's per-row metric gathers need). Each
rank compares its update with the float64 full-batch reference over ALL 14 samples of both ranks
(``hf_gradacc/testing/trl_steps.py``: no TRL code) and writes one JSON per case; a case that raises writes its
traceback and the worker exits.

Cases: ``sft``, ``dpo``, ``reward`` (hf_gradacc's trainers) and ``sft_stock``, ``dpo_stock``, ``reward_stock`` (TRL's).
``sft_pack``, ``sft_budget``: GradAccSFTTrainer with ``pack_micro_batches=True`` / ``max_tokens_per_micro_batch`` over
16 rows, one stock step of batch 2 x GA 4 on each rank (the seeded stock order, no fixed layout: hf_gradacc plans the
micro-batches); each rank also records the token ids of every sequence it trained and the token positions it computed.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import traceback
from typing import Any

import torch

from hf_gradacc import patches
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import build_tiny_model
from hf_gradacc.testing.trl_steps import (
    build_tiny_reward_model,
    dpo_dataset,
    dpo_pairs,
    dpo_reference,
    reward_reference,
    reward_rows,
    sft_reference,
    sft_rows,
    uneven_batch_sizes,
    with_batch_layout,
    word_tokenizer,
)
from tests.distributed.workers._common import finish_worker, rank, world_size, write_result

BS, GA = 2, 4
LAYOUT = uneven_batch_sizes(BS, GA, world_size())  # 2 + 2 + 2 + 1 on every rank
NUM_SAMPLES = sum(LAYOUT)
BETA = 0.1
CENTER = 0.01  # reward: center_rewards_coefficient
# hf_gradacc plans these steps itself: one stock window of BS x GA rows per rank, each sample once.
PLANNED = {"sft_pack": {"pack_micro_batches": True}, "sft_budget": {"max_tokens_per_micro_batch": 24}}
PLANNED_NUM_SAMPLES = BS * GA * world_size()


class _RowRecorder:
    """Keeps the number of rows of every micro-batch this rank trained (a preference batch: 2 rows per pair)."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        rows = [int(next(v for v in b.values() if torch.is_tensor(v)).shape[0]) for b in batches]
        self.micro_batch_rows = [*getattr(self, "micro_batch_rows", []), *rows]
        self.sequences = [*getattr(self, "sequences", []), *(seq for b in batches for seq in _sequences(b))]
        sizes = [int(b["input_ids"].numel()) for b in batches]  # token positions computed per micro-batch
        self.micro_batch_tokens = [*getattr(self, "micro_batch_tokens", []), *sizes]
        return batches, num_items


def _sequences(batch: dict[str, Any]) -> list[list[int]]:
    """Token ids of every sequence of a micro-batch: padding-free rows cut where their sequences start
    (``cu_seq_lens_q``, or ``position_ids`` restarting at 0 where TRL < 1.16's collator gives no offsets), padded rows
    read through the attention mask."""
    ids = batch["input_ids"].cpu()
    if "attention_mask" not in batch:
        from itertools import accumulate

        from hf_gradacc.data.pack import packed_sequence_lengths

        offsets = [0, *accumulate(packed_sequence_lengths({k: v.cpu() if torch.is_tensor(v) else v
                                                           for k, v in batch.items()}))]  # fmt: skip
        return [ids[0, a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:]) if b > a]
    return [row[mask.bool()].tolist() for row, mask in zip(ids, batch["attention_mask"].cpu())]


def _backend_args(backend: str) -> dict[str, Any]:
    if backend == "deepspeed":
        return {"use_cpu": False}  # use_cpu would bypass DeepSpeed; the CPU patch picks gloo
    if backend == "fsdp2":
        return {"use_cpu": True, "fsdp": True, "fsdp_config": {"version": 2}, "ddp_backend": "gloo"}
    return {"use_cpu": True, "ddp_backend": "gloo"}


def _kind(case: str) -> tuple[str, bool]:
    kind, _, stock = case.partition("_")
    return kind, stock == "stock"


def run_case(case: str, backend: str, bases: dict[str, torch.nn.Module]) -> dict[str, Any]:
    import trl

    from hf_gradacc import trl as gradacc_trl

    kind, stock = _kind(case)
    planned = PLANNED.get(case)
    trainer_kwargs: dict[str, Any] = {}
    if kind == "sft":
        base, rows = bases["causal_lm"], sft_rows(PLANNED_NUM_SAMPLES if planned else NUM_SAMPLES)
        from datasets import Dataset

        dataset, reference = Dataset.from_list(rows), sft_reference(bases["causal_lm"], rows)
        config: dict[str, Any] = {"completion_only_loss": True, "max_length": None, **(planned or {})}
        names = ("SFTTrainer", "SFTConfig")
    elif kind == "dpo":
        base, pairs = bases["causal_lm"], dpo_pairs(NUM_SAMPLES)
        dataset, reference = dpo_dataset(pairs), dpo_reference(base, pairs, beta=BETA)
        config = {"beta": BETA}
        trainer_kwargs["ref_model"] = copy.deepcopy(base)
        names = ("DPOTrainer", "DPOConfig")
    elif kind == "reward":
        from datasets import Dataset

        base, rows = bases["reward"], reward_rows(NUM_SAMPLES)
        dataset, reference = Dataset.from_list(rows), reward_reference(base, rows, center=CENTER)
        config = {"center_rewards_coefficient": CENTER}
        names = ("RewardTrainer", "RewardConfig")
    else:
        raise ValueError(f"unknown case {case!r}")
    module = trl if stock else gradacc_trl
    prefix = "" if stock else "GradAcc"
    trainer_class = getattr(module, prefix + names[0])
    config_class = getattr(module, prefix + names[1])
    args = one_step_args(
        tempfile.mkdtemp(prefix=f"hf_gradacc_trl_{case}_"),
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        args_class=config_class,
        bf16=False,
        seed=0,
        ddp_timeout=120,
        **_backend_args(backend),
        **config,
    )
    cls = type(f"Recording{trainer_class.__name__}", (_RowRecorder, trainer_class), {})
    if planned is None:
        cls = with_batch_layout(cls, LAYOUT)
    model = copy.deepcopy(base)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=word_tokenizer(), **trainer_kwargs)
    trainer.train()
    final = full_parameters(trainer)
    update = {n: initial[n] - final[n].float() for n in initial}
    comparison = compare(update, reference.grads)
    log = next((h for h in trainer.state.log_history if "loss" in h), {})
    plugin = trainer.accelerator.state.deepspeed_plugin
    wrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return {
        "case": case,
        "trainer": trainer_class.__name__,
        "relative_error": comparison.relative_error,
        "cosine": comparison.cosine,
        "norm_ratio": comparison.norm_ratio,
        "num_parameters": len(initial),
        "num_unchanged": sum(int(bool((u == 0).all())) for u in update.values()),
        "micro_batch_rows": getattr(trainer, "micro_batch_rows", []),
        "sequences": getattr(trainer, "sequences", []),
        "micro_batch_tokens": getattr(trainer, "micro_batch_tokens", []),
        "dataset_sequences": [row["input_ids"] for row in rows] if kind == "sft" else [],
        "global_step": trainer.state.global_step,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "param_types": sorted({type(p).__name__ for p in wrapped.parameters()}),
        "logged_loss": log.get("loss"),
        "logged_grad_norm": log.get("grad_norm"),
        "reference_loss": reference.loss,
        "reference_norm": reference.norm,
    }


# ---------------------------------------------------------------------------------------------- GRPO
GRPO_MAX_COMPLETION_LENGTH = 8


def run_grpo_case(case: str, backend: str) -> dict[str, Any]:
    """``grpo_<loss_type>_spg<steps_per_generation>[_stock]``: ONE SGD(lr=1) step of TRL's GRPO (with hf_gradacc in
    front, or stock) on TRL's own dataloader: 16 prompts, 2 completions each, batch 2 x GA 4 on every rank (16
    completions per step over both ranks), generated with ``model.generate`` and scored by a deterministic reward.
    Each rank records the micro-batches it trained on; both ranks' are gathered after the step and each rank compares
    its update with the float64 full-batch step over all 16 completions (``hf_gradacc/testing/grpo_steps.py``)."""
    import torch.distributed as dist
    import trl

    from hf_gradacc import trl as gradacc_trl
    from hf_gradacc.testing.grpo_steps import (
        GRPOStepRecorder,
        build_tiny_policy,
        grpo_prompts,
        grpo_reference,
        grpo_tokenizer,
        length_reward,
    )

    _, loss_type, spg, *stock = case.split("_")
    module, prefix = (trl, "") if stock else (gradacc_trl, "GradAcc")
    trainer_class, config_class = getattr(module, prefix + "GRPOTrainer"), getattr(module, prefix + "GRPOConfig")
    args = one_step_args(
        tempfile.mkdtemp(prefix=f"hf_gradacc_trl_{case}_"),
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        args_class=config_class,
        bf16=False,
        seed=0,
        ddp_timeout=120,
        num_generations=2,
        max_completion_length=GRPO_MAX_COMPLETION_LENGTH,
        steps_per_generation=int(spg.removeprefix("spg")),
        loss_type=loss_type,
        beta=0.0,
        **_backend_args(backend),
    )
    base = build_tiny_policy()
    model = copy.deepcopy(base)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cls = type(f"Recording{trainer_class.__name__}", (GRPOStepRecorder, trainer_class), {})
    trainer = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=grpo_prompts(16),
                  processing_class=grpo_tokenizer())  # fmt: skip
    trainer.train()
    final = full_parameters(trainer)
    update = {n: initial[n] - final[n].float() for n in initial}
    every_rank: list[Any] = [None] * world_size()
    dist.all_gather_object(every_rank, trainer.recorded_micro_batches)
    micro_batches = [mb for recorded in every_rank for mb in recorded]
    reference = grpo_reference(base, micro_batches, loss_type=loss_type, max_completion_length=GRPO_MAX_COMPLETION_LENGTH)
    comparison = compare(update, reference.grads)
    log = next((h for h in trainer.state.log_history if "loss" in h), {})
    plugin = trainer.accelerator.state.deepspeed_plugin
    wrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return {
        "case": case,
        "trainer": trainer_class.__name__,
        "relative_error": comparison.relative_error,
        "cosine": comparison.cosine,
        "norm_ratio": comparison.norm_ratio,
        "num_parameters": len(initial),
        "num_unchanged": sum(int(bool((u == 0).all())) for u in update.values()),
        "micro_batch_rows": [int(mb["completion_ids"].shape[0]) for mb in trainer.recorded_micro_batches],
        "num_completions": sum(int(mb["completion_ids"].shape[0]) for mb in micro_batches),
        "completion_lengths": [int(n) for mb in micro_batches for n in mb["completion_mask"].sum(1)],
        "global_step": trainer.state.global_step,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "param_types": sorted({type(p).__name__ for p in wrapped.parameters()}),
        "logged_loss": log.get("loss"),
        "logged_grad_norm": log.get("grad_norm"),
        "reference_loss": reference.loss,
        "reference_norm": reference.norm,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("ddp", "deepspeed", "fsdp2"), required=True)
    parser.add_argument("--cases", required=True, help="comma-separated: sft, sft_stock, dpo, dpo_stock, reward, ...")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    patches.maybe_enable_from_env()  # DeepSpeed on CPU ranks: the stock trainers need it before their arguments
    if opts.backend == "fsdp2":
        from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()
    # Models before anything DeepSpeed-related exists.
    bases = {"causal_lm": build_tiny_model("causal_lm"), "reward": build_tiny_reward_model()}
    for case in opts.cases.split(","):
        try:
            if case.startswith("grpo_"):
                payload = run_grpo_case(case, opts.backend)
            else:
                payload = run_case(case, opts.backend, bases)
        except BaseException:
            write_result(case, {"crash": traceback.format_exc()})
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # do not wait in the next collective for a rank that will never join it
        write_result(case, payload)
        if rank() == 0:
            print(f"[trl_cases] {opts.backend} {case}: {payload}", flush=True)
    finish_worker()


if __name__ == "__main__":
    main()
