"""One rank of the ZeRO-3 model-construction recipe (docs/recipes.md), under
``accelerate launch --config_file examples/accelerate_configs/zero3_cpu.yaml`` (``zero3_init_flag: false``) with
``HF_GRADACC_CPU_DISTRIBUTED=1``; started by tests/distributed/test_recipes.py.

    zero3_construction.py CHECKPOINT --output_dir DIR ... (GradAccConfig flags)

Records whether a model is partitioned (DeepSpeed ``ds_id`` on its parameters, ``numel() == 0`` locally) when it is
built before the arguments are parsed, after them from its class, after them with ``from_pretrained`` and with
``AutoModelForCausalLM.from_config``; then trains the ``from_pretrained`` one (partitioned at load) for ONE SGD(lr=1)
step and compares the update with the float64 full-batch gradient of the checkpoint (loaded before the arguments,
whole), over every rank's samples.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import SequentialSampler
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer, patches
from hf_gradacc.testing.one_step import full_parameters
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, make_samples
from tests.distributed.workers._common import finish_worker, write_result


def _state(model: torch.nn.Module) -> dict[str, Any]:
    params = list(model.parameters())
    return {"partitioned": any(hasattr(p, "ds_id") for p in params), "local_numel": sum(p.numel() for p in params)}


class _InOrder(GradAccTrainer):
    """Samples in dataset order: rank r's micro-batches are known, the reference covers all of them."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


def main() -> None:
    torch.set_num_threads(1)
    checkpoint, argv = sys.argv[1], sys.argv[2:]
    patches.maybe_enable_from_env()  # DeepSpeed on CPU ranks
    config = AutoConfig.from_pretrained(checkpoint)
    whole = AutoModelForCausalLM.from_pretrained(checkpoint)  # before the arguments
    (args,) = HfArgumentParser(GradAccConfig).parse_args_into_dataclasses(argv)
    states = {
        "before_parse_from_pretrained": _state(whole),
        "after_parse_class_from_config": _state(type(whole)(config)),
        "after_parse_auto_from_config": _state(AutoModelForCausalLM.from_config(config)),
    }
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    states["after_parse_from_pretrained"] = _state(model)
    samples = make_samples(
        "causal_lm", args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size, seed=3
    )
    trainer = _InOrder(model=model, args=args, train_dataset=ListDataset(samples), data_collator=PaddingCollator())
    trainer.train()
    initial = {n: p.detach().clone() for n, p in whole.named_parameters()}
    final = full_parameters(trainer)
    update = {n: initial[n] - final[n].float() for n in initial}
    comparison = compare(update, reference_gradients(whole, samples, "causal_lm", PaddingCollator()))
    plugin = trainer.accelerator.state.deepspeed_plugin
    write_result("zero3_construction", {
        **states,
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "zero3_init_flag": plugin.zero3_init_flag if plugin is not None else None,
        "num_processes": trainer.accelerator.num_processes,
        "relative_error": comparison.relative_error,
        "num_unchanged": sum(int(bool((u == 0).all())) for u in update.values()),
    })  # fmt: skip
    finish_worker()


if __name__ == "__main__":
    main()
