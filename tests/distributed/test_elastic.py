"""torchrun elastic on one host, as docs/elastic.md prints it: two agents (``--nnodes 1:2``, c10d rendezvous,
``--max-restarts 1``) run examples/elastic_clm.py; after checkpoint-2 one agent is killed with its worker (a node
lost). The survivor leaves its collective with the library's error within ``ddp_timeout`` (no hang), its agent
restarts it on a world of 1, the restarted worker resumes from the newest complete checkpoint and finishes.

Both runs hold ``--total_train_batch_size 8`` (GA 2 on 2 processes, 4 after the restart on 1): the elastic run ends on
the weights of the same command run uninterrupted on 2 processes, within 1e-5 of the parameter change
(:func:`assert_equals_uninterrupted_run`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_gradacc.checkpoints import COMPLETE_NAME, latest_complete_checkpoint

from .launcher import find_free_port, kill_tree, launch_env, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_clm.py"
DDP_TIMEOUT_S = 30
MAX_STEPS = 4
DEADLINE_S = 110.0
# what the survivor stops with: the library's error, wherever its collective was (a step's, or the Trainer's own log
# gather: `GradAccMixin.train` names it too), with torch's as the cause
SURVIVOR_ERROR = "GradAccDistributedError"
TOLERANCE = 1e-5


def _agent(index: int, port: int, out: Path, log: Path) -> subprocess.Popen:
    """One torchrun agent, the docs' command line; agent 0 hosts the rendezvous store (``is_host``), so killing
    agent 1 takes no store down. Short keep-alives let the survivor drop the dead node in seconds."""
    rdzv_conf = f"is_host={int(index == 0)},join_timeout=60,last_call_timeout=5,keep_alive_interval=1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"elastic-{port}",
        "--rdzv-conf", rdzv_conf, "--max-restarts", "1", "--monitor-interval", "0.5",
        str(EXAMPLE), *_script_args(out), "--seconds_per_step", "1.0",
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=launch_env(extra={"LOGLEVEL": "INFO"}),
        start_new_session=True,
    )


def _script_args(out: Path) -> list[str]:
    """The example's arguments, the same at every start and for the uninterrupted run: the global batch held by
    ``total_train_batch_size`` (8 = 2 per device x GA 2 x 2 processes, GA 4 on 1)."""
    return [
        "--output_dir", str(out), "--save_steps", "2", "--max_steps", str(MAX_STEPS), "--save_on_preemption", "true",
        "--ddp_timeout", str(DDP_TIMEOUT_S), "--use_cpu", "true", "--ddp_backend", "gloo", "--report_to", "none",
        "--disable_tqdm", "true", "--per_device_train_batch_size", "2", "--total_train_batch_size", "8",
        "--learning_rate", "1e-3", "--logging_steps", "1",
    ]  # fmt: skip


def _records(out: Path) -> list[dict]:
    path = out / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, condition, deadline: float, logs: list[Path]) -> float:
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(0.2)
    tails = "\n".join(f"----- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def assert_equals_uninterrupted_run(run_dir: Path, uninterrupted_dir: Path, initial_dir: Path) -> None:
    """The elastic run's final weights equal the uninterrupted 2-process run's within 1e-5, relative to the parameter
    change from ``initial_dir``'s weights."""
    ours, theirs = load_file(str(run_dir / "model.safetensors")), load_file(str(uninterrupted_dir / "model.safetensors"))
    initial = load_file(str(initial_dir / "model.safetensors"))
    diff = sum(float((ours[n] - theirs[n]).double().pow(2).sum()) for n in theirs)
    change = sum(float((theirs[n] - initial[n]).double().pow(2).sum()) for n in theirs)
    assert (diff / change) ** 0.5 <= TOLERANCE


def test_torchrun_elastic_survives_a_lost_node() -> None:
    out = Path(tempfile.mkdtemp(prefix="hf_gradacc_elastic_"))
    run = out / "run"
    logs = [out / "agent0.log", out / "agent1.log"]
    port = find_free_port()
    began = time.monotonic()
    deadline = began + DEADLINE_S
    agents = [_agent(0, port, run, logs[0])]
    try:
        time.sleep(1.0)  # agent 0 binds the store first
        agents.append(_agent(1, port, run, logs[1]))
        _wait("the 2-process start", lambda: any(r["world_size"] == 2 for r in _records(run)), deadline, logs)
        _wait("checkpoint-2", lambda: (run / "checkpoint-2" / COMPLETE_NAME).exists(), deadline, logs)

        kill_tree(agents[1])  # node 1 lost: its agent and its worker, at once
        killed = time.monotonic()

        # the survivor's worker exits with an error (its agent logs "failed (exitcode: 1)") within ddp_timeout
        failed = _wait("the survivor's worker to fail", lambda: "failed (exitcode" in logs[0].read_text(), deadline, logs)
        assert failed - killed <= DDP_TIMEOUT_S + 5.0, failed - killed  # left its collective: no hang
        assert SURVIVOR_ERROR in logs[0].read_text(), logs[0].read_text()[-6000:]  # the library's, naming the step

        def restarted() -> bool:
            return any(r["event"] == "start" and r["restart"] == 1 for r in _records(run))

        _wait("the restart on world 1", restarted, deadline, logs)
        newest_complete = Path(latest_complete_checkpoint(str(run))).name  # nothing saved since the kill
        agents[0].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents:
            kill_tree(agent)

    log = logs[0].read_text()
    assert agents[0].returncode == 0, log[-6000:]
    records = _records(run)
    first, restart = records[0], next(r for r in records if r["event"] == "start" and r["restart"] == 1)
    assert first["world_size"] == 2 and first["resumed_from"] is None, records
    assert restart["world_size"] == 1, records  # the smaller world
    assert restart["resumed_from"] == newest_complete and int(newest_complete.split("-")[1]) >= 2, records
    assert records[-1]["event"] == "finished" and records[-1]["global_step"] == MAX_STEPS, records
    assert (run / "train_results.json").exists()
    assert time.monotonic() - began < DEADLINE_S
    assert first["gradient_accumulation_steps"] == 2 and restart["gradient_accumulation_steps"] == 4, records

    # the same command, uninterrupted on 2 processes: the elastic run trained the same samples in every step
    uninterrupted = out / "uninterrupted"
    run_workers(EXAMPLE, nproc=2, args=_script_args(uninterrupted), method="torchrun", timeout=180, out_dir=out)
    assert_equals_uninterrupted_run(run, uninterrupted, run / "tiny_model")


def test_the_exactness_assertion_can_fail(tmp_path: Path) -> None:
    """The exactness assertion is not vacuous: two different weights files fail it, the same passes."""
    from safetensors.torch import save_file

    for name, value in (("a", 1.0), ("b", 1.5), ("init", 0.0)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.full((3,), value)}, str(tmp_path / name / "model.safetensors"))
    assert_equals_uninterrupted_run(tmp_path / "a", tmp_path / "a", tmp_path / "init")
    with pytest.raises(AssertionError):
        assert_equals_uninterrupted_run(tmp_path / "a", tmp_path / "b", tmp_path / "init")
