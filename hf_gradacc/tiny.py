"""Deprecated: moved to :mod:`hf_gradacc.testing.tiny` in 0.2; this path will be removed in the next release."""

from ._deprecated import warn_moved

warn_moved(__name__, "hf_gradacc.testing.tiny")

from .testing.tiny import *  # noqa: E402, F401, F403
