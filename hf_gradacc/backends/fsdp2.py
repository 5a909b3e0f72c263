"""FSDP2 (`torch.distributed.fsdp.fully_shard`, accelerate ``fsdp_version: 2``)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import FSDP_SYNCS
from ..errors import GradAccConfigError
from .base import Backend

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

logger = logging.getLogger(__name__)

# The accelerate release whose FSDP2 wrapping `fsdp2_wrap_problems` mirrors (`fsdp2_prepare_model`): on it a
# predicted problem is an error; on another release it is a warning, since the wrapping may have changed.
WRAPPING_CHECKED_WITH_ACCELERATE = (1, 15)


def fsdp_root(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost module ``fully_shard`` was applied to (``model`` itself once accelerate prepared it).

    Example:
        ```python
        root = fsdp_root(trainer.model_wrapped)
        root.set_requires_gradient_sync(False)
        ```
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # pre-order: the first FSDP module is the outermost one
        if isinstance(module, FSDPModule):
            return module
    raise GradAccConfigError(
        f"The model ({type(model).__name__}) has no module wrapped by FSDP2 `fully_shard`, yet accelerate reports "
        "FSDP2. Let the Trainer prepare the model (do not pass an already-prepared model), or set `fsdp_version: 2` "
        "in the accelerate config."
    )


def is_hsdp(model: torch.nn.Module) -> bool:
    """Whether ``model``'s FSDP2 parameters live on a 2-D (replicate, shard) mesh: hybrid sharding (HSDP)."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in model.parameters():
        if isinstance(param, DTensor):
            return any(isinstance(p, Replicate) for p in param.placements)
    return False


# ---------------------------------------------------------------------------------------------- wrapping preflight
@dataclass(frozen=True, slots=True, kw_only=True)
class WrapProblem:
    """One reason accelerate's FSDP2 wrapping would fail on a model, with the fix."""

    kind: str  # "nested_embedding" | "tied_across_groups"
    message: str


