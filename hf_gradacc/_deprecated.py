"""The one warning of a moved import path (kept for one release)."""

from __future__ import annotations

import warnings


def warn_moved(old: str, new: str) -> None:
    """Warn that module ``old`` moved to ``new`` (a FutureWarning: shown to users by default)."""
    warnings.warn(
        f"`{old}` moved to `{new}` in hf_gradacc 0.2; the old path will be removed in the next release.",
        FutureWarning,
        stacklevel=3,
    )
