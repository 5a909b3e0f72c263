"""One rank of the context-parallel GPU test (accelerate launch --config_file cp_fsdp2.yaml): a tiny Llama (SDPA)
trained one SGD(lr=1) step by the stock Trainer (``--trainer stock``) on sequences split over the context-parallel
ranks, or GradAccTrainer (``--trainer gradacc``: today refused by name, its result then holds the error); rank 0
compares the update with the float64 full batch and writes ``<trainer>.rank<r>.json``.

Micro-batches are right-padded to a multiple of 2 x cp_size with ignored labels and carry no attention mask (the
Trainer refuses a padding mask under context parallelism): with causal attention a real token never sees the
padding after it, so the reference (with its padding mask) computes the same targets.
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.tensor import DTensor
from transformers import Trainer

from hf_gradacc import GradAccTrainer
from hf_gradacc.errors import UnsupportedBackendError
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, write_result

MULTIPLE = 4  # 2 x cp_size 2


def collate(samples):
    batch = PaddingCollator()(samples)
    extra = -batch["input_ids"].shape[1] % MULTIPLE
    batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra), value=0)
    batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=-100)
    del batch["attention_mask"]
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", default="gradacc", choices=("gradacc", "stock"))
    which = parser.parse_args().trainer
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_tiny_model("causal_lm")
    model.config._attn_implementation = "sdpa"
    reference_model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 8, seed=11)
    initial = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer_class = GradAccTrainer if which == "gradacc" else Trainer
    try:
        trainer = trainer_class(model=model, args=args, train_dataset=ListDataset(samples), data_collator=collate)
    except UnsupportedBackendError as error:  # GradAccTrainer refuses cp_size > 1 by name (see the GPU test)
        write_result(which, {"error_type": type(error).__name__, "error": str(error)})
        finish_worker(0)
    trainer.train()
    final = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
             for n, p in trainer.model_wrapped.named_parameters()}  # fmt: skip
    update = {n.removeprefix("_orig_mod."): initial[n] - final[n] for n in initial if n in final}
    reference = reference_gradients(reference_model, samples, "causal_lm", PaddingCollator())
    result = {
        "update": compare(update, reference).__dict__,
        "cp_size": trainer.accelerator.parallelism_config.cp_size,
        "num_updated": len(update),
        "backend": trainer.backend.describe() if hasattr(trainer, "backend") else None,
    }
    write_result(which, result)
    finish_worker(0)


if __name__ == "__main__":
    main()
