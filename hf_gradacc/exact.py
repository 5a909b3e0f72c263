"""`make_exact(trainer)`: exact accumulation for a `Trainer` someone else built (a framework, a larger codebase).

The mechanism, in three steps, all on the instance, before ``train()``:

1. **The class.** The instance's class ``C`` is swapped for ``GradAcc<C>``, a subclass made once per class:
   ``type("GradAcc<C>", (GradAccMixin, C), {...})``. The mixin comes first, as in a class written by hand, so its
   step (``_run_epoch``, ``training_step``, ``get_batch_samples``) runs, and its hooks that call ``super()`` (``log``,
   ``get_train_dataloader``, ``train``, ``prediction_step``, ``save_model``, ...) reach ``C``'s own overrides.
   ``C``'s ``compute_loss`` override, which would sit BEHIND the mixin's in that order, is put in front of it
   (``compute_loss = C.compute_loss`` in the new class), so the mixin sees it as an override, exactly as in
   ``class T(GradAccMixin, C)`` with ``compute_loss`` written in ``T``: a plain mean tensor is re-weighted by the
   micro-batch's share of the step, a :class:`~hf_gradacc.LossTerm` is taken as it is. The stock
   ``Trainer.compute_loss`` is not an override: the mixin's built-in loss replaces it.
2. **The setup.** ``GradAccMixin._setup_gradacc(gradacc_args)``, the part of ``GradAccMixin.__init__`` that runs
   after ``Trainer.__init__`` (settings, head, backend, step state, callbacks): the ONE setup path of both.
3. **TRL.** An instance of TRL's ``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``, ``GRPOTrainer``, and (TRL >= 1.16)
   ``KTOTrainer``, ``RLOOTrainer`` or ``DistillationTrainer`` (or of a subclass that overrides none of the methods
   hf_gradacc.trl replaces) gets ``hf_gradacc.trl``'s class in front instead of the bare mixin; its setup runs the same
   refusals as its constructor. TRL's experimental trainers (``trl.experimental``: online DPO, GKD, ORPO, ...) are
   refused by name.

What cannot be made exact is refused, naming the way out: an object that is not a `Trainer`, a trainer whose
``train()`` has started, a class that replaces a step the mixin must own (``training_step``, ``get_batch_samples``,
``_run_epoch``), a TRL trainer hf_gradacc.trl does not cover.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from transformers import Seq2SeqTrainer, Trainer
from transformers.utils import logging

from . import patches
from .compat import check_trainer_class
from .config import GRADACC_FIELDS, unknown_knobs_error
from .errors import GradAccTypeError, GradAccUsageError
from .mixin import GradAccMixin

logger = logging.get_logger(__name__)

# TRL's trainers hf_gradacc.trl makes exact: TRL class name -> hf_gradacc.trl class name.
TRL_TRAINERS: dict[str, str] = {
    "SFTTrainer": "GradAccSFTTrainer",
    "DPOTrainer": "GradAccDPOTrainer",
    "RewardTrainer": "GradAccRewardTrainer",
    "GRPOTrainer": "GradAccGRPOTrainer",
    "KTOTrainer": "GradAccKTOTrainer",
    "RLOOTrainer": "GradAccRLOOTrainer",
    "DistillationTrainer": "GradAccDistillationTrainer",
}
# Steps the mixin runs itself, without calling super(): a class that overrides them would silently lose its version.
_OWNED_STEPS = ("training_step", "get_batch_samples", "_run_epoch")

_EXACT_CLASSES: dict[type, type] = {}


def make_exact(trainer: Trainer, **gradacc_args: Any) -> Trainer:
    """Make an already-constructed `transformers.Trainer` (of any subclass) exact under gradient accumulation, IN
    PLACE, before ``train()``; returns the same object.

    The trainer then runs :class:`~hf_gradacc.GradAccMixin`'s step: one optimizer step over N micro-batches on W
    ranks equals one full-batch step. Its class's own overrides are kept (a ``compute_loss`` returning the
    micro-batch's mean is re-weighted exactly; a :class:`~hf_gradacc.LossTerm` is honoured), and so are its callbacks,
    logging and evaluation. ``gradacc_args`` are the :class:`~hf_gradacc.GradAccArguments` fields
    (``regroup_micro_batches=True``, ``head_type="causal_lm"``, ...). A trainer already made exact is returned as it
    is. How it works: :mod:`hf_gradacc.exact`.

    Raises:
        GradAccTypeError: ``trainer`` is not a `Trainer`, or its class cannot be made exact (the message says what
            to construct instead).
        GradAccUsageError: ``train()`` has started, or knobs were passed for a trainer already made exact.
        GradAccConfigError: a knob name that does not exist (the message names the closest one) or a knob value that
            is invalid.

    Example:
        ```python
        from hf_gradacc import make_exact

        trainer = framework.build_trainer(config)        # any Trainer subclass, built by someone else
        make_exact(trainer, regroup_micro_batches=True)  # before train()
        trainer.train()
        ```
    """
    if not isinstance(trainer, Trainer):
        raise GradAccTypeError(
            f"make_exact takes a transformers.Trainer (or a subclass of it), got a {type(trainer).__name__}."
        )
    unknown = [name for name in gradacc_args if name not in GRADACC_FIELDS]
    if unknown:
        raise unknown_knobs_error(unknown, where="make_exact(**knobs)")
    if isinstance(trainer, GradAccMixin):
        if gradacc_args:
            raise GradAccUsageError(
                f"The {type(trainer).__name__} is already exact; its knobs were fixed when it was made so, and "
                f"{sorted(gradacc_args)} would be ignored. Pass them where it was built (`gradacc_args=` or a "
                "GradAccConfig), or call make_exact once, with them, on the trainer before it was made exact."
            )
        return trainer
    if trainer.is_in_train or trainer.state.global_step > 0:
        raise GradAccUsageError(
            f"make_exact was called on a {type(trainer).__name__} whose `train()` has started (global step "
            f"{trainer.state.global_step}): the steps already taken were not exact, and the optimizer, scheduler and "
            "data loader were built for the stock step. Call make_exact(trainer) right after constructing it, before "
            "`train()`."
        )
    if os.environ.get(patches.CPU_DISTRIBUTED_ENV, "").strip().lower() not in ("", "0", "false", "no", "off") and (
        not patches.is_cpu_distributed_enabled()
    ):
        logger.warning_once(
            f"`{patches.CPU_DISTRIBUTED_ENV}` is set, but make_exact comes after the trainer built its accelerator, "
            "which the CPU-distributed patch must precede: call hf_gradacc.patches.enable_cpu_distributed() before "
            "the framework constructs its trainer (see docs/patches.md)."
        )
    original = type(trainer)
    exact = exact_class(original)
    check_trainer_class(exact)  # the private members the step rests on (compat.py), before anything changes
    GradAccMixin.adopt(trainer, exact, gradacc_args)
    if "compute_loss" in exact.__dict__ and not exact.__module__.startswith("hf_gradacc.trl"):
        # The class's compute_loss may call super().compute_loss, which is then the STOCK Trainer's: with
        # `model_accepts_loss_kwargs` it would multiply the micro-batch's mean by the number of processes
        # (`average_tokens_across_devices`). Off, the model averages over its own micro-batch, which is what the
        # mixin reads a plain loss as. Nothing else in hf_gradacc's step reads it. hf_gradacc.trl's trainers undo
        # TRL's own normalisation, which on TRL < 1.15 is the stock Trainer's with the step's `num_items_in_batch`
        # handed to the model: left on for them.
        trainer.model_accepts_loss_kwargs = False
    logger.info(f"hf_gradacc: {original.__name__} made exact ({exact.__name__}).")
    return trainer


def exact_class(cls: type) -> type:
    """The class :func:`make_exact` gives an instance of ``cls``: ``GradAcc<cls>`` (made once per class, cached), or
    ``hf_gradacc.trl``'s class for TRL's own trainers.

    Example:
        ```python
        from transformers import Seq2SeqTrainer, Trainer
        from hf_gradacc.exact import exact_class

        assert exact_class(Trainer).__name__ == "GradAccTrainer"
        ```
    """
    cached = _EXACT_CLASSES.get(cls)
    if cached is not None:
        return cached
    from .trainer import GradAccSeq2SeqTrainer, GradAccTrainer

    trl_base = _trl_base(cls)
    if cls in (Trainer, Seq2SeqTrainer):
        made = GradAccTrainer if cls is Trainer else GradAccSeq2SeqTrainer
    elif trl_base is not None:
        made = _trl_exact_class(cls, trl_base)
    else:
        _refuse_owned_steps(cls, Trainer, "")
        namespace: dict[str, Any] = {"__module__": __name__, "__doc__": f"{cls.__name__} with GradAccMixin in front."}
        if cls.compute_loss is not Trainer.compute_loss:
            namespace["compute_loss"] = cls.compute_loss  # in front of the mixin's, seen as an override
        made = type(f"GradAcc{cls.__name__}", (GradAccMixin, cls), namespace)
    _EXACT_CLASSES[cls] = made
    return made


def _trl_base(cls: type) -> type | None:
    """The first class of ``cls``'s MRO that TRL defines (its trainer), or None for a trainer without TRL."""
    if "trl" not in sys.modules:
        return None  # a TRL trainer exists only once trl was imported
    return next((c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"), None)


def _trl_exact_class(cls: type, trl_base: type) -> type:
    name = TRL_TRAINERS.get(trl_base.__name__)
    if name is None:
        raise GradAccTypeError(
            f"{cls.__name__} is built on TRL's {trl_base.__name__}, which hf_gradacc.trl does not make exact (it "
            f"covers {', '.join(TRL_TRAINERS)}). Train with one of hf_gradacc.trl's "
            f"{', '.join(TRL_TRAINERS.values())}, or without gradient accumulation (gradient_accumulation_steps=1 on "
            "one process)."
        )
    from . import trl as gradacc_trl

    ours = getattr(gradacc_trl, name)
    if cls is trl_base:
        return ours
    _refuse_owned_steps(cls, trl_base, f" Or construct hf_gradacc.trl.{name} instead of {cls.__name__}.")
    overridden = [m for m in ("compute_loss", "_prepare_inputs") if _overrides(cls, trl_base, m)]
    if overridden:
        raise GradAccTypeError(
            f"{cls.__name__} overrides {overridden} of TRL's {trl_base.__name__}; hf_gradacc.trl.{name} undoes TRL's "
            f"own normalisation and cannot know what the override changed. Construct hf_gradacc.trl.{name} instead "
            f"(subclass it: class My{trl_base.__name__}(hf_gradacc.trl.{name}) with your override, returning "
            "hf_gradacc.LossTerms)."
        )
    return type(f"GradAcc{cls.__name__}", (ours, cls), {"__module__": __name__})


def _overrides(cls: type, base: type, method: str) -> bool:
    return getattr(cls, method, None) is not getattr(base, method, None)


def _refuse_owned_steps(cls: type, base: type, way_out: str) -> None:
    owned = [m for m in _OWNED_STEPS if _overrides(cls, base, m)]
    if owned:
        raise GradAccTypeError(
            f"{cls.__name__} overrides {owned}, which hf_gradacc's step replaces (a training_step calling super() "
            "would reach the stock Trainer's backward and its division by the accumulation steps). Move that logic "
            "to `compute_loss` (return hf_gradacc.LossTerms) or to a TrainerCallback, or write the class with "
            "hf_gradacc.GradAccMixin first in its bases, where `training_step` may call `self.backward`." + way_out
        )
