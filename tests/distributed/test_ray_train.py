"""Ray Train runs GradAccTrainer exactly: examples/ray_train.py, as printed in docs/elastic.md ("Ray Train"), on 2 CPU
workers (``TorchTrainer`` + ``RayTrainReportCallback`` + ``prepare_trainer``, as Ray's Hugging Face guide wires a
Trainer) ends with the weights of the same run on 2 processes without Ray (the script's ``--without_ray``, launched by
tests/distributed/launcher.py), within 1e-5 of the parameter change: without a failure; with worker 1 failing once
after checkpoint 2 (``FailureConfig(max_failures=1)`` restarts the group), resumed from the reported checkpoint's
folder; and the same with each worker resuming from its own copy of it (another folder per worker, as a download
from cloud storage gives: the ranks agree on the checkpoint by its content).

Elastic: ``ScalingConfig(num_workers=(1, 2))`` (the script's ``--min_workers 1``) with ``total_train_batch_size`` 8;
worker 1's node is removed after checkpoint 1 is reported and Ray restarts on the 1 worker left from it, with GA 4 in
place of 2: the same weights again, and the record of each start (workers, GA, step).

Ray Train is in the ``test`` extra. The module starts one local Ray cluster (``ray.cluster_utils.Cluster``, with the
launched ranks' environment: a head with no CPU, two nodes of 1 CPU) and each case's script joins it through
``RAY_ADDRESS``, as a driver joins a running cluster: the cluster's start-up is paid once. Under pytest-xdist the
module runs on one worker (``--dist loadfile``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
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


@contextlib.contextmanager
def _launched_ranks_environment():
    """Ray processes started inside inherit the launched ranks' environment (tests/distributed/launcher.py)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(launch_env(extra=RAY_ENV, hide_gpus=True))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (``ray.cluster_utils.Cluster``): a head with no CPU, which the scripts'
    drivers join (Ray Train's controller runs on the driver's node), and two nodes of 1 CPU, one worker each."""
    from ray.cluster_utils import Cluster

    with _launched_ranks_environment():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(2):
            cluster.add_node(num_cpus=1)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_address(ray_cluster) -> str:
    return ray_cluster.address


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


def _wait_for(what: str, condition, deadline: float, log: Path) -> None:
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-6000:]}", pytrace=False)
        time.sleep(0.2)


ELASTIC_ARGS = ["--min_workers", "1", "--num_workers", "2", "--total_train_batch_size", "8"]


def test_ray_train_elastic_restarts_on_the_workers_left_exactly(without_ray, ray_cluster, tmp_path) -> None:
    """``ScalingConfig(num_workers=(1, 2))`` with ``total_train_batch_size`` 8: worker 1's node is removed after
    checkpoint 1 is reported; Ray restarts on 1 worker from it, with GA 4 in place of 2, and ends on the weights of the
    uninterrupted 2-process run (GA 2 there: 8 samples a step too)."""
    began = time.monotonic()
    deadline = began + 420
    out, log = tmp_path / "elastic", tmp_path / "ray.log"
    env = launch_env(extra={**RAY_ENV, "RAY_ADDRESS": ray_cluster.address}, hide_gpus=True)
    command = [sys.executable, str(EXAMPLE), "--output_dir", str(out), *ELASTIC_ARGS, "--pause_after_step", "1"]
    paused = [out / f"paused.rank{r}.json" for r in (0, 1)]
    registered = out / "ray_results" / "run" / "checkpoint_manager_snapshot.json"  # Ray's checkpoint manager
    removed = None
    with open(log, "w") as stream:
        proc = subprocess.Popen(command, env=env, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for("both workers paused after checkpoint 1", lambda: all(p.exists() for p in paused), deadline, log)
        _wait_for("Ray to register checkpoint 1", registered.exists, deadline, log)
        seen = [json.loads(p.read_text()) for p in paused]
        assert [s["world_size"] for s in seen] == [2, 2] and seen[0]["node_id"] != seen[1]["node_id"], seen
        removed = next(n for n in ray_cluster.worker_nodes if n.node_id == seen[1]["node_id"])
        ray_cluster.remove_node(removed)  # worker 1's node is gone, with its worker
        (out / "go").touch()
        removed_s = time.monotonic() - began
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"elastic Ray Train run still running after 420 s:\n{log.read_text()[-6000:]}", pytrace=False)
    finally:
        kill_tree(proc)
        if removed is not None:  # the module's cluster has its two worker nodes again
            with _launched_ranks_environment():
                ray_cluster.add_node(num_cpus=1)
    assert proc.returncode == 0, log.read_text()[-6000:]
    print(f"elastic Ray Train run: {time.monotonic() - began:.1f} s (node removed at {removed_s:.1f} s)")

    error = _relative_change_error(_weights(out / "result.json"), without_ray)
    print(f"relative error against the uninterrupted 2-process run: {error:.2e}")
    assert error <= TOLERANCE, error

    starts = [json.loads(line) for line in (out / "train" / "starts.jsonl").read_text().splitlines()]
    # (workers, GA, from step): 2 workers GA 2 from the start; 1 worker GA 4 from the reported checkpoint-1
    assert [(s["world_size"], s["gradient_accumulation_steps"], s["global_step"]) for s in starts] == [
        (2, 2, 0),
        (1, 4, 1),
    ], starts
    resumed = json.loads((out / "train" / "resumed.rank0.json").read_text())
    assert resumed["global_step"] == 1 and COMPLETE_NAME in resumed["files"], resumed
    assert not (out / "train" / "resumed.rank1.json").exists()
    final = json.loads((out / "result.json").read_text())["checkpoint"]
    assert json.loads((Path(final) / "trainer_state.json").read_text())["global_step"] == 3
