"""Two loss terms with different denominators, one backward pass per term or one for both, accumulated-gradient
hooks and ``trainer.grads``, on 2 CPU ranks (gloo) under DDP, DeepSpeed ZeRO-1/2/3 and FSDP2; and the VAE example
launched as users launch it.

One launch per backend runs every case of that backend (``workers/multi_backward_cases.py``): DDP and FSDP2 through
``torchrun``, DeepSpeed through ``accelerate launch --config_file examples/accelerate_configs/zero<N>_cpu.yaml``
with ``HF_GRADACC_CPU_DISTRIBUTED=1``. Each case trains two optimizer steps of per-device batch 2 x GA 4 x 2 ranks
(mixed lengths, heavy padding) with SGD(lr=1); the loss is a token cross-entropy over the window's TOKENS plus a
per-sample logit penalty over its SAMPLES. Exact means relative error <= 1e-5 against the float64 full-batch gradient
of the window over both ranks' samples, at the parameters the step started from (float32 training).
"""

from __future__ import annotations

import ast
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest

from .launcher import run_accelerate, run_workers

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "multi_backward_cases.py"
CONFIGS = REPO / "examples" / "accelerate_configs"
VAE_EXAMPLE = REPO / "examples" / "vae_adaptive_loss.py"
TOLERANCE = 1e-5
NPROC = 2
NUM_WINDOWS = 2  # optimizer steps per case (multi_backward_cases.NUM_WINDOWS)
GA = 4  # micro-batches per optimizer step (multi_backward_cases.GA)
LAUNCH_TIMEOUT_S = 300.0

BACKENDS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
MODES = ("backward_per_term", "joint_backward")
CASES = [
    {"name": "backward_per_term", "backward_per_term": True},
    {"name": "joint_backward", "backward_per_term": False},
]


_RESULTS: dict[str, dict[str, list[dict[str, Any]]]] = {}


def results_for(backend: str) -> dict[str, list[dict[str, Any]]]:
    """Every case of ``backend`` (one launch per backend and test session), by case name, indexed by rank."""
    if backend in _RESULTS:
        return _RESULTS[backend]
    worker_args = ["--cases", json.dumps(CASES)]
    if backend in ("ddp", "fsdp2"):
        launch = run_workers(
            WORKER, nproc=NPROC, args=["--backend", backend, *worker_args], timeout=LAUNCH_TIMEOUT_S, method="torchrun"
        )
        results = {case["name"]: launch.load(case["name"]) for case in CASES}
    else:
        pytest.importorskip("deepspeed")
        launch = run_accelerate(
            CONFIGS / f"{backend}_cpu.yaml",
            WORKER,
            ["--backend", "deepspeed", *worker_args],
            nproc=NPROC,
            cpu_distributed=True,
            timeout=LAUNCH_TIMEOUT_S,
            out_dir=tempfile.mkdtemp(prefix=f"hf_gradacc_mb_{backend}_"),
        )
        results = {case["name"]: launch.load(case["name"]) for case in CASES}
    _RESULTS[backend] = results
    return results


@pytest.fixture(scope="module", params=BACKENDS)
def backend_results(request) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    return request.param, results_for(request.param)


def _ranks(backend_results, mode: str) -> list[dict[str, Any]]:
    backend, results = backend_results
    ranks = results[mode]
    for r, payload in enumerate(ranks):
        assert "crash" not in payload, payload.get("crash")
        assert payload["num_processes"] == NPROC, f"{backend}, rank {r}: {payload['num_processes']} processes"
        if backend.startswith("zero"):
            assert payload["distributed_type"].endswith("DEEPSPEED") and payload["zero_stage"] == int(backend[-1])
        elif backend == "fsdp2":
            assert payload["distributed_type"].endswith("FSDP") and payload["param_types"] == ["DTensor"]
        else:
            assert payload["distributed_type"].endswith("MULTI_CPU")
        assert len(payload["steps"]) == NUM_WINDOWS
    return ranks


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", MODES)
def test_two_terms_with_different_denominators_are_exact(backend_results, mode):
    for r, payload in enumerate(_ranks(backend_results, mode)):
        for k, step in enumerate(payload["steps"]):
            where = f"{backend_results[0]} {mode}, rank {r}, step {k + 1}: {step}"
            assert step["update"] <= TOLERANCE, where
            assert step["num_unchanged"] == 0, where
            # the logged per-term losses are the exact window means over both ranks
            for key in ("logged_ce", "logged_reg", "logged_loss", "logged_grad_norm"):
                assert step[key] <= TOLERANCE, f"{key}: {where}"


