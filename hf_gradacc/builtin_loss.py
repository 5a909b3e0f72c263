"""The built-in loss of :class:`~hf_gradacc.GradAccMixin`: the labels are taken out, the model runs, and the loss is
the head's SUM over the micro-batch plus the router terms the model returns (:mod:`hf_gradacc.auxiliary`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from transformers.utils import logging

from .auxiliary import model_aux_terms
from .checks import LossCheck, agree, check_builtin
from .counting import LABEL_KEY, SHIFT_LABELS_KEY, MicroBatchCounts, input_token_count
from .errors import GradAccConfigError, GradAccDataError, GradAccLossError
from .fused.head import CheckRow, check_row, fused_causal_lm_sum, fused_row_check
from .heads import Head, unwrap_model
from .loss import LossOutput, LossTerm, causal_targets, model_labels
from .memory import is_out_of_memory
from .weights import WEIGHTS, pop_weights, weighted_loss_sum

logger = logging.get_logger(__name__)

MAIN_TERM = "main"


def logits_of(outputs: Any) -> torch.Tensor:
    """``outputs.logits`` (a ModelOutput / dict, or the first element of a tuple), or a clear error."""
    if torch.is_tensor(outputs):
        raise GradAccLossError(
            f"The model returned a bare tensor of shape {tuple(outputs.shape)}, not an output with `logits`; "
            "hf_gradacc cannot tell logits from a loss. Return a ModelOutput (or a dict with `logits`), or override "
            "`compute_loss` and return an hf_gradacc.LossTerm."
        )
    if isinstance(outputs, Mapping):
        logits = outputs.get("logits")
        if torch.is_tensor(logits):
            return logits
        raise GradAccLossError(
            f"The model's output has no `logits` (keys: {sorted(outputs.keys())}); the built-in loss is computed from "
            "them. Override `compute_loss` and return an hf_gradacc.LossTerm built from what the model returns."
        )
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    raise GradAccLossError(f"The model returned a {type(outputs).__name__}; expected a ModelOutput with `logits`.")


def builtin_loss(
    head: Head,
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    denominator: str,
    with_model_loss: bool = False,
    fused_lm_head: bool | None = None,
    routing: Any = None,
    micro_batch_index: int | None = None,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    num_input_tokens: int | None = None,
) -> tuple[dict[str, LossTerm], Any]:
    """``({"main": LossTerm(head's sum, denominator), "aux": ..., ...}, outputs)`` for one micro-batch.

    ``with_model_loss``: the labels are ALSO given to the model, so that ``outputs.loss`` is the model's own loss of
    this micro-batch (the start-up consistency check), computed from the same logits.

    ``fused_lm_head=True``: the head runs only on the positions whose target counts, in tiles
    (:mod:`hf_gradacc.fused.head`); ``outputs.logits`` is then a placeholder. The start-up check compares the
    model's own loss with the fused one on one row and raises at once. None (the default) is off for now.

    ``routing``: the step's :class:`~hf_gradacc.moe_balance.StepRouting` (``router_balance``), with the running
    ``micro_batch_index``. ``all_gather``: the backend's (every rank's row stacked), for the fused head's start-up
    check, agreed over the ranks. ``num_input_tokens``: the micro-batch's routed tokens as the window counted them
    (training: no device read); counted from ``inputs`` when None, and only for a model with router terms.
    """
    inputs = dict(inputs)
    labels = inputs.pop(LABEL_KEY, None)
    shift_labels = inputs.pop(SHIFT_LABELS_KEY, None)
    weights = pop_weights(inputs)  # never reaches the forward; the model's own (unweighted) loss is not compared
    with_model_loss = with_model_loss and weights is None
    if labels is None and shift_labels is None:
        raise GradAccDataError(
            f"The batch has no `{LABEL_KEY}` (keys: {sorted(inputs)}); GradAccTrainer computes the loss from the "
            "labels. Have the data collator return `labels`, or override `compute_loss` and return a LossTerm."
        )
    if (
        head.type == "seq2seq"
        and labels is not None
        and not {"decoder_input_ids", "decoder_inputs_embeds"} & set(inputs)
    ):
        base = unwrap_model(model)
        if hasattr(base, "prepare_decoder_input_ids_from_labels"):
            inputs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(
                labels=model_labels(labels, head.ignore_index)
            )
        else:  # the model builds its decoder inputs (and a loss that is not used)
            inputs[LABEL_KEY] = model_labels(labels, head.ignore_index)
    if fused_lm_head and weights is not None:
        raise GradAccConfigError(
            "`fused_lm_head=True` cannot take `loss_weights` (its tiles sum unweighted targets); set "
            "`fused_lm_head=False`, or drop the weights column."
        )
    if fused_lm_head:
        return _fused_loss(
            head,
            model,
            inputs,
            labels,
            shift_labels,
            denominator=denominator,
            check=with_model_loss,
            routing=routing,
            micro_batch_index=micro_batch_index,
            all_gather=all_gather or (lambda row: row[None]),
            num_input_tokens=num_input_tokens,
        )
    outputs = None
    if with_model_loss and labels is not None:
        try:  # the model's own loss from the same forward; a model that cannot compute one is simply not checked
            model_given = labels if labels.is_floating_point() else model_labels(labels, head.ignore_index)
            with_labels = {**inputs, LABEL_KEY: model_given}
            if shift_labels is not None:
                with_labels[SHIFT_LABELS_KEY] = model_labels(shift_labels, head.ignore_index)
            with loss_function_without_graph(model):
                outputs = model(**with_labels)
            drop_model_loss_graph(outputs)
        except Exception as error:  # noqa: BLE001
            if is_out_of_memory(error):
                raise  # auto_micro_batch's business, not the check's
            logger.warning_once(
                f"The start-up loss check is skipped: the model cannot compute its own loss ({error})."
            )
    if outputs is None:
        outputs = model(**inputs)
    if weights is not None:
        total = weighted_loss_sum(
            logits_of(outputs),
            labels,
            weights,
            head_type=head.type or "masked_lm",
            ignore_index=head.ignore_index,
            shift_labels=shift_labels,
            problem_type=head.problem_type_of(labels),
            label_smoothing=head.label_smoothing,
        )
        terms = {MAIN_TERM: LossTerm(total=total, normalize_by=WEIGHTS)}
    else:
        terms = {
            MAIN_TERM: LossTerm(
                total=head.sum_loss(logits_of(outputs), labels, shift_labels), normalize_by=denominator
            )
        }
    routed = num_input_tokens if num_input_tokens is not None else (lambda: input_token_count(inputs))
    terms.update(
        model_aux_terms(
            model,
            outputs,
            routed,
            routing=routing,
            attention_mask=inputs.get("attention_mask"),
            index=micro_batch_index,
        )
    )
    return terms, outputs


def _fused_loss(
    head: Head,
    model: nn.Module,
    inputs: dict[str, Any],
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    *,
    denominator: str,
    check: bool,
    routing: Any = None,
    micro_batch_index: int | None = None,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
    num_input_tokens: int | None = None,
) -> tuple[dict[str, LossTerm], Any]:
    ignore = head.ignore_index
    if LABEL_KEY in inputs:  # a seq2seq model that builds its decoder inputs from the labels would compute its loss
        raise GradAccConfigError(
            f"`fused_lm_head=True` cannot run here: {type(unwrap_model(model)).__name__} builds its decoder inputs "
            "from "
            "the labels (no `prepare_decoder_input_ids_from_labels`), so it would also compute a loss of its own. "
            "Pass `decoder_input_ids` in the batch, or set `fused_lm_head=False`."
        )
    if head.type == "causal_lm":
        targets = (shift_labels if shift_labels is not None else causal_targets(labels.long(), ignore)).long()
    else:  # seq2seq (decoder positions) and masked LM: position i predicts labels[i]
        targets = labels.long()
    # the Trainer's label smoothing per tile; the start-up row check compares without it (the model's own loss has
    # none)
    result = fused_causal_lm_sum(model, inputs, targets, ignore_index=ignore, label_smoothing=head.label_smoothing)
    if check:  # every rank runs it (its forwards gather sharded weights) and every rank stops if one rank's fails
        causal = head.type == "causal_lm"  # the check's row cut to its first targets: fewer full logits
        one = (check_row(inputs, targets, labels, shift_labels, ignore_index=ignore) if causal else None) or CheckRow(
            inputs, targets, labels, shift_labels
        )
        pair = fused_row_check(
            model, one.inputs, one.targets, labels=one.labels, shift_labels=one.shift_labels, ignore_index=ignore
        )
        verdict = check_builtin(pair[0], torch.tensor(pair[1])) if pair is not None else LossCheck()
        try:
            agree(verdict, all_gather, targets.device)
        except GradAccLossError as error:
            raise GradAccLossError(f"{error} (fused_lm_head: compared on the first row with a target)") from None
    terms = {MAIN_TERM: LossTerm(total=result.sum_loss, normalize_by=denominator)}
    routed = num_input_tokens if num_input_tokens is not None else (lambda: input_token_count(inputs))
    terms.update(
        model_aux_terms(
            model,
            result.backbone,
            routed,
            routing=routing,
            attention_mask=inputs.get("attention_mask"),
            index=micro_batch_index,
        )
    )
    return terms, result.backbone


@contextlib.contextmanager
def loss_function_without_graph(model: nn.Module) -> Iterator[None]:
    """While the start-up check's forward runs, the model's ``loss_function`` (the one transformers' heads call with
    the labels) computes without gradient: the model's own loss is only read, never back-propagated, and with a graph
    it would keep a second set of [tokens x vocabulary] log-probabilities alive beside the library's (1.5x the stock
    Trainer's peak at a 151,936-token vocabulary). Terms the model adds outside it (router terms) are untouched.

    Models without a settable ``loss_function`` (a loss written inline) keep theirs; :func:`drop_model_loss_graph`
    frees its graph before the library's loss is built."""
    base = unwrap_model(model)
    prop = getattr(type(base), "loss_function", None)
    if not isinstance(prop, property) or prop.fset is None:
        yield
        return
    missing = object()
    before = base.__dict__.get("_loss_function", missing)
    original = base.loss_function

    def without_graph(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return original(*args, **kwargs)

    base.loss_function = without_graph
    try:
        yield
    finally:
        if before is missing:
            base.__dict__.pop("_loss_function", None)
        else:
            base._loss_function = before


def drop_model_loss_graph(outputs: Any) -> None:
    """Replace ``outputs.loss`` by its value, so that whatever graph the model built for it (an inline loss, or the
    router terms added to it) is freed before the library builds its own loss from the same logits."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    if torch.is_tensor(loss) and loss.requires_grad:
        outputs["loss"] = loss.detach()


def model_mean_loss(model: nn.Module, inputs: Mapping[str, Any]) -> float | None:
    """The model's own loss of ``inputs`` (labels included) in one forward without gradient: the micro-batch mean an
    overridden ``compute_loss`` is expected to return. None when the model computes no loss or fails to."""
    try:
        with torch.no_grad():
            outputs = model(**inputs)
    except Exception:  # noqa: BLE001 - a model that cannot compute its own loss is simply not checked
        return None
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    return float(loss.detach().float()) if torch.is_tensor(loss) and loss.numel() == 1 else None


def batch_mean_loss(terms: dict[str, LossTerm], counts: MicroBatchCounts, denominator: str) -> torch.Tensor:
    """One evaluation batch's mean loss: each term over its own count in the batch. NaN, with a warning, when the batch
    has no counted item (as the stock Trainer's 0/0), never 0, which would pull the evaluation mean down."""
    if counts.get(denominator) == 0:
        logger.warning_once(
            f"An evaluation batch has no counted {denominator} (every label is ignored): its loss is NaN, as with the "
            "stock Trainer, never 0."
        )
        return torch.full((), float("nan"), device=terms[MAIN_TERM].total.device)
    return LossOutput(terms).batch_mean(counts)
