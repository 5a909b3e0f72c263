"""What a micro-batch counts, by head family and by mesh dimension: the one place that knows.

Two questions, two halves of this module, both pure (tensors, ints and sizes in; counts out):

1. **What one micro-batch counts** (:func:`count_micro_batch`, :class:`MicroBatchCounts`): target tokens after the
   causal shift for causal LMs (``shift_labels`` as given when the batch has them), labels that are not
   ``ignore_index`` for the other token heads, labelled rows for sequence-level heads, attended input positions
   (``input_tokens``), and the input tokens ``include_num_input_tokens_seen`` tracks.
2. **Over which ranks the counts add up** (:func:`count_rule`, :class:`CountRule`): a counted target is counted once
   over the mesh dimensions that hold DIFFERENT samples or different positions of a sample (data: ``dp_replicate`` x
   ``dp_shard``; sequence: ``cp`` and ``sp`` shards), never again over the dimensions that hold copies of the same
   tokens (``tp``, ``pp`` stages; ``ep`` is a second layout of the ``dp_shard`` x ``tp`` ranks, not a dimension of its
   own). The step's loss is multiplied by the number of ranks the backend averages gradients over, which is that same
   group on every mesh the Hugging Face stack builds.

:mod:`hf_gradacc.heads` (which family a model is), :mod:`hf_gradacc.step.window` (one collective per step) and the
backends only ask this module; none of them decides a count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .errors import GradAccConfigError, GradAccDataError
from .loss import IGNORE_INDEX, SAMPLE_LEVEL_HEADS, HeadType, token_count
from .weights import target_weight_sum

logger = logging.get_logger(__name__)

LABEL_KEY = "labels"
SHIFT_LABELS_KEY = "shift_labels"
PACKED_KEY = "cu_seq_lens_q"  # a packed row's sequence offsets ([0, n0, n0 + n1, ..., T]): its samples

# Mesh dimensions, in the order accelerate's ParallelismConfig / transformers' DistributedConfig name them.
MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "cp", "sp", "ep", "pp")
# Dimensions whose ranks hold different samples (data) or different positions of a sample (sequence): counted over.
COUNTED_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "sp")
# Dimensions whose ranks hold copies of the same tokens: never counted over again.
COPY_DIMS: tuple[str, ...] = ("tp", "pp")


# ---------------------------------------------------------------------------------------------- one micro-batch
@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchCounts:
    """Counted items of one micro-batch on this rank.

    Attributes:
        num_tokens: target tokens (labels that are not ignored, after the causal shift); samples for sequence heads.
        num_samples: rows with a label.
        num_input_tokens: input positions the model attends to (``attention_mask == 1``; every position without a
            mask): the ``"input_tokens"`` denominator, e.g. the tokens a mixture-of-experts router sees.
        num_seen_tokens: input tokens as `TrainingArguments.include_num_input_tokens_seen` counts them (0 when off).
        num_positions: token positions the model computes (``input_ids`` size: padding included).
        labelled: False when the micro-batch has no labels (only samples can be counted).
        weight_sum: the sum of the ``loss_weights`` of its counted targets (:mod:`hf_gradacc.weights`); None without
            that column.

    Example:
        ```python
        counts = count_micro_batch({"labels": torch.tensor([[-100, 5, 6]])}, "causal_lm")
        counts.get("tokens")   # 2: positions 0 and 1 predict 5 and 6
        ```
    """

    num_tokens: int
    num_samples: int
    num_input_tokens: int = 0
    num_seen_tokens: int = 0
    num_positions: int = 0
    labelled: bool = True
    weight_sum: float | None = None  # the `loss_weights` of its counted targets, summed (None: no weights column)

    def get(self, denominator: str) -> int | float:
        if denominator == "tokens":
            return self.num_tokens
        if denominator == "input_tokens":
            return self.num_input_tokens
        if denominator == "weights":
            return self.weight_sum or 0.0
        return self.num_samples


def count_micro_batch(
    batch: Mapping[str, Any],
    head_type: HeadType,
    *,
    ignore_index: int = IGNORE_INDEX,
    problem_type: str | None = None,
    allow_unlabelled: bool = False,
) -> MicroBatchCounts:
    """Count the targets of one micro-batch the way its loss family averages them.

    - tokens: labels that are not ``ignore_index``; for causal LMs after the shift (``labels[..., 1:]``),
      or ``shift_labels`` as given when the collator provides them (a context-parallel shard must: its last
      position's target lives on the next shard, see :func:`context_parallel_shard`).
    - samples: rows; for single-label sequence and image classification, rows whose label is not ``ignore_index``.

    With ``allow_unlabelled`` (an overridden ``compute_loss``), a batch without labels counts its rows as samples.

    Example:
        ```python
        batch = {"labels": torch.tensor([[-100, -100, 7, 8], [-100, 3, -100, -100]])}
        count_micro_batch(batch, "causal_lm").num_tokens      # 3
        count_micro_batch(batch, "masked_lm").num_tokens      # 3 (no shift: position 0 is masked anyway)
        ```
    """
    labels = batch.get(LABEL_KEY)
    if labels is None and SHIFT_LABELS_KEY not in batch and allow_unlabelled:
        # An overridden compute_loss that returns LossTerm(..., "samples") needs no labels: count rows.
        return MicroBatchCounts(num_tokens=0, num_samples=rows_of(batch), labelled=False)
    if labels is None and SHIFT_LABELS_KEY not in batch:
        raise GradAccDataError(
            f"The micro-batch has no `{LABEL_KEY}` (keys: {sorted(batch)}), so GradAccTrainer cannot count the "
            "denominator of the step. Have the data collator return `labels`, set `label_names` if your labels "
            "use another key, or override `compute_loss` and return an `hf_gradacc.LossTerm`."
        )
    if SHIFT_LABELS_KEY in batch and head_type == "causal_lm":
        targets = batch[SHIFT_LABELS_KEY]
    else:
        targets = labels
    if not torch.is_tensor(targets):
        raise GradAccDataError(f"`{LABEL_KEY}` must be a tensor, got {type(targets).__name__}")

    if head_type in SAMPLE_LEVEL_HEADS:
        rows = targets.shape[0] if targets.dim() > 0 else 1
        if problem_type in (None, "single_label_classification") and not targets.is_floating_point():
            num_samples = int(token_count(targets.reshape(rows, -1)[:, 0], ignore_index))
        else:
            num_samples = rows
        weighted = target_weight_sum(batch, head_type, ignore_index=ignore_index, problem_type=problem_type)
        return MicroBatchCounts(num_tokens=num_samples, num_samples=num_samples, weight_sum=weighted)

    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise GradAccDataError(
            f"`{LABEL_KEY}` of a {head_type} model must hold integer class ids, got dtype {targets.dtype}. "
            "Cast them to torch.long in the data collator, or set `head_type` if the model is not a "
            f"{head_type} model."
        )
    if head_type == "causal_lm" and SHIFT_LABELS_KEY not in batch:
        targets = targets[..., 1:]
    num_samples = rows_of(batch) if PACKED_KEY in batch else targets.shape[0] if targets.dim() > 1 else 1
    weighted = target_weight_sum(batch, head_type, ignore_index=ignore_index)
    return MicroBatchCounts(num_tokens=int(token_count(targets, ignore_index)), num_samples=num_samples,
                            weight_sum=weighted)  # fmt: skip


def rows_of(batch: Mapping[str, Any]) -> int:
    """Number of samples of a collated micro-batch: the first dim of its first tensor, or the sequences of a packed
    row (``cu_seq_lens_q``)."""
    if torch.is_tensor(batch.get(PACKED_KEY)):
        return int(batch[PACKED_KEY].numel()) - 1
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise GradAccDataError(f"Cannot tell the number of rows of a micro-batch with keys {sorted(batch)}: no tensor")


def input_token_count(batch: Mapping[str, Any]) -> int:
    """Input positions the model attends to: ``attention_mask == 1``, or every position of ``input_ids`` /
    ``inputs_embeds`` without a mask (padding-free batches); 0 when the batch has none of them."""
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2:
        return int(mask.sum())
    inputs = batch.get("input_ids", batch.get("inputs_embeds"))
    if torch.is_tensor(inputs) and inputs.dim() >= 2:
        return int(inputs.shape[0] * inputs.shape[1])
    return 0


def position_count(batch: Mapping[str, Any]) -> int:
    """Token positions the model computes (``input_ids`` / ``inputs_embeds`` rows x length, padding included)."""
    inputs = batch.get("input_ids", batch.get("inputs_embeds"))
    return int(inputs.shape[0] * inputs.shape[1]) if torch.is_tensor(inputs) and inputs.dim() >= 2 else 0


def seen_token_count(main_input: Any, attention_mask: Any, mode: str, pad_token_id: int | None, *,
                     padded: bool = True) -> int:  # fmt: skip
    """Input tokens as `TrainingArguments.include_num_input_tokens_seen` counts them: ``"all"`` every position of the
    main input, ``"non_padding"`` the attention mask's ones (else the non-pad ids; else every position, with a
    warning unless the batch is ``padded=False``, packed). 0 without a main input."""
    if not torch.is_tensor(main_input):
        return 0
    if mode == "non_padding":
        if torch.is_tensor(attention_mask):
            return int(attention_mask.sum())
        if pad_token_id is not None:
            return int((main_input != pad_token_id).sum())
        if padded and main_input.dim() >= 2 and main_input.shape[0] > 1:
            logger.warning_once(
                "`include_num_input_tokens_seen='non_padding'` found no `attention_mask` and no pad id (pass the "
                "tokenizer as `processing_class`): padding is counted too. Add an attention mask in the collator."
            )
    return int(main_input.numel())


# ---------------------------------------------------------------------------------------------- the mesh
def _size(mesh: Any, dim: str) -> int:
    value = mesh.get(dim, 1) if isinstance(mesh, Mapping) else getattr(mesh, dim, 1)
    value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GradAccConfigError(f"mesh size `{dim}` ({value!r}) must be a whole number >= 1")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class CountRule:
    """Where one optimizer step's counts add up on a mesh, and the loss scale that makes the backend's average a sum.

    Attributes:
        count_dims: the mesh dimensions (of size > 1) whose ranks' counts are summed: the count group.
        count_group_size: ranks in the count group (their counts are disjoint: each counted target once).
        copies: ranks holding copies of the same tokens (``tp`` x ``pp``): their counts are never added.
        loss_scale: the number of ranks the backend AVERAGES gradients over; each micro-batch's summed loss is
            multiplied by it (then divided by the global count). FSDP2 averages over ``dp_replicate`` x ``dp_shard``
            x ``cp`` (accelerate's ``dp_shard_cp``): the whole count group. DeepSpeed-Ulysses (``sp``) reduces over
            its sequence-data group but divides by the data ranks only (measured with ZeRO-1/2: the ``sp`` shards'
            gradients are summed), so ``sp`` is counted but not in the scale. Never ``tp`` or ``pp``.
        world_size: every rank of the mesh.

    Example:
        ```python
        rule = count_rule({"dp_shard": 2, "tp": 2})
        rule.count_dims, rule.count_group_size, rule.loss_scale, rule.copies   # ('dp_shard',), 2, 2, 2
        ```
    """

    count_dims: tuple[str, ...]
    count_group_size: int
    copies: int
    loss_scale: int
    world_size: int

    def describe(self) -> str:
        """One line: ``"counts summed over dp_shard (2 ranks), not over 2 copies (tp, pp); loss x 2"``."""
        dims = " x ".join(self.count_dims) or "nothing (one rank)"
        copies = f", not over {self.copies} copies (tp, pp)" if self.copies > 1 else ""
        return f"counts summed over {dims} ({self.count_group_size} ranks){copies}; loss x {self.loss_scale}"


def count_rule(mesh: Any) -> CountRule:
    """The count rule of ``mesh``: any object (or mapping) with sizes ``dp_replicate``, ``dp_shard``, ``tp``, ``cp``,
    ``sp``, ``ep``, ``pp`` (a missing or None size is 1), e.g. :class:`hf_gradacc.backends.mesh.Mesh`.

    ``ep`` is not a factor of the world: transformers lays the experts out over the same ``dp_shard`` x ``tp`` ranks
    (``ep_size`` must divide ``fsdp_size * tp_size``), so the routed tokens come from samples the data dimensions
    already count; it must divide ``dp_shard`` x ``tp``.

    Example:
        ```python
        count_rule({"dp_replicate": 2, "dp_shard": 2}).loss_scale          # 4: HSDP counts and averages over both
        count_rule({"dp_shard": 2, "cp": 2}).count_dims                      # ('dp_shard', 'cp')
        count_rule({"dp_shard": 2, "tp": 2}).count_group_size                # 2: the tp copies are not counted
        ```
    """
    sizes = {dim: _size(mesh, dim) for dim in MESH_DIMS}
    if (sizes["dp_shard"] * sizes["tp"]) % sizes["ep"]:
        raise GradAccConfigError(
            f"`ep_size` ({sizes['ep']}) must divide `fsdp_size` x `tp_size` ({sizes['dp_shard']} x {sizes['tp']}): "
            "the experts are laid out over the data-shard and tensor ranks. Change `ep_size` in DistributedConfig."
        )
    dims = tuple(d for d in COUNTED_DIMS if sizes[d] > 1)
    group = 1
    for dim in COUNTED_DIMS:
        group *= sizes[dim]
    copies = sizes["tp"] * sizes["pp"]
    # The sequence-parallel shards' gradients are summed by DeepSpeed (it divides by the data ranks only).
    return CountRule(count_dims=dims, count_group_size=group, copies=copies, loss_scale=group // sizes["sp"],
                     world_size=group * copies)  # fmt: skip


# ---------------------------------------------------------------------------------------------- sequence shards
def context_parallel_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions of a sequence one context-parallel rank holds, laid out as torch's ``context_parallel`` (the
    round-robin load balancer accelerate's ``cp_size`` uses): the sequence cut into ``2 * cp_size`` equal chunks, rank
    ``r`` holding chunk ``r`` and chunk ``2 * cp_size - 1 - r`` (a head and a tail: equal causal-attention work).

    Example:
        ```python
        context_parallel_indices(8, 2, 0).tolist()   # [0, 1, 6, 7]
        context_parallel_indices(8, 2, 1).tolist()   # [2, 3, 4, 5]
        ```
    """
    chunks = 2 * cp_size
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise GradAccConfigError(f"context-parallel rank {cp_rank} is outside a `cp_size` of {cp_size}")
    if seq_len % chunks:
        raise GradAccDataError(
            f"A sequence of {seq_len} positions cannot be split into 2 x `cp_size` ({chunks}) equal chunks: pad the "
            f"micro-batches to a multiple of {chunks} (`pad_to_multiple_of` in the data collator)."
        )
    size = seq_len // chunks
    head = torch.arange(cp_rank * size, (cp_rank + 1) * size)
    tail = torch.arange((chunks - 1 - cp_rank) * size, (chunks - cp_rank) * size)
    return torch.cat([head, tail])


def context_parallel_shard(
    batch: Mapping[str, Any], cp_size: int, cp_rank: int, *, ignore_index: int = IGNORE_INDEX
) -> dict[str, Any]:
    """One context-parallel rank's part of a causal-LM micro-batch: ``shift_labels`` made from the WHOLE sequence
    first (so the target of a shard's last position, which lives on another shard, is kept), then every per-position
    tensor (``input_ids``, ``labels``, ``shift_labels``, ``attention_mask``, ``position_ids``) cut by
    :func:`context_parallel_indices`. What each shard counts (:func:`count_micro_batch`) then adds up over the shards
    to the whole sequence's count, as the transformers Trainer prepares inputs for ``cp_size`` > 1.

    Example:
        ```python
        shard = context_parallel_shard({"input_ids": ids, "labels": ids}, cp_size=2, cp_rank=1)
        count_micro_batch(shard, "causal_lm").num_tokens      # this shard's share of the count
        ```
    """
    out = dict(batch)
    if SHIFT_LABELS_KEY not in out and torch.is_tensor(out.get(LABEL_KEY)):
        out[SHIFT_LABELS_KEY] = F.pad(out[LABEL_KEY], (0, 1), value=ignore_index)[..., 1:].contiguous()
    inputs = out.get("input_ids", out.get(SHIFT_LABELS_KEY))
    if not torch.is_tensor(inputs) or inputs.dim() < 2:
        raise GradAccDataError(f"A context-parallel shard needs per-position tensors; keys: {sorted(batch)}")
    seq_len = inputs.shape[1]
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq_len).expand(inputs.shape[0], -1)
    index = context_parallel_indices(seq_len, cp_size, cp_rank).to(inputs.device)
    for key, value in out.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq_len:
            out[key] = value.index_select(1, index)
    return out