def test_the_second_denominator_matters():
    """The penalty term is big enough that normalising it by tokens instead of samples would be caught."""
    step = results_for("ddp")["backward_per_term"][0]["steps"][0]
    assert step["wrong_denominator"] > 1000 * TOLERANCE, step


@pytest.mark.parametrize("mode", MODES)
def test_one_optimizer_step_per_window(backend_results, mode):
    backend = backend_results[0]
    per_term = mode == "backward_per_term" and backend != "zero3"
    for r, payload in enumerate(_ranks(backend_results, mode)):
        where = f"{backend} {mode}, rank {r}: {payload}"
        assert payload["global_step"] == NUM_WINDOWS, where
        assert payload["backend_optimizer_steps"] == payload["callback_optimizer_steps"] == NUM_WINDOWS, where
        # the torch SGD inside every wrapper steps only inside the trainer's optimizer step, once per window (ZeRO
        # steps it once per parameter group)
        assert payload["torch_steps_outside_optimizer_step"] == 0, where
        groups = payload["param_groups"] if backend.startswith("zero") else 1
        assert payload["torch_steps_per_window"] == [groups] * NUM_WINDOWS, where
        if backend.startswith("zero"):
            assert payload["engine_global_steps"] == NUM_WINDOWS, where
            # on_pre_optimizer_step of step k saw the engine before its k-th step: no step inside a backward pass
            assert payload["engine_steps_before_callback"] == list(range(NUM_WINDOWS)), where
        for step in payload["steps"]:
            # two backward passes per micro-batch (the first retaining the graph), or one; one final pass, the last
            assert step["backward_passes"] == (2 * GA if per_term else GA), where
            assert step["retain_graph_passes"] == (GA if per_term else 0), where
            assert step["final_passes"] == 1 and step["last_pass_is_final"], where


@pytest.mark.parametrize("mode", MODES)
def test_backward_per_term_falls_back_only_on_zero3(backend_results, mode):
    backend = backend_results[0]
    for r, payload in enumerate(_ranks(backend_results, mode)):
        assert payload["backend_supports_backward_per_term"] is (backend != "zero3")
        expected = 1 if (backend == "zero3" and mode == "backward_per_term") else 0
        # once per trainer, on every rank, although 2 steps x 4 micro-batches asked for it
        assert payload["fallback_warnings"] == expected, f"{backend} {mode}, rank {r}: {payload['warnings']}"


# ---------------------------------------------------------------------------------------------- gradient access
@pytest.mark.parametrize("mode", MODES)
def test_accumulated_grad_hook_once_per_parameter_with_the_full_gradient(backend_results, mode):
    for r, payload in enumerate(_ranks(backend_results, mode)):
        for k, step in enumerate(payload["steps"]):
            where = f"{backend_results[0]} {mode}, rank {r}, step {k + 1}: {step}"
            assert step["hook_names_match"] and step["hook_calls_per_param"] == [1], where
            assert step["hook"] <= TOLERANCE, where


@pytest.mark.parametrize("mode", MODES)
def test_trainer_grads_full_and_norm_equal_the_reference(backend_results, mode):
    ranks = _ranks(backend_results, mode)
    for r, payload in enumerate(ranks):
        for k, step in enumerate(payload["steps"]):
            where = f"{backend_results[0]} {mode}, rank {r}, step {k + 1}: {step}"
            assert step["full_grads_names"] and step["full_grads"] <= TOLERANCE, where
            assert step["norm_pre_step"] <= TOLERANCE, where  # on_pre_optimizer_step (no clipping here)
            assert step["norm_accumulated"] <= TOLERANCE, where  # GradAccCallback.on_accumulated_grads
    assert ranks[0]["num_trainable"] == ranks[1]["num_trainable"] > 0


