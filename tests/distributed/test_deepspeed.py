"""DeepSpeed ZeRO-1/2/3 on 2 CPU ranks (gloo), launched as users launch it: ``accelerate launch --config_file``.

Each stage is one launch of ``workers/deepspeed_cases.py`` with ``examples/accelerate_configs/zero<N>_cpu.yaml`` and
``HF_GRADACC_CPU_DISTRIBUTED=1``; the launch runs several one-step cases (SGD lr=1, one window of per-device batch
2 x GA 4 x 2 ranks, mixed lengths) and every test reads their results. Exact means relative gradient error <= 1e-5
against the float64 full-batch reference (float32 training). The first DeepSpeed launch on a machine builds
DeepSpeed's shm op (about 100 s, then cached in the torch extensions cache).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

from hf_gradacc.backends.deepspeed import check_client_optimizer, check_deepspeed_config  # noqa: E402
from hf_gradacc.errors import GradAccConfigError, UnsupportedBackendError  # noqa: E402
from tests.distributed.launcher import run_accelerate, run_workers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "deepspeed_cases.py"
CONFIGS = REPO / "examples" / "accelerate_configs"
TOLERANCE = 1e-5
LAUNCH_TIMEOUT_S = 240.0
NUM_MICRO_BATCHES = 4

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# ---------------------------------------------------------------------------------------------- launching
def launch_accelerate(config: Path, cases: list[dict[str, Any]], timeout: float = LAUNCH_TIMEOUT_S) -> dict[str, list]:
    """``accelerate launch --config_file config`` the worker on its 2 CPU ranks; every rank's result per case."""
    result = run_accelerate(
        config,
        WORKER,
        ["--cases", json.dumps(cases)],
        cpu_distributed=True,
        timeout=timeout,
        out_dir=tempfile.mkdtemp(prefix="hf_gradacc_ds_"),
    )
    return {case["name"]: result.load(case["name"]) for case in cases}


CAUSAL = "causal_lm"
SEQCLS = "sequence_classification"


