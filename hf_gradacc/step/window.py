"""One optimizer step in flight ("the window", :class:`Window`): its micro-batches, their counts (local and over
every rank: :class:`~hf_gradacc.counting.WindowCounts`), the micro-batch cursor and the step's flags.

The window knows nothing about backends: it is handed an ``all_gather`` callable that returns one row per data-parallel
rank, and issues exactly one such collective per optimizer step (:func:`~hf_gradacc.counting.gather_window_counts`). It
also holds the one normalisation of what ``compute_loss`` returned (:meth:`Window.normalized_terms`): each term divided
by its denominator counted over the whole step, times the data-parallel world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers.utils import logging

from ..counting import PACKED_KEY, MicroBatchCounts, WindowCounts, gather_window_counts, rows_of
from ..errors import GradAccConfigError, GradAccDataError, GradAccError, GradAccLossError
from ..loss import LossOutput, normalize
from ..moe_balance import MoeLoadLog
from ..multimodal import check_batch_rows

logger = logging.get_logger(__name__)

# Denominator kinds of a streamed window, in the column order of its gathered count vector.
STREAMED_KINDS: tuple[str, ...] = ("tokens", "samples", "custom")


def split_micro_batches(micro_batches: Sequence[Mapping[str, Any]], max_rows: int) -> list[dict[str, Any]]:
    """Cut every micro-batch into pieces of at most ``max_rows`` rows, keeping the order of samples.

    Tensors whose first dim is the row count are sliced; other values are shared by every piece.
    """
    if max_rows < 1:
        raise GradAccConfigError(f"`max_rows` ({max_rows}) must be >= 1")
    pieces: list[dict[str, Any]] = []
    for batch in micro_batches:
        check_batch_rows(batch, "`auto_micro_batch`")  # Qwen-VL images are patches of the whole batch, not rows
        if torch.is_tensor(batch.get(PACKED_KEY)):
            pieces += _split_packed(batch, max_rows)
            continue
        rows = rows_of(batch)
        for start in range(0, rows, max_rows):
            stop = min(start + max_rows, rows)
            pieces.append(
                {
                    key: value[start:stop]
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows
                    else value
                    for key, value in batch.items()
                }
            )
    return pieces


def _split_packed(batch: Mapping[str, Any], max_rows: int) -> list[dict[str, Any]]:
    """A packed row cut at its sequence boundaries into rows of at most ``max_rows`` samples (each sample's first
    label is already masked and its positions restart at 0, so every piece is a packed row of its own)."""
    offsets = [int(x) for x in batch[PACKED_KEY].tolist()]
    pieces = []
    for first in range(0, len(offsets) - 1, max_rows):
        last = min(first + max_rows, len(offsets) - 1)
        start, stop = offsets[first], offsets[last]
        local = torch.tensor([o - start for o in offsets[first : last + 1]], dtype=batch[PACKED_KEY].dtype)
        piece: dict[str, Any] = {}
        for key, value in batch.items():
            if key.startswith("cu_seq_lens"):
                piece[key] = local.to(value.device)
            elif key.startswith("max_length"):
                piece[key] = int(local.diff().max())
            elif torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == offsets[-1]:
                piece[key] = value[:, start:stop]
            else:
                piece[key] = value
        pieces.append(piece)
    return pieces


@dataclass(eq=False)
class Window:
    """One optimizer step in flight. The training loop builds one per step and passes it to every function that
    needs the step's state; ``trainer.current_window`` shows it to overridden ``compute_loss`` / ``training_step``.

    Two kinds, one micro-batch path:

    - prefetched (default): every micro-batch is fetched and counted before the first forward pass, and the counts
      are summed over ranks in one collective, so each loss term is normalised by its global count as it is
      computed;
    - streamed (``defer_normalization``): micro-batches are pulled one at a time and back-propagated as SUMS (times
      the world size); their local counts are summed over ranks once after the last one, and the reduced gradient
      is scaled by ``1 / global count`` then (:meth:`finish_streamed`).

    Attributes:
        micro_batches: this rank's inputs (prefetched; streamed: those pulled so far).
        counts: per-micro-batch counts on this rank and the global sums (streamed: local only until finished).
        index: the micro-batch running now, None between micro-batches.
        defers_sync: no backward pass reduces gradients; the backend reduces once after the window
            (streamed windows and ``auto_micro_batch``).
        final_backward_done: the step's final backward pass (the one that reduces) has run.
        grads_ready: the reduced gradient is readable (between the final backward pass and the optimizer step).
        term_totals: each named term's normalised loss summed over this window's micro-batches (for logging).
        losses: each micro-batch's share of the logged loss on this rank (to name a non-finite one).
    """

    micro_batches: list[Any]
    counts: WindowCounts
    dp_world_size: int = 1
    streamed: bool = False
    defers_sync: bool = False
    index: int | None = None
    final_backward_done: bool = False
    grads_ready: bool = False
    term_totals: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    streamed_kind: str | None = None
    streamed_custom: int = 0
    error: BaseException | None = None
    routing: Any = None  # a mixture-of-experts model's routing of the step (hf_gradacc.moe_balance.StepRouting)

    # ---------------------------------------------------------------- construction
    @classmethod
    def prefetched(
        cls,
        batches: list[Any],
        *,
        count: Callable[[Mapping[str, Any]], MicroBatchCounts],
        all_gather: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device | str,
        dp_world_size: int,
        defers_sync: bool = False,
        recheck: Callable[[Mapping[str, Any]], Any] | None = None,
    ) -> Window:
        """The window of this rank's fetched ``batches``: each one counted, the counts summed over ranks (one
        collective) and brought to the host (one transfer). A batch that cannot be counted on any rank stops every
        rank (see :func:`gather_window_counts`). ``count`` may leave its counts on the device
        (:meth:`~hf_gradacc.counting.Counter.count` ``deferred``); ``recheck`` then counts a batch whose deferred
        checks found a problem again at once, for the check's own error or warning."""
        counted: list[MicroBatchCounts] = []
        error: BaseException | None = None
        try:
            counted = [count(b) for b in batches]
        except GradAccError as exc:  # agreed below: every rank stops, none waits in a later collective
            error = exc
        again = None if recheck is None else lambda i: recheck(batches[i])
        counts = gather_window_counts(counted, all_gather, device=device, error=error, recheck=again)
        return cls(micro_batches=batches, counts=counts, dp_world_size=dp_world_size, defers_sync=defers_sync)

    @classmethod
    def stream(cls, *, dp_world_size: int) -> Window:
        """An empty streamed window; :meth:`pull` adds micro-batches as they arrive."""
        counts = WindowCounts(micro_batches=(), global_tokens=0, global_samples=0, num_micro_batches_per_rank=())
        return cls(micro_batches=[], counts=counts, dp_world_size=dp_world_size, streamed=True, defers_sync=True)

    def pull(
        self, epoch_iterator: Iterator[Any], num_batches: int, count: Callable[[Mapping[str, Any]], MicroBatchCounts]
    ) -> Iterator[Any]:
        """Streamed: yield up to ``num_batches`` micro-batches from ``epoch_iterator``, counting each on arrival and
        dropping it once its backward pass ran."""
        for _ in range(num_batches):
            try:
                inputs = next(epoch_iterator)
            except StopIteration:
                return
            try:
                counted = count(inputs)
            except GradAccError as exc:  # agreed in finish_streamed: no rank waits for this one
                self.error = exc
                return
            self.counts = self.counts.with_micro_batches([*self.counts.micro_batches, counted])
            self.micro_batches = [inputs]
            yield inputs
            self.micro_batches = []

    def resplit(self, max_rows: int, count: Callable[[Mapping[str, Any]], MicroBatchCounts]) -> None:
        """The same samples (and global counts), cut into micro-batches of at most ``max_rows`` rows on this rank."""
        pieces = split_micro_batches(self.micro_batches, max_rows)
        if len(pieces) != len(self.micro_batches):
            self.micro_batches = pieces
            self.counts = self.counts.with_micro_batches([count(p) for p in pieces])

    # ---------------------------------------------------------------- where the step stands
    @property
    def num_micro_batches(self) -> int:
        """Micro-batches of the step on this rank (streamed: pulled so far)."""
        return len(self.counts.micro_batches)

    @property
    def is_last(self) -> bool:
        """True while the last micro-batch of a prefetched window runs (a streamed window does not know it)."""
        return not self.streamed and self.index is not None and self.index == len(self.micro_batches) - 1

    @property
    def current_counts(self) -> MicroBatchCounts:
        if self.index is None:
            raise GradAccDataError("No micro-batch of the optimizer step is running")
        return self.counts.micro_batches[self.index if not self.streamed else -1]

    def global_count(self, denominator: str) -> int:
        """The denominator summed over every micro-batch of the step on every rank (prefetched windows)."""
        return self.counts.global_count(denominator)

    # ---------------------------------------------------------------- the normalisation
    def normalized_terms(
        self, parsed: LossOutput, *, primary: str, warn_on_plain_loss: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """Each term of the running micro-batch's loss, ready for backward: its sum over the micro-batch divided by
        its count over the whole step (streamed: not yet divided), times the world size.

        A plain scalar (``parsed.plain``) is read as a mean over the micro-batch's counted ``primary`` items.
        """
        if self.streamed:
            return self._streamed_terms(parsed, primary=primary)
        local_counts = self.current_counts
        world = self.dp_world_size
        if parsed.plain is None:
            parts: list[tuple[str, torch.Tensor]] = []
            for name, term in parsed.terms.items():
                if not isinstance(term.normalize_by, str):
                    raise GradAccLossError(
                        f"LossTerm {name!r} has a custom count ({term.normalize_by!r}), known only after the forward "
                        "pass: set `defer_normalization=True` (the gradient is scaled once per step), or use "
                        "normalize_by='tokens' / 'samples'."
                    )
                why = self.counts.unavailable(term.normalize_by)
                if why is not None:
                    raise GradAccLossError(f"LossTerm {name!r} is normalised by {term.normalize_by!r} but {why}.")
                global_count = self.global_count(term.normalize_by)
                if global_count == 0:
                    logger.warning_once(
                        f"Loss term {name!r} has no counted {term.normalize_by} in this optimizer step on any rank; "
                        "it is left out of the step (no NaN)."
                    )
                    parts.append((name, term.total * 0.0))
                else:
                    parts.append((name, normalize(term.total, global_count, world)))
            return parts
        if self.counts.weighted:
            raise GradAccLossError(
                "compute_loss returned a plain tensor for a step whose batches carry `loss_weights`: a mean cannot be "
                're-weighted exactly. Return hf_gradacc.LossTerm(total=<weighted sum>, normalize_by="weights") '
                "(hf_gradacc.weights.weighted_loss_sum), or drop the column."
            )
        if warn_on_plain_loss:
            logger.warning_once(
                "compute_loss returned a plain tensor: GradAccTrainer reads it as the MEAN over the micro-batch's "
                f"counted {primary} (num_items_in_batch is that local count) and re-weights it exactly. If it is not "
                "such a mean, return hf_gradacc.LossTerm(total=<sum>, normalize_by=...) (set "
                "`warn_on_plain_loss=False` to silence this)."
            )
        local = local_counts.get(primary)
        if local == 0:
            if not bool(torch.isfinite(parsed.plain)):
                raise GradAccLossError(
                    "compute_loss returned a non-finite mean for a micro-batch with no counted item. Return "
                    "hf_gradacc.LossTerm(total=<sum>, ...), whose sum is 0 for an empty micro-batch."
                )
            return [("loss", parsed.plain * 0.0)]
        return [("loss", normalize(parsed.plain * local, self.global_count(primary), world))]

    def _streamed_terms(self, parsed: LossOutput, *, primary: str) -> list[tuple[str, torch.Tensor]]:
        """Streamed windows: the ONE denominator all terms share, their sum times the world size."""
        world = self.dp_world_size
        weighted = any(t.normalize_by == "weights" for t in parsed.terms.values() if isinstance(t.normalize_by, str))
        if weighted or self.current_counts.weight_sum is not None:
            raise GradAccConfigError(
                "`loss_weights` (the 'weights' denominator) cannot be used with `defer_normalization=True`: the "
                "weight "
                "sum is gathered with the counts before the first forward pass. Set `defer_normalization=False`."
            )
        if parsed.plain is not None:
            kind, custom = primary, 0
            local = self.current_counts.get(primary)
            summed = parsed.plain * local if local else parsed.plain * 0.0
        else:
            terms = list(parsed.terms.values())
            kinds = {t.normalize_by if isinstance(t.normalize_by, str) else "custom" for t in terms}
            if len(kinds) != 1:
                raise GradAccLossError(
                    f"With `defer_normalization=True` every LossTerm must share one denominator (got {sorted(kinds)}):"
                    " the gradient is scaled once per step. Turn `defer_normalization` off to mix denominators."
                )
            kind, custom = kinds.pop(), 0
            if kind == "custom":
                counts_given = {int(t.normalize_by) for t in terms}
                if len(counts_given) != 1:
                    raise GradAccLossError(
                        "With `defer_normalization=True` every LossTerm must share one count (got "
                        f"{sorted(counts_given)})"
                    )
                custom = counts_given.pop()
            summed = terms[0].total
            for term in terms[1:]:
                summed = summed + term.total
        if self.streamed_kind not in (None, kind):
            raise GradAccLossError(
                f"With `defer_normalization=True` every micro-batch of a step must use one denominator "
                f"(got {self.streamed_kind!r} and {kind!r})."
            )
        self.streamed_kind = kind
        self.streamed_custom += custom
        return [("loss", summed * world)]

    def finish_streamed(
        self, all_gather: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str
    ) -> int | None:
        """Sum this streamed window's counts over ranks (one collective) and agree on the denominator.

        Returns the global count (0: nothing counted on any rank), or None when no rank had a micro-batch. An error
        a rank met while streaming (``self.error``) is agreed here too: every rank raises.
        """
        local = self.counts
        kind_code = -1 if self.streamed_kind is None else STREAMED_KINDS.index(self.streamed_kind)
        values = [local.local_tokens, local.local_samples, self.streamed_custom, self.num_micro_batches, kind_code]
        values += [local.local_input_tokens, local.local_seen_tokens, int(self.error is not None)]
        values.append(sum(mb.num_positions for mb in local.micro_batches))
        rows = all_gather(torch.tensor(values, dtype=torch.int64, device=device)).reshape(-1, len(values)).cpu()
        failed = [r for r in range(rows.shape[0]) if int(rows[r, 7])]
        if self.error is not None:
            raise self.error
        if failed:
            raise GradAccDataError(
                f"Rank(s) {failed} failed in this optimizer step's micro-batches (see the error on those ranks); "
                "every rank stops here rather than wait for them."
            )
        self.counts = replace(
            self.counts,
            global_tokens=int(rows[:, 0].sum()),
            global_samples=int(rows[:, 1].sum()),
            num_micro_batches_per_rank=tuple(int(n) for n in rows[:, 3]),
            global_input_tokens=int(rows[:, 5].sum()),
            global_seen_tokens=int(rows[:, 6].sum()),
            global_positions=int(rows[:, 8].sum()),
        )
        if int(rows[:, 3].max()) == 0:
            return None
        # The denominator is agreed from every rank's row (a rank without micro-batches has none of its own).
        codes = sorted({int(c) for c in rows[:, 4] if int(c) >= 0})
        if len(codes) != 1:
            raise GradAccLossError(
                "With `defer_normalization=True` every rank must use one denominator in a step (got "
                f"{[STREAMED_KINDS[c] for c in codes]})."
            )
        return int(rows[:, codes[0]].sum())  # columns 0, 1, 2 hold tokens, samples, custom counts

    def add_term_totals(self, parts: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Keep each named term's share of the logged loss (only when there are several terms)."""
        if len(parts) < 2:
            return
        for name, part in parts:
            value = part.detach().float()
            total = self.term_totals.get(name)
            self.term_totals[name] = value if total is None else total + value


@dataclass
class TermLog:
    """Each named loss term's share of the logged loss, summed over the optimizer steps since the last log line; and
    a mixture-of-experts model's expert load (``moe``: ``moe/load_max_over_mean``, hf_gradacc.moe_balance)."""

    totals: dict[str, torch.Tensor] = field(default_factory=dict)
    num_steps: int = 0
    moe: MoeLoadLog = field(default_factory=MoeLoadLog)

    def add(self, window: Window) -> None:
        self.moe.add(window.routing)
        if not window.term_totals:
            return
        self.num_steps += 1
        for name, value in window.term_totals.items():
            total = self.totals.get(name)
            self.totals[name] = value if total is None else total + value

    def pop_means(
        self, all_gather: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str
    ) -> dict[str, float]:
        """``{"loss/<name>": mean per step, averaged over ranks}``, with the expert load of a mixture-of-experts model
        (summed over ranks), then reset: ONE collective on several ranks (the terms' float64 bits and the load counts
        in one int64 vector, as the step's count vector carries a weight sum)."""
        load = self.moe.take()
        names = sorted(self.totals) if self.num_steps else []
        parts = (
            [torch.stack([self.totals[n] for n in names]).detach().cpu().double().view(torch.int64)] if names else []
        )
        parts += [load.reshape(-1).cpu().long()] if load is not None else []
        if not parts:
            return {}
        rows = all_gather(torch.cat(parts).to(device)).cpu()  # [ranks, terms + load]
        means = rows[:, : len(names)].contiguous().view(torch.float64).mean(dim=0).tolist()
        logs = {f"loss/{name}": value / self.num_steps for name, value in zip(names, means)}
        if load is not None:
            logs.update(self.moe.logs(rows[:, len(names) :].sum(dim=0).reshape(load.shape)))
        self.totals, self.num_steps = {}, 0
        return logs
