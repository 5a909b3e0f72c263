"""The opt-in CPU-distributed patch (`hf_gradacc.patches`): opt-in, idempotent, reversible, version-gated, and
acting only where upstream accelerate finds no backend for a DeepSpeed launch without GPU.

The 2-rank behaviour (DeepSpeed ZeRO-1/2/3 on gloo) is tested in ``tests/distributed/test_deepspeed.py``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest
import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from hf_gradacc import patches
from hf_gradacc.patches import cpu_distributed

ORIGINAL = PartialState.__dict__["_prepare_backend"]
LAUNCH_ENV = {"LOCAL_RANK": "0", "ACCELERATE_USE_DEEPSPEED": "true"}


@pytest.fixture(autouse=True)
def restore_patches():
    """Leave accelerate as the test found it (other tests may run in the same process)."""
    fsdp = cpu_distributed._fsdp_module()
    fsdp_was_on = fsdp is not None and fsdp.is_fsdp_on_cpu_enabled()
    was_on = patches.is_cpu_distributed_enabled()
    yield
    patches.disable_cpu_distributed()
    if was_on:
        patches.enable_cpu_distributed(fsdp=False)
    if fsdp_was_on:
        fsdp.enable_fsdp_on_cpu()


@pytest.fixture
def cpu_deepspeed_launch(monkeypatch):
    """A rank started by `accelerate launch` with a DeepSpeed config, on a host without CUDA."""
    for key, value in LAUNCH_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def prepare_backend(cpu: bool = False, backend: str | None = None):
    # _prepare_backend reads no instance attribute; a bare object stands in for the shared-state instance
    return PartialState._prepare_backend(object(), cpu, False, backend)


def test_nothing_is_patched_at_import():
    code = (
        "import hf_gradacc, hf_gradacc.patches, hf_gradacc.backends.deepspeed\n"
        "from accelerate.state import PartialState\n"
        "raise SystemExit(int(hasattr(PartialState._prepare_backend, '__hf_gradacc_original__')))\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_enable_is_idempotent_and_disable_restores_the_original():
    patches.disable_cpu_distributed()
    assert PartialState.__dict__["_prepare_backend"] is ORIGINAL
    assert patches.enable_cpu_distributed(fsdp=False)
    wrapper = PartialState.__dict__["_prepare_backend"]
    assert wrapper is not ORIGINAL and patches.is_cpu_distributed_enabled()
    assert patches.enable_cpu_distributed(fsdp=False)
    assert PartialState.__dict__["_prepare_backend"] is wrapper  # not wrapped twice
    assert patches.disable_cpu_distributed()
    assert PartialState.__dict__["_prepare_backend"] is ORIGINAL
    assert not patches.is_cpu_distributed_enabled()
    assert not patches.disable_cpu_distributed()  # nothing left to restore


def test_upstream_finds_no_backend_and_the_patch_picks_gloo(cpu_deepspeed_launch, caplog):
    patches.disable_cpu_distributed()
    # The upstream behaviour the patch works around; when this fails, accelerate changed: re-check the patch.
    assert prepare_backend() == (None, DistributedType.NO)
    patches.enable_cpu_distributed(fsdp=False)
    with caplog.at_level(logging.WARNING, logger=cpu_distributed.__name__):
        assert prepare_backend() == ("gloo", DistributedType.MULTI_CPU)
    assert "('gloo', MULTI_CPU)" in caplog.text


@pytest.mark.parametrize(
    "change",
    ["cuda available", "no LOCAL_RANK", "not DeepSpeed", "cpu=True"],
)
def test_the_patch_changes_nothing_elsewhere(cpu_deepspeed_launch, monkeypatch, change):
    cpu = False
    if change == "cuda available":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    elif change == "no LOCAL_RANK":
        monkeypatch.delenv("LOCAL_RANK")
    elif change == "not DeepSpeed":
        monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    else:
        cpu = True
    patches.disable_cpu_distributed()
    upstream = prepare_backend(cpu=cpu)
    patches.enable_cpu_distributed(fsdp=False)
    assert prepare_backend(cpu=cpu) == upstream


@pytest.mark.parametrize(
    "value, enabled, warns",
    [(None, False, False), ("0", False, False), ("1", True, False), ("true", True, False), ("maybe", False, True)],
)
def test_env_var_opts_in(monkeypatch, caplog, value, enabled, warns):
    patches.disable_cpu_distributed()
    if value is None:
        monkeypatch.delenv(patches.CPU_DISTRIBUTED_ENV, raising=False)
    else:
        monkeypatch.setenv(patches.CPU_DISTRIBUTED_ENV, value)
    with caplog.at_level(logging.WARNING, logger=patches.__name__):
        assert patches.maybe_enable_from_env() is enabled
    assert patches.is_cpu_distributed_enabled() is enabled
    assert (patches.CPU_DISTRIBUTED_ENV in caplog.text) is warns


def test_repairs_a_state_built_before_the_patch(cpu_deepspeed_launch, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    broken = {
        "backend": None,
        "distributed_type": DistributedType.DEEPSPEED,
        "num_processes": 1,
        "process_index": 0,
        "local_process_index": 1,
    }
    saved_partial, saved_accel = dict(PartialState._shared_state), dict(AcceleratorState._shared_state)
    try:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(broken)
        AcceleratorState._shared_state.clear()
        patches.disable_cpu_distributed()
        patches.enable_cpu_distributed(fsdp=False)
        state = dict(PartialState._shared_state)
    finally:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(saved_partial)
        AcceleratorState._shared_state.clear()
        AcceleratorState._shared_state.update(saved_accel)
    assert state == {**broken, "backend": "gloo", "num_processes": 2, "process_index": 1, "local_process_index": 1}


def test_a_healthy_state_is_left_alone(cpu_deepspeed_launch):
    saved = dict(PartialState._shared_state)
    healthy = {"backend": "gloo", "distributed_type": DistributedType.DEEPSPEED, "num_processes": 2}
    try:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(healthy)
        assert not cpu_distributed._repair_initialized_state()
        assert dict(PartialState._shared_state) == healthy
    finally:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(saved)


def test_too_old_accelerate_is_not_patched(monkeypatch, caplog):
    patches.disable_cpu_distributed()
    monkeypatch.setattr(cpu_distributed, "_accelerate_version", lambda: "0.34.2")
    with caplog.at_level(logging.WARNING, logger=cpu_distributed.__name__):
        assert patches.enable_cpu_distributed() is False
    assert not patches.is_cpu_distributed_enabled()
    assert "0.34.2" in caplog.text


def test_fsdp_part_is_applied_and_undone_when_present(monkeypatch):
    calls: list[str] = []
    state = {"on": False}

    def enable() -> bool:
        calls.append("enable")
        state["on"] = True
        return True

    def disable() -> None:
        calls.append("disable")
        state["on"] = False

    fake = types.SimpleNamespace(
        enable_fsdp_on_cpu=enable, disable_fsdp_on_cpu=disable, is_fsdp_on_cpu_enabled=lambda: state["on"]
    )
    patches.disable_cpu_distributed()
    monkeypatch.setattr(cpu_distributed, "_fsdp_module", lambda: fake)
    patches.enable_cpu_distributed(fsdp=False)
    assert calls == []
    patches.enable_cpu_distributed()
    assert calls == ["enable"]
    assert patches.disable_cpu_distributed()
    assert calls == ["enable", "disable"]

    monkeypatch.setattr(cpu_distributed, "_fsdp_module", lambda: None)  # the FSDP module is optional
    assert patches.enable_cpu_distributed() and patches.disable_cpu_distributed()