# ---------------------------------------------------------------------------------------------- this rank's counts
@dataclass(frozen=True, slots=True, kw_only=True)
class SeenTokens:
    """How `TrainingArguments.include_num_input_tokens_seen` counts input tokens (``mode`` ``"no"``: not at all)."""

    mode: str = "no"
    main_input_name: str = "input_ids"
    pad_token_id: int | None = None


class Counter:
    """What one micro-batch counts on this rank, for the trainer's head: the one object every count is asked from.

    :meth:`count` is what this rank holds of a training micro-batch: the whole micro-batch, or under context
    parallelism its shard (``cp``, a :class:`~hf_gradacc.backends.context_parallel.ContextParallel`: its targets and
    input tokens, which add up over the ``cp`` group, and its samples on ``cp`` rank 0 only); plus the input tokens
    ``include_num_input_tokens_seen`` tracks. :meth:`count_batch` counts a batch as it is (evaluation).

    Example:
        ```python
        counter = Counter(Head.for_model(model))
        counter.count({"input_ids": ids, "labels": labels}).num_tokens     # target tokens after the shift
        ```
    """

    def __init__(self, head: Any, *, cp: Any = None, seen: SeenTokens | None = None) -> None:
        self.head, self.cp, self.seen = head, cp, seen or SeenTokens()

    def count_batch(self, batch: Mapping[str, Any]) -> MicroBatchCounts:
        """The head's counts of ``batch`` as it is (:func:`count_micro_batch`, after the head checked its labels),
        with its attended input positions and its computed positions."""
        head = self.head
        head.check_batch(batch)
        if head.type is None and LABEL_KEY in batch:
            logger.warning_once(
                "hf_gradacc could not tell the model's loss family; 'tokens' are counted on unshifted labels. Set "
                "`head_type` if the model shifts its labels (causal LM)."
            )
        counts = count_micro_batch(
            batch, head.type or "masked_lm", ignore_index=head.ignore_index,
            problem_type=head.problem_type_of(batch.get(LABEL_KEY)), allow_unlabelled=head.allow_unlabelled,
        )
        return replace(counts, num_input_tokens=input_token_count(batch), num_positions=position_count(batch))

    def count(self, batch: Mapping[str, Any]) -> MicroBatchCounts:
        """What this rank holds of the training micro-batch ``batch``, counted (see the class docstring)."""
        cp = self.cp
        sharded = cp is not None and cp.size > 1
        view = cp.count_view(batch) if sharded else batch
        counts = self.count_batch(view)
        if self.seen.mode != "no":
            packed = PACKED_KEY in view  # a packed row has no padding, and may hold end-of-sequence ids equal to pad
            seen = seen_token_count(view.get(self.seen.main_input_name), view.get("attention_mask"), self.seen.mode,
                                    None if packed else self.seen.pad_token_id, padded=not packed)
            counts = replace(counts, num_seen_tokens=seen)
        return replace(counts, num_samples=0) if sharded and cp.rank != 0 else counts
