"""The pure parts of hf_gradacc.backends.tensor_parallel and the CPU patch for a tensor-parallel ParallelismConfig
(the 4-rank run is tests/distributed/test_mesh_tp.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_gradacc.backends.tensor_parallel import check_model_sharding, data_group_ranks, distributed_config_of
from hf_gradacc.errors import UnsupportedBackendError


@pytest.mark.parametrize(
    ("sizes", "groups"),
    [
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}, [[0, 2], [1, 3]]),
        ({"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 4}, [[0], [1], [2], [3]]),
        ({"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}, [[0, 1, 2, 3]]),
    ],
)
def test_data_groups_follow_transformers_mesh_layout(sizes, groups):
    """transformers builds ("pp", "dp_replicate", "fsdp", "tp") row-major: the tensor ranks are neighbours."""
    assert data_group_ranks(sizes, 0) == groups
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(len(flat)))  # every rank in exactly one data group
    mesh = torch.arange(len(flat)).reshape(sizes["pp"], sizes["dp_replicate"], sizes["dp_shard"], sizes["tp"])
    for t, group in enumerate(groups):
        assert group == mesh[0, :, :, t].reshape(-1).tolist()


def _sharded_model(**sizes):
    from transformers.distributed import DistributedConfig

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(distributed_config=DistributedConfig(**sizes))
    model._is_distributed_loading_by_transformers = True
    return model


def test_pipeline_parallelism_is_refused_by_name():
    model = _sharded_model(pp_size=2)
    with pytest.raises(UnsupportedBackendError, match=r"pp_size=2.*_sync_replicated_trainable_parameters"):
        check_model_sharding(model)


@pytest.mark.parametrize("sizes", [{"fsdp_size": 2, "ep_size": 2}, {"tp_size": 2, "ep_size": 2},
                                   {"fsdp_size": 4, "ep_size": 4}])  # fmt: skip
def test_expert_parallel_layouts_shown_exact_pass(sizes):
    """Every expert whole on one rank, the expert group the data ranks or the tensor ranks (the 2-rank runs:
    tests/distributed/test_mesh_ep.py); the model goes to the tensor-parallel backend even without a mesh in accelerate."""
    from hf_gradacc.backends.sharded_model import uses_expert_parallelism

    model = _sharded_model(**sizes)
    assert check_model_sharding(model).ep_size == sizes["ep_size"]
    assert uses_expert_parallelism(model) and not uses_expert_parallelism(_sharded_model(fsdp_size=2))


@pytest.mark.parametrize(
    ("sizes", "reason"),
    [
        ({"fsdp_size": 4, "ep_size": 2}, r"FSDP-sharded over .* = 2 ranks"),
        ({"tp_size": 2, "fsdp_size": 2, "ep_size": 2}, r"FSDP-sharded over .* = 2 ranks"),
        ({"tp_size": 2, "fsdp_size": 2, "ep_size": 4}, r"spans both the data ranks"),
        ({"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2}, r"dp_replicate_size` 2 \(HSDP\)"),
    ],
)
def test_other_expert_parallel_layouts_are_refused_by_name(sizes, reason):
    with pytest.raises(UnsupportedBackendError, match=rf"ep_size={sizes['ep_size']}\).*{reason}.*fsdp_size=N, ep_size=N"):
        check_model_sharding(_sharded_model(**sizes))


def test_an_expert_parallel_model_goes_to_the_tensor_parallel_backend():
    """With `tp_size` 1 accelerate has no parallelism_config (MULTI_CPU): the model decides."""
    from accelerate.utils import DistributedType

    from hf_gradacc.backends import resolve_backend
    from hf_gradacc.backends.ddp import DDPBackend
    from hf_gradacc.backends.tensor_parallel import TensorParallelBackend

    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, parallelism_config=None)
    backend = resolve_backend(accelerator, SimpleNamespace(), model=_sharded_model(fsdp_size=2, ep_size=2))
    assert isinstance(backend, TensorParallelBackend)
    assert type(resolve_backend(accelerator, SimpleNamespace(), model=_sharded_model(fsdp_size=2))) is DDPBackend


def test_tensor_parallel_models_pass_and_plain_models_are_not_sharded():
    assert check_model_sharding(_sharded_model(tp_size=2, fsdp_size=2)).tp_size == 2
    plain = torch.nn.Linear(2, 2)
    assert distributed_config_of(plain) is None and check_model_sharding(plain) is None


def test_the_cpu_patch_lifts_only_the_multi_cpu_refusal():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    from hf_gradacc.patches.parallelism_cpu import (
        disable_parallelism_on_cpu,
        enable_parallelism_on_cpu,
        is_parallelism_on_cpu_enabled,
    )

    original = ParallelismConfig._validate_accelerator
    config = ParallelismConfig(tp_size=2)
    cpu = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, is_fsdp2=False,
                          multi_device=False, is_main_process=True)  # fmt: skip
    with pytest.raises(ValueError, match="only compatible"):
        config._validate_accelerator(cpu)
    try:
        assert enable_parallelism_on_cpu() and enable_parallelism_on_cpu()  # idempotent
        assert is_parallelism_on_cpu_enabled()
        config._validate_accelerator(cpu)  # accepted now
        with pytest.raises(ValueError, match="num_processes"):  # accelerate's other checks stay
            config._validate_accelerator(SimpleNamespace(**{**vars(cpu), "num_processes": 4}))
        with pytest.raises(ValueError, match="only compatible"):  # context parallelism still needs a device
            ParallelismConfig(cp_size=2)._validate_accelerator(cpu)
    finally:
        disable_parallelism_on_cpu()
    assert not is_parallelism_on_cpu_enabled()
    assert ParallelismConfig._validate_accelerator is original
    disable_parallelism_on_cpu()  # idempotent


def test_context_parallelism_is_refused_by_name_at_backend_resolution():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    from hf_gradacc.backends import resolve_backend
    from hf_gradacc.backends.sharded_model import check_context_parallel

    check_context_parallel(None)
    check_context_parallel(ParallelismConfig(dp_shard_size=2))
    # trained under FSDP2 (hf_gradacc/backends/context_parallel.py, tests/unit/test_context_parallel.py); refused elsewhere
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, parallelism_config=ParallelismConfig(cp_size=2))
    with pytest.raises(UnsupportedBackendError, match=r"cp_size` \(2\).*FSDP2 only"):
        resolve_backend(accelerator, SimpleNamespace())


def test_sequence_parallelism_outside_deepspeed_is_refused_by_name_at_backend_resolution():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    from hf_gradacc.backends import resolve_backend
    from hf_gradacc.backends.sharded_model import check_context_parallel

    config = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    # Ulysses under DeepSpeed is trained (exact: tests/distributed/test_sequence_parallel.py)
    check_context_parallel(config, distributed_type=DistributedType.DEEPSPEED)
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, parallelism_config=config)
    with pytest.raises(UnsupportedBackendError, match=r"sp_size` \(2, sequence parallelism.*only under DeepSpeed"):
        resolve_backend(accelerator, SimpleNamespace())


@pytest.mark.parametrize("sp_size", [1, 2])
def test_a_sequence_classifier_under_ulysses_is_refused_by_name(sp_size):
    """DeepSpeed's Ulysses adapter cuts every batch tensor along the sequence; a sequence classifier's one label per
    row then fails inside it with a raw IndexError (seen on 2 CPU ranks). GradAccTrainer refuses it when created;
    a causal LM under sp, and any head without sp, pass."""
    from hf_gradacc.backends.deepspeed import DeepSpeedBackend
    from hf_gradacc.config import GradAccSettings
    from hf_gradacc.testing.tiny import build_tiny_model

    backend = object.__new__(DeepSpeedBackend)
    backend.settings = GradAccSettings()
    backend.accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=sp_size, sp_backend="deepspeed"))
    backend.check_model(build_tiny_model("causal_lm"))
    # what the automatic fused head and router_balance='global_batch' ask: sp named, or no model parallelism
    assert backend.model_parallelism == (None if sp_size == 1 else "Ulysses sequence parallelism (`sp_size` 2)")
    classifier = build_tiny_model("sequence_classification")
    if sp_size == 1:
        backend.check_model(classifier)
        return
    with pytest.raises(UnsupportedBackendError, match=r"ForSequenceClassification \(head `sequence_classification`\).*sp_size` 2.*sp_size: 1"):
        backend.check_model(classifier)