# ---------------------------------------------------------------------------------------------- the VAE example
VAE_ARGS = (
    "--max_steps 3 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --num_samples 64 "
    "--logging_steps 1 --report_to none --save_strategy no --disable_tqdm true"
).split()
VAE_LAUNCHES = {
    # ddp_cpu.yaml is MULTI_GPU + use_cpu: without GPU the script must ask for the CPU itself (`--use_cpu true`)
    "ddp": ("ddp_cpu.yaml", ["--use_cpu", "true"], {}),
    "zero2": ("zero2_cpu.yaml", [], {"HF_GRADACC_CPU_DISTRIBUTED": "1"}),
}
_VAE: dict[str, tuple[str, dict[str, float]]] = {}


def vae_run(backend: str) -> tuple[str, dict[str, float]]:
    """Launch the VAE example for 3 steps; its output and the summary rank 0 printed."""
    if backend not in _VAE:
        config, extra_args, extra_env = VAE_LAUNCHES[backend]
        if backend.startswith("zero"):
            pytest.importorskip("deepspeed")
        out = Path(tempfile.mkdtemp(prefix=f"hf_gradacc_vae_{backend}_"))
        text = run_accelerate(
            CONFIGS / config,
            VAE_EXAMPLE,
            ["--output_dir", str(out / "run"), *VAE_ARGS, *extra_args],
            env=extra_env,
            timeout=LAUNCH_TIMEOUT_S,
            out_dir=out,
        ).output
        lines = [line for line in text.splitlines() if line.startswith("vae summary: ")]
        assert len(lines) == 1, f"expected one summary (rank 0 of one 2-rank run), got {len(lines)}:\n{text[-4000:]}"
        _VAE[backend] = (text, ast.literal_eval(lines[0][len("vae summary: ") :]))
    return _VAE[backend]


@pytest.mark.parametrize("backend", list(VAE_LAUNCHES))
def test_vae_example_runs_on_two_ranks(backend):
    _, summary = vae_run(backend)
    assert summary["num_processes"] == NPROC and summary["steps"] == 3
    for key in ("loss/reconstruction", "loss/adversarial", "loss", "grad_norm", "grad_norm/global"):
        assert math.isfinite(summary[key]) and summary[key] > 0, (key, summary)
    assert summary["loss"] == pytest.approx(summary["loss/reconstruction"] + summary["loss/adversarial"], rel=1e-5)
    assert summary["grad_norm/global"] == pytest.approx(summary["grad_norm"], rel=1e-4)


def test_vae_example_gives_the_same_training_under_ddp_and_zero2():
    """Same seed, same samples per step: the third step's losses and norm agree across backends (AdamW, fp32)."""
    ddp, zero2 = vae_run("ddp")[1], vae_run("zero2")[1]
    for key in ("loss/reconstruction", "loss/adversarial", "grad_norm"):
        assert zero2[key] == pytest.approx(ddp[key], rel=TOLERANCE), (key, ddp, zero2)


def test_ddp_cpu_config_without_use_cpu_is_a_clear_error():
    """Without `--use_cpu`, ddp_cpu.yaml starts 2 ranks that each report ONE process: refused, not trained apart."""
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_vae_nocpu_"))
    text = run_accelerate(
        CONFIGS / "ddp_cpu.yaml",
        VAE_EXAMPLE,
        ["--output_dir", str(out / "run"), *VAE_ARGS],
        timeout=LAUNCH_TIMEOUT_S,
        out_dir=out,
        check=False,
    ).output
    assert "UnsupportedBackendError" in text and "`use_cpu=True`" in text and "--use_cpu true" in text, text[-4000:]
    assert "vae summary" not in text
