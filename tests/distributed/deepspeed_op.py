"""DeepSpeed's CPU communication op, built once per test run before any rank starts, and its stale build lock.

On CPU DeepSpeed JIT-builds ``deepspeed_shm_comm`` (``deepspeed.comm.torch.build_shm_op``, through
``torch.utils.cpp_extension.load``) the first time a process initialises it: 100-240 s on a busy 2-core machine.
Every process that loads it, built or not, first takes torch's build lock, a file
``<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/py<XY>_<cpu|cuXXX>>/deepspeed_shm_comm/lock`` created with
``O_EXCL`` and held open until it is removed. A process killed while it holds it (a rank stopped at a launcher's
timeout) leaves the file behind, and every later DeepSpeed process waits for it forever, in silence.

So the launcher (:mod:`tests.distributed.launcher`) calls :func:`ensure_deepspeed_op` before the first DeepSpeed
launch of a test run: the op is built (or found built) by ONE process, under its own time limit, before the launch's
clock starts; and :func:`check_build_lock` before every DeepSpeed launch: a lock that no live process holds open is
reported by path, with the command that removes it, instead of a launch that waits until its timeout.

Example:
    ```python
    from tests.distributed.deepspeed_op import check_build_lock, ensure_deepspeed_op

    check_build_lock()          # raises StaleBuildLockError naming the file if a killed process left it
    seconds = ensure_deepspeed_op()   # builds once per process; None when DeepSpeed is not installed
    ```
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

OP_NAME = "deepspeed_shm_comm"
BUILD_TIMEOUT_ENV = "HF_GRADACC_TEST_OP_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 1800.0  # apart from every launch's own timeout
_STALE_CONFIRM_S = 1.0  # a holder closes the lock file just before it removes it: look twice
_POLL_S = 2.0

# What DeepSpeed runs when a CPU process group starts (deepspeed/comm/torch.py): the same conditions, the same build.
BUILD_SCRIPT = (
    "import time; t = time.monotonic()\n"
    "from deepspeed.comm.torch import build_shm_op\n"
    "op = build_shm_op()\n"
    "print(f'hf_gradacc tests: {OP_NAME} ' + ('ready' if op is not None else 'not used here') "
    "+ f' in {time.monotonic() - t:.1f}s')\n"
).replace("{OP_NAME}", OP_NAME)

_built: dict[str, float] = {}  # extensions root -> seconds the build (or the check that it is built) took


class StaleBuildLockError(AssertionError):
    """A torch extensions build lock that no live process holds: every DeepSpeed launch would wait for it forever."""


class OpBuildError(AssertionError):
    """The one-off build of DeepSpeed's CPU op failed or ran past its own time limit."""


def extensions_root(env: Mapping[str, str] | None = None) -> Path:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py<XY>_<acc>``
    (``torch.utils.cpp_extension._get_build_directory``'s rule)."""
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def lock_path(env: Mapping[str, str] | None = None) -> Path:
    """The build lock of DeepSpeed's CPU op."""
    return extensions_root(env) / OP_NAME / "lock"


def lock_holders(path: Path) -> list[int]:
    """The live processes that hold ``path`` open (Linux /proc; torch's FileBaton keeps its file open while held)."""
    target = os.path.realpath(path)
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(fd_dir.parent.name))
                    break
            except OSError:
                continue
    return holders


