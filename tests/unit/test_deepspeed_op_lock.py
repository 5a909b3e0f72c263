"""The test launcher and DeepSpeed's JIT-built CPU op: one build before any rank, a stale build lock named at once.

A planted lock file stands for the one a rank killed mid-build leaves; a small process holding a lock open stands for
a build in progress (torch's FileBaton keeps its file open while held). No DeepSpeed build runs here: the build
script is swapped for a stand-in where the test needs one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.distributed import deepspeed_op
from tests.distributed.deepspeed_op import (
    StaleBuildLockError,
    check_build_lock,
    ensure_deepspeed_op,
    lock_file_blocks,
    lock_path,
)
from tests.distributed.launcher import run_workers

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lock holders are read from Linux /proc"),
    pytest.mark.skipif(
        not lock_file_blocks(), reason="this torch's build lock is advisory (FileLock): a left file is not stale"
    ),
]


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch) -> Path:
    """A per-test TORCH_EXTENSIONS_DIR (the user's cache is never touched)."""
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def _plant_lock(root: Path) -> Path:
    path = root / deepspeed_op.OP_NAME / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    return path


def _hold_lock(root: Path) -> subprocess.Popen:
    """A process that takes the lock the way torch's FileBaton does (O_CREAT | O_EXCL, kept open) and sleeps."""
    path = root / deepspeed_op.OP_NAME / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    code = f"import os, time; fd = os.open({str(path)!r}, os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_stale_lock_is_named_with_the_command_that_removes_it(extensions_dir):
    path = _plant_lock(extensions_dir)
    assert lock_path() == path
    with pytest.raises(StaleBuildLockError) as err:
        check_build_lock()
    assert str(path) in str(err.value)
    assert f"rm {path}" in str(err.value)


def test_a_lock_held_by_a_live_build_is_not_stale(extensions_dir):
    holder = _hold_lock(extensions_dir)
    try:
        check_build_lock()  # someone is building: wait for them, no error
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(StaleBuildLockError):  # the holder died without removing it
        check_build_lock()


def test_no_lock_no_error(extensions_dir):
    check_build_lock()


def _tiny_worker(tmp_path: Path) -> Path:
    script = tmp_path / "hello.py"
    script.write_text("print('hello from', __import__('os').environ['RANK'])\n")
    return script


def test_a_deepspeed_launch_with_a_stale_lock_fails_at_once_naming_it(extensions_dir, tmp_path):
    path = _plant_lock(extensions_dir)
    start = time.monotonic()
    with pytest.raises(StaleBuildLockError, match=f"rm {path}"):
        run_workers(_tiny_worker(tmp_path), nproc=2, args=["--backend", "zero2"], timeout=600, out_dir=tmp_path / "o")
    assert time.monotonic() - start < 30  # not the launch's 600 s timeout
    assert not list((tmp_path / "o").glob("logs*")), "no rank may start while the lock would make it wait"


@pytest.mark.slow  # a 6 s stand-in build, or a 3 s wait for the holder to die
def test_the_op_is_built_once_and_outside_the_launch_timeout(extensions_dir, tmp_path, monkeypatch):
    """The build (a 6 s stand-in) happens once per test process, before the launch's clock starts: a launch with a
    timeout shorter than the build still succeeds."""
    if deepspeed_op.importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the op is built only where DeepSpeed is installed")
    builds = tmp_path / "builds.txt"
    stand_in = f"import time; open({str(builds)!r}, 'a').write('built\\n'); time.sleep(6)"
    monkeypatch.setattr(deepspeed_op, "BUILD_SCRIPT", stand_in)
    worker = _tiny_worker(tmp_path)
    for attempt in range(2):
        result = run_workers(worker, nproc=2, args=["--backend", "zero2"], timeout=5, out_dir=tmp_path / f"o{attempt}")
        assert result.ok
        assert "hello from 1" in result.ranks[1].stdout
        assert result.wall_s < 5
    assert builds.read_text() == "built\n"  # once, not per launch


@pytest.mark.slow  # a 6 s stand-in build, or a 3 s wait for the holder to die
def test_a_build_waiting_on_a_lock_whose_holder_dies_stops_naming_the_lock(extensions_dir, tmp_path, monkeypatch):
    """Our one-off build waits for another process's build; that process is killed mid-build: the wait ends with
    the lock's name, not after the build's 30-minute limit."""
    if deepspeed_op.importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the op is built only where DeepSpeed is installed")
    holder = _hold_lock(extensions_dir)
    path = lock_path()
    waiter = textwrap.dedent(
        f"""
        import os, time
        while os.path.exists({str(path)!r}):  # what torch's FileBaton.wait() does
            time.sleep(0.1)
        """
    )
    monkeypatch.setattr(deepspeed_op, "BUILD_SCRIPT", waiter)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(3); os.kill({holder.pid}, 9)"])
    start = time.monotonic()
    try:
        with pytest.raises(StaleBuildLockError, match=f"rm {path}"):
            ensure_deepspeed_op(timeout=120)
    finally:
        killer.wait()
        holder.kill()
        holder.wait()
    assert time.monotonic() - start < 60
    assert os.path.exists(path)  # named, never removed behind the user's back


@pytest.mark.slow  # a launch that runs into its 8 s timeout
def test_a_rank_killed_at_the_timeout_while_holding_the_lock_is_named_in_the_error(extensions_dir, tmp_path,
                                                                                  monkeypatch):  # fmt: skip
    """The incident: a rank stopped at the launcher's timeout while it held torch's build lock. The launch's error
    names the lock it left, so the next launch is not the first to find out."""
    from tests.distributed.launcher import WorkerError

    monkeypatch.setattr(deepspeed_op, "BUILD_SCRIPT", "pass")  # the op is 'built'; rank 0 then takes the lock
    path = lock_path()
    path.parent.mkdir(parents=True)
    worker = tmp_path / "holds_the_lock.py"
    worker.write_text(
        "import os, time\n"
        f"if os.environ['RANK'] == '0':\n    fd = os.open({str(path)!r}, os.O_CREAT | os.O_EXCL)\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(WorkerError, match=f"(?s)timed out after 8s.*stale torch extensions build lock.*rm {path}"):
        run_workers(worker, nproc=2, deepspeed=True, timeout=8, out_dir=tmp_path / "o")
