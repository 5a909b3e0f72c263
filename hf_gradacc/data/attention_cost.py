"""What one micro-batch costs on the device, by its layout: :class:`AttentionCostModel`, which the packing plan of
:mod:`hf_gradacc.data.pack` minimises so that a packed row never costs more than the padded micro-batches it
replaces where attention is dense over the whole row (eager, sdpa: no variable-length kernel).

Example:
    ```python
    from hf_gradacc.data.attention_cost import AttentionCostModel

    cost = AttentionCostModel.for_model(model)       # the model's sizes and attention implementation
    cost.packed_cost([300, 200]), cost.padded_cost([300, 200])  # one row of 500 tokens vs two rows of 300
    ```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import GradAccConfigError


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from ..heads import unwrap_model

    return unwrap_model(model)


# ---------------------------------------------------------------------------------------------- the cost model
# Calibration of AttentionCostModel.for_model on a CPU (eager / sdpa, float32, one thread), by
# `python benchmarks/packed_row_cost.py --fit`: a dense attention score costs _SCORE_FLOP_FACTOR times its
# matrix-product FLOPs (the mask, the softmax and their backward are memory-bound), and a micro-batch costs a fixed
# _MICRO_BATCH_FLOPS_PER_LAYER per layer (kernel launches, Python) on top of its positions.
_SCORE_FLOP_FACTOR = 0.43
_MICRO_BATCH_FLOPS_PER_LAYER = 7.2e7


@dataclass(frozen=True, slots=True)
class AttentionCostModel:
    """The cost of one micro-batch's forward and backward pass, in units of one token position's cost, that
    :class:`WindowPackBatchSampler` minimises and :class:`PackedCollator` lays each micro-batch out by.

    A micro-batch of samples with lengths ``l_1..l_n`` (``T`` their sum, ``L`` the longest) costs ``per_micro_batch
    + positions + per_score * scores``: as ONE packed row, ``T`` positions and, with a ``dense`` attention kernel
    (eager and sdpa compute every score of the row and mask the cross-sample ones), ``T^2`` scores, else (the
    variable-length flash kernels, flex attention's block mask) ``sum l_i^2``; padded to ``[n, L]``, ``n L``
    positions and ``n L^2`` scores. A dense row of a few long samples is costlier than the same samples padded: the
    collator then pads them (when ``padded_layout``) and the sampler packs rows only where that pays.

    Args:
        per_score: cost of one attention score (a query-key pair, all layers) per position's cost.
        per_micro_batch: fixed cost of a micro-batch (a forward and backward call), in positions.
        dense: True when a packed row's attention is dense (``T^2``).
        padded_layout: True when the collator may pad a micro-batch instead of packing it (hf_gradacc's
            :class:`PackedCollator`; False for a collator that always packs, such as TRL's).

    Example:
        ```python
        from hf_gradacc.data.attention_cost import AttentionCostModel

        cost = AttentionCostModel(per_score=2e-3, per_micro_batch=500.0)
        cost.packs([100] * 8)          # False: one dense row of 800 tokens costs more than [8, 100] padded
        cost.packs([300, 20, 10])      # True: little attention saved by padding, 570 padded positions saved
        ```
    """

    per_score: float
    per_micro_batch: float = 0.0
    dense: bool = True
    padded_layout: bool = True

    def __post_init__(self) -> None:
        for name in ("per_score", "per_micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise GradAccConfigError(f"AttentionCostModel `{name}` ({value!r}) must be a finite number >= 0")

    def packed_cost(self, lengths: Sequence[int]) -> float:
        """Cost of ``lengths`` as one packed row."""
        total = sum(lengths)
        scores = total * total if self.dense else sum(n * n for n in lengths)
        return self.per_micro_batch + total + self.per_score * scores

    def padded_cost(self, lengths: Sequence[int]) -> float:
        """Cost of ``lengths`` padded to ``[len(lengths), max(lengths)]``."""
        longest = max(lengths)
        return self.per_micro_batch + len(lengths) * longest * (1 + self.per_score * longest)

    def packs(self, lengths: Sequence[int]) -> bool:
        """True when ``lengths`` go into one packed row; False when padding them costs less (``padded_layout``)."""
        if not self.padded_layout or not self.dense or len(lengths) == 1:
            return True  # per-sample attention: a row never costs more than the padded batch (fewer positions)
        return self.packed_cost(lengths) <= self.padded_cost(lengths)

    def cost(self, lengths: Sequence[int]) -> float:
        """Cost of ``lengths`` in the layout :meth:`packs` picks."""
        return self.packed_cost(lengths) if self.packs(lengths) else self.padded_cost(lengths)

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, padded_layout: bool = True) -> AttentionCostModel:
        """The cost model of ``model``'s config, from FLOPs: a position costs 6 FLOPs per weight it multiplies (the
        input embedding is a lookup), a score ``12 x attention width x layers`` FLOPs times a dense kernel's
        overhead factor, a micro-batch a fixed cost per layer (both factors calibrated on a CPU by
        ``benchmarks/packed_row_cost.py --fit``). ``dense`` unless the attention implementation is a flash or flex
        one.

        Example:
            ```python
            from hf_gradacc.data.attention_cost import AttentionCostModel
            from hf_gradacc.testing.tiny import build_tiny_model

            AttentionCostModel.for_model(build_tiny_model("causal_lm")).dense     # True: sdpa on CPU
            ```
        """
        base = _unwrap(model)
        config = getattr(base, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = int(getattr(text, "num_hidden_layers", 0) or 1)
        hidden = int(getattr(text, "hidden_size", 0) or 1)
        heads = int(getattr(text, "num_attention_heads", 0) or 1)
        head_dim = int(getattr(text, "head_dim", 0) or hidden // heads)
        embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if head is not None and any(id(p) in skip for p in head.parameters()):  # tied: the head still multiplies
            skip -= {id(p) for p in head.parameters()}
        shapes = [(id(p), tuple(getattr(p, "ds_shape", p.shape))) for p in base.parameters()]  # ZeRO-3: full shape
        weights = sum(math.prod(shape) for key, shape in shapes if len(shape) >= 2 and key not in skip)
        per_position = 6.0 * max(weights, 1)
        attn = str(getattr(config, "_attn_implementation", None) or "")
        return cls(
            per_score=_SCORE_FLOP_FACTOR * 12.0 * heads * head_dim * layers / per_position,
            per_micro_batch=_MICRO_BATCH_FLOPS_PER_LAYER * layers / per_position,
            dense=not (attn.startswith("flash") or attn.startswith("flex")),
            padded_layout=padded_layout,
        )