def _stage_cases(stage: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for reduction in ("per_micro_batch", "per_window"):
        for task in (CAUSAL, SEQCLS):
            cases.append(
                {
                    "name": f"{task}-{reduction}",
                    "task": task,
                    "zero_reduction": reduction,
                    "read_grads": task == CAUSAL,
                    "count_reductions": task == CAUSAL,
                }
            )
    cases.append({"name": f"{SEQCLS}-stock", "task": SEQCLS, "trainer": "stock", "observe_step": True})
    for reduction in ("per_micro_batch", "per_window"):
        cases.append({"name": f"two-steps-{reduction}", "task": CAUSAL, "num_windows": 2, "zero_reduction": reduction})
    if stage in (1, 2, 3):  # ZeRO-3 falls back to one backward pass on the summed terms (same gradient)
        for reduction in ("per_micro_batch", "per_window"):
            cases.append(
                {
                    "name": f"multi-backward-{reduction}",
                    "task": CAUSAL,
                    "multi_backward": True,
                    "zero_reduction": reduction,
                    "count_reductions": True,
                }
            )
    if stage == 1:
        cases += [
            {
                "name": "unpatched",
                "task": CAUSAL,
                "mode": "config_error",
                "unpatched": True,
                "env": {"HF_GRADACC_CPU_DISTRIBUTED": "0"},
            },
            {
                "name": "clip-conflict",
                "task": CAUSAL,
                "mode": "config_error",
                "env": {"ACCELERATE_GRADIENT_CLIPPING": "1.0"},
            },
            {
                "name": "ga-conflict",
                "task": CAUSAL,
                "mode": "config_error",
                "env": {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"},
            },
            {
                "name": "closure-optimizer",
                "task": CAUSAL,
                "mode": "config_error",
                "optimizer": "closure_sgd",
                "train": True,
            },
        ]
    if stage in (2, 3):
        cases += [
            {"name": "hooked", "task": CAUSAL, "hook_scale": 0.5, "zero_reduction": "per_window"},
            {"name": "hooked-local", "task": CAUSAL, "hook_scale": 0.5, "hook_local": True},
        ]
    if stage == 2:
        cases += [
            {"name": "clipped", "task": CAUSAL, "max_grad_norm": 0.5},
        ]
    cases += [{"name": f"moe-{family}", "task": CAUSAL, "moe": family} for family in ("mixtral", "qwen3_moe")]
    return cases


_RESULTS: dict[int, dict[str, list]] = {}


def results_for(stage: int) -> dict[str, list]:
    """The results of the stage's launch (one launch per stage and test session)."""
    if stage not in _RESULTS:
        _RESULTS[stage] = launch_accelerate(CONFIGS / f"zero{stage}_cpu.yaml", _stage_cases(stage))
    return _RESULTS[stage]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["zero1", "zero2", "zero3"])
def stage_results(request) -> tuple[int, dict[str, list]]:
    return request.param, results_for(request.param)


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("task", [CAUSAL, SEQCLS])
@pytest.mark.parametrize("reduction", ["per_micro_batch", "per_window"])
def test_one_step_is_exact(stage_results, task, reduction):
    stage, results = stage_results
    rank0, rank1 = results[f"{task}-{reduction}"]
    assert rank0["zero_stage"] == stage
    assert rank0["accelerate_num_processes"] == rank0["args_world_size"] == rank0["torch_world_size"] == 2
    assert rank0["backend"] == "gloo" and rank0["distributed_type"] == "DistributedType.DEEPSPEED"
    assert rank0["global_step"] == 1 and rank0["engine_global_steps"] == 1
    assert rank0["relative_error"] <= TOLERANCE, rank0
    assert rank0["num_unchanged"] == 0, "every trainable parameter must receive its update"
    # every rank holds the same parameters after the step
    assert rank1["relative_error"] == pytest.approx(rank0["relative_error"], rel=1e-6, abs=1e-12)
    # the logged grad_norm is the exact norm of the accumulated gradient, before the step
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_grad_norm"], rel=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_router_term_is_exact(stage_results, family):
    """Mixture of experts under ZeRO-1/2/3: the router load-balancing term weighted by each micro-batch's routed
    tokens over both ranks (one micro-batch one sample short), against the float64 reference of the same
    micro-batches."""
    stage, results = stage_results
    rank0, rank1 = results[f"moe-{family}"]
    assert rank0["zero_stage"] == stage and rank0["global_step"] == 1
    assert rank0["micro_batch_sizes"] == [1] + [2] * 7  # per-device batch 2 x GA 4 x 2 ranks, 15 samples
    assert rank0["relative_error"] <= TOLERANCE, rank0
    assert rank0["num_router"] == 2 and rank0["router_relative_error"] <= 5e-5, rank0  # as on DDP and FSDP2
    assert rank1["relative_error"] == pytest.approx(rank0["relative_error"], rel=1e-6, abs=1e-12)


def test_stock_trainer_is_wrong_on_sequence_classification(stage_results):
    stage, results = stage_results
    rank0 = results[f"{SEQCLS}-stock"][0]
    assert rank0["relative_error"] > 1.0, rank0
    assert rank0["norm_ratio"] > 3.0
    # under DeepSpeed the stock Trainer's on_pre_optimizer_step runs after the engine stepped
    assert rank0["engine_steps_before_callback"] == 1


# ---------------------------------------------------------------------------------------------- gradient access
@pytest.mark.parametrize("reduction", ["per_micro_batch", "per_window"])
def test_on_pre_optimizer_step_sees_the_accumulated_gradient(stage_results, reduction):
    stage, results = stage_results
    for rank0 in results[f"{CAUSAL}-{reduction}"]:
        assert rank0["engine_steps_before_callback"] == 0, "the callback must run before engine.step()"
        assert rank0["read_relative_error"] <= TOLERANCE
        assert rank0["backend_norm"] == pytest.approx(rank0["reference_grad_norm"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- communication
@pytest.mark.parametrize("reduction", ["per_micro_batch", "per_window"])
def test_gradient_reductions_per_optimizer_step(stage_results, reduction):
    stage, results = stage_results
    counts = results[f"{CAUSAL}-{reduction}"][0]["reductions_per_micro_batch"]
    assert len(counts) == NUM_MICRO_BATCHES
    if stage == 1 or reduction == "per_window":
        # nothing while accumulating, one reduction after the final backward pass
        assert counts[:-1] == [0] * (NUM_MICRO_BATCHES - 1) and counts[-1] >= 1, counts
    else:
        # ZeRO-2/3 upstream default: a reduce-scatter after every micro-batch
        assert all(c >= 1 for c in counts), counts
    assert counts == results[f"{CAUSAL}-{reduction}"][1]["reductions_per_micro_batch"]


# ---------------------------------------------------------------------------------------------- several steps
def test_two_optimizer_steps_agree_between_reduction_modes(stage_results):
    stage, results = stage_results
    runs = [results[f"two-steps-{reduction}"][0] for reduction in ("per_micro_batch", "per_window")]
    for run in runs:
        assert run["global_step"] == run["engine_global_steps"] == 2, run  # no step silently skipped
        assert len(run["logged_grad_norms"]) == 2 and run["num_unchanged"] == 0
    assert runs[1]["projection"] == pytest.approx(runs[0]["projection"], rel=1e-5)
    assert runs[1]["update_norm"] == pytest.approx(runs[0]["update_norm"], rel=1e-5)


def test_two_optimizer_steps_agree_across_zero_stages():
    runs = {stage: results_for(stage)["two-steps-per_micro_batch"][0] for stage in (1, 2, 3)}
    for stage in (2, 3):
        assert runs[stage]["projection"] == pytest.approx(runs[1]["projection"], rel=1e-5), runs
        assert runs[stage]["logged_grad_norms"] == pytest.approx(runs[1]["logged_grad_norms"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- several backward passes
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["per_micro_batch", "per_window"])
def test_two_backward_passes_per_micro_batch_are_exact(stage, reduction):
    rank0 = results_for(stage)[f"multi-backward-{reduction}"][0]
    assert rank0["relative_error"] <= TOLERANCE, rank0
    assert rank0["global_step"] == rank0["engine_global_steps"] == 1  # one engine.step(), not one per backward
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_grad_norm"], rel=1e-5)


def test_zero3_backward_per_term_falls_back_to_one_backward_pass():
    """ZeRO-3 cannot backward twice through one forward: the trainer sums the terms instead (exact, see above)."""
    from hf_gradacc.backends.base import Backend

    assert Backend.supports_backward_per_term is True
    for reduction in ("per_micro_batch", "per_window"):
        rank0 = results_for(3)[f"multi-backward-{reduction}"][0]
        assert rank0["relative_error"] <= TOLERANCE, rank0


# ---------------------------------------------------------------------------------------------- clipping, hooks, errors
def test_clipping_follows_max_grad_norm():
    results = results_for(2)
    rank0 = results["clipped"][0]
    assert rank0["reference_grad_norm"] > 0.5  # the case clips at 0.5
    assert rank0["relative_error"] <= TOLERANCE, rank0  # update == reference * 0.5 / (norm + 1e-6)
    assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_grad_norm"], rel=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", ["hooked", "hooked-local"])
def test_accumulated_grad_hook_reaches_the_optimizer(stage, case):
    """A hook that halves the full gradient (safe_get/set_full_grad) or this rank's part of it (in place)."""
    rank0 = results_for(stage)[case][0]
    assert rank0["relative_error"] <= TOLERANCE, rank0  # update == 0.5 * reference


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("unpatched", "UnsupportedBackendError", ["HF_GRADACC_CPU_DISTRIBUTED", "1 process"]),
        ("clip-conflict", "GradAccConfigError", ["gradient_clipping", "max_grad_norm", "1.0"]),
        ("ga-conflict", "GradAccConfigError", ["gradient_accumulation_steps", "(2)", "(4)"]),
        ("closure-optimizer", "GradAccConfigError", ["ClosureSGD", "closure"]),
    ],
)
def test_clear_errors(case, error, words):
    results = results_for(1)
    for result in results[case]:
        assert result["error_type"] == error, result
        for word in words:
            assert word in result["error"], result["error"]


# ---------------------------------------------------------------------------------------------- TrainingArguments(deepspeed=...)
DEEPSPEED_JSON = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}


