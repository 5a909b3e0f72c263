"""``GradAccDistillationTrainer`` and ``GradAccDistillationConfig``: TRL's on-policy distillation with exact
accumulation.

TRL's ``DistillationTrainer`` has the student generate completions once per optimizer step (a generation batch of
``per_device_train_batch_size x gradient_accumulation_steps`` prompts per process) and trains it to match the
teacher's next-token distribution on them: the generalized Jensen-Shannon divergence of ``beta`` (0: forward KL, 1:
reverse KL) summed over the completion tokens and divided by the generation batch's completion tokens over every
process. The full-batch loss of a step is the sum over ALL its counted completion tokens (``completion_mask``, times
``tool_mask`` when tools ran) over their number.

Here the step's micro-batches are generated and sliced by TRL's own ``_prepare_inputs`` when the step is fetched, and
each carries ``labels`` marking its counted completion tokens, so that the window counts them over every process in
its one collective; TRL's normaliser is undone and the micro-batch's sum is divided by the step's count. The two
agree whenever the generation batch is exactly the step (TRL's design; measured exact for stock TRL on one process
with unequal completion lengths); they differ where the window is not one generation batch (a short last window of an
epoch, a process count TRL did not generate for).

Refused: regrouping and packing (the dataloader yields prompts), ``accumulation_schedule`` (TRL generates for a fixed
number of micro-batches), ``auto_micro_batch`` and ``defer_normalization``. A teacher of another vocabulary size than
the student is refused as TRL refuses it, but as a :class:`~hf_gradacc.GradAccConfigError` before the Trainer is built
when both are model objects (a model given as a path: TRL's ValueError, after loading it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from trl import DistillationConfig, DistillationTrainer

from ..config import GradAccArguments
from ..errors import GradAccConfigError
from ..loss import LossTerm
from ..mixin import GradAccMixin
from ._common import (
    GeneratesAtFetch,
    check_args_class,
    refuse_uneven_micro_batches,
    training_window,
)

__all__ = ["GradAccDistillationConfig", "GradAccDistillationTrainer"]


@dataclass
class GradAccDistillationConfig(GradAccArguments, DistillationConfig):
    """TRL's `DistillationConfig` plus the :class:`~hf_gradacc.GradAccArguments` fields, for
    :class:`GradAccDistillationTrainer`; every field is a flag with `HfArgumentParser`.

    Example:
        ```python
        from hf_gradacc.trl import GradAccDistillationConfig

        args = GradAccDistillationConfig(
            output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
            beta=0.5, max_completion_length=128,
        )
        ```
    """


class GradAccDistillationTrainer(GradAccMixin, GeneratesAtFetch, DistillationTrainer):
    """TRL's `DistillationTrainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step:
    the generalized JSD (``beta``; ``temperature``) summed over ALL the step's counted completion tokens over their
    number, counted by the window over every process.

    Generation (transformers or vLLM), the teacher, TRL's chunked divergence (no full-vocabulary logits) and the
    logged metrics are TRL's. Refused with the field to change: regrouping and packing, ``accumulation_schedule``,
    ``auto_micro_batch``, ``defer_normalization``, a teacher of another vocabulary size (checked first, when both
    models are objects).

    Example:
        ```python
        from hf_gradacc.trl import GradAccDistillationConfig, GradAccDistillationTrainer

        args = GradAccDistillationConfig(
            output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8, beta=0.5
        )
        trainer = GradAccDistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                                             processing_class=tokenizer)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, gradacc_args: Any = None, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        check_args_class(config, DistillationConfig, GradAccDistillationConfig)
        refuse_other_vocabulary(
            kwargs.get("model", args[0] if args else None),
            kwargs.get("teacher_model", args[1] if len(args) > 1 else None),
        )  # before TRL prepares the student, the Trainer and the accelerator
        super().__init__(*args, gradacc_args=gradacc_args, **kwargs)

    def _setup_gradacc(self, gradacc_args: Any) -> None:
        """The mixin's setup, then what on-policy distillation cannot do (also run by
        :func:`~hf_gradacc.make_exact`)."""
        super()._setup_gradacc(gradacc_args)
        refuse_uneven_micro_batches(self, rows_gathered=True)
        if self.global_batch is not None:  # TRL sized its completion log from the GA given, before the total's
            args, processes = self.args, self.accelerator.num_processes
            size = args.per_device_train_batch_size * processes * self.global_batch.accumulation
            self._logs = {key: deque(logged, maxlen=size) for key, logged in self._logs.items()}
        name = type(self).__name__
        if self.gradacc.regroups:
            raise GradAccConfigError(
                f"`regroup_micro_batches` / `max_tokens_per_micro_batch` / `pack_micro_batches` is not supported by "
                f"{name}: its dataloader yields generation batches of prompts, whose completions exist only after "
                "generation. Turn them off."
            )
        if self.gradacc.accumulation_schedule is not None:
            raise GradAccConfigError(
                f"`accumulation_schedule` is not supported by {name}: TRL generates once per "
                "`gradient_accumulation_steps` micro-batches. Remove `accumulation_schedule`."
            )

    # ------------------------------------------------------------------ fetch: generate before counting
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, each generated and sliced by TRL's ``_prepare_inputs`` in order (TRL generates
        once per step and serves slices of its buffer), with ``labels`` marking the counted completion tokens."""
        generation_batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        return self._generate_at_fetch(DistillationTrainer._prepare_inputs, generation_batches), None

    def _prepare_inputs(self, inputs):
        """In a training step the micro-batch was prepared when the step was fetched: returned as it is."""
        window = self.current_window
        if window is not None and window.index is not None:
            return inputs
        return super()._prepare_inputs(inputs)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of the micro-batch with TRL's normaliser (the generation batch's tokens over the processes)
        undone: ``LossTerm(divergence sum, "tokens")``. Outside training: TRL's loss, unchanged."""
        window = training_window(self)
        if window is None:
            return DistillationTrainer.compute_loss(
                self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        out = DistillationTrainer.compute_loss(self, model, inputs, return_outputs=False)
        # TRL divided the micro-batch's sum by (the generation batch's tokens over every process) / processes.
        generated = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
        term = LossTerm(total=out * generated, normalize_by="tokens")
        return (term, None) if return_outputs else term


def _vocab_size(model: Any) -> int | None:
    """The vocabulary size TRL compares (``config.get_text_config().vocab_size``) of a model object; None for a path
    (TRL loads it, then compares)."""
    config = None if isinstance(model, str) else getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text_config, "vocab_size", None)
    return size if isinstance(size, int) else None


def refuse_other_vocabulary(student: Any, teacher: Any) -> None:
    """The divergence compares the teacher's and the student's next-token distributions token id for token id: a
    teacher of another vocabulary size is refused naming both sizes, as TRL refuses it, but before the Trainer is
    built. A model given as a path is loaded by TRL, which then compares."""
    student_size, teacher_size = _vocab_size(student), _vocab_size(teacher)
    if student_size is None or teacher_size is None or student_size == teacher_size:
        return
    raise GradAccConfigError(
        f"`teacher_model` has vocab_size {teacher_size} and the student (`model`) {student_size}: on-policy "
        "distillation compares the teacher's next-token distribution with the student's token id for token id, over "
        "one vocabulary. Pass a `teacher_model` with the student's vocabulary (vocab_size "
        f"{student_size}, the same tokenizer), or use TRL's GOLD trainer (trl.experimental.gold) for distillation "
        "across tokenizers (not made exact by hf_gradacc)."
    )
