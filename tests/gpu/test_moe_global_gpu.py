"""GPU tier: `router_balance="global_batch"` on CUDA (the experts' grouped-mm kernels, no TF32): the routing pre-pass
routes exactly as the training forwards (no micro-batch's routing moved) and the step equals the float64 reference
of definition B (tests/unit/test_moe_global.py is the CPU version). Skipped without a CUDA device; NOT run yet
(no GPU was available when it was written)."""

from __future__ import annotations

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.moe_balance import StepRouting
from hf_gradacc.testing.moe_reference import global_balance_gradients
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import MOE_FAMILIES, PaddingCollator, build_tiny_moe, make_samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs a CUDA device"),
]

TOLERANCE = 1e-5
ROUTER_TOLERANCE = 5e-5


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize(("bs", "ga"), [(8, 1), (2, 4), (1, 8)])
def test_gpu_global_batch_exact(family: str, bs: int, ga: int, monkeypatch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    moved = []
    original = StepRouting._check_routing

    def record(self, counts, index):
        expected = self.prepass[index]
        moved.append(int((expected[:, :-1] - counts[:, :-1]).abs().sum()))
        return original(self, counts, index)

    monkeypatch.setattr(StepRouting, "_check_routing", record)
    model = build_tiny_moe(family, router_aux_loss_coef=0.1)
    samples = make_samples("causal_lm", 8, seed=27)
    args = one_step_args(per_device_train_batch_size=bs, gradient_accumulation_steps=ga, args_class=GradAccConfig,
                         router_balance="global_batch")  # fmt: skip
    update, trainer = one_step_update(GradAccTrainer, model, samples, args)
    assert trainer.args.device.type == "cuda"
    assert len(moved) == ga and not any(moved), moved  # the pre-pass routed as the training forwards did
    reference = global_balance_gradients(model, samples, PaddingCollator())
    router = [n for n in reference if n.endswith("mlp.gate.weight")]
    assert compare(update, reference).relative_error <= TOLERANCE
    assert compare({n: update[n] for n in router}, {n: reference[n] for n in router}).relative_error <= ROUTER_TOLERANCE
