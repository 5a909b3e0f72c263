"""A small launcher for multi-rank CPU tests: N worker processes on gloo, a hard timeout, per-rank output.

Workers are plain scripts (see ``tests/distributed/workers/``). They find their rank in the usual torch env vars
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), write JSON results into the folder
named by ``HF_GRADACC_TEST_OUT`` (``workers/_common.py`` has ``write_result``), and the test reads them back with
:meth:`LaunchResult.load`.

Example:
    ```python
    from tests.distributed.launcher import run_workers

    result = run_workers(WORKERS / "ddp_cases.py", nproc=2, args=["--cases", "causal_lm"], timeout=240)
    rank0, rank1 = result.load("causal_lm")
    ```

Two ways to start the ranks:

- ``method="subprocess"`` (default): one ``python script`` per rank with the env vars set by us. Each rank's
  stdout / stderr is captured on its own.
- ``method="torchrun"``: ``python -m torch.distributed.run --nproc_per_node N script``, as users launch it; the
  per-rank streams come from torchrun's ``--log-dir`` / ``--redirects``.

Whatever happens, no process outlives :func:`run_workers`: every process group it started is killed at the
timeout (and on any error).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

OUT_DIR_ENV = "HF_GRADACC_TEST_OUT"
DEFAULT_TIMEOUT_S = 300.0
_FAILURE_GRACE_S = 5.0  # how long the other ranks may run on once one rank has failed

# Values that keep CPU ranks from oversubscribing a small machine and from reaching the network.
_QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
}
# Inherited from an enclosing distributed job, these would make the workers join the wrong group.
_DIST_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_FSDP",
)


class WorkerError(AssertionError):
    """A rank exited non-zero or the launch ran past its timeout; the message holds every rank's output tail."""


