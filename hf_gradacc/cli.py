"""Deprecated: the command line moved to :mod:`hf_gradacc.commands` in 0.2; this path will be removed in the next
release."""

from ._deprecated import warn_moved

warn_moved(__name__, "hf_gradacc.commands.hf_gradacc_cli")

from .commands.hf_gradacc_cli import *  # noqa: E402, F401, F403
