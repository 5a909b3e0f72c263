"""Context parallelism (accelerate's ``parallelism_config.cp_size`` > 1, torch's ``context_parallel``) in the step.

Each sequence of a micro-batch is cut over the ``cp`` ranks, which hold the SAME samples (accelerate deals one
batch per data rank); attention is computed across them by torch (ring attention, CUDA only in torch 2.13). The
Trainer's own entry does the cut: ``Trainer._prepare_context_parallel_inputs`` adds ``shift_labels`` made from the
WHOLE sequence (a shard's last position predicts a token another shard holds) and ``position_ids``, and hands
``input_ids``, ``labels``, ``shift_labels``, the 2-D ``attention_mask`` and ``position_ids`` to accelerate's
``maybe_context_parallel``, which shards them in place with torch's head-tail load balancer (``2 x cp_size``
chunks, rank ``r`` holding chunk ``r`` and chunk ``2 x cp_size - 1 - r``) and drops the attention mask inside
attention for ``is_causal=True``.

What this module adds, and the step's owner asks for:

- :meth:`ContextParallel.count_view`: what this rank will hold of a micro-batch, which the counter
  (:class:`hf_gradacc.counting.Counter`) counts: its shard's targets (counted once over the ``cp`` group, summed with
  every rank's in the step's one collective), its shard's input tokens, and the micro-batch's samples on ``cp`` rank 0
  only (every ``cp`` rank holds the same rows). The loss is scaled by the ranks FSDP2 averages over,
  ``dp_replicate x dp_shard x cp`` (accelerate shards over ``dp_shard_cp``): the mesh's ``dp_world_size``.
- :meth:`ContextParallel.pad` and :meth:`ContextParallel.entered`: the micro-batch right-padded to a multiple of
  ``2 x cp_size`` (a padded position has an ignored target and, under causal attention, is seen by no real token),
  then the Trainer's entry, then the micro-batch inside the context: forward AND backward, as the stock Trainer runs
  them (:meth:`hf_gradacc.step.engine.StepEngine.micro_batch`).
- :meth:`ContextParallel.evaluation_inputs` / :meth:`ContextParallel.batch_mean`: evaluation on the shards, the
  batch checked and padded as in training (the check agreed over every rank before any forward), each batch's loss
  summed and counted over the ``cp`` group: ``eval_loss`` is the unsharded run's.
- :func:`context_parallel_for`: the combinations refused by name at construction (see its docstring).
- Under DeepSpeed Ulysses sequence parallelism (``sp_size`` > 1, no ``cp``), the counter counts the slice DeepSpeed's
  adapter handed this rank as it is, after :meth:`ContextParallel.check_slice`
  (:func:`check_sequence_parallel_shard`): a slice whose attention mask shows left padding is refused by name
  (Ulysses drops the mask inside attention), the verdict agreed over every rank in the step's count collective.

torch 2.13 cannot shard attention on CPU (``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding
strategy), so the CPU tests simulate the shards in one process (tests/unit/test_context_parallel.py) and the run
itself is in the GPU tier (tests/gpu/test_context_parallel.py, 2 CUDA devices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import logging

from ..builtin_loss import batch_mean_loss
from ..counting import LABEL_KEY, PACKED_KEY, SHIFT_LABELS_KEY, MicroBatchCounts
from ..errors import GradAccCompatibilityError, GradAccConfigError, GradAccDataError
from ..loss import IGNORE_INDEX

logger = logging.get_logger(__name__)

# The per-position tensors the Trainer's context-parallel entry shards (transformers 5.24
# `Trainer._prepare_context_parallel_inputs`); any other one would stay whole while these are cut.
SHARDED_KEYS: tuple[str, ...] = ("input_ids", LABEL_KEY, SHIFT_LABELS_KEY, "attention_mask", "position_ids")
# What a right pad holds, per key (input ids: any id works, a padded position is seen by no real token).
_PAD_VALUES = {"input_ids": 0, "attention_mask": 0}


# ---------------------------------------------------------------------------------------------- the layout
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


def cp_size_of(accelerator: Any) -> int:
    """``parallelism_config.cp_size`` of ``accelerator`` (1 without a parallelism config)."""
    return int(getattr(getattr(accelerator, "parallelism_config", None), "cp_size", None) or 1)


class ContextParallel:
    """This rank's place in the context-parallel group, and the step's two context-parallel operations; with ``size``
    1 (no context parallelism) both leave the micro-batch whole.

    Args:
        size: ``cp_size`` (1: none).
        rank: this rank's index in the ``cp`` mesh dimension.
        ignore_index: the target that is not counted (a padded position's).
        group_ranks: the global ranks of this rank's ``cp`` group, in ``cp`` order (by default ``0 .. size - 1``:
            the world is one ``cp`` group); their rows of a collective over every rank are summed in evaluation.
        sp_size / sp_rank: DeepSpeed Ulysses sequence parallelism (``parallelism_config.sp_size``, with ``size`` 1)
            and this rank's place in its sequence group: each micro-batch is the slice DeepSpeed's adapter handed
            this rank, checked by :meth:`check_slice` before it is counted.

    Example:
        ```python
        cp = ContextParallel(size=2, rank=1)
        shard = cp.count_view(batch)                  # what rank 1 holds once torch shards the micro-batch
        ```
    """

    def __init__(
        self,
        *,
        size: int,
        rank: int,
        ignore_index: int = IGNORE_INDEX,
        group_ranks: tuple[int, ...] | None = None,
        sp_size: int = 1,
        sp_rank: int = 0,
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise GradAccConfigError(f"context-parallel rank {rank} of `cp_size` {size}: expected 0 <= rank < size")
        if sp_size < 1 or not 0 <= sp_rank < sp_size:
            raise GradAccConfigError(
                f"sequence-parallel rank {sp_rank} of `sp_size` {sp_size}: expected 0 <= rank < size"
            )
        self.size, self.rank, self.ignore_index = size, rank, ignore_index
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.group_ranks = tuple(range(size)) if group_ranks is None else tuple(group_ranks)
        self.inside = False  # True while a micro-batch runs inside the context (on its shard)

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this (torch's head-tail balancer: ``2 x cp_size`` chunks)."""
        return 2 * self.size

    def pad(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch`` with every per-position tensor right-padded to a multiple of ``2 x cp_size`` (labels with
        ``ignore_index``), after checking that the micro-batch is one torch's context parallelism computes exactly;
        new tensors (torch shards the buffers in place, the window keeps its own)."""
        check_micro_batch(batch)
        width = batch["input_ids"].shape[1]
        extra = -width % self.multiple
        out: dict[str, Any] = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == width:
                fill = _PAD_VALUES.get(key, self.ignore_index)
                if key == "position_ids":  # positions go on counting into the padding
                    tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device)
                    out[key] = torch.cat([value, tail.to(value.dtype)], 1)
                else:
                    out[key] = F.pad(value, (0, extra), value=fill) if extra else value.clone()
            else:
                out[key] = value
        return out

    def count_view(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """What this rank holds of ``batch`` once the Trainer's entry and torch have sharded it (padded, shifted over
        the whole sequence, cut by the head-tail layout)."""
        return context_parallel_shard(self.pad(batch), self.size, self.rank, ignore_index=self.ignore_index)

    def check_slice(self, batch: Mapping[str, Any]) -> None:
        """Under Ulysses sequence parallelism the micro-batch is already this rank's slice: refused by
        :func:`check_sequence_parallel_shard` when its mask shows left padding (called where the window counts, so
        every rank learns it from the step's count collective); nothing to check otherwise."""
        if self.size == 1 and self.sp_size > 1:
            check_sequence_parallel_shard(batch, sp_size=self.sp_size, sp_rank=self.sp_rank)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """While this rank's shard of a micro-batch runs inside torch's context (the step's owner enters it once)."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    # ------------------------------------------------------------------ evaluation
    def evaluation_inputs(
        self, inputs: dict[str, Any], prediction_loss_only: bool, all_gather: Callable, device: Any
    ) -> dict[str, Any]:
        """An evaluation batch (already prepared) ready for `Trainer.prediction_step` (which enters the Trainer's
        context-parallel entry itself): checked and padded as in training, the check agreed over every rank in one
        collective (a rank whose batch torch cannot shard stops every rank before any forward, so none waits in the
        model's collectives); the trainer's ``compute_loss`` then returns the batch's mean over its whole sequences
        (:meth:`batch_mean`). The logits and labels would be this rank's chunks of each sequence:
        ``prediction_loss_only=False`` (``compute_metrics``, ``predict``) is refused by name."""
        if not prediction_loss_only:
            raise GradAccConfigError(
                f"Evaluation with logits under context parallelism (`cp_size` {self.size}): each rank holds its "
                "chunks "
                "of every sequence, so `compute_metrics` and `predict` would see a shard's logits against whole-width "
                "labels. `eval_loss` alone is exact here: set `compute_metrics=None` (or "
                "`prediction_loss_only=True`), "
                "or evaluate with `cp_size: 1`."
            )
        return self.agreed_pad(inputs, all_gather, device)

    def agreed_pad(self, batch: Mapping[str, Any], all_gather: Callable, device: Any) -> dict[str, Any]:
        """:meth:`pad` (with :func:`check_micro_batch`), its verdict agreed over every rank (one collective): a
        rank's refused batch raises on that rank, and on every other one a :class:`~hf_gradacc.GradAccDataError`
        naming it, instead of a wait in the next collective."""
        error: GradAccDataError | None = None
        padded: dict[str, Any] = {}
        try:
            padded = self.pad(batch)
        except GradAccDataError as exc:  # agreed below: every rank stops
            error = exc
        flags = all_gather(torch.tensor([int(error is not None)], device=device))
        failed = [int(r) for r in flags.reshape(-1).nonzero().flatten()]
        if error is not None:
            raise error
        if failed:
            raise GradAccDataError(
                f"Rank(s) {failed} could not shard their evaluation batch for context parallelism (see the error on "
                "those ranks); every rank stops here rather than wait for them."
            )
        return padded

    def batch_mean(
        self, terms: dict[str, Any], counts: MicroBatchCounts, denominator: str, all_gather: Callable
    ) -> torch.Tensor:
        """One evaluation batch's mean loss (``compute_loss`` outside training). Without context parallelism
        :func:`~hf_gradacc.builtin_loss.batch_mean_loss` of the batch; with it, each term's sum and the counted
        targets of this rank's chunks are added up over its ``cp`` group first (one collective over every rank,
        this group's rows summed), so every ``cp`` rank returns the mean over the batch's whole sequences, as the
        unsharded evaluation does: NaN only when the whole batch counts nothing, never for a shard without a
        target. The ``cp`` ranks hold the same rows: the samples are not added up."""
        if self.size == 1:
            return batch_mean_loss(terms, counts, denominator)
        names = list(terms)
        device = terms[names[0]].total.device
        local = torch.stack(
            [
                *(terms[n].total.detach().reshape(()).to(torch.float64) for n in names),
                torch.tensor(float(counts.num_tokens), dtype=torch.float64, device=device),
            ]
        )
        rows = all_gather(local).reshape(-1, local.numel())
        summed = rows[list(self.group_ranks)].sum(0).to(device)
        whole = {n: replace(terms[n], total=summed[i].to(terms[n].total.dtype)) for i, n in enumerate(names)}
        return batch_mean_loss(whole, replace(counts, num_tokens=int(round(float(summed[-1])))), denominator)

    def gather_for_metrics(
        self, accelerator: Any, data_ranks: tuple[int, ...], data: Any, use_gather_object: bool = False
    ) -> Any:
        """accelerate's ``gather_for_metrics`` over the data ranks only (the trainer's ``gather_function`` under
        context parallelism): the ranks of a ``cp`` group evaluate the same rows, so of a gathered tensor only the rows
        of ``data_ranks`` (each group's ``cp`` rank 0, in data order) are kept, then the last batch's duplicates are
        dropped as accelerate does. Gathered from every process, accelerate would keep ``cp_size`` copies of every
        batch but only ``remainder`` rows of the last, partial one: its weight in ``eval_loss`` cut ``cp_size``
        times. Anything but one tensor goes to accelerate's own."""
        if use_gather_object or not torch.is_tensor(data):
            return accelerator.gather_for_metrics(data, use_gather_object=use_gather_object)
        gathered = accelerator.gather(data).reshape(accelerator.num_processes, -1, *data.shape[1:])
        rows = gathered[list(data_ranks)].flatten(0, 1)
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            rows = rows[: state.remainder]
        return rows

    def custom_batch_mean(
        self, parsed: Any, batch: Mapping[str, Any], *, counter: Any, denominator: str, all_gather: Callable
    ) -> torch.Tensor:
        """An overridden ``compute_loss``'s LossTerms (``parsed``, a :class:`~hf_gradacc.loss.LossOutput`) as one
        evaluation batch's mean: over ``batch``'s counts (``counter``: a :class:`~hf_gradacc.counting.Counter`); under
        context parallelism over the counts of this rank's chunks, then summed over the ``cp`` group
        (:meth:`batch_mean`)."""
        if self.size == 1:
            return parsed.batch_mean(counter.count_batch(batch))
        counts = counter.count_batch(self.count_view(batch))
        return self.batch_mean(parsed.terms, counts, denominator, all_gather)


def check_micro_batch(batch: Mapping[str, Any]) -> None:
    """Raise :class:`~hf_gradacc.GradAccDataError` for a micro-batch torch's context parallelism would compute
    wrongly or not at all: no ``input_ids``; a packed / padding-free row (``cu_seq_lens_q``, or ``position_ids`` that
    restart inside a row: attention would cross samples once the mask is dropped); an ``attention_mask`` that is not a
    2-D padding mask, or with padding before a real token (left padding: real tokens would attend to it under
    ``is_causal=True``); another per-position tensor the Trainer's entry does not shard. Called where a micro-batch
    is counted, so the verdict rides on the step's count collective (every rank stops together)."""
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise GradAccDataError(
            "Context parallelism (`cp_size` > 1) needs `input_ids` of shape [rows, positions] (keys: "
            f"{sorted(batch)}): "
            "the Trainer's context-parallel entry shards them and makes the position ids from them."
        )
    if PACKED_KEY in batch or (torch.is_tensor(batch.get("position_ids")) and _restarts(batch["position_ids"])):
        raise GradAccDataError(
            "A packed (padding-free) micro-batch under context parallelism: torch's `context_parallel` drops the "
            "attention mask for plain causal attention, so its samples would attend to each other. Use padded "
            "micro-batches (turn off `pack_micro_batches` / `DataCollatorWithFlattening` / `padding_free`)."
        )
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() != 2:
        raise GradAccDataError(
            f"The micro-batch's `attention_mask` has {mask.dim()} dimensions (shape {list(mask.shape)}): under "
            "context "
            "parallelism torch's `context_parallel` drops the mask for plain causal attention and the Trainer's entry "
            "would leave it whole beside sharded input ids. Give a 2-D padding mask [rows, positions], right-padded."
        )
    if torch.is_tensor(mask) and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise GradAccDataError(
            "The micro-batch's `attention_mask` has padding before a real token (left padding, or holes): torch's "
            "`context_parallel` drops the mask for plain causal attention, so real tokens would attend to that "
            'padding. Pad on the right (`tokenizer.padding_side = "right"`).'
        )
    width = ids.shape[1]
    others = sorted(
        k
        for k, v in batch.items()
        if k not in SHARDED_KEYS and torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == width
    )
    if others:
        raise GradAccDataError(
            f"The micro-batch holds per-position tensors {others} that the Trainer's context-parallel entry does not "
            f"shard (it shards {list(SHARDED_KEYS)}): the model would get them whole beside sharded input ids. Drop "
            "them in the data collator."
        )


def check_sequence_parallel_shard(batch: Mapping[str, Any], *, sp_size: int, sp_rank: int) -> None:
    """Raise :class:`~hf_gradacc.GradAccDataError` for a DeepSpeed Ulysses slice whose ``attention_mask`` shows
    padding before a real token. DeepSpeed's ``UlyssesSPDataLoaderAdapter`` cuts every sequence into ``sp_size``
    contiguous slices (rank ``r`` holds the ``r``-th) and its attention drops the mask, attending causally over the
    gathered sequence: a right-padded row is exact (no real token comes after a pad), a left-padded one is not (its
    real tokens attend to the padding; measured on 2 CPU ranks: relative gradient error 0.41, right-padded 3.8e-07).

    Each rank sees its slice only: a rise of the mask (0 then 1) inside it, or, on sequence rank 0, a row that starts
    with padding (every left-padded row does; so does a row with no token at all, refused alike). Padding between two
    real tokens exactly at a slice boundary is seen by no rank, and a micro-batch without ``attention_mask`` cannot be
    checked: right padding is then the collator's to ensure. Called where the window counts, so the verdict rides on
    the step's count collective (every rank stops together, before any forward)."""
    mask = batch.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or mask.shape[1] == 0:
        return
    bad = (mask[:, 1:] > mask[:, :-1]).any(1) if mask.shape[1] > 1 else torch.zeros_like(mask[:, 0], dtype=torch.bool)
    if sp_rank == 0:
        bad = bad | (mask[:, 0] == 0)
    rows = [int(r) for r in bad.nonzero().flatten()]
    if rows:
        raise GradAccDataError(
            f"Under DeepSpeed Ulysses sequence parallelism (`parallelism_config.sp_size` {sp_size}) the micro-batch's "
            f"`attention_mask` has padding before a real token in row(s) {rows[:8]} of this rank's slice (sequence "
            f"rank {sp_rank}): left padding, or holes. Ulysses attention drops the mask and attends causally, so real "
            'tokens would attend to that padding. Pad on the right (`tokenizer.padding_side = "right"`, '
            "`position_ids` 0 .. width - 1), or set `parallelism_config_sp_size: 1`."
        )


def _restarts(position_ids: torch.Tensor) -> bool:
    return (
        position_ids.dim() == 2
        and position_ids.shape[1] > 1
        and bool((position_ids[:, 1:] <= position_ids[:, :-1]).any())
    )


def context_parallel_for(
    *,
    accelerator: Any,
    settings: Any,
    head: Any,
    model: Any,
    source: Any,
    trainer_class: type,
    sequence_parallel_size: int = 1,
    size: int | None = None,
    rank: int | None = None,
) -> tuple[ContextParallel, Callable | None]:
    """This rank's :class:`ContextParallel` (of size 1 when ``cp_size`` is 1), after refusing by name what is not
    exact, and the ``gather_function`` evaluation must use (None: accelerate's own). ``size`` / ``rank``: the ``cp``
    group's size and this rank's place in it; by default accelerate's ``parallelism_config.cp_size`` and the ``cp``
    mesh dimension (given, for a simulated group in tests). ``source``: where the trainer's loss comes from
    (:class:`~hf_gradacc.step.engine.LossSource`); ``trainer_class``: the trainer's class (it must have the Trainer's
    context-parallel entry); ``sequence_parallel_size``: DeepSpeed Ulysses' ``sp_size`` (the backend's), whose
    slices are checked as they are counted (:meth:`ContextParallel.check_slice`).

    The backend check (:func:`hf_gradacc.backends.sharded_model.check_context_parallel`) already admitted only
    FSDP2 with ``cp_backend="torch"``, ``tp_size`` 1 and ``sp_size`` 1. Refused here, each with its reason:

    - a head other than a causal LM: sequence-level heads pool one position per row, which lives on one shard, and
      their per-row labels are not a per-position buffer; bidirectional heads (masked LM, token classification,
      seq2seq) would be trained causally (accelerate forces ``is_causal=True``);
    - attention other than SDPA (torch shards SDPA only);
    - ``fused_lm_head=True`` (its start-up row check picks a row per rank: the ``cp`` ranks would run attention on
      different rows; the automatic choice is off, :mod:`hf_gradacc.fused.choice`), ``pack_micro_batches`` (samples
      would attend to each other), an overridden ``training_step`` (it would bypass the context), a mixture-of-experts
      router term (a function of the whole micro-batch's routing, computed per shard).

    An overridden ``compute_loss`` (or ``compute_loss_func``) runs on the shard and gets a warning: it must take the
    targets from ``shift_labels`` (never shift ``labels`` itself).

    Example:
        ```python
        cp, gather = context_parallel_for(accelerator=trainer.accelerator, settings=trainer.gradacc,
                                          head=trainer.head, model=trainer.model, source=source,
                                          trainer_class=type(trainer))   # done by GradAccMixin at construction
        ```
    """
    size = cp_size_of(accelerator) if size is None else size
    if size <= 1:
        return ContextParallel(size=1, rank=0, **_sequence_parallel_place(sequence_parallel_size)), None
    if not hasattr(trainer_class, "_prepare_context_parallel_inputs"):
        import transformers

        raise GradAccCompatibilityError(
            f"`cp_size` {size}: transformers {transformers.__version__} has no "
            "`Trainer._prepare_context_parallel_inputs`"
            ", the entry GradAccTrainer shards a micro-batch through. Use transformers >= 5.24, or `cp_size: 1`."
        )
    from ..compat import OPTIONAL_MEMBERS, check_members

    check_members(tuple(m for m in OPTIONAL_MEMBERS if m.name == "_prepare_context_parallel_inputs"))
    from ..heads import unwrap_model

    config = getattr(unwrap_model(model), "config", None)
    why = None
    if head.type != "causal_lm":
        why = (
            f"the model's head is {head.type!r}: under context parallelism each rank holds chunks of every sequence "
            "and "
            "attention is forced causal, so only causal LMs are computed exactly (a sequence-level head pools one "
            "position, which lives on one shard; a bidirectional head would be trained causally)"
        )
    elif getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        why = (
            f"attention is {config._attn_implementation!r}: torch's context parallelism shards SDPA only; load the "
            'model with `attn_implementation="sdpa"`'
        )
    elif settings.fused_lm_head:
        why = (
            "`fused_lm_head=True`: its start-up check runs one row per rank, and the cp ranks must run attention on "
            "the same rows; set `fused_lm_head=False`"
        )
    elif settings.pack_micro_batches:
        why = "`pack_micro_batches=True`: the packed samples would attend to each other; set it to False"
    elif source.custom_training_step:
        why = (
            f"{trainer_class.__name__} overrides `training_step`, which would run outside the context-parallel "
            "context; put the extra work in `compute_loss`"
        )
    elif getattr(config, "output_router_logits", False):
        why = (
            "the model returns a router load-balancing term, a function of the routing of the whole micro-batch, "
            "which each shard would compute on its chunks only; set `output_router_logits=False`"
        )
    if why is not None:
        raise GradAccConfigError(f"`parallelism_config.cp_size` ({size}) cannot be trained exactly here: {why}.")
    if source.custom_compute_loss:
        logger.warning_once(
            "Context parallelism with an overridden `compute_loss` / `compute_loss_func`: it runs on this rank's "
            "chunks of each sequence. Take the targets from `inputs['shift_labels']` (made from the whole sequence), "
            "never shift `labels` yourself (a chunk's last target lives on another rank). In evaluation a LossTerm it "
            "returns is summed over the cp ranks (exact `eval_loss`); a plain tensor is each rank's chunk mean, "
            "averaged over the ranks: not the batch's mean."
        )
    if rank is not None:  # a simulated group (tests): the caller gathers
        return ContextParallel(size=size, rank=rank, ignore_index=head.ignore_index), None
    mesh = accelerator.torch_device_mesh
    cp_mesh = mesh["cp"]
    rank, group_ranks = int(cp_mesh.get_local_rank()), tuple(int(r) for r in cp_mesh.mesh.flatten().tolist())
    cp = ContextParallel(size=size, rank=rank, ignore_index=head.ignore_index, group_ranks=group_ranks)
    # evaluation gathers one copy of each batch: the rows of every group's cp rank 0
    data_ranks = tuple(sorted(int(r) for r in mesh.mesh.select(mesh.mesh_dim_names.index("cp"), 0).flatten().tolist()))
    return cp, partial(cp.gather_for_metrics, accelerator, data_ranks)


def _sequence_parallel_place(sp_size: int) -> dict[str, int]:
    """``sp_size`` and this rank's place in its DeepSpeed Ulysses sequence group (1 elsewhere). DeepSpeed groups
    consecutive ranks (``parallel_state_sp``: ranks ``i x sp .. (i + 1) x sp - 1``), so the place is the global rank
    modulo ``sp_size``."""
    if sp_size <= 1:
        return {}
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return {"sp_size": sp_size, "sp_rank": rank % sp_size}
