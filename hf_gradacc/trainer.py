"""The trainers users swap in: :class:`GradAccMixin` on the stock `Trainer` and `Seq2SeqTrainer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import Seq2SeqTrainer, Trainer

from .mixin import GradAccMixin

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn
    from torch.utils.data import Dataset, IterableDataset
    from transformers import (
        BaseImageProcessor,
        EvalPrediction,
        FeatureExtractionMixin,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        ProcessorMixin,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.data.data_collator import DataCollator

    from .config import GradAccArguments

    _TrainData = Dataset | IterableDataset | datasets.Dataset
    _Processor = PreTrainedTokenizerBase | BaseImageProcessor | FeatureExtractionMixin | ProcessorMixin
    _Optimizers = tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None]


class GradAccTrainer(GradAccMixin, Trainer):
    """A `transformers.Trainer` whose optimizer step over N micro-batches on W ranks equals one full-batch step.

    It takes the same constructor arguments as `Trainer` (plus ``gradacc_args=``); ``args`` may be a plain
    `TrainingArguments` or a :class:`~hf_gradacc.GradAccConfig`. See :class:`~hf_gradacc.GradAccMixin` for what
    happens in each optimizer step and how to override ``compute_loss``.

    Example:
        ```python
        from transformers import AutoModelForSequenceClassification
        from hf_gradacc import GradAccConfig, GradAccTrainer

        model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=3)
        args = GradAccConfig(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=4)
        trainer = GradAccTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator)
        trainer.train()
        ```
    """

    def __init__(
        self,
        model: PreTrainedModel | nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: _TrainData | None = None,
        eval_dataset: _TrainData | dict[str, _TrainData] | None = None,
        processing_class: _Processor | None = None,
        model_init: Callable[..., PreTrainedModel] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: _Optimizers = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        gradacc_args: GradAccArguments | dict[str, Any] | None = None,
    ) -> None:
        """`Trainer.__init__`'s parameters, in its order, plus the keyword ``gradacc_args``: the
        :class:`~hf_gradacc.GradAccArguments` (or a dict of them) when ``args`` is not a GradAcc config."""
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            gradacc_args=gradacc_args,
        )


class GradAccSeq2SeqTrainer(GradAccMixin, Seq2SeqTrainer):
    """`Seq2SeqTrainer` with exact accumulation: training as :class:`GradAccTrainer`, evaluation as
    `Seq2SeqTrainer` (``predict_with_generate`` generates; the loss is the batch's token mean).

    Use it with a :class:`~hf_gradacc.GradAccSeq2SeqConfig` (both argument sets in one dataclass), or with
    `Seq2SeqTrainingArguments` and ``gradacc_args=``.

    Example:
        ```python
        from hf_gradacc import GradAccSeq2SeqConfig, GradAccSeq2SeqTrainer

        args = GradAccSeq2SeqConfig(output_dir="out", gradient_accumulation_steps=8, predict_with_generate=True)
        trainer = GradAccSeq2SeqTrainer(model=t5, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                                        data_collator=collator, processing_class=tokenizer)
        trainer.train()
        print(trainer.evaluate(max_new_tokens=32))
        ```
    """

    def __init__(
        self,
        model: PreTrainedModel | nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: _TrainData | None = None,
        eval_dataset: _TrainData | dict[str, _TrainData] | None = None,
        processing_class: _Processor | None = None,
        model_init: Callable[..., PreTrainedModel] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: _Optimizers = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        gradacc_args: GradAccArguments | dict[str, Any] | None = None,
    ) -> None:
        """`Seq2SeqTrainer.__init__`'s parameters, in its order, plus the keyword ``gradacc_args``: the
        :class:`~hf_gradacc.GradAccArguments` (or a dict of them) when ``args`` is not a GradAcc config."""
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            gradacc_args=gradacc_args,
        )
