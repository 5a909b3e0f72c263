"""Vision-language cases of the 2-rank launch of ``tests/distributed/test_weighted_ddp.py`` (run by
``weighted_cases.py``, which imports :data:`CASES`): on each of 2 DDP ranks (gloo), one SGD(lr=1) step, per-device
batch 2 x GA 4, of a tiny LLaVA and a tiny Qwen2.5-VL (``accepts_loss_kwargs = False``) built from their configs
(hf_gradacc/testing/tiny_vlm.py), against the float64 full batch of both ranks' 16 samples
(hf_gradacc/testing/reference.py); on Qwen2.5-VL the stock Trainer's step beside ours, same data, same reference.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import Trainer

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny_vlm import VLMCollator, build_tiny_vlm, make_vlm_samples
from tests.distributed.workers._common import world_size

BS, GA = 2, 4


def _step(family: str, trainer_class: type[Trainer] = GradAccTrainer) -> dict:
    """One step of ``trainer_class`` on this rank's half of one window of ``BS * GA * world`` samples (mixed answer
    lengths, some answers empty, prompt and image tokens masked); the reference sees every rank's samples."""
    model = build_tiny_vlm(family)
    samples = make_vlm_samples(model, BS * GA * world_size(), seed=1)
    collate = VLMCollator(model)
    args = one_step_args(args_class=GradAccConfig, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                         ddp_backend="gloo", ddp_timeout=120, seed=0)  # fmt: skip
    update, trainer = one_step_update(trainer_class, model, samples, args, data_collator=collate)
    flat = torch.cat([update[n].double().reshape(-1) for n in sorted(update)])
    from_rank0 = flat.clone()
    dist.broadcast(from_rank0, src=0)
    comparison = compare_with_reference(copy.deepcopy(update), model, samples, "causal_lm", data_collator=collate)
    patches = [n for n in update if "patch_embed" in n and n.endswith("weight")]
    return {
        "relative_error": comparison.relative_error,
        "cosine": comparison.cosine,
        "norm_ratio": comparison.norm_ratio,
        "max_abs_diff_vs_rank0": float((flat - from_rank0).abs().max()),
        "image_path_trained": bool(patches) and all(bool(update[n].abs().max() > 0) for n in patches),
        "global_step": trainer.state.global_step,
        "dp_world_size": dist.get_world_size(),
        "accepts_loss_kwargs": getattr(type(model), "accepts_loss_kwargs", None),
    }


def vlm_llava() -> dict:
    return _step("llava")


def vlm_qwen2_5_vl() -> dict:
    return _step("qwen2_5_vl")


def vlm_qwen2_5_vl_stock() -> dict:
    """The stock Trainer on the same step: Qwen2.5-VL takes no ``num_items_in_batch``, so each micro-batch is its own
    mean and DDP averages the ranks' means of means."""
    return _step("qwen2_5_vl", Trainer)


CASES = {"vlm_llava": vlm_llava, "vlm_qwen2_5_vl": vlm_qwen2_5_vl, "vlm_qwen2_5_vl_stock": vlm_qwen2_5_vl_stock}
