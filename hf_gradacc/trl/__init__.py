"""TRL's trainers with :class:`~hf_gradacc.GradAccMixin` in front: exact accumulation for SFT, DPO, reward models,
GRPO, and (TRL >= 1.16) KTO, RLOO and on-policy distillation.

Each trainer keeps TRL's own loss (its fused LM head: no full-vocabulary logits per micro-batch), its data
preparation, collators, reference model and logged metrics; only the normalisation over the optimizer step changes,
so that a step over N micro-batches on W ranks is the full-batch step. One module per trainer, its config beside it,
with the trainer's own rules in the module's docstring:

- :mod:`hf_gradacc.trl.sft`: ``GradAccSFTTrainer`` / ``GradAccSFTConfig``, the mean over ALL the step's target tokens;
- :mod:`hf_gradacc.trl.dpo`: ``GradAccDPOTrainer`` / ``GradAccDPOConfig``, the mean over ALL the step's pairs;
- :mod:`hf_gradacc.trl.reward`: ``GradAccRewardTrainer`` / ``GradAccRewardConfig``, likewise over pairs;
- :mod:`hf_gradacc.trl.grpo`: ``GradAccGRPOTrainer`` / ``GradAccGRPOConfig``, the mean over the step's completion
  tokens or sequences, by ``loss_type``;
- :mod:`hf_gradacc.trl.kto`: ``GradAccKTOTrainer`` / ``GradAccKTOConfig``, the mean over ALL the step's samples with
  KTO's KL estimate over ALL the step's mismatched pairs (docs/preference.md);
- :mod:`hf_gradacc.trl.rloo`: ``GradAccRLOOTrainer`` / ``GradAccRLOOConfig``, the mean over the step's completions;
- :mod:`hf_gradacc.trl.distillation`: ``GradAccDistillationTrainer`` / ``GradAccDistillationConfig``, the mean over the
  step's completion tokens (docs/distillation.md).

The last three need TRL >= 1.16 (read and tested there): on an older TRL their names are not exported, and asking for
one raises :class:`TRLDependencyError` naming the version.

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

from ..compat import SUPPORTED_VERSIONS, is_supported, trl_at_least  # noqa: E402

if not is_supported("trl", _trl.__version__):
    raise TRLDependencyError(
        f"hf_gradacc.trl supports trl{SUPPORTED_VERSIONS['trl']}, and trl {_trl.__version__} is installed. Install a "
        'supported version with the extra: pip install "hf_gradacc[trl]" (or pip install '
        f"'trl{SUPPORTED_VERSIONS['trl']}')."
    )

from .dpo import GradAccDPOConfig, GradAccDPOTrainer  # noqa: E402
from .grpo import GradAccGRPOConfig, GradAccGRPOTrainer  # noqa: E402
from .reward import GradAccRewardConfig, GradAccRewardTrainer  # noqa: E402
from .sft import GradAccSFTConfig, GradAccSFTTrainer  # noqa: E402

# KTO, RLOO and Distillation rest on TRL 1.16's loss code (its fused LM head in KTO, its generation buffer in RLOO and
# Distillation): exported from that release on.
TRL_MORE_TRAINERS = "1.16"
_MORE_TRAINERS = (
    "GradAccDistillationConfig",
    "GradAccDistillationTrainer",
    "GradAccKTOConfig",
    "GradAccKTOTrainer",
    "GradAccRLOOConfig",
    "GradAccRLOOTrainer",
)
if trl_at_least(TRL_MORE_TRAINERS):
    from .distillation import GradAccDistillationConfig, GradAccDistillationTrainer  # noqa: E402
    from .kto import GradAccKTOConfig, GradAccKTOTrainer  # noqa: E402
    from .rloo import GradAccRLOOConfig, GradAccRLOOTrainer  # noqa: E402

__all__ = [
    "GradAccDPOConfig",
    "GradAccDPOTrainer",
    "GradAccDistillationConfig",
    "GradAccDistillationTrainer",
    "GradAccGRPOConfig",
    "GradAccGRPOTrainer",
    "GradAccKTOConfig",
    "GradAccKTOTrainer",
    "GradAccRLOOConfig",
    "GradAccRLOOTrainer",
    "GradAccRewardConfig",
    "GradAccRewardTrainer",
    "GradAccSFTConfig",
    "GradAccSFTTrainer",
    "TRLDependencyError",
]
if not trl_at_least(TRL_MORE_TRAINERS):
    __all__ = [name for name in __all__ if name not in _MORE_TRAINERS]


def __getattr__(name: str):
    if name in _MORE_TRAINERS:
        raise TRLDependencyError(
            f"hf_gradacc.trl.{name} needs trl>={TRL_MORE_TRAINERS} (installed {_trl.__version__}): hf_gradacc makes "
            f"TRL's KTO, RLOO and Distillation trainers exact from that release on. Upgrade TRL "
            f"(pip install 'trl>={TRL_MORE_TRAINERS},<2')."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
