"""The one exception hierarchy of hf_gradacc.

Every error the library raises derives from :class:`GradAccError`, with the natural Python base as a second base
(``ValueError`` for bad values, ``TypeError`` for bad types, ``RuntimeError`` for misuse at the wrong time, ...),
so that ``except GradAccError`` catches everything from hf_gradacc and ``except ValueError`` still works. Every
message names the value, where it came from, and the field or call to change.
"""

from __future__ import annotations


class GradAccError(Exception):
    """Base class of every error raised by hf_gradacc."""


class GradAccConfigError(GradAccError, ValueError):
    """A setting (a `GradAccConfig` / `TrainingArguments` field or a backend config value) is invalid."""


class GradAccDataError(GradAccError, ValueError):
    """A batch cannot be normalised exactly: no labels, labels of the wrong dtype or shape, ids out of range,
    ranks out of step, an empty dataset."""


class GradAccLossError(GradAccError, ValueError):
    """`compute_loss` returned something that cannot be normalised exactly (non-scalar, unknown denominator, a count
    that is negative, fractional or not finite), or the loss the model defines differs from the one reconstructed."""


class GradAccTypeError(GradAccError, TypeError):
    """A value of the wrong type reached the public API (e.g. a `LossTerm.total` that is not a tensor)."""


class UnsupportedBackendError(GradAccError, NotImplementedError):
    """The accelerate distributed type (or the config asking for it) is not one hf_gradacc can make exact here."""


class GradientsNotReadyError(GradAccError, RuntimeError):
    """The accumulated gradient was read (``trainer.grads``) outside the window between the final backward pass of
    an optimizer step and the step itself."""


class GradAccUsageError(GradAccError, RuntimeError):
    """A public method was called where it cannot work (e.g. ``trainer.backward`` outside a training step, a gradient
    hook registered after training started, a parameter name that does not exist)."""


class NonFiniteStepError(GradAccError, FloatingPointError):
    """An optimizer step's loss or accumulated gradient is NaN or infinite and ``nonfinite_steps="raise"``."""


class GradAccDistributedError(GradAccError, RuntimeError):
    """A collective between ranks failed or timed out (a peer froze, died or raised); the message names the step."""


class GradAccCompatibilityError(GradAccError, RuntimeError):
    """The installed transformers / TRL / accelerate lacks (or changed the signature of) a private member hf_gradacc
    overrides or reads (:mod:`hf_gradacc.compat`); the message names the member, the installed version and the
    supported range."""