@dataclass(frozen=True)
class RankOutput:
    """What one rank printed and how it ended (``returncode`` None: killed at the timeout)."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of :func:`run_workers`."""

    ranks: tuple[RankOutput, ...]
    out_dir: Path
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def load(self, name: str) -> list[dict]:
        """Every rank's JSON result ``name`` (written by ``workers/_common.write_result``), indexed by rank."""
        results = []
        for rank in range(len(self.ranks)):
            path = self.out_dir / f"{name}.rank{rank}.json"
            if not path.exists():
                raise WorkerError(f"rank {rank} wrote no result {name!r} ({path} is missing)\n{self.describe()}")
            results.append(json.loads(path.read_text()))
        return results

    def describe(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of each rank's stdout and stderr."""
        parts = [f"launch: timed_out={self.timed_out}, wall={self.wall_s:.1f}s, out_dir={self.out_dir}"]
        for r in self.ranks:
            parts.append(f"----- rank {r.rank}: returncode={r.returncode}")
            parts.append(f"[stdout]\n{r.stdout[-tail:]}")
            parts.append(f"[stderr]\n{r.stderr[-tail:]}")
        return "\n".join(parts)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(extra: Mapping[str, str] | None, out_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(_QUIET_ENV)
    # Workers import the package and tests/ from the repository checkout.
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    env[OUT_DIR_ENV] = str(out_dir)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc``, its process group and every descendant (torchrun puts its workers in sessions of their own)."""
    descendants = _descendants(proc.pid) if proc.poll() is None else []
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process leads its own session (start_new_session=True)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in descendants:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _launch_subprocesses(
    script: Path, nproc: int, args: Sequence[str], env: dict[str, str], port: int, logs: Path, deadline: float
) -> tuple[list[int | None], list[tuple[str, str]], bool]:
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for rank in range(nproc):
            rank_env = dict(env)
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            out = open(logs / f"rank{rank}.stdout", "w")  # files, not pipes: a chatty rank cannot block
            err = open(logs / f"rank{rank}.stderr", "w")
            files += [out, err]
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=rank_env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        timed_out = False
        failed_at: float | None = None
        while None in [p.poll() for p in procs]:  # a list, not any(): every rank's status must be refreshed
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > _FAILURE_GRACE_S:
                # A rank failed: the others would wait forever in their next collective. They had a moment to
                # print their side of the story; stop them.
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            _stop(proc)
        for f in files:
            f.close()
    # None: the rank was still running when it was stopped (timeout, or another rank failed)
    codes = [None if p.returncode == -signal.SIGKILL else p.returncode for p in procs]
    outputs = [(_read(logs / f"rank{r}.stdout"), _read(logs / f"rank{r}.stderr")) for r in range(nproc)]
    return codes, outputs, timed_out


def _launch_torchrun(
    script: Path, nproc: int, args: Sequence[str], env: dict[str, str], port: int, logs: Path, deadline: float
) -> tuple[list[int | None], list[tuple[str, str]], bool]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--log-dir",
        str(logs / "torchrun"),
        "--redirects",
        "3",
        str(script),
        *args,
    ]
    with open(logs / "agent.stdout", "w") as out, open(logs / "agent.stderr", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _stop(proc)
    agent_out, agent_err = _read(logs / "agent.stdout"), _read(logs / "agent.stderr")
    outputs = []
    for rank in range(nproc):
        # torchrun writes <log-dir>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log
        outs = sorted((logs / "torchrun").glob(f"*/attempt_*/{rank}/stdout.log"))
        errs = sorted((logs / "torchrun").glob(f"*/attempt_*/{rank}/stderr.log"))
        stdout = "".join(_read(p) for p in outs)
        stderr = "".join(_read(p) for p in errs)
        if rank == 0:
            stdout += f"\n[torchrun agent stdout]\n{agent_out}"
            stderr += f"\n[torchrun agent stderr]\n{agent_err}"
        outputs.append((stdout, stderr))
    # torchrun reports one exit status for the job; a failed worker makes the whole job fail.
    code = None if timed_out else proc.returncode
    return [code] * nproc, outputs, timed_out


def run_workers(
    script_path: str | os.PathLike,
    nproc: int = 2,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    method: Literal["subprocess", "torchrun"] = "subprocess",
    out_dir: str | os.PathLike | None = None,
    check: bool = True,
) -> LaunchResult:
    """Run ``script_path`` on ``nproc`` CPU ranks and wait at most ``timeout`` seconds for all of them.

    Args:
        script_path: the worker script.
        nproc: number of ranks (``WORLD_SIZE``).
        args: command-line arguments for the script (the same on every rank).
        env: extra environment variables (they win over the defaults: ``OMP_NUM_THREADS=1``, offline hub, ...).
        timeout: hard wall-clock limit in seconds for the whole launch; every process is killed after it.
        method: ``"subprocess"`` (one process per rank, started by us) or ``"torchrun"``.
        out_dir: where workers write their JSON results (``HF_GRADACC_TEST_OUT``); a new temp dir if None.
        check: raise :class:`WorkerError` with every rank's output when a rank fails or the timeout is hit.

    Returns:
        A :class:`LaunchResult` with each rank's output; ``load(name)`` reads the ranks' JSON results.

    Example:
        ```python
        result = run_workers("tests/distributed/workers/ddp_cases.py", nproc=2, args=["--cases", "causal_lm"])
        assert result.ok
        ```
    """
    script = Path(script_path).resolve()
    if not script.is_file():
        raise FileNotFoundError(f"worker script {script} does not exist")
    if nproc < 1:
        raise ValueError(f"`nproc` ({nproc}) must be >= 1")
    if method not in ("subprocess", "torchrun"):
        raise ValueError(f"`method` ({method!r}) must be 'subprocess' or 'torchrun'")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hf_gradacc_dist_"))
    out.mkdir(parents=True, exist_ok=True)
    launch = _launch_subprocesses if method == "subprocess" else _launch_torchrun
    start = time.monotonic()
    deadline = start + timeout
    result: LaunchResult | None = None
    for attempt in range(3):  # a free port can be taken between find_free_port() and the bind: retry then
        logs = Path(tempfile.mkdtemp(prefix=f"logs{attempt}_", dir=out))
        codes, outputs, timed_out = launch(script, nproc, args, _base_env(env, out), find_free_port(), logs, deadline)
        result = LaunchResult(
            ranks=tuple(RankOutput(r, codes[r], *outputs[r]) for r in range(nproc)),
            out_dir=out,
            timed_out=timed_out,
            wall_s=time.monotonic() - start,
        )
        port_taken = any("EADDRINUSE" in o[1] or "address already in use" in o[1].lower() for o in outputs)
        if result.ok or timed_out or not port_taken:
            break
    assert result is not None
    if check and not result.ok:
        reason = f"timed out after {timeout:.0f}s" if result.timed_out else "a rank failed"
        raise WorkerError(f"{script.name} on {nproc} ranks: {reason}\n{result.describe()}")
    return result
