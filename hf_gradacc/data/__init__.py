"""How a step's samples become micro-batches: pure planning (:mod:`.regroup`) and the Trainer wiring
(:mod:`.loader`). The planning never changes which samples an optimizer step holds, only their grouping."""

from .loader import adjust_training_values, build_train_dataloader, find_regroup_sampler, window_schedule
from .regroup import WindowRegroupBatchSampler, regroup_window, sample_lengths, stock_windows

__all__ = [
    "WindowRegroupBatchSampler",
    "adjust_training_values",
    "build_train_dataloader",
    "find_regroup_sampler",
    "regroup_window",
    "sample_lengths",
    "stock_windows",
    "window_schedule",
]
