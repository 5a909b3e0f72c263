"""Ray Train runs GradAccTrainer exactly: examples/ray_train.py, as printed in docs/elastic.md ("Ray Train"), on 2 CPU
workers (``TorchTrainer`` + ``RayTrainReportCallback`` + ``prepare_trainer``, as Ray's Hugging Face guide wires a
Trainer) ends with the weights of the same run on 2 processes without Ray (the script's ``--without_ray``, launched by
tests/distributed/launcher.py), within 1e-5 of the parameter change: without a failure; with worker 1 failing once
after checkpoint 2 (``FailureConfig(max_failures=1)`` restarts the group), resumed from the reported checkpoint's
folder; and the same with each worker resuming from its own copy of it (another folder per worker, as a download
from cloud storage gives: the ranks agree on the checkpoint by its content).

Ray Train is in the ``test`` extra. The module starts one local Ray instance (``ray.init``, with the launched ranks'
environment) and each case's script joins it through ``RAY_ADDRESS``, as a driver joins a running cluster: the
instance's start-up is paid once. Under pytest-xdist the module runs on one worker (``--dist loadfile``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_gradacc.checkpoints import COMPLETE_NAME, SAVING_NAME
from tests.distributed.launcher import REPO_ROOT, kill_tree, launch_env, run_workers

pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'hf_gradacc[ray]')")

EXAMPLE = REPO_ROOT / "examples" / "ray_train.py"
TOLERANCE = 1e-5

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.ray]
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module; its processes inherit the launched ranks' environment."""
    import ray

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(launch_env(extra=RAY_ENV, hide_gpus=True))
    try:
        context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _weights(result: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(json.loads(result.read_text())["checkpoint"]) / "model.safetensors"))


@pytest.fixture(scope="module")
def without_ray(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same run on 2 processes launched without Ray: its final weights."""
    out = tmp_path_factory.mktemp("without_ray")
    run_workers(EXAMPLE, nproc=2, args=["--output_dir", str(out), "--without_ray"], timeout=240, out_dir=out)
    return _weights(out / "result.json")


def _relative_change_error(got: dict, reference: dict) -> float:
    """The distance between the two final weights, relative to the reference run's change of the weights."""
    from hf_gradacc.testing.tiny import build_tiny_model

    initial = {n: p.detach() for n, p in build_tiny_model("causal_lm", seed=0).named_parameters()}
    keys = [k for k in reference if k in initial]
    assert len(keys) == len(initial), sorted(set(initial) - set(reference))
    diff = sum(float((got[k] - reference[k]).norm() ** 2) for k in keys) ** 0.5
    change = sum(float((reference[k] - initial[k]).norm() ** 2) for k in keys) ** 0.5
    return diff / change


@pytest.mark.parametrize(
    "case, args",
    [
        ("no_failure", []),
        ("failure_reported_folder", ["--fail_after_step", "2"]),
        ("failure_own_copies", ["--fail_after_step", "2", "--own_copy"]),
    ],
)
def test_ray_train_equals_the_run_without_ray(case, args, without_ray, ray_address, tmp_path) -> None:
    out = tmp_path / case
    env = launch_env(extra={**RAY_ENV, "RAY_ADDRESS": ray_address}, hide_gpus=True)
    log = tmp_path / "ray.log"
    with open(log, "w") as stream:
        proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--output_dir", str(out), *args], env=env,
                                stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=480)
        except subprocess.TimeoutExpired:
            pytest.fail(f"Ray Train run {case} still running after 480 s:\n{log.read_text()[-6000:]}", pytrace=False)
        finally:
            kill_tree(proc)
    assert proc.returncode == 0, log.read_text()[-6000:]
    error = _relative_change_error(_weights(out / "result.json"), without_ray)
    assert error <= TOLERANCE, (case, error)
    result = json.loads((out / "result.json").read_text())
    resumed = [out / "train" / f"resumed.rank{r}.json" for r in (0, 1)]
    if not args:
        assert not result["failed_once"] and not any(p.exists() for p in resumed), result
        return
    assert result["failed_once"], result
    folders = [json.loads(p.read_text()) for p in resumed]
    for seen in folders:  # the checkpoint reported after step 2: complete, no save in progress
        assert seen["global_step"] == 2 and COMPLETE_NAME in seen["files"] and SAVING_NAME not in seen["files"], seen
    own = folders[0]["folder"] != folders[1]["folder"]
    assert own == ("--own_copy" in args), folders
