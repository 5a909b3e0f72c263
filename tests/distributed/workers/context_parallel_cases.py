"""One rank of the context-parallel GPU test (``accelerate launch --config_file cp_fsdp2.yaml``: cp 2, FSDP2 over
``dp_shard_cp``): a tiny Llama (SDPA) trained one SGD(lr=1) step on sequences cut over the context-parallel ranks,
by GradAccTrainer (``--trainer gradacc``) or the stock Trainer (``--trainer stock``, recorded); rank 0 compares the
update with the float64 full batch and writes ``<trainer>.rank<r>.json``.

GradAccTrainer gets the plain right-padded micro-batches with their attention mask (it pads them to 2 x cp_size
itself; accelerate drops the mask inside attention for plain causal attention, which a real token of a right-padded
row cannot tell apart). The stock Trainer gets them padded to 2 x cp_size, without a mask. (A sequence classifier
is refused by name at construction: tests/distributed/test_context_parallel.py on CPU ranks.)
"""

from __future__ import annotations

import argparse

import torch
from transformers import Trainer

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.one_step import full_parameters, one_step_args
from hf_gradacc.testing.reference import compare, float64_copy, full_batch_loss, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples
from tests.distributed.workers._common import finish_worker, write_result

CP_SIZE = 2
BS, GA = 2, 4  # one data rank (2 ranks / cp 2): the step holds BS x GA samples
EVAL_BS = 3


def eval_reference(parameters, samples) -> float:
    """``eval_loss`` of the unsharded batches in float64 on the CPU (the tiny model with ``parameters``): each
    batch's token mean, weighted by its rows."""
    reference = float64_copy(build_tiny_model("causal_lm"))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(parameters[name].cpu())
    batches = [samples[i : i + EVAL_BS] for i in range(0, len(samples), EVAL_BS)]
    with torch.no_grad():
        means = [float(full_batch_loss(reference, PaddingCollator()(b), "causal_lm")) for b in batches]
    return sum(m * len(b) for m, b in zip(means, batches, strict=True)) / len(samples)


def stock_collate(samples):
    batch = PaddingCollator()(samples)
    extra = -batch["input_ids"].shape[1] % (2 * CP_SIZE)
    batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra), value=0)
    batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=-100)
    del batch["attention_mask"]
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", default="gradacc", choices=("gradacc", "stock"))
    which = parser.parse_args().trainer
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_tiny_model("causal_lm")
    model.config._attn_implementation = "sdpa"
    reference_model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", BS * GA, seed=11)
    initial = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    args = one_step_args(per_device_train_batch_size=BS, gradient_accumulation_steps=GA, per_device_eval_batch_size=EVAL_BS)
    trainer_class, collate = (GradAccTrainer, PaddingCollator()) if which == "gradacc" else (Trainer, stock_collate)
    trainer = trainer_class(model=model, args=args, train_dataset=ListDataset(samples), data_collator=collate)
    trainer.train()
    final = full_parameters(trainer)
    update = {n: initial[n] - final[n].float().cpu() for n in initial if n in final}
    reference = reference_gradients(reference_model, samples, "causal_lm", PaddingCollator())
    evaluation = {}
    if which == "gradacc":  # each batch's loss summed and counted over the cp ranks' chunks (ring attention)
        eval_samples = make_samples("causal_lm", 4 * EVAL_BS, seed=7)
        evaluation = {"eval_loss": trainer.evaluate(ListDataset(eval_samples))["eval_loss"],
                      "eval_reference": eval_reference(final, eval_samples)}  # fmt: skip
    result = {
        **evaluation,
        "update": compare(update, reference).__dict__,
        "cp_size": trainer.accelerator.parallelism_config.cp_size,
        "num_updated": sum(int(u.abs().sum() > 0) for u in update.values()),
        "num_parameters": len(initial),
        "backend": trainer.backend.describe() if hasattr(trainer, "backend") else None,
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "accelerate": __import__("accelerate").__version__},  # fmt: skip
    }
    write_result(which, result)
    finish_worker(0)


if __name__ == "__main__":
    main()
