"""TRL's trainers with :class:`~hf_gradacc.GradAccMixin` in front: exact accumulation for SFT, DPO, reward models
and GRPO.

Each trainer keeps TRL's own loss (its fused LM head: no full-vocabulary logits per micro-batch), its data
preparation, collators, reference model and logged metrics; only the normalisation over the optimizer step changes,
so that a step over N micro-batches on W ranks is the full-batch step. One module per trainer, its config beside it,
with the trainer's own rules in the module's docstring:

- :mod:`hf_gradacc.trl.sft`: ``GradAccSFTTrainer`` / ``GradAccSFTConfig``, the mean over ALL the step's target tokens;
- :mod:`hf_gradacc.trl.dpo`: ``GradAccDPOTrainer`` / ``GradAccDPOConfig``, the mean over ALL the step's pairs;
- :mod:`hf_gradacc.trl.reward`: ``GradAccRewardTrainer`` / ``GradAccRewardConfig``, likewise over pairs;
- :mod:`hf_gradacc.trl.grpo`: ``GradAccGRPOTrainer`` / ``GradAccGRPOConfig``, the mean over the step's completion
  tokens or sequences, by ``loss_type``.

A mixture-of-experts model's router load-balancing term (SFT, DPO, GRPO) is taken out of TRL's loss and kept as its
own term weighted by the micro-batch's routed tokens (:mod:`hf_gradacc.auxiliary`), logged as ``loss/aux``. TRL
gathers its metrics across ranks inside ``compute_loss``, once per micro-batch, so every rank must run the same
micro-batches: the modes that break this are refused at construction. See docs/trl.md.

Import the names from here (``from hf_gradacc.trl import GradAccSFTTrainer``). Importing this package without TRL, or
with a TRL outside the supported range, raises :class:`TRLDependencyError`; ``pip install "hf_gradacc[trl]"``
installs TRL.
"""

from __future__ import annotations

from ..errors import GradAccError


class TRLDependencyError(GradAccError, ImportError):
    """``hf_gradacc.trl`` was imported but TRL is not installed (or too old to provide its trainers)."""


# Checked here, before any trainer module imports TRL: the package's own code runs on every import of it, even when
# its submodules are already loaded.
try:
    from trl import (  # noqa: F401 - what the trainer modules import, checked first
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        RewardConfig,
        RewardTrainer,
        SFTConfig,
        SFTTrainer,
    )
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised with trl hidden from sys.modules
    raise TRLDependencyError(
        f"hf_gradacc.trl needs TRL's trainers, which could not be imported ({_error}). Install the extra: "
        'pip install "hf_gradacc[trl]"'
    ) from _error

import trl as _trl  # noqa: E402

from ..compat import SUPPORTED_VERSIONS, is_supported  # noqa: E402

if not is_supported("trl", _trl.__version__):
    raise TRLDependencyError(
        f"hf_gradacc.trl supports trl{SUPPORTED_VERSIONS['trl']}, and trl {_trl.__version__} is installed. Install a "
        f"supported version with the extra: pip install \"hf_gradacc[trl]\" (or pip install 'trl{SUPPORTED_VERSIONS['trl']}')."
    )

from .dpo import GradAccDPOConfig, GradAccDPOTrainer  # noqa: E402
from .grpo import GradAccGRPOConfig, GradAccGRPOTrainer  # noqa: E402
from .reward import GradAccRewardConfig, GradAccRewardTrainer  # noqa: E402
from .sft import GradAccSFTConfig, GradAccSFTTrainer  # noqa: E402

__all__ = [
    "GradAccDPOConfig",
    "GradAccDPOTrainer",
    "GradAccGRPOConfig",
    "GradAccGRPOTrainer",
    "GradAccRewardConfig",
    "GradAccRewardTrainer",
    "GradAccSFTConfig",
    "GradAccSFTTrainer",
    "TRLDependencyError",
]
