"""Process-group utilities that are not a backend: ending a distributed run safely."""

from __future__ import annotations


def finish_distributed() -> bool:
    """Wait for every rank, destroy the process group, and let gloo's worker threads finish before exit.

    Returns True when it tore down a gloo group (the caller may then leave through ``os._exit``), else False.

    On CPU ranks (gloo) a worker thread frees the last collective's tensors only once it holds the GIL; if the
    interpreter is already shutting down then, the rank aborts ("terminate called without an active exception",
    pytorch issue 190489). A short sleep after destroying the group hands it the GIL; that makes the abort rare, not
    impossible (the `hf-gradacc` executable therefore leaves through ``os._exit``). Delete once torch fixes it.
    """
    import gc
    import time

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    uses_gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if uses_gloo:
        gc.collect()  # a group held only by reference cycles is destroyed now, while the interpreter is alive
        time.sleep(0.25)
    return uses_gloo