def lock_file_blocks() -> bool:
    """Whether torch's extension build lock blocks by the file's existence (``FileBaton``, torch <= 2.14), so that a
    file left by a killed process is stale. torch 2.15 holds an advisory ``FileLock`` on the file instead: the kernel
    releases it when its holder dies and the file stays after every build, so a file no one holds is no stale lock.
    """
    import torch.utils.cpp_extension as cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def stale_lock(env: Mapping[str, str] | None = None) -> Path | None:
    """The op's build lock if it exists and no live process holds it (looked at twice, a moment apart); None where
    torch's lock does not block by its file's existence (:func:`lock_file_blocks`)."""
    path = lock_path(env)
    if not path.exists() or not Path("/proc/self/fd").is_dir():
        return None  # no lock; or no /proc to tell a stale lock from a held one
    if not lock_file_blocks():
        return None  # torch's advisory lock: a file no process holds blocks no one
    try:
        inode = path.stat().st_ino
    except FileNotFoundError:
        return None
    if lock_holders(path):
        return None
    time.sleep(_STALE_CONFIRM_S)
    try:
        if path.stat().st_ino != inode:
            return None  # released and taken again in between: someone is working
    except FileNotFoundError:
        return None
    return None if lock_holders(path) else path


def stale_lock_message(path: Path) -> str:
    age = time.time() - path.stat().st_mtime if path.exists() else float("nan")
    return (
        f"stale torch extensions build lock: {path} (created {age:.0f} s ago; no running process holds it). A "
        f"process killed while it built or loaded DeepSpeed's {OP_NAME} op (for example a rank stopped at a test "
        f"launcher's timeout) left it, and every DeepSpeed process now waits for it forever. Make sure no DeepSpeed "
        f"run is still starting, then remove it: rm {path}"
    )


def check_build_lock(env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`StaleBuildLockError` naming the file (and how to remove it) if the op's build lock is stale."""
    path = stale_lock(env)
    if path is not None:
        raise StaleBuildLockError(stale_lock_message(path))


def build_timeout_s() -> float:
    return float(os.environ.get(BUILD_TIMEOUT_ENV, DEFAULT_BUILD_TIMEOUT_S))


def ensure_deepspeed_op(env: Mapping[str, str] | None = None, timeout: float | None = None) -> float | None:
    """Build (or find built) DeepSpeed's CPU op in one process, once per extensions folder and test process.

    Args:
        env: the environment the ranks will get (its ``TORCH_EXTENSIONS_DIR`` decides the folder); this process's
            if None.
        timeout: seconds the build may take (``HF_GRADACC_TEST_OP_BUILD_TIMEOUT``, default 1800), apart from any
            launch's timeout.

    Returns:
        The seconds it took; None when DeepSpeed is not installed (nothing to build).

    Raises:
        StaleBuildLockError: the lock is stale, before the build or while waiting for another process's build.
        OpBuildError: the build failed or ran past ``timeout``.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return None
    env = dict(os.environ if env is None else env)
    root = str(extensions_root(env))
    if root in _built:
        return _built[root]
    check_build_lock(env)
    timeout = build_timeout_s() if timeout is None else timeout
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILD_SCRIPT],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        while proc.poll() is None:
            if time.monotonic() - start > timeout:
                # Killing a build leaves its lock: say where, so nobody waits on it.
                proc.kill()
                out = proc.communicate()[0]
                raise OpBuildError(
                    f"building DeepSpeed's {OP_NAME} op took over {timeout:.0f} s ({BUILD_TIMEOUT_ENV} raises the "
                    f"limit); if {lock_path(env)} is left, remove it.\n{out[-4000:]}"
                )
            # Our build waits for another process's lock: if that process died, the wait would never end.
            path = lock_path(env)
            if path.exists() and proc.pid not in lock_holders(path):
                stale = stale_lock(env)
                if stale is not None:
                    proc.kill()
                    proc.communicate()
                    raise StaleBuildLockError(stale_lock_message(stale))
            time.sleep(_POLL_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.communicate()[0]
    if proc.returncode != 0:
        raise OpBuildError(f"building DeepSpeed's {OP_NAME} op failed (exit {proc.returncode}):\n{out[-4000:]}")
    _built[root] = time.monotonic() - start
    print(f"hf_gradacc tests: DeepSpeed's {OP_NAME} op under {root}: {_built[root]:.1f} s, before any rank started")
    return _built[root]
