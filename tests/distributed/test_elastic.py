"""torchrun elastic on one host, as docs/elastic.md prints it: two agents (``--nnodes 1:2``, c10d rendezvous,
``--max-restarts 1``) run examples/elastic_clm.py; after checkpoint-2 one agent is killed with its worker (a node
lost). The survivor leaves its collective with the library's error within ``ddp_timeout`` (no hang), its agent
restarts it on a world of 1, the restarted worker resumes from the newest complete checkpoint and finishes.

Both runs hold ``--total_train_batch_size 8`` (GA 2 on 2 processes, 4 after the restart on 1): the elastic run ends on
the weights of the same command run uninterrupted on 2 processes, within 1e-5 of the parameter change
(:func:`assert_equals_uninterrupted_run`).

The world growing back (:func:`test_torchrun_elastic_grows_back`): agent 0 starts alone (world 1, GA 4), a second
agent joins after checkpoint-2, torchrun restarts the worker (SIGTERM: ``save_on_preemption`` saves and exits 0) and
the world of 2 (GA 2) resumes from that save and ends on the same uninterrupted run's weights (one reference run for
the module: the ``uninterrupted`` fixture).
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
MAX_STEPS = 6
DEADLINE_S = 110.0
# what the survivor stops with: the library's error, wherever its collective was (a step's, or the Trainer's own log
# gather: `GradAccMixin.train` names it too), with torch's as the cause
SURVIVOR_ERROR = "GradAccDistributedError"
TOLERANCE = 1e-5


def _agent(
    index: int,
    port: int,
    out: Path,
    log: Path,
    *,
    max_restarts: int = 1,
    seconds_per_step: float = 1.0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """One torchrun agent, the docs' command line; agent 0 hosts the rendezvous store (``is_host``), so killing
    agent 1 takes no store down. Short keep-alives let the survivor drop the dead node in seconds."""
    rdzv_conf = f"is_host={int(index == 0)},join_timeout=60,last_call_timeout=5,keep_alive_interval=1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"elastic-{port}",
        "--rdzv-conf", rdzv_conf, "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
        str(EXAMPLE), *_script_args(out), "--seconds_per_step", str(seconds_per_step),
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=launch_env(extra={"LOGLEVEL": "INFO", **(env or {})}),
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same command, uninterrupted on 2 processes (torchrun, no elastic range): the reference of both elastic
    runs, run once per module."""
    out = tmp_path_factory.mktemp("elastic_uninterrupted")
    run_workers(EXAMPLE, nproc=2, args=_script_args(out / "run"), method="torchrun", timeout=180, out_dir=out)
    return out / "run"


def _fresh_run(prefix: str) -> tuple[Path, Path, list[Path], int, float]:
    """A new folder for one elastic job: the folder, its run's output_dir, the two agents' logs, a free rendezvous
    port, and the time it began."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    return out, out / "run", [out / "agent0.log", out / "agent1.log"], find_free_port(), time.monotonic()


def test_torchrun_elastic_survives_a_lost_node(uninterrupted: Path) -> None:
    _, run, logs, port, began = _fresh_run("hf_gradacc_elastic_")
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


# the growth case: agent 1, started once checkpoint-2 is complete, is seen by agent 0 ~1 s later (during step 3); the
# worker then stops at the next agreed step boundary (3 or 4: step 3's agreement may be past), before MAX_STEPS
GROW_SECONDS_PER_STEP = 3.0
GROW_DEADLINE_S = 90.0
# torch 2.13's c10d rendezvous shares the agent's TCPStore with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0, its
# default) and publishes the workers' MASTER_ADDR / MASTER_PORT only on a node's first rendezvous: on a join, the
# running rank-0 agent never writes them for the new round, and both agents wait for each other until the store
# times out (measured: no progress in 45 s, in the store `get` of the joiner and the rank-0 agent's `multi_get`). With
# 1, every round publishes its own; the growth case needs it.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_torchrun_elastic_grows_back(uninterrupted: Path) -> None:
    """Agent 0 starts alone (``--nnodes 1:2``: world 1, GA 4); after its checkpoint-2 a second agent joins. torchrun's
    running agent sees the waiting node (``num_nodes_waiting``, polled every ``--monitor-interval``) and restarts
    its worker: a SIGTERM, on which the worker saves at the end of its step (``save_on_preemption``) and exits 0; a
    membership change costs none of ``--max-restarts`` (0 here). The world of 2 resumes from that checkpoint with
    GA 2 and ends on the uninterrupted 2-process run's weights within 1e-5. Both agents run with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (:data:`NO_SHARED_STORE`: without it the join hangs)."""
    _, run, logs, port, began = _fresh_run("hf_gradacc_elastic_grow_")
    deadline = began + GROW_DEADLINE_S
    pace = {"max_restarts": 0, "seconds_per_step": GROW_SECONDS_PER_STEP, "env": NO_SHARED_STORE}
    agents = [_agent(0, port, run, logs[0], **pace)]
    try:
        _wait("checkpoint-2", lambda: (run / "checkpoint-2" / COMPLETE_NAME).exists(), deadline, logs)
        joining = time.monotonic()
        agents.append(_agent(1, port, run, logs[1], **pace))

        def grown() -> bool:
            return any(r["event"] == "start" and r["world_size"] == 2 for r in _records(run))

        _wait("the restart on world 2", grown, deadline, logs)
        regrown = time.monotonic()
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        finished = time.monotonic()
    finally:
        for agent in agents:
            kill_tree(agent)

    texts = [log.read_text() for log in logs]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(t[-6000:] for t in texts)
    assert "new nodes from group_rank=0; will restart worker group" in texts[0], texts[0][-6000:]
    records = _records(run)
    print(  # the measured times (pytest -s)
        f"grow: checkpoint-2 at {joining - began:.1f} s, world 2 started {regrown - joining:.1f} s after agent 1 was "
        f"launched, finished at {finished - began:.1f} s; records {records}"
    )
    assert [r["event"] for r in records] == ["start", "preempted", "start", "finished"], records
    first, preempted, grown_start, last = records
    assert first["world_size"] == 1 and first["resumed_from"] is None and first["gradient_accumulation_steps"] == 4
    # the worker stopped at a step boundary after checkpoint-2 and saved it; the world of 2 resumed exactly there
    assert preempted["preempted"] and 2 < preempted["global_step"] < MAX_STEPS, records
    assert grown_start["world_size"] == 2 and grown_start["gradient_accumulation_steps"] == 2, records
    assert grown_start["resumed_from"] == f"checkpoint-{preempted['global_step']}", records
    assert grown_start["restart"] == first["restart"] == 0, records  # a membership change is not a restart attempt
    assert last["global_step"] == MAX_STEPS and not last["preempted"], records
    assert finished - began < GROW_DEADLINE_S

    # no sample lost or repeated: every step trained the uninterrupted run's samples
    assert_equals_uninterrupted_run(run, uninterrupted, run / "tiny_model")
