"""Which models train on packed rows exactly as on the same samples padded: :func:`check_packing_support`.

A packed row (:class:`~hf_gradacc.data.pack.PackedCollator`) holds several samples; a model must keep them apart
(restarting ``position_ids``, an attention implementation that turns them into a block-diagonal mask or calls the
variable-length kernels). Transformers raises nothing when a model does not, it only computes another loss, so the
check refuses such a model with the reason; where it can, it runs a small probe on the model itself.

Example:
    ```python
    from hf_gradacc.data.pack_check import check_packing_support

    check_packing_support(model)  # after Trainer.__init__ (it sets `model.config.use_cache`)
    ```
"""

from __future__ import annotations

import inspect

import torch

from ..backends.sharded_model import holds_whole_parameters
from ..errors import GradAccConfigError
from .attention_cost import _unwrap
from .pack import PackedCollator

# Attention implementations of transformers that keep the sequences of a packed row apart when the batch has
# `position_ids` that restart at 0 and no `attention_mask`: the mask builders of `masking_utils` (eager, sdpa, flex)
# turn the restarts into a block-diagonal causal mask, the flash ones call their variable-length kernels.
PACKED_ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)

# Model types whose packed rows were measured equal to the separate samples (eager, and sdpa where the model has it;
# transformers 5.23):
# trusted by `check_packing_support` when its probe cannot run (parameters on the meta device or sharded).
VERIFIED_PACKED_MODEL_TYPES: frozenset[str] = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "gemma2", "gpt_neox", "gptj", "gpt2"}
)

# Relative tolerance (to the largest logit + 1) of the probe of `check_packing_support`. A model that keeps the
# samples of a row apart computes the probed sample from the same numbers whatever precedes it (1e-7 and below in
# float32); the leaks measured on tiny random models move its logits by 3.7e-3 (BERT as a decoder, near-uniform
# attention) to 0.23 (Falcon). Half precision rounds logits to ~4e-3 of their size: its probe is best effort. The
# second tolerance compares the sample packed with the sample alone (other shapes, so other rounding).
_PROBE_RTOL: dict[torch.dtype, tuple[float, float]] = {torch.float64: (1e-9, 1e-7), torch.float32: (1e-5, 1e-4)}
_PROBE_RTOL_HALF = (2e-3, 5e-2)


# ---------------------------------------------------------------------------------------------- the model
def _probe_packing(model: torch.nn.Module) -> None:
    """Run two packed rows ``[a, c]`` and ``[b, c]`` (``a`` and ``b`` differ) and ``c`` alone: a model that keeps the
    samples apart gives ``c`` the same logits in all three. Raises :class:`GradAccConfigError` otherwise."""
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 3:
        raise GradAccConfigError(
            f"check_packing_support cannot probe {type(model).__name__}: its config has no usable `vocab_size` "
            f"({vocab!r}). Pass `probe=False` if you have checked that it honours packed `position_ids`."
        )
    device = next(model.parameters()).device
    # Two prefixes of one repeated token each (their attention averages differ the most), then a short sample.
    a, b = [1] * 16, [vocab - 1] * 16
    c = torch.randint(2, vocab - 1, (2,), generator=torch.Generator().manual_seed(0)).tolist()
    collate = PackedCollator()
    rows = [collate([{"input_ids": x}, {"input_ids": c}]) for x in (a, b)] + [collate([{"input_ids": c}])]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = []
            for row in rows:
                inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in row.items() if k != "labels"}
                logits.append(model(**inputs).logits[0, -len(c) :].double().cpu())
    except TypeError as error:
        raise GradAccConfigError(
            f"{type(model).__name__}.forward does not take the keys of a packed row ({sorted(rows[0])}): {error}"
        ) from error
    finally:
        model.train(was_training)
    dtype = next(model.parameters()).dtype
    leak_rtol, shift_rtol = _PROBE_RTOL.get(dtype, _PROBE_RTOL_HALF)
    scale = float(logits[2].abs().max()) + 1.0
    leak = float((logits[0] - logits[1]).abs().max()) / scale
    shift = float((logits[0] - logits[2]).abs().max()) / scale
    attn = getattr(config, "_attn_implementation", None)
    where = f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}, attention {attn!r})"
    if leak > leak_rtol:
        raise GradAccConfigError(
            f"{where} lets the samples of a packed row attend to each other: the logits of a sample change by "
            f"{leak:.1e} (relative) when the sample before it in the row changes. Its forward does not turn the "
            "restarting `position_ids` into separate sequences; packing would silently train on cross-sample "
            "attention. Do not pack this model with this attention implementation (the flash ones read the sequences "
            "inside each attention layer, where the model passes `position_ids` down)."
        )
    if shift > shift_rtol:
        raise GradAccConfigError(
            f"{where} gives a packed sample other logits than the same sample alone ({shift:.1e} relative): it does "
            "not restart positions at the `position_ids` of a packed row. Do not pack this model."
        )


