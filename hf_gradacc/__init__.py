"""hf_gradacc: exact gradient accumulation for the Hugging Face Trainer.

Swap `transformers.Trainer` for `GradAccTrainer` (or put `GradAccMixin` in front of any Trainer subclass): an
optimizer step over N micro-batches on W ranks equals one full-batch step over the same samples, for every head
and backend, within float32 rounding.
"""

from .config import GradAccArguments, GradAccConfig, GradAccSeq2SeqConfig, gradacc_config_class
from .errors import (
    GradAccCompatibilityError,
    GradAccConfigError,
    GradAccDataError,
    GradAccDistributedError,
    GradAccError,
    GradAccLossError,
    GradAccUsageError,
    GradientsNotReadyError,
    NonFiniteStepError,
    UnsupportedBackendError,
)
from .exact import make_exact
from .loss import IGNORE_INDEX, LossTerm
from .mixin import GradAccMixin
from .trainer import GradAccSeq2SeqTrainer, GradAccTrainer

__version__ = "0.2.0.dev0"

__all__ = [
    "IGNORE_INDEX",
    "GradAccArguments",
    "GradAccCompatibilityError",
    "GradAccConfig",
    "GradAccConfigError",
    "GradAccDataError",
    "GradAccDistributedError",
    "GradAccError",
    "GradAccLossError",
    "GradAccMixin",
    "GradAccSeq2SeqConfig",
    "GradAccSeq2SeqTrainer",
    "GradAccTrainer",
    "GradAccUsageError",
    "GradientsNotReadyError",
    "LossTerm",
    "NonFiniteStepError",
    "UnsupportedBackendError",
    "__version__",
    "gradacc_config_class",
    "make_exact",
]
