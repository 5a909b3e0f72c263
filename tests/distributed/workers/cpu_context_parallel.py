"""Test-only: run accelerate's context parallelism (``cp_size`` > 1, torch ``context_parallel``) on CPU ranks.

torch 2.13 has no CPU sharding rule for SDPA ("aten._scaled_dot_product_flash_attention_for_cpu ... does not have a
sharding strategy registered") and accelerate 1.15 refuses a ``ParallelismConfig`` with ``cp_size`` on MULTI_CPU.
:func:`install` replaces exactly those two pieces, in the worker process only:

- inside torch's ``context_parallel`` context, ``F.scaled_dot_product_attention`` becomes an exact all-gather
  attention: every rank's keys and values gathered over the ``cp`` group (backward: the summed gradient of this
  rank's slice, one all-reduce), and each local query attends causally by its GLOBAL position in torch's head-tail
  layout. Everything else is upstream's: accelerate's ``_prepare_cp`` and mask hooks, torch's buffer sharding with its
  load balancer, FSDP2 over ``dp_shard_cp``, the Trainer's context-parallel entry;
- accelerate's "ParallelismConfig is only compatible with ..." refusal is let through on MULTI_CPU.

(``torch.distributed.nn.functional.all_gather`` is not used: its gloo backward, an all-to-all of the non-contiguous
gradient slices ``torch.cat`` hands back, gave wrong key / value gradients here: 1.1 relative error.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ORIGINAL_SDPA = F.scaled_dot_product_attention


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of [batch, heads, positions, dim]) over ``group``."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), tensor.shape[2]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def _enable(seq_dim, mesh):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    group, size, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def cp_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or not is_causal:  # accelerate's hook: no mask, is_causal=True
            raise AssertionError(f"context parallelism expects plain causal attention (mask {attn_mask is not None})")
        order = _HeadTailLoadBalancer(query.shape[2] * size, size, "cpu")._generate_indices()[0].long()
        keys, values = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
        mine = order.view(size, -1)[rank].to(query.device)
        allowed = order.to(query.device)[None, :] <= mine[:, None]  # causal by global position
        return _ORIGINAL_SDPA(query, keys, values, attn_mask=allowed, dropout_p=dropout_p, scale=scale,
                              enable_gqa=enable_gqa)  # fmt: skip

    F.scaled_dot_product_attention = cp_sdpa


def _disable():
    F.scaled_dot_product_attention = _ORIGINAL_SDPA


def install() -> None:
    """Patch torch's context-parallel attention dispatch and accelerate's MULTI_CPU check (this process only)."""
    import torch.distributed.tensor.experimental._context_parallel._attention as attention
    from accelerate.parallelism_config import ParallelismConfig

    attention._enable_context_parallel_dispatcher_impl = _enable
    attention._disable_context_parallel_dispatcher_impl = _disable
    validate = ParallelismConfig._validate_accelerator

    def validate_on_cpu(self, accelerator):
        try:
            return validate(self, accelerator)
        except ValueError as error:
            if "only compatible" not in str(error):
                raise

    ParallelismConfig._validate_accelerator = validate_on_cpu
