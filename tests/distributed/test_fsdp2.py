"""FSDP2 on 2 CPU ranks (gloo): every `fsdp_sync` strategy gives the full-batch step, with the communication it
promises; models accelerate cannot wrap get a clear error; FSDP1 is refused; the CPU patch is reversible.

The tolerance is the project's: relative error <= 1e-5 against the float64 full-batch reference over the samples
of both ranks (float32 training). All 2-rank cases run in one launch (module fixture), plus one
``accelerate launch --config_file examples/accelerate_configs/fsdp2_cpu.yaml`` run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_gradacc.errors import GradAccConfigError, UnsupportedBackendError
from tests.distributed.launcher import run_accelerate, run_workers

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "fsdp2_cases.py"
CPU_YAML = REPO / "examples" / "accelerate_configs" / "fsdp2_cpu.yaml"
TOLERANCE = 1e-5
SYNCS = ("deferred", "every_micro_batch", "defer_all_reduce")
# accelerate's default auto-wrap list for BERT holds BertEmbeddings, which it cannot wrap (see test below)
BERT_WRAP = {"transformer_layer_cls_to_wrap": ["BertLayer"]}
TASK_FSDP_CONFIG = {"causal_lm": {}, "sequence_classification": BERT_WRAP}
TASKS = tuple(TASK_FSDP_CONFIG)

CASES = (
    [
        {"name": f"{task}-{sync}", "task": task, "fsdp_sync": sync, "fsdp_config": TASK_FSDP_CONFIG[task]}
        for task in TASKS
        for sync in SYNCS
    ]
    + [
        {
            "name": "stock-sequence_classification",
            "task": "sequence_classification",
            "trainer": "stock",
            "fsdp_config": BERT_WRAP,
        },
        {"name": "hook-causal_lm", "task": "causal_lm", "fsdp_sync": "deferred", "hook": True},
        *({"name": f"moe-{family}", "task": "causal_lm", "fsdp_sync": "deferred", "moe": family}
          for family in ("mixtral", "qwen3_moe")),
        {"name": "error-bert-default-wrap", "task": "sequence_classification", "mode": "setup_error"},
        {"name": "error-masked_lm-tied", "task": "masked_lm", "mode": "setup_error", "fsdp_config": BERT_WRAP},
        {"name": "error-seq2seq-tied", "task": "seq2seq", "mode": "setup_error"},
    ]
    + [{"name": f"direct-hsdp-{sync}", "mode": "direct", "fsdp_sync": sync, "hsdp": True} for sync in SYNCS]
    + [
        {"name": f"direct-two-backward-{sync}", "mode": "direct", "fsdp_sync": sync, "two_backward": True}
        for sync in ("deferred", "every_micro_batch")
    ]
)


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    launch = run_workers(WORKER, nproc=2, args=["--cases", json.dumps(CASES)], timeout=420)
    return {case["name"]: launch.load(case["name"]) for case in CASES}


def _assert_exact(comparison: dict[str, float], what: str) -> None:
    assert comparison["relative_error"] <= TOLERANCE, f"{what}: {comparison}"
    assert comparison["cosine"] > 1 - 1e-9, f"{what}: {comparison}"


def _counts(result: dict, key: str) -> list[int]:
    return [mb[key] for mb in result["per_micro_batch"]]


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("task", TASKS)
def test_one_step_equals_full_batch_step(results, task, sync):
    rank0, rank1 = results[f"{task}-{sync}"]
    assert rank0["distributed_type"].endswith("FSDP") and rank0["param_types"] == ["DTensor"]
    assert rank0["grad_types"] == ["DTensor"]  # sharded grads after the final backward, on every parameter
    _assert_exact(rank0["update"], "SGD(lr=1) update")
    _assert_exact(rank0["grad"], "gradient read in on_pre_optimizer_step (DTensor.full_tensor())")
    assert rank0["num_grads"] > 0 and rank0["missing"] == [] and rank0["unchanged"] == []
    # the logged grad_norm is the pre-clip norm of the exact accumulated gradient, the same on both ranks
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)
    assert rank0["grads_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)
    assert rank1["grads_norm"] == pytest.approx(rank0["grads_norm"], rel=1e-12)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_router_term_is_exact_on_sharded_parameters(results, family):
    """Mixture of experts under FSDP2: the router load-balancing term weighted by each micro-batch's routed tokens
    over both ranks (one micro-batch one sample short), against the float64 reference of the same micro-batches."""
    rank0, _ = results[f"moe-{family}"]
    assert rank0["distributed_type"].endswith("FSDP") and rank0["param_types"] == ["DTensor"]
    assert rank0["micro_batch_sizes"] == [1] + [2] * 7  # per-device batch 2 x GA 4 x 2 ranks, 15 samples
    _assert_exact(rank0["update"], f"{family}: SGD(lr=1) update")
    assert rank0["num_router"] == 2 and rank0["router"]["relative_error"] <= 5e-5, rank0["router"]  # as on DDP
    assert rank0["missing"] == []


def test_stock_trainer_is_wrong_on_sequence_classification(results):
    stock = results["stock-sequence_classification"][0]
    assert stock["param_types"] == ["DTensor"]
    # BertForSequenceClassification ignores num_items_in_batch: each of the 4 micro-batch means is added up and
    # FSDP2 averages over 2 ranks while the Trainer does not multiply by the world size for this head: 4 x 2 = 8
    assert stock["update"]["norm_ratio"] == pytest.approx(8.0, rel=1e-3)
    assert stock["update"]["relative_error"] > 6.0


# ---------------------------------------------------------------------------------------------- communication
def test_reduce_scatter_count_per_strategy(results):
    deferred = _counts(results["causal_lm-deferred"][0], "reduce_scatter")
    every = _counts(results["causal_lm-every_micro_batch"][0], "reduce_scatter")
    assert len(deferred) == len(every) == 4  # micro-batches per optimizer step
    groups = every[0]
    assert groups >= 3  # one reduce-scatter per FSDP group: 2 decoder layers, embeddings, tail / root
    # deferred: nothing until the last micro-batch, then one reduce-scatter per group for the whole window
    assert deferred == [0, 0, 0, groups]
    # every_micro_batch: one per group per micro-batch
    assert every == [groups] * 4
    for name in ("causal_lm-deferred", "causal_lm-every_micro_batch", "sequence_classification-deferred"):
        # a 1-D mesh has no gradient all-reduce; the one counted after the last micro-batch is the step's scalar
        # non-finite verdict, agreed after the gradient hooks (hf_gradacc.step.nonfinite.agreed_flags)
        assert _counts(results[name][0], "all_reduce") == [0, 0, 0, 1]
    bert = _counts(results["sequence_classification-deferred"][0], "reduce_scatter")
    assert bert[:3] == [0, 0, 0] and bert[3] > 0


def test_defer_all_reduce_without_hsdp_warns_and_syncs_every_micro_batch(results):
    rank0 = results["causal_lm-defer_all_reduce"][0]
    assert _counts(rank0, "reduce_scatter") == _counts(results["causal_lm-every_micro_batch"][0], "reduce_scatter")
    assert sum("defer_all_reduce" in w and "HSDP" in w for w in rank0["warnings"]) == 1
    assert not any("defer_all_reduce" in w for w in results["causal_lm-deferred"][0]["warnings"])


def test_hsdp_defers_only_the_cross_replica_all_reduce(results):
    dar = results["direct-hsdp-defer_all_reduce"][0]
    every = results["direct-hsdp-every_micro_batch"][0]
    deferred = results["direct-hsdp-deferred"][0]
    assert dar["is_hsdp"] and every["is_hsdp"] and deferred["is_hsdp"]
    groups = _counts(every, "all_reduce")[0]
    assert groups >= 3 and _counts(every, "all_reduce") == [groups] * 4
    assert _counts(dar, "all_reduce") == [0, 0, 0, groups]
    assert _counts(deferred, "all_reduce") == [0, 0, 0, groups]
    for result in (dar, every, deferred):
        _assert_exact(result["grad"], result["name"])
        assert result["clip_norm"] == pytest.approx(result["reference_norm"], rel=1e-5)
        assert result["sq_norm_sum"] == pytest.approx(result["reference_norm"] ** 2, rel=2e-5)


def test_two_backward_passes_per_micro_batch(results):
    deferred = results["direct-two-backward-deferred"][0]
    every = results["direct-two-backward-every_micro_batch"][0]
    for result in (deferred, every):
        _assert_exact(result["grad"], result["name"])
        assert result["sq_norm_sum"] == pytest.approx(result["reference_norm"] ** 2, rel=2e-5)
    groups = _counts(deferred, "reduce_scatter")[-1]
    # the sync is decided per backward pass: only the window's final pass reduces under 'deferred'
    assert groups >= 3 and _counts(deferred, "reduce_scatter") == [0, 0, 0, groups]
    assert _counts(every, "reduce_scatter") == [2 * groups] * 4


# ---------------------------------------------------------------------------------------------- gradient access
def test_accumulated_grad_hook_writes_back_into_the_shards(results):
    rank0, rank1 = results["hook-causal_lm"]
    assert rank0["zeroed_update_max"] == 0.0  # the hook zeroed the full gradient; the shards got it
    _assert_exact(rank0["update"], "update of the other parameters")
    _assert_exact(rank0["grad"], "gradient of the other parameters")
    # trainer.grads.norm() in on_pre_optimizer_step sees the hooked gradient (lm_head removed)
    assert rank0["grads_norm"] == pytest.approx(rank0["reference_norm"], rel=1e-5)
    assert rank1["grads_norm"] == pytest.approx(rank0["grads_norm"], rel=1e-12)


# ---------------------------------------------------------------------------------------------- clear errors
def test_bert_with_default_wrap_list_gets_a_clear_error(results):
    for rank in results["error-bert-default-wrap"]:
        assert rank["error_type"] == "GradAccConfigError", rank.get("traceback")
        assert "BertEmbeddings" in rank["error"] and "transformer_layer_cls_to_wrap" in rank["error"]
        assert "BertLayer" in rank["error"]


@pytest.mark.parametrize(
    ("name", "tied"), [("error-masked_lm-tied", "cls.predictions.bias"), ("error-seq2seq-tied", "shared.weight")]
)
def test_tied_weights_across_groups_get_a_clear_error(results, name, tied):
    for rank in results[name]:
        assert rank["error_type"] == "GradAccConfigError", rank.get("traceback")
        assert "tied" in rank["error"] and tied in rank["error"] and "DDP or DeepSpeed" in rank["error"]


def test_fsdp_version_1_is_refused():
    from accelerate.utils import DistributedType

    from hf_gradacc.backends import resolve_backend

    accelerator = SimpleNamespace(
        distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1))
    )
    with pytest.raises(UnsupportedBackendError, match=r"FSDP version 1 .*fsdp_version: 2"):
        resolve_backend(accelerator, SimpleNamespace())


def test_unknown_fsdp_sync_is_refused():
    from hf_gradacc import GradAccArguments

    with pytest.raises(GradAccConfigError, match="`fsdp_sync` \\('sometimes'\\)"):
        GradAccArguments(fsdp_sync="sometimes")


def _plugin(**kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", **kwargs)


@pytest.mark.parametrize(
    ("task", "plugin_kwargs", "kinds"),
    [
        ("causal_lm", {}, []),
        ("sequence_classification", {}, ["nested_embedding"]),
        ("sequence_classification", {"transformer_cls_names_to_wrap": ["BertLayer"]}, []),
        ("token_classification", {"transformer_cls_names_to_wrap": ["BertLayer"]}, []),
        ("masked_lm", {"transformer_cls_names_to_wrap": ["BertLayer"]}, ["tied_across_groups"]),
        ("seq2seq", {}, ["tied_across_groups"]),
    ],
)
def test_wrap_problems_are_predicted(task, plugin_kwargs, kinds):
    from hf_gradacc.backends.fsdp2_wrap import fsdp2_wrap_problems
    from hf_gradacc.testing.tiny import build_tiny_model

    problems = fsdp2_wrap_problems(build_tiny_model(task), _plugin(**plugin_kwargs))
    assert [p.kind for p in problems] == kinds


def test_tied_input_output_embeddings_are_wrappable():
    import transformers as tf

    from hf_gradacc.backends.fsdp2_wrap import fsdp2_wrap_problems

    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = tf.LlamaForCausalLM(config)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert fsdp2_wrap_problems(model, _plugin()) == []  # accelerate puts both in one (tail) group


# ---------------------------------------------------------------------------------------------- the CPU patch
def test_fsdp_cpu_patch_is_idempotent_and_reversible(monkeypatch):
    from accelerate.state import AcceleratorState

    from hf_gradacc.patches import fsdp_cpu

    was_enabled = fsdp_cpu.is_fsdp_on_cpu_enabled()  # another test (or HF_GRADACC_CPU_DISTRIBUTED) may have done it
    fsdp_cpu.disable_fsdp_on_cpu()
    original = AcceleratorState.__init__
    try:
        assert fsdp_cpu.enable_fsdp_on_cpu() is not torch.cuda.is_available()
        patched = AcceleratorState.__init__
        assert fsdp_cpu.enable_fsdp_on_cpu() is not torch.cuda.is_available()
        assert AcceleratorState.__init__ is patched  # idempotent: not wrapped twice
        if not torch.cuda.is_available():
            assert patched is not original and fsdp_cpu.is_fsdp_on_cpu_enabled()
    finally:
        fsdp_cpu.disable_fsdp_on_cpu()
    assert AcceleratorState.__init__ is original and not fsdp_cpu.is_fsdp_on_cpu_enabled()
    fsdp_cpu.disable_fsdp_on_cpu()  # idempotent
    assert AcceleratorState.__init__ is original
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        assert fsdp_cpu.enable_fsdp_on_cpu() is False  # no effect with CUDA
        assert AcceleratorState.__init__ is original
    if was_enabled:
        fsdp_cpu.enable_fsdp_on_cpu()


def test_fsdp_cpu_switch_reaches_partial_state(monkeypatch):
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from hf_gradacc.patches.fsdp_cpu import _switch_to_fsdp

    shared: dict = {"distributed_type": DistributedType.MULTI_CPU}
    monkeypatch.setattr(PartialState, "_shared_state", shared)
    plugin = SimpleNamespace(fsdp_version=2)
    state = SimpleNamespace(
        distributed_type=DistributedType.MULTI_CPU, _mixed_precision="no", backend="gloo", num_processes=2
    )
    _switch_to_fsdp(state, plugin)
    assert state.distributed_type == DistributedType.FSDP and state.fsdp_plugin is plugin
    assert shared["distributed_type"] == DistributedType.FSDP
    untouched = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    _switch_to_fsdp(untouched, None)  # no FSDP plugin: a plain CPU DDP run stays DDP
    assert untouched.distributed_type == DistributedType.MULTI_CPU


# ---------------------------------------------------------------------------------------------- accelerate launch
def test_accelerate_launch_with_the_cpu_config():
    out_dir = Path(tempfile.mkdtemp(prefix="hf_gradacc_fsdp2_accel_"))
    case = {"name": "accelerate-causal_lm", "task": "causal_lm", "fsdp_sync": "deferred"}
    done = run_accelerate(
        CPU_YAML,
        WORKER,
        ["--cases", json.dumps([case]), "--launcher", "accelerate"],
        cpu_distributed=True,
        timeout=300,
        out_dir=out_dir,
        check=False,
    )
    assert done.returncode == 0, done.output[-6000:]
    rank0 = json.loads((out_dir / f"{case['name']}.rank0.json").read_text())
    assert rank0["distributed_type"].endswith("FSDP") and rank0["param_types"] == ["DTensor"]
    _assert_exact(rank0["update"], "update under accelerate launch")
    assert _counts(rank0, "reduce_scatter")[:3] == [0, 0, 0] and _counts(rank0, "reduce_scatter")[3] >= 3
