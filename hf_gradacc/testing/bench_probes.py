"""What `hf-gradacc bench` measures besides wall time: the peak memory within a step (:class:`MemoryProbe`) and
every rank's process CPU time (:func:`cpu_times_of_every_rank`), which a busy machine does not inflate the way it
inflates wall time.

Example:
    ```python
    probe = MemoryProbe("cpu")
    probe.start()
    ...  # one optimizer step
    print(probe.peak())
    ```
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


class MemoryProbe:
    """Peak memory increase within an interval: CUDA allocator stats, or the process's RSS high-water mark."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.baseline = 0
        self.available = True
        if not self.cuda:
            try:
                # Fixed thresholds: large tensors are mmap'd and handed back on free, so RSS follows live tensors
                # instead of what glibc keeps cached (its adaptive threshold would hide a later trainer's peak).
                libc = ctypes.CDLL("libc.so.6")
                libc.mallopt(-3, 32 * 1024)  # M_MMAP_THRESHOLD
                libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
                self._reset_hwm()
            except OSError:
                self.available = False

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise OSError(f"{key} not in /proc/self/status")

    @staticmethod
    def _reset_hwm() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        elif self.available:
            self._reset_hwm()
            self.baseline = self._status("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        if not self.available:
            return 0
        return self._status("VmHWM") - self.baseline


def cpu_times_of_every_rank(local: dict[str, list[float]], world_size: int) -> dict[str, list[list[float]]]:
    """Each trainer's step CPU times on every rank (one gather; every rank calls it once per dataset, in the same
    order): on a shared machine the process CPU time is what a rank spent, whatever the others' load."""
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return {name: [times] for name, times in local.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {name: [ranks[name] for ranks in gathered] for name in local}
