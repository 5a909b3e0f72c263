"""The run's mesh: how many ranks hold what, on how many nodes, and whether that is the world the launch asked for.

`Mesh` is a value object (frozen, slotted) read once from accelerate's state, its ``parallelism_config``, the model's
``DistributedConfig`` and the launcher's environment variables. It knows nothing about gradients: backends and the
counting code ask it which dimensions hold different samples (data: replicate x shard; sequence: context /
sequence-parallel shards) and which hold copies of the same tokens (tensor, expert, pipeline).

`check_launched_world` is the start-up check that the world a process joined is the world the launch asked for
(``accelerate launch --num_machines`` x processes per machine, torchrun's ``--nnodes`` x ``--nproc_per_node``): a
launch that splits into several smaller worlds (DeepSpeed's pdsh launcher without a hostfile) is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import GradAccConfigError, GradAccDistributedError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

__all__ = [
    "COPY_DIMS",
    "COUNTED_DIMS",
    "MESH_DIMS",
    "LaunchedWorld",
    "Mesh",
    "check_launched_world",
    "mesh_from_accelerator",
]


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchedWorld:
    """What the launcher told this process, from its environment variables only (no collective).

    Attributes:
        launcher: ``"torchrun"`` (torch elastic: ``torchrun`` and ``accelerate launch``'s DDP / FSDP / DeepSpeed
            ``standard`` paths), ``"deepspeed"`` (DeepSpeed's own launcher: pdsh, ``deepspeed`` CLI),
            ``"env"`` (only ``WORLD_SIZE`` / ``RANK``), or ``"none"`` (a single process).
        world_size: ``WORLD_SIZE``.
        num_nodes: torchrun's ``GROUP_WORLD_SIZE`` (``--nnodes``), DeepSpeed's ``CROSS_SIZE``; with only
            ``LOCAL_WORLD_SIZE`` (Ray Train sets it and no node count) ``WORLD_SIZE / LOCAL_WORLD_SIZE`` when that
            divides, a guess that nothing checks; else 1.
        num_processes_per_node: ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (DeepSpeed); else the world (also
            when ``LOCAL_WORLD_SIZE`` does not divide it: workers placed unevenly, Ray Train's 3 as 2 + 1).
        from_accelerate_multinode_deepspeed: the launch went through ``accelerate launch``'s DeepSpeed multi-node
            path (``ACCELERATE_CONFIG_DS_FIELDS`` is set, so accelerate launched it, and DeepSpeed's launcher set
            ``CROSS_SIZE``, which accelerate uses only for ``--num_machines`` > 1 without
            ``deepspeed_multinode_launcher: standard``).

    Example:
        ```python
        world = LaunchedWorld.from_env()
        print(world.num_nodes, world.num_processes_per_node)   # 2 2 under torchrun --nnodes 2 --nproc_per_node 2
        ```
    """

    launcher: str = "none"
    world_size: int = 1
    num_nodes: int = 1
    num_processes_per_node: int = 1
    from_accelerate_multinode_deepspeed: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchedWorld:
        env = os.environ if env is None else env
        world = _int(env, "WORLD_SIZE")
        if world is None:
            return cls()
        if _int(env, "GROUP_WORLD_SIZE") is not None or "TORCHELASTIC_RUN_ID" in env:
            nodes = _int(env, "GROUP_WORLD_SIZE") or 1
            local = _int(env, "LOCAL_WORLD_SIZE") or world // nodes
            return cls(launcher="torchrun", world_size=world, num_nodes=nodes, num_processes_per_node=local)
        if _int(env, "CROSS_SIZE") is not None:
            nodes = _int(env, "CROSS_SIZE") or 1
            local = _int(env, "LOCAL_SIZE") or world // nodes
            return cls(
                launcher="deepspeed",
                world_size=world,
                num_nodes=nodes,
                num_processes_per_node=local,
                from_accelerate_multinode_deepspeed="ACCELERATE_CONFIG_DS_FIELDS" in env,
            )
        local = _int(env, "LOCAL_WORLD_SIZE") or world
        if world % local:  # placed unevenly (Ray Train: 3 workers as 2 + 1): this rank cannot tell the nodes
            return cls(launcher="env", world_size=world, num_nodes=1, num_processes_per_node=world)
        return cls(launcher="env", world_size=world, num_nodes=max(1, world // local), num_processes_per_node=local)


def check_launched_world(joined_world_size: int, env: Mapping[str, str] | None = None) -> LaunchedWorld:
    """Raise unless the world this process joined is the world its launch asked for; return what was asked.

    Every rank runs it at trainer construction (no collective: each rank reads its own environment, and a rank
    that disagrees stops with the same message on every rank that shares the environment).

    - ``accelerate launch --num_machines N`` with a DeepSpeed config and no ``deepspeed_multinode_launcher: standard``
      hands over to DeepSpeed's pdsh launcher; without a hostfile it runs "local resources only": each machine
      starts its own smaller world (``CROSS_SIZE=1``), trains on part of the samples and reports success. Refused.
    - torchrun / the DeepSpeed launcher: ``WORLD_SIZE`` must be nodes x processes per node (homogeneous nodes, as
      accelerate and transformers assume) and the process group's size must be ``WORLD_SIZE``. A launch that tells
      no node count (only ``WORLD_SIZE`` and maybe ``LOCAL_WORLD_SIZE``: Ray Train, which may place 3 workers as
      2 + 1) is checked on ``WORLD_SIZE`` alone.

    Raises:
        GradAccConfigError: the pdsh split (names the config line that fixes it).
        GradAccDistributedError: the process group's size differs from what the launcher set.

    Example:
        ```python
        import torch.distributed as dist
        world = check_launched_world(dist.get_world_size() if dist.is_initialized() else 1)
        ```
    """
    world = LaunchedWorld.from_env(env)
    if world.launcher == "none":
        # No launcher variable to compare with: a process group the user set up (mp.spawn with a tcp:// init method,
        # MPI, a notebook) is theirs to size.
        return world
    if world.from_accelerate_multinode_deepspeed and world.num_nodes == 1:
        raise GradAccConfigError(
            f"`accelerate launch --num_machines` > 1 with a DeepSpeed config handed over to DeepSpeed's pdsh "
            f"launcher, which found no hostfile and ran on local resources only: this machine trains its own world "
            f"of {world.world_size} (`CROSS_SIZE=1`), not the multi-node world the launch asked for, on part of the "
            "samples per step. Add `deepspeed_multinode_launcher: standard` to the accelerate config (under "
            "`deepspeed_config:`) and run the same `accelerate launch --num_machines N --machine_rank R "
            "--main_process_ip <node 0>` on every machine, or give pdsh a hostfile (`deepspeed_hostfile:`) and "
            "launch once (see docs/recipes.md, 'Multi-node')."
        )
    if world.num_nodes * world.num_processes_per_node != world.world_size:
        raise GradAccDistributedError(
            f"The {world.launcher} launch set WORLD_SIZE={world.world_size} but {world.num_nodes} node(s) x "
            f"{world.num_processes_per_node} process(es) per node = {world.num_nodes * world.num_processes_per_node}:"
            " nodes with different process counts are not supported. Give every node the same `--nproc_per_node` "
            "(`num_processes` / `num_machines` in the accelerate config)."
        )
    if joined_world_size != world.world_size:
        raise GradAccDistributedError(
            f"This process joined a world of {joined_world_size} ranks but its launcher asked for "
            f"WORLD_SIZE={world.world_size} ({world.num_nodes} node(s) x {world.num_processes_per_node}): the process "
            "group was set up by something else. Let the Trainer (accelerate) initialise torch.distributed from the "
            "launcher's environment."
        )
    return world


# Mesh dimensions, in the order accelerate's ParallelismConfig / transformers' DistributedConfig name them.
MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "cp", "sp", "ep", "pp")
# Dimensions whose ranks hold different samples (data) or different positions of a sample (sequence): counted over.
COUNTED_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "sp")
# Dimensions whose ranks hold copies of the same tokens: never counted over again.
COPY_DIMS: tuple[str, ...] = ("tp", "pp")


def _size(sizes: Any, dim: str) -> int:
    value = sizes.get(dim, 1) if isinstance(sizes, Mapping) else getattr(sizes, dim, 1)
    value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GradAccConfigError(f"mesh size `{dim}` ({value!r}) must be a whole number >= 1")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    """The run's mesh: the size of every parallel dimension, the nodes it spans, and the ONE answer to which ranks
    count, average and hold copies (asked by the counting, the backends, the checkpoints and context parallelism).

    Dimensions that hold different samples or different positions of a sample: ``dp_replicate``, ``dp_shard``
    (data), ``cp``, ``sp`` (positions of a sample): a counted target is counted once over them
    (:attr:`count_group_size`). Dimensions that hold copies of the same tokens: ``tp``, ``pp`` (:attr:`copies`),
    never counted over again; ``ep`` is a second layout of the ``dp_shard`` x ``tp`` ranks, not a dimension of its
    own. ``world_size`` is the product of the others. Three sizes, three names:

    - :attr:`data_parallel_size`: ranks holding different samples (``dp_replicate x dp_shard``): a step's samples are
      its micro-batch rows times this (checkpoints record it; a resume re-batches by it);
    - :attr:`count_group_size`: ranks whose counted targets add up to the step's count (data x ``cp`` x ``sp``);
    - :attr:`dp_world_size`: ranks the backend AVERAGES gradients over; each micro-batch's summed loss is multiplied
      by it (then divided by the global count). FSDP2 averages over ``dp_replicate x dp_shard x cp`` (accelerate's
      ``dp_shard_cp``): the whole count group. DeepSpeed-Ulysses (``sp``) reduces over its sequence-data group but
      divides by the data ranks only (measured with ZeRO-1/2: the ``sp`` shards' gradients are summed), so ``sp`` is
      counted but not in the scale. Never ``tp`` or ``pp``.

    Example:
        ```python
        mesh = mesh_from_accelerator(trainer.accelerator, trainer.model_wrapped)
        print(mesh.describe())        # "HSDP 2 x 2", "DDP 4, 2 nodes x 2", "TP 2 x FSDP 2", "single process"
        print(mesh.count_group_size)  # ranks whose counted targets add up to the step's count
        ```
    """

    backend: str = "single process"
    world_size: int = 1
    num_nodes: int = 1
    num_processes_per_node: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1
    ep: int = 1
    pp: int = 1
    sizes_from: tuple[str, ...] = field(default=())

    @property
    def data_parallel_size(self) -> int:
        """Ranks that hold different samples: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def count_group_size(self) -> int:
        """Ranks whose counted targets are different targets: data x context x sequence parallel."""
        return self.data_parallel_size * self.cp * self.sp

    @property
    def dp_world_size(self) -> int:
        """Ranks the backend averages gradients over (the loss scale): the count group without the ``sp`` shards."""
        return self.count_group_size // self.sp

    @property
    def copies(self) -> int:
        """Ranks holding copies of the same tokens (``tp`` x ``pp``): their counts are never added."""
        return self.tp * self.pp

    @property
    def count_dims(self) -> tuple[str, ...]:
        """The mesh dimensions (of size > 1) whose ranks' counts are summed: the count group."""
        return tuple(dim for dim in COUNTED_DIMS if getattr(self, dim) > 1)

    def describe_counting(self) -> str:
        """One line: ``"counts summed over dp_shard (2 ranks), not over 2 copies (tp, pp); loss x 2"``."""
        dims = " x ".join(self.count_dims) or "nothing (one rank)"
        copies = f", not over {self.copies} copies (tp, pp)" if self.copies > 1 else ""
        return f"counts summed over {dims} ({self.count_group_size} ranks){copies}; loss x {self.dp_world_size}"

    @classmethod
    def of(cls, sizes: Any, **fields: Any) -> Mesh:
        """The mesh of ``sizes``: any object (or mapping) with sizes ``dp_replicate``, ``dp_shard``, ``tp``, ``cp``,
        ``sp``, ``ep``, ``pp`` (a missing or None size is 1); ``fields``: the others (``backend``, nodes).

        ``ep`` must divide ``dp_shard`` x ``tp``: transformers lays the experts out over those ranks (``ep_size``
        must divide ``fsdp_size * tp_size``), so the routed tokens come from samples the data dimensions count.

        Example:
            ```python
            Mesh.of({"dp_replicate": 2, "dp_shard": 2}).dp_world_size          # 4: HSDP counts and averages over both
            Mesh.of({"dp_shard": 2, "cp": 2}).count_dims                         # ('dp_shard', 'cp')
            Mesh.of({"dp_shard": 2, "tp": 2}).count_group_size                   # 2: the tp copies are not counted
            ```
        """
        dims = {dim: _size(sizes, dim) for dim in MESH_DIMS}
        if (dims["dp_shard"] * dims["tp"]) % dims["ep"]:
            raise GradAccConfigError(
                f"`ep_size` ({dims['ep']}) must divide `fsdp_size` x `tp_size` ({dims['dp_shard']} x {dims['tp']}): "
                "the experts are laid out over the data-shard and tensor ranks. Change `ep_size` in DistributedConfig."
            )
        world = 1
        for dim in (*COUNTED_DIMS, *COPY_DIMS):
            world *= dims[dim]
        return cls(world_size=fields.pop("world_size", world), **dims, **fields)

    @property
    def is_hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def _data_part(self) -> str:
        dp = self.data_parallel_size
        if self.backend == "FSDP2":
            if self.is_hsdp:
                return f"HSDP {self.dp_replicate} x {self.dp_shard}"
            return f"FSDP {self.dp_shard}" if self.dp_shard > 1 else ""
        if self.backend.startswith("DeepSpeed"):
            return f"{self.backend.removeprefix('DeepSpeed ')} {dp}" if dp > 1 else ""
        return f"DDP {dp}" if dp > 1 else ""

    def describe(self) -> str:
        """The mesh in words, outermost model-parallel dimension first: ``"TP 2 x FSDP 2"``, ``"HSDP 2 x 2"``,
        ``"DDP 4, 2 nodes x 2"``; ``"single process"`` for one rank."""
        if self.world_size == 1:
            return "single process"
        parts = [
            f"{name} {size}"
            for name, size in (("PP", self.pp), ("TP", self.tp), ("EP", self.ep), ("CP", self.cp), ("SP", self.sp))
            if size > 1
        ]
        data = self._data_part()
        if data:
            parts.append(data)
        text = " x ".join(parts) or f"{self.backend} {self.world_size}"
        if self.num_nodes > 1:
            text += f", {self.num_nodes} nodes x {self.num_processes_per_node}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__} | {"describe": self.describe()}


def _backend_label(accelerator: Accelerator) -> str:
    from accelerate.utils import DistributedType

    dist_type = accelerator.distributed_type
    if dist_type == DistributedType.DEEPSPEED:
        stage = getattr(getattr(accelerator.state, "deepspeed_plugin", None), "zero_stage", None)
        return f"DeepSpeed ZeRO-{stage}" if stage is not None else "DeepSpeed"
    if dist_type == DistributedType.FSDP:
        return "FSDP2" if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2 else "FSDP1"
    return "single process" if dist_type == DistributedType.NO else "DDP"


def _param_mesh(model: torch.nn.Module | None) -> tuple[dict[str, int], tuple[str, ...]]:
    """The sizes of the device mesh the model's DTensor parameters live on, by dimension name."""
    if model is None:
        return {}, ()
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            return dict(zip(names, mesh.shape, strict=True)), ("parameters",)
    return {}, ()


def mesh_from_accelerator(
    accelerator: Accelerator, model: torch.nn.Module | None = None, env: Mapping[str, str] | None = None
) -> Mesh:
    """Read the run's `Mesh` from accelerate's state, its ``parallelism_config``, the model's ``DistributedConfig``
    (``model.config.distributed_config``) and its DTensor parameters (after preparation), and the launcher's env.

    Example:
        ```python
        mesh = mesh_from_accelerator(trainer.accelerator, trainer.model_wrapped)
        assert mesh.world_size == trainer.accelerator.num_processes
        ```
    """
    world = int(accelerator.num_processes)
    backend = _backend_label(accelerator)
    launched = LaunchedWorld.from_env(env)
    nodes = launched.num_nodes if launched.world_size == world else 1
    per_node = world // nodes if nodes else world
    sizes = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 1, "sp": 1, "ep": 1, "pp": 1}
    sources: list[str] = []

    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and getattr(pc, "total_size", 1) > 1:
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            sizes[name] = int(getattr(pc, f"{name}_size", None) or 1)
        sources.append("parallelism_config")
    dc = getattr(getattr(model, "config", None), "distributed_config", None) if model is not None else None
    if dc is not None:
        for name, attr in (
            ("tp", "tp_size"),
            ("ep", "ep_size"),
            ("pp", "pp_size"),
            ("dp_shard", "fsdp_size"),
            ("dp_replicate", "dp_replicate_size"),
        ):
            value = getattr(dc, attr, None)
            if value:
                sizes[name] = int(value)
        sources.append("DistributedConfig")
        if backend == "DDP" and sizes["dp_shard"] > 1:
            backend = "FSDP2"  # sharded by transformers at load time (accelerate reports plain DDP)
    param_sizes, param_source = _param_mesh(model)
    if "dp_replicate" in param_sizes:
        sizes["dp_replicate"] = param_sizes["dp_replicate"]
        sources.extend(param_source)
    shard = param_sizes.get("dp_shard_cp", param_sizes.get("dp_shard"))
    if shard is not None:
        sizes["dp_shard"] = shard // max(1, sizes["cp"]) if "dp_shard_cp" in param_sizes else shard

    # expert parallelism lays experts over ranks of the tensor / shard dimensions: it is no dimension of its own
    model_parallel = sizes["tp"] * sizes["cp"] * sizes["sp"] * sizes["pp"]
    if sizes["dp_replicate"] * sizes["dp_shard"] * model_parallel != world:
        # no parallelism config: the data-parallel backend spans the rest of the world
        rest = max(1, world // max(1, model_parallel))
        if backend == "FSDP2" and sizes["dp_replicate"] == 1:
            sizes["dp_shard"] = rest
        elif backend == "FSDP2":
            sizes["dp_shard"] = max(1, rest // sizes["dp_replicate"])
        else:
            sizes["dp_replicate"], sizes["dp_shard"] = rest, 1
    return Mesh(
        backend=backend,
        world_size=world,
        num_nodes=nodes,
        num_processes_per_node=per_node,
        sizes_from=tuple(sources),
        **sizes,
    )