def test_deepspeed_json_under_torchrun_is_exact():
    """`--deepspeed ds_config.json` with torchrun (no accelerate config): ZeRO-3, both reduction modes."""
    cases = [
        {"name": f"json-{task}-{reduction}", "task": task, "zero_reduction": reduction, "count_reductions": True}
        for task in (CAUSAL, SEQCLS)
        for reduction in ("per_micro_batch", "per_window")
    ]
    result = run_workers(
        WORKER,
        nproc=2,
        args=["--cases", json.dumps(cases), "--deepspeed-config", json.dumps(DEEPSPEED_JSON)],
        timeout=LAUNCH_TIMEOUT_S,
        method="torchrun",
    )
    for case in cases:
        rank0 = result.load(case["name"])[0]
        assert rank0["zero_stage"] == 3 and rank0["args_world_size"] == 2
        assert rank0["relative_error"] <= TOLERANCE, rank0
        assert rank0["logged_grad_norm"] == pytest.approx(rank0["reference_grad_norm"], rel=1e-5)
        expected = [0, 0, 0, 1] if case["zero_reduction"] == "per_window" else [1, 1, 1, 1]
        assert rank0["reductions_per_micro_batch"] == expected


# ---------------------------------------------------------------------------------------------- config checks (1 process)
class _Args:
    def __init__(self, **kwargs: Any) -> None:
        self.gradient_accumulation_steps = 4
        self.per_device_train_batch_size = 2
        self.max_grad_norm = 1.0
        self.__dict__.update(kwargs)


