"""Worker of ``tests/distributed/test_weighted_ddp.py``: on each of 2 DDP ranks (gloo), one SGD(lr=1) step of
GradAccTrainer over a ``loss_weights`` column, against the float64 full batch of every rank's samples
(hf_gradacc/testing/reference.py), and the same step with rank 1's weight sum one token short (the check must fail).
The same launch runs the vision-language cases of ``vlm_cases.py`` (tiny LLaVA and Qwen2.5-VL, ours and stock).

    python weighted_cases.py --cases plain,one_token_short      # started by tests/distributed/launcher.run_workers
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples
from hf_gradacc.weights import LOSS_WEIGHTS_KEY, LossWeightsCollator
from tests.distributed.workers._common import rank, run_named_cases, world_size
from tests.distributed.workers.vlm_cases import CASES as VLM_CASES

BS, GA = 2, 4


def _samples(per_sample: bool = False) -> list[dict]:
    """One window over every rank: mixed lengths, masked prompts, weights in [0, 3) (a quarter of tokens 0; per
    sample, every sixth sample 0)."""
    g = torch.Generator().manual_seed(7)
    samples = make_samples("causal_lm", BS * GA * world_size(), seed=31)
    for i, s in enumerate(samples):
        if per_sample:
            s[LOSS_WEIGHTS_KEY] = 0.0 if i % 6 == 1 else float(3 * torch.rand((), generator=g))
        else:
            w = 3 * torch.rand(len(s["labels"]), generator=g)
            s[LOSS_WEIGHTS_KEY] = (w * (torch.rand(len(w), generator=g) > 0.25)).tolist()
    return samples


def _step(samples: list[dict], **config) -> dict:
    collate = LossWeightsCollator(PaddingCollator())
    model = build_tiny_model("causal_lm", seed=0)
    args = one_step_args(args_class=GradAccConfig, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                         ddp_backend="gloo", ddp_timeout=120, seed=0, **config)  # fmt: skip
    update, trainer = one_step_update(GradAccTrainer, model, samples, args, data_collator=collate)
    flat = torch.cat([update[n].double().reshape(-1) for n in sorted(update)])
    from_rank0 = flat.clone()
    dist.broadcast(from_rank0, src=0)
    comparison = compare_with_reference(copy.deepcopy(update), model, samples, "causal_lm", data_collator=collate)
    return {
        "relative_error": comparison.relative_error,
        "max_abs_diff_vs_rank0": float((flat - from_rank0).abs().max()),
        "global_step": trainer.state.global_step,
        "dp_world_size": trainer.backend.mesh.dp_world_size,
    }


def plain() -> dict:
    return _step(_samples(per_sample=False))


def one_token_short() -> dict:
    """Rank 1 leaves the weight of its last counted token out of its weight sum: one token of 2 x 8 rows."""
    import hf_gradacc.counting as counting
    from hf_gradacc import weights

    def short(batch, head_type, **kwargs):
        total = weights.target_weight_sum(batch, head_type, **kwargs)
        w = weights.target_weights(batch[LOSS_WEIGHTS_KEY], batch["labels"], head_type=head_type)
        return total - float(w[w > 0].reshape(-1)[-1])

    if rank() == 1:
        counting.target_weight_sum = short
    try:
        return _step(_samples(per_sample=False))
    finally:  # the cases after this one (vlm_cases.py) run with the real count
        counting.target_weight_sum = weights.target_weight_sum


CASES = {"plain": plain, "one_token_short": one_token_short, **VLM_CASES}

if __name__ == "__main__":
    run_named_cases(CASES, __doc__)
