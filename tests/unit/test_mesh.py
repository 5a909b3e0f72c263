"""The mesh description (hf_gradacc/backends/mesh.py), the launched-world check, and the FSDP2 sharding-strategy
check, in one process: the launchers' environments are the ones measured under torchrun, `accelerate launch` and
DeepSpeed's launcher (2026-11-26, accelerate 1.15, DeepSpeed 0.19.8)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_gradacc.backends.fsdp2 import check_fsdp2_sharding_strategy
from hf_gradacc.backends.mesh import LaunchedWorld, Mesh, check_launched_world
from hf_gradacc.errors import GradAccConfigError, GradAccDistributedError, UnsupportedBackendError

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "accelerate_configs"

# One rank of `accelerate launch --config_file zero2_cpu.yaml --num_machines 2 --num_processes 4 --machine_rank 0`
# without a hostfile (seen in the worker's environment): DeepSpeed's launcher ran a local world of 2.
PDSH_SPLIT_ENV = {
    "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,offload_optimizer_device,offload_param_device,mixed_precision",
    "ACCELERATE_USE_DEEPSPEED": "true", "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731", "RANK": "0", "WORLD_SIZE": "2",
}
TORCHRUN_2X2_ENV = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}


@pytest.mark.parametrize(
    ("mesh", "text"),
    [
        (Mesh(), "single process"),
        (Mesh(backend="DDP", world_size=2, dp_replicate=2), "DDP 2"),
        (Mesh(backend="DDP", world_size=4, dp_replicate=4, num_nodes=2, num_processes_per_node=2),
         "DDP 4, 2 nodes x 2"),
        (Mesh(backend="FSDP2", world_size=4, dp_replicate=2, dp_shard=2), "HSDP 2 x 2"),
        (Mesh(backend="FSDP2", world_size=4, dp_shard=4), "FSDP 4"),
        (Mesh(backend="FSDP2", world_size=4, tp=2, dp_shard=2), "TP 2 x FSDP 2"),
        (Mesh(backend="DeepSpeed ZeRO-2", world_size=2, dp_shard=2), "ZeRO-2 2"),
    ],
)
def test_describe(mesh, text):
    assert mesh.describe() == text


def test_count_group_spans_data_and_sequence_dimensions_only():
    mesh = Mesh(backend="FSDP2", world_size=16, dp_replicate=2, dp_shard=2, tp=2, cp=2)
    assert mesh.data_parallel_size == 4 and mesh.count_group_size == 8 and mesh.is_hsdp
    with pytest.raises(AttributeError):
        mesh.tp = 1  # frozen


def test_launched_world_from_each_launcher():
    assert LaunchedWorld.from_env({}) == LaunchedWorld()
    torchrun = LaunchedWorld.from_env(TORCHRUN_2X2_ENV)
    assert (torchrun.launcher, torchrun.num_nodes, torchrun.num_processes_per_node) == ("torchrun", 2, 2)
    split = LaunchedWorld.from_env(PDSH_SPLIT_ENV)
    assert (split.launcher, split.num_nodes, split.from_accelerate_multinode_deepspeed) == ("deepspeed", 1, True)


def test_the_pdsh_split_is_refused_naming_the_config_line():
    with pytest.raises(GradAccConfigError, match="deepspeed_multinode_launcher: standard"):
        check_launched_world(2, PDSH_SPLIT_ENV)
    # the same DeepSpeed launcher with a hostfile that lists 2 machines: the real world of 4
    assert check_launched_world(4, {**PDSH_SPLIT_ENV, "CROSS_SIZE": "2", "WORLD_SIZE": "4"}).num_nodes == 2
    # `deepspeed train.py` on one machine, not through `accelerate launch`: a world of 2 is what was asked
    single = {k: v for k, v in PDSH_SPLIT_ENV.items() if k != "ACCELERATE_CONFIG_DS_FIELDS"}
    assert check_launched_world(2, single).world_size == 2


def test_a_world_other_than_the_launched_one_is_refused():
    assert check_launched_world(4, TORCHRUN_2X2_ENV).world_size == 4
    with pytest.raises(GradAccDistributedError, match="joined a world of 2 ranks"):
        check_launched_world(2, TORCHRUN_2X2_ENV)
    with pytest.raises(GradAccDistributedError, match="different process counts"):
        check_launched_world(5, {**TORCHRUN_2X2_ENV, "WORLD_SIZE": "5"})
    # No launcher variable: nothing to compare with (a process group the user initialised), so no refusal.
    assert check_launched_world(2, {}).launcher == "none"
    assert check_launched_world(1, {}).launcher == "none"


# Ray Train's worker environment (ray/train/torch/config.py sets these and no node count): 3 workers placed as 2 on
# node 0 and 1 on node 1.
RAY_2_PLUS_1_ENVS = [
    {"WORLD_SIZE": "3", "RANK": str(rank), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(size),
     "NODE_RANK": str(node), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for rank, local, size, node in ((0, 0, 2, 0), (1, 1, 2, 0), (2, 0, 1, 1))
]  # fmt: skip


def test_workers_placed_unevenly_without_a_node_count_are_not_refused():
    """Ray Train sets ``LOCAL_WORLD_SIZE`` but not ``GROUP_WORLD_SIZE``: 3 workers as 2 + 1 join a world of 3 on
    every rank; only a world other than ``WORLD_SIZE`` is refused. torchrun's node count is still checked."""
    for env in RAY_2_PLUS_1_ENVS:
        world = check_launched_world(3, env)
        assert (world.launcher, world.world_size) == ("env", 3), env
    assert LaunchedWorld.from_env(RAY_2_PLUS_1_ENVS[0]).num_processes_per_node == 3  # 2 does not divide 3: unknown
    with pytest.raises(GradAccDistributedError, match="joined a world of 2 ranks"):
        check_launched_world(2, RAY_2_PLUS_1_ENVS[0])
    with pytest.raises(GradAccDistributedError, match="different process counts"):
        check_launched_world(3, {**TORCHRUN_2X2_ENV, "WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "2"})


def _launch_env(config: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file config` gives its ranks (accelerate's own code path)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(config), "x.py"]))
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", ["hsdp_cpu.yaml", "hsdp.yaml"])
def test_shipped_hsdp_configs_ask_accelerate_for_the_2d_mesh(name):
    env = _launch_env(CONFIGS / name)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true" and env["FSDP_VERSION"] == "2"
    replicate, shard = int(env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"]), int(env["PARALLELISM_CONFIG_DP_SHARD_SIZE"])
    assert replicate == 2 and shard > 1
    check_fsdp2_sharding_strategy(SimpleNamespace(sharding_strategy=None), None, env)  # FULL_SHARD: fine


def test_hybrid_shard_under_fsdp2_is_refused_naming_the_parallelism_config_lines(tmp_path):
    config = tmp_path / "hybrid.yaml"
    config.write_text((CONFIGS / "fsdp2_cpu.yaml").read_text().replace(
        "  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_sharding_strategy: HYBRID_SHARD\n"))
    env = _launch_env(config)
    assert env["FSDP_SHARDING_STRATEGY"] == "HYBRID_SHARD"  # accelerate passes it on, then ignores it under v2
    no_strategy = SimpleNamespace(sharding_strategy=None)
    with pytest.raises(UnsupportedBackendError, match="parallelism_config_dp_replicate_size") as error:
        check_fsdp2_sharding_strategy(no_strategy, None, env)
    assert "parallelism_config_dp_shard_size" in str(error.value) and "HYBRID_SHARD" in str(error.value)
    with pytest.raises(UnsupportedBackendError, match="fsdp_reshard_after_forward: false"):
        check_fsdp2_sharding_strategy(SimpleNamespace(sharding_strategy="SHARD_GRAD_OP"), None, {})


def test_hybrid_shard_beside_a_2d_parallelism_config_is_only_warned(caplog):
    hsdp = SimpleNamespace(dp_replicate_size=2, dp_shard_size=2)
    with caplog.at_level(logging.WARNING):
        check_fsdp2_sharding_strategy(SimpleNamespace(sharding_strategy=None), hsdp,
                                      {"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"})
    assert "is ignored under `fsdp_version: 2`" in caplog.text


def test_the_check_report_prints_the_mesh():
    """`hf-gradacc check` prints the mesh it ran on (the 2-node run printed `mesh      DDP 4, 2 nodes x 2`)."""
    from hf_gradacc.commands.check.report import HeadResult, Setup, format_heads_report
    from hf_gradacc.testing.reference import Comparison

    setup = Setup(task="causal_lm", model="tiny", model_class="", num_parameters=0, per_device_train_batch_size=2,
                  gradient_accumulation_steps=4, world_size=4, num_samples=32, backend="FSDP2", device="cpu", seed=0,
                  versions={}, mesh=Mesh(backend="FSDP2", world_size=4, dp_replicate=2, dp_shard=2).describe())
    exact = Comparison(relative_error=3e-7, cosine=1.0, norm_ratio=1.0)
    row = HeadResult(key="causal_lm", options="--task causal_lm", task="causal_lm", stock=exact, ours=exact)
    assert "  mesh      HSDP 2 x 2" in format_heads_report(setup, [row], 1e-5).splitlines()