def check_packing_support(model: torch.nn.Module, *, probe: bool = True) -> None:
    """Raise :class:`~hf_gradacc.GradAccConfigError`, with the reason, when ``model`` cannot train on the packed rows
    of :class:`PackedCollator` exactly as on the same samples padded; return None when it can.

    The rules, in order: a decoder-only causal LM (``config.is_encoder_decoder`` and ``config.is_causal=False``
    fail: an encoder's bidirectional mask is built from ``attention_mask`` only); its ``forward`` takes
    ``position_ids``; its attention implementation is one of :data:`PACKED_ATTENTION_IMPLEMENTATIONS`;
    ``config.use_cache`` is off (transformers looks for packed sequences only without a cache, and the model
    creates one when ``use_cache`` is on: ``Trainer.__init__`` sets it from ``TrainingArguments.use_cache``, False
    by default, so call this after it). Then, with ``probe``, a forward pass of a few tokens checks that a sample's
    logits do not depend on the sample packed before it and equal those of the sample alone: models whose forward
    takes ``position_ids`` but does not pass them to the mask (OPT, Falcon, BERT as a decoder) fail there. When the
    parameters cannot run a forward pass on their own (meta device, FSDP2 or ZeRO-3 shards) the model type must be
    one of :data:`VERIFIED_PACKED_MODEL_TYPES`.

    Example:
        ```python
        from hf_gradacc.data.pack_check import check_packing_support
        from hf_gradacc.testing.tiny import build_tiny_model

        model = build_tiny_model("causal_lm")
        model.config.use_cache = False      # what Trainer.__init__ does with the default TrainingArguments
        check_packing_support(model)        # passes: Llama with sdpa honours packed position_ids
        ```
    """
    from ..heads import detect_head_type

    base = _unwrap(model)
    name = type(base).__name__
    config = getattr(base, "config", None)
    if config is None:
        raise GradAccConfigError(f"{name} has no `config`: packing is supported for transformers models only.")
    from ..multimodal import packing_problem

    if packing_problem(base) is not None:
        raise GradAccConfigError(f"`pack_micro_batches=True` cannot run here: {packing_problem(base)}.")
    if getattr(config, "is_encoder_decoder", False):
        raise GradAccConfigError(
            f"{name} is an encoder-decoder model: packed rows are for decoder-only causal LMs (the encoder's "
            "bidirectional mask is built from `attention_mask`, which a packed row does not have)."
        )
    head = detect_head_type(base)
    if head != "causal_lm" or getattr(config, "is_causal", True) is False:
        raise GradAccConfigError(
            f"{name} is a {head or 'unknown'} model, not a causal LM: packed rows are for decoder-only causal LMs "
            "(transformers separates packed sequences in causal masks only; a bidirectional encoder would attend "
            "across samples)."
        )
    if "position_ids" not in inspect.signature(base.forward).parameters:
        raise GradAccConfigError(
            f"{name}.forward takes no `position_ids`: it cannot restart positions per sample nor tell the samples "
            "of a packed row apart (e.g. ALiBi models such as BLOOM)."
        )
    attn = getattr(config, "_attn_implementation", None)
    if attn not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise GradAccConfigError(
            f"{name} uses the attention implementation {attn!r}, which transformers does not give packed sequences "
            f"to; use one of {PACKED_ATTENTION_IMPLEMENTATIONS} (`attn_implementation` of `from_pretrained`)."
        )
    if getattr(config, "use_cache", False):
        raise GradAccConfigError(
            f"{name} has `config.use_cache=True`: with a cache transformers does not look for packed sequences and "
            "the samples of a row would attend to each other. Keep `use_cache=False` (`TrainingArguments.use_cache`, "
            "which `Trainer.__init__` copies to the model's config)."
        )
    if not probe:
        return
    if holds_whole_parameters(base):
        _probe_packing(base)
        return
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_PACKED_MODEL_TYPES:
        raise GradAccConfigError(
            f"{name} (model_type {model_type!r}) cannot be probed here (its parameters are sharded or on the meta "
            f"device) and is not one of the verified model types {sorted(VERIFIED_PACKED_MODEL_TYPES)}. Call "
            "check_packing_support before sharding it, or pass `probe=False` if you have checked it yourself."
        )
