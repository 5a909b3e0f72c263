"""Models sharded at load time by transformers' ``DistributedConfig``: tensor parallelism, alone or with FSDP2.

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))`` (or ``tp_plan="auto"``) shards
the model itself: tensor-parallel DTensor weights on a ``("pp", "dp_replicate", "fsdp", "tp")`` device mesh, FSDP2
``fully_shard`` over the data dimensions. The Trainer then builds accelerate's ``ParallelismConfig(tp_size,
dp_shard_size)`` and leaves the model unwrapped. What this backend changes against FSDP2 (see
:mod:`hf_gradacc.counting` for the rule):

- the tensor ranks hold copies of the same tokens: the step's counts are summed over the DATA group only (one
  all-gather on that group), and the loss is scaled by the data-parallel size, not the world size;
- the gradients are DTensors on a 2-D (data x tensor) or 1-D (tensor) mesh: norms, clipping and ``trainer.grads`` go
  through DTensor reductions, so a tensor-sharded weight is neither missed nor counted twice.

Expert parallelism (``ep_size`` > 1) runs here too, also with ``tp_size`` 1, where the Trainer gives accelerate no
``parallelism_config`` (``resolve_backend`` sees the model's ``DistributedConfig``): the experts are a second layout
of the same ranks, so the data group, the loss scale and the DTensor norms are the ones above; each micro-batch's
router term is weighted by its routed tokens over that group. Shown exact for ``ep_size == fsdp_size`` (``tp_size``
1) and ``ep_size == tp_size`` (``fsdp_size`` 1); other layouts and pipeline parallelism (``pp_size``) are refused by
name (:func:`check_model_sharding`: the measured reasons there).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from transformers.utils import logging

from ..errors import UnsupportedBackendError
from ..grads import RunningGradNorm
from .fsdp2 import FSDP2Backend, fsdp_root
from .sharded_model import check_model_sharding, distributed_config_of  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from ..config import GradAccSettings

logger = logging.get_logger(__name__)


def _sizes(config: Any) -> dict[str, int]:
    return {
        "dp_replicate": int(getattr(config, "dp_replicate_size", None) or 1),
        "dp_shard": int(getattr(config, "fsdp_size", None) or 1),
        "tp": int(getattr(config, "tp_size", None) or 1),
        "pp": int(getattr(config, "pp_size", None) or 1),
        "ep": int(getattr(config, "ep_size", None) or 1),
    }


def data_group_ranks(sizes: dict[str, int], rank: int) -> list[list[int]]:
    """Every data-parallel group of transformers' ``("pp", "dp_replicate", "fsdp", "tp")`` mesh (row-major ranks), in
    one order on every rank: the ranks that share this rank's pipeline stage and tensor coordinate.

    Example:
        ```python
        data_group_ranks({"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}, 0)   # [[0, 2], [1, 3]]
        ```
    """
    pp, rep, shard, tp = sizes["pp"], sizes["dp_replicate"], sizes["dp_shard"], sizes["tp"]
    groups = []
    for stage in range(pp):
        for t in range(tp):
            groups.append([((stage * rep + r) * shard + f) * tp + t for r in range(rep) for f in range(shard)])
    return groups


class TensorParallelBackend(FSDP2Backend):
    """A model sharded by transformers' ``DistributedConfig`` (tensor parallel, optionally x FSDP2 / HSDP; expert
    parallel with FSDP2 or with tensor parallelism).

    The count collective runs on the data-parallel group (the ranks that hold different samples); the loss is scaled
    by its size. With FSDP2 over the data dimensions (``fsdp_size`` > 1) the window's reduction follows
    ``fsdp_sync`` as on :class:`~hf_gradacc.backends.fsdp2.FSDP2Backend`; tensor parallelism alone reduces nothing
    across ranks (every tensor rank computes its own slice's gradient from the same tokens).

    Example:
        ```python
        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)
        )
        trainer = GradAccTrainer(model=model, args=args, train_dataset=data)   # torchrun --nproc_per_node 4
        trainer.backend.describe()   # "TP 2 x FSDP 2, 4 processes, gloo"
        ```
    """

    name = "tensor_parallel"

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        settings: GradAccSettings | None = None,
        *,
        multi_backward: bool = False,
        model: torch.nn.Module | None = None,
    ) -> None:
        super().__init__(accelerator, args, settings, multi_backward=multi_backward, model=model)
        self._sizes: dict[str, int] | None = None
        self._group: Any = None

    # ---- the mesh
    def check_model(self, model: torch.nn.Module) -> None:
        config = check_model_sharding(model, self.args)
        if config is None:
            raise UnsupportedBackendError(
                f"accelerate set up tensor parallelism (`parallelism_config.tp_size` "
                f"{getattr(self.accelerator.parallelism_config, 'tp_size', '?')}) but the model "
                f"({type(model).__name__}) was not sharded by transformers. GradAccTrainer supports tensor "
                "parallelism "
                "through `from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))` "
                "(or `tp_plan='auto'`); remove `tp_size` from the accelerate `parallelism_config` otherwise."
            )
        self._sizes = _sizes(config)
        if getattr(self.settings, "fused_lm_head", False) and self._sizes["tp"] > 1:
            raise UnsupportedBackendError(
                f"`fused_lm_head=True` is not supported under tensor parallelism (`tp_size` {self._sizes['tp']}): the "
                "head's tiles would need their sums and log-sum-exps reduced across the tensor ranks of a "
                "vocabulary-sharded `lm_head`, which the fused head does not do. Set `fused_lm_head=False` (the "
                "model's own head then runs, tensor-parallel)."
            )
        self._build_group()

    @property
    def model_parallelism(self) -> str | None:
        tp = (self._sizes or {}).get("tp", 1)
        return f"tensor parallelism (`tp_size` {tp})" if tp > 1 else None

    def _build_group(self) -> None:
        import torch.distributed as dist

        assert self._sizes is not None
        if not (dist.is_available() and dist.is_initialized()) or self.mesh.dp_world_size == 1:
            return
        rank = dist.get_rank()
        for ranks in data_group_ranks(self._sizes, rank):  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                self._group = group

    @property
    def _has_fsdp(self) -> bool:
        return self._sizes is not None and self._sizes["dp_replicate"] * self._sizes["dp_shard"] > 1

    def kind(self) -> str:
        sizes = self._sizes or {}
        parts = [f"TP {sizes['tp']}"] if sizes.get("tp", 1) > 1 else []
        if sizes.get("ep", 1) > 1:
            parts.append(f"EP {sizes['ep']}")
        rep, shard = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1)
        if rep > 1 and shard > 1:
            parts.append(f"HSDP {rep} x {shard}")
        elif rep * shard > 1:
            parts.append(f"FSDP {rep * shard}")
        return " x ".join(parts) or "transformers-sharded model"

    def describe(self) -> str:
        import torch.distributed as dist

        group = dist.get_backend() if dist.is_available() and dist.is_initialized() else "?"
        return f"{self.kind()}, {self.accelerator.num_processes} processes, {group}"

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """One collective on the data-parallel group: the tensor ranks' rows would be copies of the same counts."""
        import torch.distributed as dist

        if self._group is None:
            return tensor.unsqueeze(0)
        rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(rows, tensor.contiguous(), group=self._group)
        return torch.stack(rows)

    # ---- the window
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if self._has_fsdp:
            super().setup(model, optimizer)
        else:
            self.model = model

    def _set_sync(self, root: torch.nn.Module, *, is_final: bool) -> None:
        if self._has_fsdp:
            super()._set_sync(root, is_final=is_final)

    def sync_context(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        return super().sync_context(is_last=is_last) if self._has_fsdp else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, is_final: bool, retain_graph: bool = False) -> None:
        if self._has_fsdp:
            super().backward(loss, is_final=is_final, retain_graph=retain_graph)
        else:
            self.accelerator.backward(loss, retain_graph=retain_graph)

    def running_grad_sq_norm(self, params: list[torch.nn.Parameter]) -> RunningGradNorm:
        raise UnsupportedBackendError(
            "The gradient between micro-batches is not readable under tensor parallelism (not measured): read "
            "gradients after the final backward pass (`trainer.grads`, `on_pre_optimizer_step`)."
        )

    # ---- gradients: DTensors on the (data x tensor) mesh
    def grad_sq_norms(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Each parameter's full squared gradient norm, for every DTensor gradient in ONE all-reduce over the world.

        Each rank adds its local shard's sum of squares, weighted by ``pieces / world``: a DTensor on a mesh sharded
        into ``pieces`` distinct pieces (the product of its ``Shard`` dimensions) has every piece on ``world /
        pieces`` ranks (its replicated dimensions and the ranks outside its sub-mesh hold copies), so the world's sum
        is the full norm once. A pending sum (a ``Partial`` placement) is reduced on its own first. Plain tensors are
        whole on every rank: their norms are local. Every rank calls it with the same parameters, in the same order.
        """
        import math

        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        values: list[torch.Tensor] = []
        sharded: list[bool] = []
        device = None
        for param in params:
            grad = param.grad
            if grad is None:
                values.append(torch.zeros((), dtype=torch.float64))
                sharded.append(False)
                continue
            if isinstance(grad, DTensor) and not any(p.is_partial() for p in grad.placements):
                # every placement but Replicate cuts (Shard, and FSDP2's _StridedShard, for which is_shard() is False)
                pieces = math.prod(
                    grad.device_mesh.size(d) for d, p in enumerate(grad.placements) if not p.is_replicate()
                )
                local = grad.to_local().detach()
                device = device or local.device
                values.append(local.double().pow(2).sum().cpu() * (pieces / world))
                sharded.append(True)
                continue
            norm = torch.linalg.vector_norm(grad.detach(), dtype=torch.float64)
            if isinstance(norm, DTensor):  # a Partial gradient: its sum first
                norm = norm.full_tensor()
            values.append(norm.square().cpu())
            sharded.append(False)
        if not values:
            return torch.zeros(0, dtype=torch.float64)
        squares = torch.stack(values)
        if world > 1 and any(sharded):
            mask = torch.tensor(sharded)
            summed = torch.where(mask, squares, torch.zeros_like(squares)).to(device)
            dist.all_reduce(summed)  # one collective for every sharded parameter
            squares = torch.where(mask, summed.cpu(), squares)
        return squares

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self._bound().parameters() if p.grad is not None]
        norm = self.grad_sq_norms(params).sum().sqrt()
        if max_norm != float("inf") and float(norm) > max_norm:
            factor = max_norm / (float(norm) + 1e-6)
            for param in params:
                param.grad.mul_(factor)  # elementwise on each rank's shard: no communication
        return norm.float()

    def full_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        module = fsdp_root(model) if self._has_fsdp else self.accelerator.unwrap_model(model)
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in module.named_parameters()
        }
