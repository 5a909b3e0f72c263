"""Deprecated: moved to :mod:`hf_gradacc.data` in 0.2; this path will be removed in the next release."""

from ._deprecated import warn_moved

warn_moved(__name__, "hf_gradacc.data")

from .data import *  # noqa: E402, F401, F403
from .data.loader import *  # noqa: E402, F401, F403
from .data.regroup import *  # noqa: E402, F401, F403