def _accelerate_version() -> tuple[int, ...]:
    import accelerate

    parts = []
    for piece in accelerate.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _auto_wrap_class_names(model: torch.nn.Module, fsdp_plugin: Any) -> list[str] | None:
    """The class names accelerate's transformer auto-wrap policy wraps, or None for another policy."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = getattr(fsdp_plugin, "auto_wrap_policy", None)
    if isinstance(policy, functools.partial):
        policy = policy.func
    if isinstance(policy, str):  # not yet resolved by the plugin's __post_init__
        if policy.upper() != "TRANSFORMER_BASED_WRAP":
            return [] if policy.upper() == "NO_WRAP" else None
    elif policy is None:
        return []
    elif policy is not transformer_auto_wrap_policy:
        return None  # size-based or custom: not predicted
    names = getattr(fsdp_plugin, "transformer_cls_names_to_wrap", None)
    if isinstance(names, str):
        names = names.split(",")
    if names is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
    return [n.strip() for n in names if n.strip()]


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        from accelerate.utils.fsdp_utils import _find_final_norm
    except ImportError:
        return None
    return _find_final_norm(model)


def fsdp2_wrap_problems(model: torch.nn.Module, fsdp_plugin: Any) -> list[WrapProblem]:
    """Why accelerate's FSDP2 wrapping (``fsdp2_prepare_model``, accelerate 1.15) would fail on ``model``.

    accelerate wraps, in this order: every module of the auto-wrap classes (``transformer_layer_cls_to_wrap``, by
    default the model's ``_no_split_modules``), the input embeddings, a tail group (final norm, output embeddings,
    and the input embeddings when they are tied to the output ones), then the root. Two layouts make torch refuse:

    - ``nested_embedding``: an auto-wrap class contains the input (or output) embeddings, which accelerate then
      wraps a second time (BERT: ``BertEmbeddings`` is in ``_no_split_modules``). torch fails with "Invariant
      encountered: value was None when it should not be".
    - ``tied_across_groups``: one parameter reachable from modules of two different groups (T5's shared embedding,
      BertForMaskedLM's decoder bias). torch fails with "... is shared with a parameter already managed by another
      FSDP group".

    Input and output embeddings tied to each other (``tie_word_embeddings=True``) are fine: they share a group.
    Size-based and custom wrap policies are not predicted (empty list).

    Example:
        ```python
        problems = fsdp2_wrap_problems(model, trainer.accelerator.state.fsdp_plugin)
        for p in problems:
            print(p.kind, p.message)
        ```
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return []  # already sharded (e.g. loaded with a distributed config): accelerate does not wrap it again
    class_names = _auto_wrap_class_names(model, fsdp_plugin)
    if class_names is None:
        return []
    problems: list[WrapProblem] = []
    paths = {id(m): name or "<root>" for name, m in model.named_modules()}
    # accelerate wraps bottom-up (innermost first); a module belongs to the first unit that contains it
    units: list[tuple[str, torch.nn.Module]] = []
    for name, module in reversed(list(model.named_modules())):
        if module is not model and type(module).__name__ in class_names:
            units.append((f"{type(module).__name__} ({name})", module))
    unit_of: dict[int, str] = {}

    def claim(label: str, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            for sub in module.modules():
                unit_of.setdefault(id(sub), label)

    for label, module in units:
        claim(label, [module])

    def embedding(getter: str) -> torch.nn.Module | None:
        fn = getattr(model, getter, None)
        try:
            return fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            return None

    input_embed, output_embed = embedding("get_input_embeddings"), embedding("get_output_embeddings")
    input_weight = getattr(input_embed, "weight", None)
    tied_io = input_weight is not None and input_weight is getattr(output_embed, "weight", None)
    tail = [
        m
        for m in ((_final_norm(model), input_embed, output_embed) if tied_io else (_final_norm(model), output_embed))
        if m is not None
    ]
    extra = ([] if tied_io or input_embed is None else [("input embeddings", [input_embed])]) + (
        [("tail (final norm, output embeddings)", tail)] if tail else []
    )
    for label, modules in extra:
        for module in modules:
            owner = next(
                (lbl for lbl, unit in units if unit is not module and any(s is module for s in unit.modules())), None
            )
            if owner is not None:
                owner_class = owner.split(" ")[0]
                keep = [n for n in class_names if n != owner_class]
                problems.append(
                    WrapProblem(
                        kind="nested_embedding",
                        message=(
                            f"`{paths.get(id(module))}` ({type(module).__name__}, part of the {label}) lies inside "
                            f"the auto-wrapped {owner}; accelerate wraps it a second time and torch fails "
                            "('Invariant encountered: value was None'). Wrap only the layer classes: "
                            f"fsdp_config={{'transformer_layer_cls_to_wrap': {keep}}} in TrainingArguments (accelerate "
                            f"config: `fsdp_transformer_layer_cls_to_wrap: {','.join(keep)}`)."
                        ),
                    )
                )
        claim(label, modules)
    claim("root", [model])

    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            owners.setdefault(id(param), []).append((full, unit_of.get(id(module), "root")))
    for entries in owners.values():
        groups = sorted({g for _, g in entries})
        if len(groups) > 1:
            names = sorted({n for n, _ in entries})
            problems.append(
                WrapProblem(
                    kind="tied_across_groups",
                    message=(
                        f"{names} are one tied parameter, but accelerate puts them in different FSDP groups "
                        f"({', '.join(groups)}); torch refuses ('shared with a parameter already managed by another "
                        "FSDP group'). FSDP2 through accelerate cannot shard this model as is: train it with DDP or "
                        "DeepSpeed ZeRO (`distributed_type` in the accelerate config), or untie the weights where "
                        "the model allows it."
                    ),
                )
            )
    return problems


class FSDP2Backend(Backend):
    """FSDP2 through accelerate: one window's gradient is reduced per ``args.fsdp_sync``.

    - ``'deferred'`` (default): every backward pass but the window's final one runs with
      ``set_requires_gradient_sync(False)``; each rank keeps the full (unsharded) gradient of its wrapped blocks
      and the final backward reduce-scatters the sum once. One reduce-scatter per FSDP group per optimizer step;
      unsharded gradient memory.
    - ``'every_micro_batch'``: every backward pass reduce-scatters and only the gradient shard is kept, summed
      across micro-batches. One reduce-scatter per FSDP group per backward pass; sharded gradient memory.
    - ``'defer_all_reduce'``: HSDP only. Every backward reduce-scatters inside the shard group; the all-reduce
      across replicas runs once, in the final backward (``set_requires_all_reduce``). On a 1-D mesh there is no
      all-reduce to defer: it behaves like ``'every_micro_batch'`` (a warning says so once).

    FSDP2 decides the reduction in each parameter group's post-backward hook, so the choice is made per backward
    pass (several backward passes per micro-batch are exact). FSDP2 averages over the data-parallel ranks like DDP,
    so the trainer's normalisation (sum / global count * world size) is exact for every choice. The final backward
    runs with ``set_is_last_backward(True)`` (FSDP waits for every pending reduction), the others with False.

    Example:
        ```python
        args = GradAccConfig(
            output_dir="out", gradient_accumulation_steps=8, fsdp=True, fsdp_config={"version": 2},
            fsdp_sync="every_micro_batch",   # sharded gradients only: less memory, GA x the reduce-scatters
        )
        ```
    """

    name = "fsdp2"

    def __init__(self, accelerator: Accelerator, args: TrainingArguments) -> None:
        super().__init__(accelerator, args)
        self.fsdp_sync: str = getattr(args, "fsdp_sync", "deferred")
        if self.fsdp_sync not in FSDP_SYNCS:
            raise GradAccConfigError(f"`fsdp_sync` ({self.fsdp_sync!r}) must be one of {FSDP_SYNCS}")
        self._hsdp: bool | None = None

    def kind(self) -> str:
        return "FSDP2"

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise a clear error for a model accelerate's FSDP2 wrapping would reject (see `fsdp2_wrap_problems`)."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is None:
            return
        problems = fsdp2_wrap_problems(model, plugin)
        if not problems:
            return
        text = f"{type(model).__name__} cannot be wrapped by accelerate's FSDP2:\n" + "\n".join(
            f"- {p.message}" for p in problems
        )
        if _accelerate_version() == WRAPPING_CHECKED_WITH_ACCELERATE:
            raise GradAccConfigError(text)
        logger.warning(f"{text}\n(predicted from accelerate 1.15's wrapping; this accelerate may differ)")

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        root = fsdp_root(model)
        self._hsdp = is_hsdp(root)
        if self.fsdp_sync == "defer_all_reduce" and not self._hsdp:
            logger.warning(
                "`fsdp_sync='defer_all_reduce'` only differs from 'every_micro_batch' under HSDP (a 2-D replicate x "
                "shard mesh); this model is fully sharded on a 1-D mesh, so every micro-batch reduce-scatters. Set "
                "`fsdp_sync='deferred'` for one reduce-scatter per optimizer step."
            )
        logger.info(f"FSDP2 gradient sync: {self.fsdp_sync} (HSDP: {self._hsdp})")

    def _set_sync(self, root: torch.nn.Module, *, is_final: bool) -> None:
        if self._hsdp is None:
            self._hsdp = is_hsdp(root)
        if self.fsdp_sync == "deferred":
            root.set_requires_gradient_sync(is_final)
        elif self.fsdp_sync == "defer_all_reduce" and self._hsdp:
            root.set_requires_gradient_sync(True)
            root.set_requires_all_reduce(is_final)
        else:
            root.set_requires_gradient_sync(True)
        # False lets a non-final backward return without waiting on its reductions (torch's documented
        # micro-batching use); the final one waits for all of them, so the grads are complete for the step.
        root.set_is_last_backward(is_final)

    @contextlib.contextmanager
    def _restore_defaults(self, model: torch.nn.Module) -> Iterator[None]:
        try:
            yield
        finally:
            # upstream defaults again, so that evaluation or user code outside the window never sees a stale setting
            root = fsdp_root(model)
            root.set_requires_gradient_sync(True)
            root.set_is_last_backward(True)

    def sync_context(self, model: torch.nn.Module, *, is_last: bool) -> contextlib.AbstractContextManager:
        # FSDP2 reads the sync flags in the post-backward hooks, so `backward` sets them per pass; outside the
        # micro-batch the upstream defaults are restored.
        return self._restore_defaults(model)

    def backward(
        self, loss: torch.Tensor, *, model: torch.nn.Module, is_final: bool, retain_graph: bool = False
    ) -> None:
        self._set_sync(fsdp_root(model), is_final=is_final)
        # accelerate's FSDP2 path is a plain loss.backward() (through its grad scaler with fp16); the Trainer keeps
        # accelerate's own accumulation at 1 step, so accelerate does not rescale the loss.
        self.accelerator.backward(loss, retain_graph=retain_graph)

    def scale_grads(self, model: torch.nn.Module, factor: float) -> None:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)  # elementwise on each rank's shard: no communication

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(norm, DTensor):  # a norm over sharded grads is a DTensor
            norm = norm.full_tensor()
        return norm if torch.is_tensor(norm) else torch.tensor(float(norm))

    # ---- gradient access: grads are DTensors sharded on dim 0 (Replicate x Shard(0) under HSDP)
    def full_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        # DTensor shards are all-gathered (a collective: every rank, same order).
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in fsdp_root(model).named_parameters()
        }

    def full_grad(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        grad = param.grad
        if grad is None:
            grad = torch.zeros_like(param)
        return grad.full_tensor() if isinstance(grad, DTensor) else grad

    def local_grad(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        grad = param.grad
        if grad is None:
            return torch.zeros_like(param.to_local() if isinstance(param, DTensor) else param)
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def write_full_grad(self, name: str, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(param, DTensor):
            super().write_full_grad(name, param, grad)
            return
        # Every rank holds the same full gradient: cut this rank's shard locally (src_data_rank=None: no collective)
        shard = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
        if param.grad is None:
            param.grad = shard
        else:
            param.grad.to_local().copy_(shard.to_local())

    def grad_sq_norms(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Shard

        local: list[torch.Tensor] = []
        group = None
        shard_rank = 0
        for _, param in named_params:
            grad = param.grad
            if isinstance(grad, DTensor):
                if group is None:
                    dims = [i for i, p in enumerate(grad.placements) if isinstance(p, Shard)]
                    if dims:
                        group = grad.device_mesh.get_group(dims[0])
                        shard_rank = grad.device_mesh.get_local_rank(dims[0])
                local.append(grad.to_local().detach().double().pow(2).sum())
            elif grad is None:
                local.append(torch.zeros((), dtype=torch.float64, device=param.device))
            else:
                local.append(grad.detach().double().pow(2).sum())
        if not local:
            return torch.zeros(0, dtype=torch.float64)
        squares = torch.stack(local)
        if group is not None:
            # replicated (non-DTensor) grads are whole on every shard rank: count them once
            plain = torch.tensor([not isinstance(p.grad, DTensor) for _, p in named_params], device=squares.device)
            if shard_rank != 0:
                squares = torch.where(plain, torch.zeros_like(squares), squares)
            dist.all_reduce(squares, group=group)  # one collective: the shards' sums of squares add up
        return squares.cpu()
