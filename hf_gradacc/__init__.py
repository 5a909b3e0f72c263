"""hf_gradacc: exact gradient accumulation for the Hugging Face Trainer.

Swap `transformers.Trainer` for `GradAccTrainer`: an optimizer step over N micro-batches on W ranks equals one
full-batch step over the same samples, for every head and backend, within float32 rounding.
"""

from .config import GradAccConfig
from .errors import (
    GradAccConfigError,
    GradAccDataError,
    GradAccError,
    GradAccLossError,
    UnsupportedBackendError,
)
from .loss import IGNORE_INDEX, LossTerm
from .trainer import GradAccTrainer

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "GradAccConfig",
    "GradAccConfigError",
    "GradAccDataError",
    "GradAccError",
    "GradAccLossError",
    "GradAccTrainer",
    "LossTerm",
    "UnsupportedBackendError",
    "__version__",
]
