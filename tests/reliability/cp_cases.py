"""Catalogue rows for context parallelism (accelerate ``cp_size`` > 1): what is refused by name, and where."""

from __future__ import annotations

from types import SimpleNamespace

from accelerate.utils import DistributedType

from hf_gradacc import GradAccTrainer
from hf_gradacc.backends.context_parallel import ContextParallel, context_parallel_for
from hf_gradacc.backends.sharded_model import check_context_parallel
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples


def cp_under_ddp() -> None:
    """``parallelism_config_cp_size: 2`` with a DDP config: refused when the backend is resolved."""
    check_context_parallel(SimpleNamespace(cp_size=2), distributed_type=DistributedType.MULTI_GPU)


def cp_sequence_classifier() -> None:
    """A sequence classifier under cp 2: refused at construction (the cp group is the one GradAccMixin would build)."""
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    samples = make_samples("sequence_classification", 4, seed=1)
    trainer = GradAccTrainer(model=build_tiny_model("sequence_classification"), args=args,
                             train_dataset=ListDataset(samples), data_collator=PaddingCollator())  # fmt: skip
    context_parallel_for(
        accelerator=trainer.accelerator, settings=trainer.gradacc, head=trainer.head, model=trainer.model,
        source=trainer.step_engine.source, trainer_class=type(trainer), size=2, rank=0,
    )


def cp_left_padding() -> None:
    """A left-padded micro-batch on a cp rank: refused when it is counted, before any step."""
    batch = PaddingCollator()(make_samples("causal_lm", 3, seed=2))
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    ContextParallel(size=2, rank=0).count_view(batch)


def cp_evaluation_with_logits() -> None:
    """`compute_metrics` / `predict` under cp 2 (``prediction_loss_only=False``): refused at the first evaluation batch,
    before the batch is looked at."""
    ContextParallel(size=2, rank=0).evaluation_inputs({}, False, lambda t: t[None], "cpu")
