"""``HF_GRADACC_CPU_DISTRIBUTED=1`` turns on every CPU patch a shipped CPU recipe needs, and nothing stays behind.

The shipped recipes (``examples/accelerate_configs/*cpu*.yaml``) and what each needs on a host without GPU:
DeepSpeed configs the DeepSpeed part (``cpu_distributed``), FSDP configs the FSDP2 part (``fsdp_cpu``), and the DDP
config (``ddp_cpu.yaml``, MULTI_GPU launched, MULTI_CPU on a CPU host) the tensor-parallel ``ParallelismConfig`` part
(``parallelism_cpu``) for a ``DistributedConfig(tp_size=...)`` model, whose ``ParallelismConfig(tp_size, dp_shard_size)``
the Trainer builds itself. The 2-rank run of that script under ``ddp_cpu.yaml`` with the variable alone is
tests/distributed/test_cpu_patch_env.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType

import hf_gradacc.patches as patches
from hf_gradacc.patches import cpu_distributed

REPO = Path(__file__).resolve().parents[2]
CPU_RECIPES = sorted((REPO / "examples" / "accelerate_configs").glob("*cpu*.yaml"))
# what a recipe's `distributed_type` needs on CPU ranks (MULTI_GPU: ddp_cpu.yaml, a tensor-parallel model's mesh)
NEEDS = {"DEEPSPEED": "cpu_distributed", "FSDP": "fsdp_cpu", "MULTI_GPU": "parallelism_cpu"}
IS_ENABLED = {"cpu_distributed": "is_cpu_distributed_enabled", "fsdp_cpu": "is_fsdp_on_cpu_enabled",
              "parallelism_cpu": "is_parallelism_on_cpu_enabled"}  # fmt: skip
# a MULTI_CPU accelerator as accelerate's `ParallelismConfig._validate_accelerator` reads it (2 gloo ranks)
MULTI_CPU = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, is_fsdp2=False,
                            multi_device=False, is_main_process=True)  # fmt: skip


def _enabled() -> dict[str, bool]:
    return {name: bool(getattr(importlib.import_module(f"hf_gradacc.patches.{name}"), IS_ENABLED[name])())
            for name in IS_ENABLED}  # fmt: skip


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    """Every part off before and after (other tests share the process), the variable unset."""
    monkeypatch.delenv(patches.CPU_DISTRIBUTED_ENV, raising=False)
    was = _enabled()
    patches.disable_cpu_distributed()
    yield
    patches.disable_cpu_distributed()
    if was["cpu_distributed"]:
        cpu_distributed.enable_cpu_distributed(fsdp=was["fsdp_cpu"])
    if was["parallelism_cpu"]:
        patches.enable_parallelism_on_cpu()


def test_every_patch_module_is_a_part_of_the_set():
    """A new CPU patch module must be wired into the set (and here): the variable would leave it off."""
    modules = {m.name for m in pkgutil.iter_modules(patches.__path__)}
    assert modules == set(IS_ENABLED), modules


@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=lambda p: p.name)
def test_the_variable_turns_on_every_patch_a_shipped_cpu_recipe_needs(monkeypatch, recipe):
    config = yaml.safe_load(recipe.read_text())
    need = NEEDS[config["distributed_type"]]
    assert not any(_enabled().values())
    monkeypatch.setenv(patches.CPU_DISTRIBUTED_ENV, "1")
    assert patches.maybe_enable_from_env()
    assert _enabled()[need], (recipe.name, need, _enabled())
    assert patches.disable_cpu_distributed() and not any(_enabled().values())  # undone, every part


def test_a_tensor_parallel_mesh_on_cpu_ranks_passes_with_the_variable_and_only_then(monkeypatch):
    """What the Trainer builds for a `DistributedConfig(tp_size=2)` model under ddp_cpu.yaml: refused by accelerate
    with its raw ValueError before, accepted after the variable; a mesh without `tp_size` (an HSDP block under a DDP
    launch) and context parallelism stay refused."""
    tp = ParallelismConfig(tp_size=2)
    with pytest.raises(ValueError, match="only compatible"):
        tp._validate_accelerator(MULTI_CPU)
    monkeypatch.setenv(patches.CPU_DISTRIBUTED_ENV, "1")
    patches.maybe_enable_from_env()
    tp._validate_accelerator(MULTI_CPU)
    for other in (ParallelismConfig(dp_shard_size=2), ParallelismConfig(cp_size=2)):
        with pytest.raises(ValueError, match="only compatible"):
            other._validate_accelerator(MULTI_CPU)


def test_the_tensor_parallel_part_can_be_left_out():
    patches.enable_cpu_distributed(fsdp=False, parallelism=False)
    assert _enabled() == {"cpu_distributed": True, "fsdp_cpu": False, "parallelism_cpu": False}
    patches.enable_cpu_distributed()
    assert all(_enabled().values())
