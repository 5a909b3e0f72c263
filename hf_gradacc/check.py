"""Deprecated: moved to :mod:`hf_gradacc.testing.one_step` in 0.2; this path will be removed in the next release."""

from ._deprecated import warn_moved

warn_moved(__name__, "hf_gradacc.testing.one_step")

from .testing.one_step import *  # noqa: E402, F401, F403
