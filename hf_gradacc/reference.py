"""Deprecated: moved to :mod:`hf_gradacc.testing.reference` in 0.2; this path will be removed in the next release."""

from ._deprecated import warn_moved

warn_moved(__name__, "hf_gradacc.testing.reference")

from .testing.reference import *  # noqa: E402, F401, F403
