"""One rank of tests/distributed/test_context_parallel.py: accelerate ``cp_size`` 2 x FSDP2 on 2 CPU ranks (the
attention through :mod:`cpu_context_parallel`'s exact all-gather stand-in for torch's ring attention), one SGD(lr=1)
step of GradAccTrainer (and, with ``stock`` in the arguments, of the stock Trainer) against the float64 full batch;
then a sequence classifier, refused at construction. Writes ``cp.rank<r>.json``.
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig
from cpu_context_parallel import install
from transformers import Trainer, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.errors import GradAccError
from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, world_size, write_result

CP, BS, GA = 2, 2, 3
WRAP = {"sequence_classification": {"transformer_layer_cls_to_wrap": ["BertLayer"]}}  # tied embeddings: per layer


def stock_collate(samples):  # the stock Trainer pads nothing itself: to 2 x cp_size, no mask
    batch = PaddingCollator()(samples)
    extra = -batch["input_ids"].shape[1] % (2 * CP)
    return {"input_ids": F.pad(batch["input_ids"], (0, extra)), "labels": F.pad(batch["labels"], (0, extra), value=-100)}


def one_step(kind: str, task: str = "causal_lm") -> dict:
    dp = world_size() // CP
    model = build_tiny_model(task)
    samples = make_samples(task, BS * GA * dp, seed=5)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = one_step_args(tempfile.mkdtemp(prefix="hf_gradacc_cp_"), per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, args_class=GradAccConfig if kind == "gradacc" else TrainingArguments,
                         fsdp=True, fsdp_config={"version": 2, **WRAP.get(task, {})}, ddp_backend="gloo", use_cpu=True,
                         parallelism_config=ParallelismConfig(cp_size=CP, dp_shard_size=dp))  # fmt: skip
    trainer_class, collate = (GradAccTrainer, PaddingCollator()) if kind == "gradacc" else (Trainer, stock_collate)
    try:
        trainer = trainer_class(model=model, args=args, train_dataset=ListDataset(samples), data_collator=collate)
    except GradAccError as error:
        return {"error_type": type(error).__name__, "error": str(error)}
    trainer.train()
    final = full_parameters(trainer)
    update = {n: initial[n] - final[n].float() for n in initial}
    reference = reference_gradients(build_tiny_model(task), samples, task, PaddingCollator())
    return {"update": compare(update, reference).__dict__, "moved": sum(int(u.abs().sum() > 0) for u in update.values()),
            "parameters": len(update), "cp_size": trainer.accelerator.parallelism_config.cp_size,
            "cp_rank": trainer._cp.rank if kind == "gradacc" else None}  # fmt: skip


def main() -> None:
    install()
    enable_fsdp_on_cpu()
    torch.manual_seed(0)
    kinds = sys.argv[1:] or ["gradacc"]  # "stock": the stock Trainer on the same launch (recorded by hand)
    result = {kind: one_step(kind) for kind in kinds}
    write_result("cp", {**result, "sequence_classification": one_step("gradacc", "sequence_classification")})
    finish_worker(0)


if __name__ == "__main__":
    main()
