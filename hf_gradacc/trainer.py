"""The trainers users swap in: :class:`GradAccMixin` on the stock `Trainer` and `Seq2SeqTrainer`."""

from __future__ import annotations

from transformers import Seq2SeqTrainer, Trainer

from .mixin import GradAccMixin


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
