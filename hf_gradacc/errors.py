"""The small exception hierarchy of hf_gradacc."""

from __future__ import annotations


class GradAccError(Exception):
    """Base class of every error raised by hf_gradacc."""


class GradAccConfigError(GradAccError, ValueError):
    """A setting (a `GradAccConfig` / `TrainingArguments` field or a backend config value) is invalid."""


class GradAccDataError(GradAccError, ValueError):
    """A batch cannot be normalised exactly: no labels, labels of the wrong dtype, ranks out of step."""


class GradAccLossError(GradAccError, ValueError):
    """`compute_loss` returned something that cannot be normalised exactly (non-scalar, unknown denominator)."""


class UnsupportedBackendError(GradAccError, NotImplementedError):
    """The accelerate distributed type is not one hf_gradacc can make exact."""


class GradientsNotReadyError(GradAccError, RuntimeError):
    """The accumulated gradient was read (``trainer.grads``) outside the window between the final backward pass of
    an optimizer step and the step itself."""


class GradAccUsageError(GradAccError, RuntimeError):
    """A public method was called where it cannot work (e.g. ``trainer.backward`` outside a training step, a gradient
    hook registered after training started)."""
