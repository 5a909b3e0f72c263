"""What every `hf-gradacc` command shares: the exit statuses, the end of a command, and the matplotlib that
``--plot`` and ``hf-gradacc plot`` need (:class:`PlotDependencyError`).

The subcommand modules (``check``, ``bench``, ``plot``) and :mod:`.hf_gradacc_cli`, which wires them, all import
from here, so no command module imports the command line that imports it.
"""

from __future__ import annotations

from ..errors import GradAccError

EXIT_OK = 0
EXIT_NOT_EXACT = 1
EXIT_USAGE = 2

_GLOO_GROUP_FINISHED = False  # set once a gloo process group was torn down in this process


def finish_command() -> None:
    """Tear the process group down at the end of a command (see :func:`.hf_gradacc_cli.console_main`)."""
    global _GLOO_GROUP_FINISHED
    from ..backends.distributed import finish_distributed

    _GLOO_GROUP_FINISHED = finish_distributed() or _GLOO_GROUP_FINISHED


def gloo_group_finished() -> bool:
    """Whether a command of this process tore a gloo process group down (then the executable leaves hard)."""
    return _GLOO_GROUP_FINISHED


class PlotDependencyError(GradAccError, ImportError):
    """matplotlib is needed to draw and is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`PlotDependencyError` with the install line when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotDependencyError(
            "--plot needs matplotlib, which is not installed: pip install hf_gradacc[plot]"
        ) from exc
