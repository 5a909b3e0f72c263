"""Mesh worker: the run's mesh and world, and the collectives per optimizer step, on CPU ranks (gloo).

Started by ``tests/distributed/test_mesh_dp.py``, through ``tests/distributed/launcher.py`` (2 ranks) or through two
``accelerate launch --num_machines 2 --machine_rank R`` launchers (2 simulated nodes x 2 processes):

    python tests/distributed/workers/mesh_cases.py --cases budget_ddp,budget_fsdp2_deferred

Cases:
- ``multinode_<task>``: ddp_cases' exactness case (GradAccTrainer and the stock Trainer, one SGD step against the
  float64 full batch) plus the mesh (`mesh_from_accelerator`) and the launcher's world (`LaunchedWorld.from_env`).
- ``construct_only``: a GradAccTrainer is built (its start-up checks run), nothing trained.
- ``construct_distributed_config``: the same for a model FSDP2-sharded by transformers' ``DistributedConfig``.
- ``budget_<backend>[_clipped]``: three optimizer steps of the GradAccTrainer and of the stock Trainer (GA 4; clipping
  at ``max_grad_norm`` 1.0 with ``_clipped``), every ``torch.distributed`` and functional collective counted per
  optimizer step and per log line (:class:`Budget`), each attributed to the innermost frame outside torch
  (``hf_gradacc`` = the library's own; inside a module call: ``model<...``), plus DDP's bucket all-reduces (a comm
  hook: the reducer is C++). The rules: tests/distributed/collective_budget.py.
- ``strided_shard_norms``: ``FSDP2Backend.grad_sq_norms`` of a ``_StridedShard``-placed DTensor gradient.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from _common import rank, run_named_cases, world_size
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.backends.mesh import LaunchedWorld, mesh_from_accelerator
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

BS, GA, STEPS = 2, 4, 3
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single",
    "barrier", "all_gather_single", "reduce_scatter_single",
)
# torch's functional collectives: what DTensor (FSDP2 / tensor-parallel gradients, their norms) reduces with
FUNCTIONAL = (
    "all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_single", "all_to_all_single",
    "all_to_all_single_autograd", "broadcast", "permute_tensor",
)
_TORCH = os.path.dirname(torch.__file__)
_MODULE_CALL = (os.path.join(_TORCH, "nn", "modules", "module.py"), ("_call_impl", "_wrapped_call_impl"))


def _origin() -> str:
    """The package of the innermost caller outside torch and accelerate's collective helpers (``hf_gradacc``,
    ``transformers``, ``accelerate``, ...): a gather the library asks accelerate for is the library's. A collective
    made inside a module call (FSDP2's pre-forward all-gathers, a tensor-parallel layer's hooks) is the model's:
    ``model<caller``, whoever ran the forward (the library's loss runs the model's forward as the Trainer's does)."""
    frame = sys._getframe(2)
    in_module = False
    while frame is not None:
        path = frame.f_code.co_filename
        if path == _MODULE_CALL[0] and frame.f_code.co_name in _MODULE_CALL[1]:
            in_module = True
        helper = path.replace(os.sep, "/").endswith("accelerate/utils/operations.py") or (
            path.replace(os.sep, "/").endswith("accelerate/accelerator.py") and frame.f_code.co_name == "gather")
        if not path.startswith(_TORCH) and not helper:
            return ("model<" if in_module else "") + _caller(frame)
        frame = frame.f_back
    return "torch"


def _caller(frame: Any) -> str:
    """``hf_gradacc:<its innermost 3 function names>``, ``transformers``, ``accelerate``, ``deepspeed`` or
    ``other:<file>:<function>`` for the frame that asked."""
    parts = frame.f_code.co_filename.replace(os.sep, "/").split("/")
    if "hf_gradacc" in parts:  # the library's: name its first frames (which of its steps asked)
        names = []
        while frame is not None and len(names) < 3:
            if "/hf_gradacc/" in frame.f_code.co_filename.replace(os.sep, "/"):
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        return "hf_gradacc:" + "<".join(names)
    for package in ("transformers", "accelerate", "deepspeed"):
        if package in parts:
            return package
    return f"other:{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


def _counting_hook(budget, bucket):  # no annotations: DDP checks them, and they are strings here
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    budget.buckets += 1
    return default_hooks.allreduce_hook(None, bucket)


class Budget(TrainerCallback):
    """Collectives per optimizer step (``per_step``) and per log line (``per_log``): ``torch.distributed`` and
    functional collective calls by (function, origin), and DDP buckets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.buckets = 0
        self.per_step: list[dict[str, Any]] = []
        self.per_log: list[dict[str, Any]] = []
        self._originals: dict[tuple[Any, str], Any] = {}
        self.is_paused = False  # while a test's own callback reads gradients (trainer.grads: its collectives)
        self.trainer: Any = None

    def __enter__(self) -> Budget:
        import torch.distributed._functional_collectives as funcol

        inside = [False]  # a collective that calls another one is counted once
        for module, names, prefix in ((dist, COLLECTIVES, ""), (funcol, FUNCTIONAL, "funcol.")):
            for name in names:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._originals[(module, name)] = original

                def counted(*args: Any, _name: str = prefix + name, _original: Any = original, **kwargs: Any) -> Any:
                    if inside[0] or self.is_paused:
                        return _original(*args, **kwargs)
                    origin = _origin()
                    if not origin.startswith("other:mesh_cases.py"):  # the comm hook's own bucket all-reduce
                        self.calls.append((_name, origin))
                    inside[0] = True
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        inside[0] = False

                setattr(module, name, counted)
        return self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False

    def __exit__(self, *exc: Any) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            wrapped.register_comm_hook(self, _counting_hook)
        self.calls.clear()

    def _take(self) -> dict[str, Any]:
        by = collections.Counter(f"{name}@{origin}" for name, origin in self.calls)
        taken = {"calls": dict(by), "ddp_buckets": self.buckets, "total": len(self.calls) + self.buckets,
                 "library": sum(n for k, n in by.items() if "@hf_gradacc" in k)}
        self.calls.clear()
        self.buckets = 0
        return taken

    def on_step_end(self, args, state, control, **kwargs):  # once per optimizer step, after it
        self.per_step.append(self._take())

    def on_log(self, args, state, control, logs=None, **kwargs):
        # the Trainer logs after on_step_end: what a logging step adds (the loss gather, the library's logged terms
        # and expert load) is counted apart from the step, per log line (``is_train_log``: a line with the loss)
        self.per_log.append({**self._take(), "step": state.global_step, "is_train_log": "loss" in (logs or {})})


def _budget(backend: str, fsdp_sync: str | None = None, max_grad_norm: float = 0.0,
            **knobs: Any) -> Callable[[], dict[str, Any]]:  # fmt: skip
    def run() -> dict[str, Any]:
        overrides: dict[str, Any] = {"max_steps": STEPS, "logging_steps": 1000, "max_grad_norm": max_grad_norm}
        if backend == "fsdp2":
            from hf_gradacc.patches.fsdp_cpu import enable_fsdp_on_cpu

            enable_fsdp_on_cpu()
            overrides.update(fsdp=True, fsdp_config={"version": 2}, ddp_backend="gloo")
        samples = make_samples("causal_lm", world_size() * BS * GA * STEPS, seed=5)
        result: dict[str, Any] = {}
        for kind in ("gradacc", "stock"):
            extra = {"fsdp_sync": fsdp_sync} if (kind == "gradacc" and fsdp_sync) else {}
            extra.update(knobs if kind == "gradacc" else {})  # e.g. save_on_preemption: its flag adds no collective
            args = one_step_args(
                tempfile.mkdtemp(prefix="hf_gradacc_budget_"), per_device_train_batch_size=BS,
                gradient_accumulation_steps=GA, args_class=GradAccConfig if kind == "gradacc" else TrainingArguments,
                **overrides, **extra,
            )
            budget = Budget()
            trainer_class = GradAccTrainer if kind == "gradacc" else Trainer
            trainer = trainer_class(model=build_tiny_model("causal_lm"), args=args, train_dataset=ListDataset(samples),
                                    data_collator=PaddingCollator(), callbacks=[budget])
            budget.trainer = trainer
            with budget:
                trainer.train()
            result[kind] = {"steps": budget.per_step, "logs": budget.per_log, "global_step": trainer.state.global_step,
                            "mesh": mesh_from_accelerator(trainer.accelerator, trainer.model).describe()}
        return result

    return run


def _multinode(task: str) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        import ddp_cases
        from accelerate import Accelerator

        payload = ddp_cases.case_exact(task)()
        mesh = mesh_from_accelerator(Accelerator(), None)
        world = LaunchedWorld.from_env()
        return {**payload, "mesh": mesh.as_dict(), "world": {"launcher": world.launcher, "nodes": world.num_nodes,
                                                            "per_node": world.num_processes_per_node},
                "rank": rank(), "dist_world": dist.get_world_size()}

    return run


def _construct_only() -> dict[str, Any]:
    """Build a GradAccTrainer and nothing else: the start-up checks run (the world check among them)."""
    args = one_step_args(tempfile.mkdtemp(prefix="hf_gradacc_mesh_"), per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, args_class=GradAccConfig)
    trainer = GradAccTrainer(model=build_tiny_model("causal_lm"), args=args,
                             train_dataset=ListDataset(make_samples("causal_lm", 8)), data_collator=PaddingCollator())
    return {"mesh": mesh_from_accelerator(trainer.accelerator).describe()}


def _construct_distributed_config() -> dict[str, Any]:
    """A model FSDP2-sharded at load time by transformers' ``DistributedConfig(fsdp_size=W)``, then a GradAccTrainer
    (its start-up checks refuse it: accelerate sets up DDP for such a model)."""
    import time
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = Path(os.environ["HF_GRADACC_TEST_OUT"]) / "tiny_causal_lm"
    if rank() == 0:
        build_tiny_model("causal_lm").save_pretrained(checkpoint / "tmp")
        (checkpoint / "tmp").rename(checkpoint / "model")
    while not (checkpoint / "model" / "config.json").exists():
        time.sleep(0.2)
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model",
                                                 distributed_config=DistributedConfig(fsdp_size=world_size()))
    args = one_step_args(tempfile.mkdtemp(prefix="hf_gradacc_mesh_"), per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, args_class=GradAccConfig, ddp_backend="gloo")
    trainer = GradAccTrainer(model=model, args=args, train_dataset=ListDataset(make_samples("causal_lm", 8)),
                             data_collator=PaddingCollator())
    return {"backend": type(trainer.backend).__name__}


def _strided_shard_norms() -> dict[str, Any]:
    """``FSDP2Backend.grad_sq_norms`` of a DTensor gradient placed ``_StridedShard`` (what ``fully_shard`` over a
    tensor-parallel dimension gives; in torch 2.13 no ``Shard`` subclass) first, then a plain (replicated) gradient:
    each entry against the full gradient's squared norm, computed on every rank from the same seed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from hf_gradacc.backends.fsdp2 import FSDP2Backend

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size(),))
    generator = torch.Generator().manual_seed(7)
    fulls = [torch.randn(8, 3, generator=generator), torch.randn(5, generator=generator)]
    strided = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 3), mesh, [_StridedShard(0, split_factor=2)]))
    strided.grad = distribute_tensor(fulls[0], mesh, [_StridedShard(0, split_factor=2)])
    plain = torch.nn.Parameter(torch.zeros(5))
    plain.grad = fulls[1].clone()
    squares = FSDP2Backend(accelerator=None, args=None).grad_sq_norms([strided, plain])
    return {"squares": squares.tolist(), "expected": [float(f.double().pow(2).sum()) for f in fulls],
            "placements": str(strided.grad.placements), "local_rows": strided.grad.to_local().shape[0]}


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "strided_shard_norms": _strided_shard_norms,
    "construct_only": _construct_only,
    "construct_distributed_config": _construct_distributed_config,
    "budget_ddp": _budget("ddp"),
    "budget_ddp_clipped": _budget("ddp", max_grad_norm=1.0),
    "budget_ddp_preemption": _budget("ddp", save_on_preemption=True),
    **{f"budget_fsdp2_{sync}": _budget("fsdp2", sync) for sync in ("deferred", "every_micro_batch")},
    **{f"multinode_{task}": _multinode(task) for task in ("causal_lm", "sequence_classification")},
}

if __name__ == "__main__":
    run_named_cases(CASES, __doc__)
