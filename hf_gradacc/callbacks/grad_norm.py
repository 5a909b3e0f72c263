"""`GradNormCallback`: log the global and per-module norms of the exact accumulated gradient."""

from __future__ import annotations

import math

from ..errors import GradAccConfigError
from .callback import GradAccCallback


class GradNormCallback(GradAccCallback):
    """Log ``grad_norm/global`` and ``grad_norm/<module>`` for every optimizer step that is logged.

    Norms are of the fully reduced, accumulated gradient before clipping, on every backend (read through
    ``trainer.grads``: one collective per step). Modules are parameter-name prefixes cut at ``depth`` dots after
    dropping wrapper prefixes such as ``base_model.model.``.

    Args:
        depth: how many name components form a module (``2`` turns ``model.layers.0.mlp.up_proj.weight`` into
            ``model.layers``).
        every_step: compute on every optimizer step (True) or only on steps that will be logged (False, default).

    Example:
        ```python
        from hf_gradacc import GradAccTrainer
        from hf_gradacc.callbacks import GradNormCallback

        trainer = GradAccTrainer(model=model, args=args, train_dataset=ds, callbacks=[GradNormCallback(depth=3)])
        ```
    """

    def __init__(self, depth: int = 2, every_step: bool = False) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise GradAccConfigError(f"`depth` ({depth!r}) must be an int >= 1")
        self.depth = depth
        self.every_step = every_step
        self.last_norms: dict[str, float] = {}

    def module_of(self, name: str) -> str:
        for prefix in ("base_model.model.", "module.", "_orig_mod."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        return ".".join(name.split(".")[: self.depth])

    def on_accumulated_grads(self, args, state, control, **kwargs):
        trainer = self._require_trainer()
        step = state.global_step + 1
        will_log = args.logging_steps and step % max(int(args.logging_steps), 1) == 0
        if not (self.every_step or will_log or step == 1):
            return
        squares: dict[str, float] = {}
        for name, norm in trainer.grads.named_norms().items():
            module = self.module_of(name)
            squares[module] = squares.get(module, 0.0) + norm * norm
        norms = {f"grad_norm/{m}": math.sqrt(v) for m, v in squares.items()}
        norms["grad_norm/global"] = math.sqrt(sum(squares.values()))
        self.last_norms = norms
        trainer.add_log_metrics(norms)