@pytest.mark.parametrize("max_grad_norm, expected", [(1.0, 1.0), (0.0, 0.0), (None, 0.0), (-1.0, 0.0), (0.3, 0.3)])
def test_gradient_clipping_is_set_from_max_grad_norm(max_grad_norm, expected):
    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}
    check_deepspeed_config(config, _Args(max_grad_norm=max_grad_norm), num_processes=2)
    assert config["gradient_clipping"] == expected
    missing = {"zero_optimization": {"stage": 2}}  # DeepSpeed's own default would be 1.0
    check_deepspeed_config(missing, _Args(max_grad_norm=max_grad_norm), num_processes=2)
    assert missing["gradient_clipping"] == expected
    assert missing["gradient_accumulation_steps"] == 4 and missing["train_micro_batch_size_per_gpu"] == 2
    assert missing["train_batch_size"] == 16


@pytest.mark.parametrize(
    "config, words",
    [
        ({"gradient_clipping": 1.0}, ["`gradient_clipping` (1.0)", "`max_grad_norm` (0.0)"]),
        ({"gradient_accumulation_steps": 1}, ["`gradient_accumulation_steps` (1)", "(4)"]),
        (
            {"train_micro_batch_size_per_gpu": 8},
            ["`train_micro_batch_size_per_gpu` (8)", "per_device_train_batch_size"],
        ),
        ({"train_batch_size": 32}, ["`train_batch_size` (32)", "2 x 4 x 2 = 16"]),
        ({"managed_gradient_accumulation": False}, ["managed_gradient_accumulation"]),
    ],
)
def test_conflicting_deepspeed_values_raise(config, words):
    with pytest.raises(GradAccConfigError) as err:
        check_deepspeed_config({"zero_optimization": {"stage": 2}, **config}, _Args(max_grad_norm=0.0), 2)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("stage", [0, 4, None])
def test_unsupported_zero_stage_raises(stage):
    with pytest.raises(UnsupportedBackendError, match="zero_stage"):
        check_deepspeed_config({"zero_optimization": {"stage": stage}}, _Args(), 2)


def test_optimizers_deepspeed_cannot_step_raise():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    check_client_optimizer(torch.optim.SGD(params, lr=0.1))
    check_client_optimizer(torch.optim.AdamW(params))
    with pytest.raises(GradAccConfigError, match="closure"):
        check_client_optimizer(torch.optim.LBFGS(params))

    class LayerWiseDummyOptimizer(torch.optim.SGD):  # transformers' name for its layer-wise optimizers
        pass

    with pytest.raises(GradAccConfigError, match="layer-wise"):
        check_client_optimizer(LayerWiseDummyOptimizer(params, lr=0.1))
