"""Deprecated: moved to :mod:`hf_gradacc.testing.benchmark` in 0.2; this path will be removed in the next release."""

from ._deprecated import warn_moved

warn_moved(__name__, "hf_gradacc.testing.benchmark")

from .commands.bench import bench_command as run  # noqa: E402, F401
from .commands.bench import bench_command_parser as add_parser  # noqa: E402, F401
from .commands.bench import main  # noqa: E402, F401
from .testing.benchmark import *  # noqa: E402, F401, F403
