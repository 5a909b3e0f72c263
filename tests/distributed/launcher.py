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

:func:`run_accelerate` launches the way users do, ``accelerate launch --config_file <yaml> script`` (or ``-m
module``), on a free ``--main_process_port``, with the same environment (:func:`launch_env`), the same hard
timeout and the same cleanup (:func:`kill_tree`).

A launch that uses DeepSpeed (an accelerate config with ``DEEPSPEED``; worker arguments that name ``zero`` or
``deepspeed``; or ``deepspeed=True``) first has DeepSpeed's CPU op built once per test process, under its own time
limit and before the launch's clock starts, and is refused at once, naming the file, when a stale torch build lock
would make every rank wait (:mod:`tests.distributed.deepspeed_op`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tests.distributed.deepspeed_op import check_build_lock, ensure_deepspeed_op, stale_lock, stale_lock_message

OUT_DIR_ENV = "HF_GRADACC_TEST_OUT"
REPO_ROOT = Path(__file__).resolve().parents[2]
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
        return _load_results(self.out_dir, len(self.ranks), name, self.describe)

    def describe(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of each rank's stdout and stderr."""
        parts = [f"launch: timed_out={self.timed_out}, wall={self.wall_s:.1f}s, out_dir={self.out_dir}"]
        for r in self.ranks:
            parts.append(f"----- rank {r.rank}: returncode={r.returncode}")
            parts.append(f"[stdout]\n{r.stdout[-tail:]}")
            parts.append(f"[stderr]\n{r.stderr[-tail:]}")
        return "\n".join(parts)


@dataclass(frozen=True)
class AccelerateResult:
    """The outcome of :func:`run_accelerate`: the launcher's streams (all ranks print into them) and exit status
    (``returncode`` None: killed at the timeout)."""

    returncode: int | None
    stdout: str
    stderr: str
    out_dir: Path
    nproc: int
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return self.stdout + self.stderr

    def load(self, name: str) -> list[dict]:
        """Every rank's JSON result ``name`` (written by ``workers/_common.write_result``), indexed by rank."""
        return _load_results(self.out_dir, self.nproc, name, self.describe)

    def describe(self, tail: int = 6000) -> str:
        """The exit status and the last ``tail`` characters of stdout and stderr."""
        return (
            f"launch: returncode={self.returncode}, timed_out={self.timed_out}, wall={self.wall_s:.1f}s, "
            f"out_dir={self.out_dir}\n[stdout]\n{self.stdout[-tail:]}\n[stderr]\n{self.stderr[-tail:]}"
        )


def _uses_deepspeed(args: Sequence[str], config: Path | None = None) -> bool:
    """Whether a launch will start DeepSpeed: its accelerate config says DEEPSPEED, or a worker argument names
    ``zero`` (``--backend zero2``) or ``deepspeed`` (``--deepspeed-config``)."""
    if config is not None and config.is_file() and "DEEPSPEED" in config.read_text().upper():
        return True
    return any("zero" in a.lower() or "deepspeed" in a.lower() for a in map(str, args))


def prepare_deepspeed(env: Mapping[str, str]) -> None:
    """Before a DeepSpeed launch: the op built once (its own time limit, not the launch's), no stale build lock."""
    ensure_deepspeed_op(env)
    check_build_lock(env)


def _lock_note(env: Mapping[str, str], uses_deepspeed: bool) -> str:
    """After a failed DeepSpeed launch: the stale build lock it may have left (a rank killed while holding it)."""
    if not uses_deepspeed:
        return ""
    path = stale_lock(env)
    return "" if path is None else "\n" + stale_lock_message(path)


def _load_results(out_dir: Path, nproc: int, name: str, describe: Callable[[], str]) -> list[dict]:
    results = []
    for rank in range(nproc):
        path = out_dir / f"{name}.rank{rank}.json"
        if not path.exists():
            raise WorkerError(f"rank {rank} wrote no result {name!r} ({path} is missing)\n{describe()}")
        results.append(json.loads(path.read_text()))
    return results


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(
    out_dir: str | os.PathLike | None = None,
    extra: Mapping[str, str] | None = None,
    *,
    hide_gpus: bool = False,
    cpu_distributed: bool = False,
) -> dict[str, str]:
    """The environment for launched ranks: this one without distributed / accelerate variables, plus quiet defaults.

    Args:
        out_dir: the folder for the workers' JSON results (``HF_GRADACC_TEST_OUT``); not set if None.
        extra: variables that win over everything else.
        hide_gpus: ``CUDA_VISIBLE_DEVICES=""``, so CPU configs stay on the CPU on a host with a GPU too.
        cpu_distributed: ``HF_GRADACC_CPU_DISTRIBUTED=1`` (DeepSpeed / FSDP2 on CPU ranks).

    Returns:
        A new dict: ``OMP_NUM_THREADS=1`` and the other thread limits, offline Hub / datasets / W&B, unbuffered
        output, ``PYTHONPATH`` starting with the repository root, and ``TORCH_EXTENSIONS_DIR`` inside this
        virtualenv unless it is set.

    Example:
        ```python
        env = launch_env(tmp_path, hide_gpus=True, cpu_distributed=True)
        ```
    """
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith("ACCELERATE_")}
    env.update(_QUIET_ENV)
    # JIT-built ops (DeepSpeed's CPU op) in a folder of THIS environment: torch keys its default folder only by the
    # Python and accelerator, so two virtualenvs (a developer's and a CI-style one, or another DeepSpeed version)
    # would rebuild the op over each other's build at every launch, 100-300 s each on 2 cores.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    # Workers import the package and tests/ from the repository checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if cpu_distributed:
        env["HF_GRADACC_CPU_DISTRIBUTED"] = "1"
    if out_dir is not None:
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


def kill_tree(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """Kill ``proc``, its process group and every descendant, and wait for them (at most ``wait_s`` for those that
    are not our children).

    ``proc`` must lead its own session (``start_new_session=True``); torchrun and ``accelerate launch`` (torch
    elastic) start their ranks in sessions of their own, hence the walk over the descendants.

    Example:
        ```python
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            proc.wait(timeout=60)
        finally:
            kill_tree(proc)
        ```
    """
    descendants = _descendants(proc.pid) if proc.poll() is None else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + wait_s
    while descendants and time.monotonic() < deadline:
        descendants = [pid for pid in descendants if _is_alive(pid)]
        if descendants:
            time.sleep(0.02)


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has released everything; its new parent reaps it


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _launch_subprocesses(
    script: Path,
    nproc: int,
    args: Sequence[str],
    env: dict[str, str],
    port: int,
    logs: Path,
    deadline: float,
    failure_grace: float = _FAILURE_GRACE_S,
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
            if failed_at is not None and now - failed_at > failure_grace:
                # A rank failed: the others would wait forever in their next collective. They had a moment to
                # print their side of the story; stop them.
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            kill_tree(proc)
        for f in files:
            f.close()
    # None: the rank was still running when it was stopped (timeout, or another rank failed)
    codes = [None if p.returncode == -signal.SIGKILL else p.returncode for p in procs]
    outputs = [(_read(logs / f"rank{r}.stdout"), _read(logs / f"rank{r}.stderr")) for r in range(nproc)]
    return codes, outputs, timed_out


def _launch_torchrun(
    script: Path,
    nproc: int,
    args: Sequence[str],
    env: dict[str, str],
    port: int,
    logs: Path,
    deadline: float,
    failure_grace: float = _FAILURE_GRACE_S,  # torchrun stops the other ranks itself when one fails
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
            kill_tree(proc)
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
    failure_grace: float = _FAILURE_GRACE_S,
    deepspeed: bool | None = None,
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
        failure_grace: seconds the other ranks may run on once one rank failed, before they are stopped (fault
            tests give the surviving ranks the time to hit their own collective timeout).
        deepspeed: whether the ranks start DeepSpeed (its CPU op is then built before ``timeout`` starts); None:
            guessed from ``args`` (``zero``, ``deepspeed``).

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
    uses_deepspeed = _uses_deepspeed(args) if deepspeed is None else deepspeed
    if uses_deepspeed:
        prepare_deepspeed(launch_env(out, env))
    start = time.monotonic()
    deadline = start + timeout
    result: LaunchResult | None = None
    for attempt in range(3):  # a free port can be taken between find_free_port() and the bind: retry then
        logs = Path(tempfile.mkdtemp(prefix=f"logs{attempt}_", dir=out))
        rank_env = launch_env(out, env)
        codes, outputs, timed_out = launch(script, nproc, args, rank_env, find_free_port(), logs, deadline, failure_grace)
        result = LaunchResult(
            ranks=tuple(RankOutput(r, codes[r], *outputs[r]) for r in range(nproc)),
            out_dir=out,
            timed_out=timed_out,
            wall_s=time.monotonic() - start,
        )
        port_taken = any(_port_taken(o[1]) for o in outputs)
        if result.ok or timed_out or not port_taken:
            break
    assert result is not None
    if check and not result.ok:
        reason = f"timed out after {timeout:.0f}s" if result.timed_out else "a rank failed"
        note = _lock_note(launch_env(out, env), uses_deepspeed)
        raise WorkerError(f"{script.name} on {nproc} ranks: {reason}{note}\n{result.describe()}")
    return result


def _port_taken(text: str) -> bool:
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def run_accelerate(
    config_file: str | os.PathLike,
    target: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    env: Mapping[str, str] | None = None,
    cpu_distributed: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    out_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    nproc: int = 2,
    check: bool = True,
) -> AccelerateResult:
    """``accelerate launch --config_file config_file --main_process_port <free> target args`` with a hard timeout.

    The config decides how many ranks start and how; the environment is :func:`launch_env` with the GPUs hidden
    (the configs are CPU configs). A launch that loses its port to another process before binding it is retried
    (twice). Whatever happens, the launcher and every rank are gone when this returns.

    Args:
        config_file: the accelerate YAML.
        target: the script, or the module name with ``module=True`` (``accelerate launch -m target``).
        args: its command-line arguments.
        module: run ``target`` as a module.
        env: extra environment variables (they win over the defaults).
        cpu_distributed: set ``HF_GRADACC_CPU_DISTRIBUTED=1`` (DeepSpeed / FSDP2 configs on CPU ranks).
        timeout: hard wall-clock limit in seconds over all attempts; a launch past it always raises
            :class:`WorkerError`. A DeepSpeed config's one-off op build happens before it starts.
        out_dir: where the ranks write their JSON results (``HF_GRADACC_TEST_OUT``) and where the launcher's
            output is logged; a new temp dir if None.
        cwd: the launch's working directory; the repository root if None.
        nproc: the number of ranks the config starts (what :meth:`AccelerateResult.load` reads back).
        check: raise :class:`WorkerError` with the output when the launch exits non-zero.

    Returns:
        An :class:`AccelerateResult`; ``load(name)`` reads the ranks' JSON results.

    Example:
        ```python
        result = run_accelerate(CONFIGS / "zero2_cpu.yaml", WORKER, ["--cases", cases], cpu_distributed=True)
        rank0, rank1 = result.load("causal_lm")
        ```
    """
    config = Path(config_file)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hf_gradacc_accel_"))
    out.mkdir(parents=True, exist_ok=True)
    launch_target = ["-m", str(target)] if module else [str(target)]
    launcher_env = launch_env(out, env, hide_gpus=True, cpu_distributed=cpu_distributed)
    uses_deepspeed = _uses_deepspeed(args, config)
    if uses_deepspeed:
        prepare_deepspeed(launcher_env)
    start = time.monotonic()
    for attempt in range(3):  # a free port can be taken between find_free_port() and the bind: retry then
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(find_free_port()),
            *launch_target,
            *args,
        ]
        stdout_log, stderr_log = out / f"launch{attempt}.stdout", out / f"launch{attempt}.stderr"
        with open(stdout_log, "w") as stdout, open(stderr_log, "w") as stderr:  # files: a chatty rank cannot block
            proc = subprocess.Popen(
                cmd,
                cwd=cwd if cwd is not None else REPO_ROOT,
                env=launcher_env,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=max(timeout - (time.monotonic() - start), 1.0))
            except subprocess.TimeoutExpired:
                code = None
            finally:
                kill_tree(proc)
        result = AccelerateResult(
            returncode=code,
            stdout=_read(stdout_log),
            stderr=_read(stderr_log),
            out_dir=out,
            nproc=nproc,
            timed_out=code is None,
            wall_s=time.monotonic() - start,
        )
        if code == 0 or code is None or not _port_taken(result.output):
            break
    if result.timed_out or (check and not result.ok):
        reason = f"timed out after {timeout:.0f}s" if result.timed_out else f"exit code {result.returncode}"
        note = _lock_note(launcher_env, uses_deepspeed)
        raise WorkerError(f"accelerate launch {config.name}: {reason}{note}\n{result.describe()}")
    return result
