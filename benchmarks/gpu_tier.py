"""The GPU tier in one command that fits 8 minutes on one H100 / H200: four sections, each with its own time budget,
one JSON and one markdown table under ``--out``.

    python benchmarks/gpu.py --tier --out tier/                     # on a GPU: ~6-7 minutes (budgets below)
    python benchmarks/gpu.py --tier --cpu-fallback --out tier/      # the same code at a tiny scale, on CPU, seconds
    python benchmarks/gpu_tier.py --sections lm_head --out tier/    # one section (or several: a,b,c,d)

Sections (``--sections``; letters or names):

a. ``exactness``: every head (causal LM, seq2seq, masked LM, token / sequence classification, image classification)
   trains one SGD(lr=1) step with GradAccTrainer (bs 2 x GA 4) in bf16 autocast and the SAME run in float32: the
   bf16 update against the float32 one (norm ratio within 5e-3 of 1; cosine and relative error reported), and both
   against the float64 full-batch reference of :mod:`hf_gradacc.testing.reference` (float32: relative error <= 1e-5,
   TF32 off).
b. ``device_reads``: what a training step reads back from the device, per optimizer step, GradAccTrainer (defaults,
   and ``fused_lm_head=True``) against the stock Trainer: the warnings of ``torch.cuda.set_sync_debug_mode("warn")``
   (CUDA only) and the calls that read a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
   ``nonzero``, boolean-mask indexing, ...; counted by a ``TorchFunctionMode``, also on CPU), with where they come
   from.
c. ``step_time``: the optimizer step's wall time, stock Trainer against GradAccTrainer (defaults, and
   ``fused_lm_head=True``), at GA 1 / 4 / 8 on a ~0.53B-parameter Llama built from a config (hidden 1024, 24 layers,
   vocabulary 128,256, untied), bf16 autocast, bs 8 of 256-512 tokens with the first 30 % of each ignored; 2 warm-up
   + 5 timed steps per run, the step time from one ``on_step_end`` to the next after a device synchronize.
d. ``lm_head``: the LM head's loss and its gradients at hidden x vocabulary 4096 x 128256, 3584 x 152064 and
   2304 x 256000 and 4k / 8k tokens (bf16, every seventh target ignored, SUM reduction): the full logits (upcast
   to float32 as transformers does), hf_gradacc's fused head (``fused_cross_entropy_sum``), torch's
   ``F.linear_cross_entropy`` (where this torch has it), Liger's fused linear cross-entropy (``liger_kernel``; the
   backend that ran is recorded) and Cut Cross-Entropy (``cut_cross_entropy``, its default ``cce`` and
   ``cce_exact``): forward + backward time (median of 3 after a warm-up), peak memory above the inputs, and the
   relative error of the loss and of both gradients against the float32 full logits (TF32 off). A package that is
   not installed is recorded as "not installed", never a failure.

Each section runs in its own process (``--in-process``: in this one) with a soft budget (no new case starts past
it: the case is recorded as skipped) and a hard one (the process is stopped; what it wrote so far is kept), within
``--total-budget`` (480 s). Written: ``OUT/gpu_tier.json`` (everything: environment, per section its status, time,
rows and verdicts), ``OUT/gpu_tier.md`` (the tables, also printed) and ``OUT/sections/<section>.json`` (each
section's own, written as it goes). Exit code 0: every section finished and every band held (a: both bands of
every head; b-d report, they hold no band); 1: a band missed, a section failed or was cut short; 2: no CUDA device
and no ``--cpu-fallback``. ``--cpu-fallback`` runs every section's code at a tiny scale on the CPU (bf16 autocast
on CPU; section d in float32 against float64; Liger and Cut Cross-Entropy "need CUDA"), in seconds:
tests/unit/test_gpu_tier_cpu.py runs it in CI. docs/benchmarks.md ("GPU tier") gives the wheels and the device
command line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

SECTIONS = ("exactness", "device_reads", "step_time", "lm_head")
LETTERS = dict(zip("abcd", SECTIONS))
BUDGETS_S = {"exactness": 70.0, "device_reads": 40.0, "step_time": 140.0, "lm_head": 140.0}
TOTAL_BUDGET_S = 480.0
START_GRACE_S = 45.0  # a section's process: imports and CUDA start-up before its soft budget starts counting
FP32_REL_ERR = 1e-5
BF16_NORM_RATIO_BAND = 5e-3
EXACTNESS_TASKS = (
    "causal_lm", "seq2seq", "masked_lm", "token_classification", "sequence_classification", "image_classification",
)  # fmt: skip
HEAD_METHODS = ("full_logits", "hf_gradacc_fused", "torch_linear_cross_entropy", "liger", "cce", "cce_exact")
FUSED_HEAD_MODULES = ("hf_gradacc.fused.head",)  # where the kernel is
HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero",
                        "masked_select", "unique", "unique_consecutive", "argwhere"})  # fmt: skip
IGNORE = -100


@dataclass(frozen=True, kw_only=True)
class Scale:
    """Everything that differs between the GPU tier and its CPU fallback; the code is the same."""

    device: str
    exact_hidden: int = 64
    exact_image_hidden: int = 32
    exact_samples: int = 8
    reads_config: dict[str, int] = field(default_factory=dict)
    reads_batch: int = 4
    reads_ga: int = 4
    reads_steps: int = 4
    reads_lengths: tuple[int, int] = (64, 256)
    step_config: dict[str, int] = field(default_factory=dict)
    step_gas: tuple[int, ...] = (1, 4, 8)
    step_batch: int = 8
    step_lengths: tuple[int, int] = (256, 512)
    step_warmup: int = 2
    step_timed: int = 5
    head_shapes: tuple[tuple[int, int], ...] = ((4096, 128256), (3584, 152064), (2304, 256000))
    head_tokens: tuple[int, ...] = (4096, 8192)
    head_dtype: str = "bfloat16"
    head_repeats: int = 3


GPU = Scale(
    device="cuda",
    reads_config=dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2),
    step_config=dict(vocab_size=128256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                     num_attention_heads=16, num_key_value_heads=4),
)  # fmt: skip
CPU = Scale(
    device="cpu",
    exact_hidden=32,
    exact_image_hidden=16,
    reads_config=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2),
    reads_batch=2,
    reads_ga=2,
    reads_steps=2,
    reads_lengths=(8, 24),
    step_config=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2),
    step_batch=1,
    step_lengths=(8, 16),
    step_warmup=1,
    step_timed=1,
    head_shapes=((64, 512), (48, 768), (32, 1000)),
    head_tokens=(64, 128),
    head_dtype="float32",
    head_repeats=1,
)  # fmt: skip


class Budget:
    """A soft deadline: ``over()`` once it has passed (no new case starts)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()

    def over(self) -> bool:
        return time.monotonic() - self.start > self.seconds

    def skipped(self, **row: Any) -> dict[str, Any]:
        return {**row, "status": f"skipped: the section's {self.seconds:.0f} s budget was spent"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    if device == "cuda":  # tensors in reference cycles (a trainer's) go now; on the CPU nothing waits for them
        gc.collect()
        torch.cuda.empty_cache()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _error(exc: BaseException) -> str:
    kind = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
    return f"error: {kind}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _lm_samples(num: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[dict[str, list[int]]]:
    """Causal-LM samples of random tokens, lengths uniform in ``lengths``, the first 30 % of each labelled -100."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        cut = int(0.3 * n)
        samples.append({"input_ids": ids, "labels": [IGNORE] * cut + ids[cut:]})
    return samples


def _llama(config: dict[str, int], device: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(max_position_embeddings=2048, pad_token_id=0, tie_word_embeddings=False, **config)
    with torch.device(device):
        return tf.LlamaForCausalLM(cfg)


def _train_args(stock: bool, scale: Scale, batch: int, ga: int, steps: int, **knobs: Any) -> Any:
    from transformers import TrainingArguments

    from hf_gradacc import GradAccConfig

    args_class = TrainingArguments if stock else GradAccConfig
    return args_class(
        output_dir=tempfile.mkdtemp(prefix="gpu_tier_"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga, max_steps=steps, learning_rate=1e-4, lr_scheduler_type="constant",
        logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True, bf16=True,
        use_cpu=scale.device == "cpu", seed=0, dataloader_drop_last=True, **knobs,
    )  # fmt: skip


# Rows of sections b and c: (name, stock Trainer?, GradAccConfig knobs)
TRAINER_ROWS = (("stock", True, {}), ("gradacc", False, {}), ("gradacc_fused", False, {"fused_lm_head": True}))


def _trainer(row: tuple[str, bool, dict], model: torch.nn.Module, samples: list, args: Any, callbacks: list) -> Any:
    from transformers import Trainer

    from hf_gradacc import GradAccTrainer
    from hf_gradacc.testing.tiny import ListDataset, PaddingCollator

    cls = Trainer if row[1] else GradAccTrainer
    return cls(model=model, args=args, train_dataset=ListDataset(samples), data_collator=PaddingCollator(),
               callbacks=callbacks)  # fmt: skip


class _OnStep(TrainerCallback):
    """Calls ``mark()`` when training starts and at the end of every optimizer step."""

    def __init__(self, mark: Callable[[], None]) -> None:
        self.mark = mark

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.mark()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.mark()


# ---------------------------------------------------------------------------------------------------------- a
def section_exactness(scale: Scale, budget: Budget, emit: Callable[[dict], None]) -> dict[str, Any]:
    """bf16 against the same run in float32, and float32 against the float64 reference, for every head."""
    from hf_gradacc import GradAccConfig, GradAccTrainer
    from hf_gradacc.testing.one_step import one_step_args, one_step_update
    from hf_gradacc.testing.reference import compare, reference_gradients
    from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_model, make_samples

    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows: list[dict[str, Any]] = []
    result = {"rows": rows, "tf32": False, "batch": "bs 2 x GA 4, one SGD(lr=1) step",
              "bands": {"fp32_vs_float64_rel_err_max": FP32_REL_ERR, "bf16_vs_fp32_norm_ratio_band": BF16_NORM_RATIO_BAND}}  # fmt: skip
    try:
        for task in EXACTNESS_TASKS:
            if budget.over():
                rows.append(budget.skipped(task=task))
                continue
            try:
                hidden = scale.exact_image_hidden if task == "image_classification" else scale.exact_hidden
                model = build_tiny_model(task, hidden_size=hidden)
                samples = make_samples(task, scale.exact_samples, seed=11)

                def args(**over: Any) -> Any:
                    return one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                         args_class=GradAccConfig, use_cpu=scale.device == "cpu", **over)  # fmt: skip

                fp32, _ = one_step_update(GradAccTrainer, model, samples, args())
                bf16, _ = one_step_update(GradAccTrainer, model, samples, args(bf16=True))
                reference = reference_gradients(model, samples, task, PaddingCollator())
                f_ref, b_ref, b_f = compare(fp32, reference), compare(bf16, reference), compare(bf16, fp32)
                rows.append({
                    "task": task, "parameters": sum(p.numel() for p in model.parameters()),
                    "fp32_vs_float64": asdict(f_ref), "bf16_vs_float64": asdict(b_ref), "bf16_vs_fp32": asdict(b_f),
                    "fp32_exact": f_ref.relative_error <= FP32_REL_ERR,
                    "bf16_norm_within_band": abs(b_f.norm_ratio - 1.0) <= BF16_NORM_RATIO_BAND, "status": "ok",
                })  # fmt: skip
            except Exception as exc:  # one head's failure is a row, not the end of the section
                rows.append({"task": task, "status": _error(exc)})
            emit(result)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    measured = [r for r in rows if r.get("status") == "ok"]
    result["bands_held"] = all(r["fp32_exact"] and r["bf16_norm_within_band"] for r in measured) if measured else None
    result["rows_ok"] = all(r.get("status") == "ok" for r in rows)
    return result


# ---------------------------------------------------------------------------------------------------------- b
class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host (each one waits for the device on CUDA), by name and
    by the line that called them."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_name: Counter[str] = Counter()
        self.by_line: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if name in HOST_READS or _is_mask_index(name, args) or _is_device_to_host(name, args, kwargs):
            self.total += 1
            self.by_name[name] += 1
            frame = sys._getframe(1)
            self.by_line[f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


def _is_mask_index(name: str, args: tuple) -> bool:
    if name not in ("__getitem__", "__setitem__") or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)


def _is_device_to_host(name: str, args: tuple, kwargs: dict | None) -> bool:
    if name not in ("cpu", "to") or not args or not torch.is_tensor(args[0]) or args[0].device.type == "cpu":
        return False
    return name == "cpu" or "cpu" in {str(a) for a in (*args[1:], *(kwargs or {}).values())}


def _short(filename: str) -> str:
    for marker in ("site-packages/", "hf_gradacc/", "benchmarks/"):
        if marker in filename:
            return (marker if marker != "site-packages/" else "") + filename.split(marker, 1)[1]
    return filename


def section_device_reads(scale: Scale, budget: Budget, emit: Callable[[dict], None]) -> dict[str, Any]:
    """Sync warnings (CUDA) and host reads per optimizer step, per trainer row."""
    cuda = scale.device == "cuda"
    rows: list[dict[str, Any]] = []
    result = {"rows": rows, "model": dict(scale.reads_config), "batch": f"bs {scale.reads_batch} x GA {scale.reads_ga}",
              "steps": scale.reads_steps, "sync_debug_mode": "warn" if cuda else "n/a (no CUDA)"}  # fmt: skip
    base = _llama(scale.reads_config, scale.device)
    samples = _lm_samples(scale.reads_batch * scale.reads_ga * scale.reads_steps, scale.reads_config["vocab_size"],
                          scale.reads_lengths, seed=1)  # fmt: skip
    for row in TRAINER_ROWS:
        if budget.over():
            rows.append(budget.skipped(trainer=row[0]))
            continue
        try:
            rows.append(_count_reads(row, base, samples, scale))
        except Exception as exc:
            rows.append({"trainer": row[0], "status": _error(exc)})
        _free(scale.device)
        emit(result)
    result["rows_ok"] = all(r.get("status") == "ok" for r in rows)
    return result


def _count_reads(row: tuple[str, bool, dict], base: torch.nn.Module, samples: list, scale: Scale) -> dict[str, Any]:
    import warnings

    cuda = scale.device == "cuda"
    reads, marks = HostReads(), []
    args = _train_args(row[1], scale, scale.reads_batch, scale.reads_ga, scale.reads_steps, **row[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(row, copy.deepcopy(base), samples, args, [_OnStep(lambda: marks.append((len(caught), reads.total)))])
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with reads:
                trainer.train()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [i for i, w in enumerate(caught) if "synchroniz" in str(w.message).lower()]
    per_step_syncs = [sum(a <= i < b for i in syncs) for (a, _), (b, _) in zip(marks, marks[1:])]
    per_step_reads = [b - a for (_, a), (_, b) in zip(marks, marks[1:])]
    after_first = [caught[i] for i in syncs if len(marks) > 1 and i >= marks[1][0]]
    lines = Counter(f"{_short(w.filename)}:{w.lineno}" for w in after_first)
    return {
        "trainer": row[0], "status": "ok", "steps": len(per_step_reads),
        "sync_warnings_per_step": per_step_syncs if cuda else None,
        "sync_warnings_steady": statistics.median(per_step_syncs[1:]) if cuda and len(per_step_syncs) > 1 else None,
        "host_reads_per_step": per_step_reads,
        "host_reads_steady": statistics.median(per_step_reads[1:]) if len(per_step_reads) > 1 else None,
        "host_reads_by_name": dict(reads.by_name.most_common()),
        "host_read_lines_top": dict(reads.by_line.most_common(8)),
        "sync_lines_top_after_step_1": dict(lines.most_common(8)),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- c
def section_step_time(scale: Scale, budget: Budget, emit: Callable[[dict], None]) -> dict[str, Any]:
    """Step wall time, stock Trainer against GradAccTrainer, at each GA, on the ~0.5B Llama."""
    device = scale.device
    rows: list[dict[str, Any]] = []
    base = _llama(scale.step_config, device)
    result = {"rows": rows, "model": dict(scale.step_config), "parameters": sum(p.numel() for p in base.parameters()),
              "batch_size": scale.step_batch, "lengths": list(scale.step_lengths), "warmup_steps": scale.step_warmup,
              "timed_steps": scale.step_timed, "precision": "bf16 autocast, float32 weights, AdamW"}  # fmt: skip
    steps = scale.step_warmup + scale.step_timed
    for ga in scale.step_gas:
        samples = _lm_samples(scale.step_batch * ga * steps, scale.step_config["vocab_size"], scale.step_lengths,
                              seed=ga)  # fmt: skip
        real_tokens = sum(len(s["input_ids"]) for s in samples) / steps
        stock_ms = None
        for row in TRAINER_ROWS:
            if budget.over():
                rows.append(budget.skipped(ga=ga, trainer=row[0]))
                continue
            try:
                rows.append(_time_steps(row, base, samples, scale, ga, real_tokens, stock_ms))
                stock_ms = rows[-1]["step_ms_median"] if row[0] == "stock" else stock_ms
            except Exception as exc:
                rows.append({"ga": ga, "trainer": row[0], "status": _error(exc)})
            _free(device)
            emit(result)
    result["rows_ok"] = all(r.get("status") == "ok" for r in rows)
    return result


def _time_steps(row: tuple[str, bool, dict], base: torch.nn.Module, samples: list, scale: Scale, ga: int,
                real_tokens: float, stock_ms: float | None) -> dict[str, Any]:  # fmt: skip
    device, stamps = scale.device, []

    def stamp() -> None:
        _sync(device)
        stamps.append(time.perf_counter())

    args = _train_args(row[1], scale, scale.step_batch, ga, scale.step_warmup + scale.step_timed, **row[2])
    trainer = _trainer(row, copy.deepcopy(base), samples, args, [_OnStep(stamp)])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    median = statistics.median(times[scale.step_warmup :])
    stock_ms = median if row[0] == "stock" else stock_ms
    return {
        "ga": ga, "trainer": row[0], "status": "ok", "step_ms": [round(t, 2) for t in times], "step_ms_median": median,
        "ratio_vs_stock": median / stock_ms if stock_ms else None, "real_tokens_per_s": real_tokens / (median / 1e3),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- d
def fused_head_kernel() -> tuple[Callable | None, str]:
    """hf_gradacc's ``fused_cross_entropy_sum`` wherever the package keeps it now, and the module it came from."""
    import pkgutil

    import hf_gradacc

    names = list(FUSED_HEAD_MODULES)
    for info in pkgutil.iter_modules(hf_gradacc.__path__, "hf_gradacc."):
        if "fused" in info.name and info.ispkg:
            module = importlib.import_module(info.name)
            names += [i.name for i in pkgutil.iter_modules(module.__path__, info.name + ".")]
        elif "fused" in info.name:
            names.append(info.name)
    for name in dict.fromkeys(names):
        with contextlib.suppress(ImportError):
            fn = getattr(importlib.import_module(name), "fused_cross_entropy_sum", None)
            if callable(fn):
                return fn, name
    return None, f"not found (looked in {', '.join(dict.fromkeys(names))})"


def head_methods(device: str) -> dict[str, tuple[Callable | None, str]]:
    """Each method of section d: ``loss(hidden, weight, targets)`` (SUM over counted rows) and what ran, or None and
    why it cannot run here."""
    import torch.nn.functional as F

    def full_logits(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE, reduction="sum")

    methods: dict[str, tuple[Callable | None, str]] = {"full_logits": (full_logits, "F.linear + float32 cross_entropy")}
    kernel, where = fused_head_kernel()
    if kernel is None:
        methods["hf_gradacc_fused"] = (None, where)
    else:

        def fused(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            head.weight = w
            return kernel(h, head.forward, t)  # as the trainer calls it: the head's bound forward

        methods["hf_gradacc_fused"] = (fused, f"{where}.fused_cross_entropy_sum")
    if not hasattr(F, "linear_cross_entropy"):
        methods["torch_linear_cross_entropy"] = (None, f"not in torch {torch.__version__}")
    else:
        options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
        extra = {"options": options()} if options is not None else {}

        def torch_lce(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.linear_cross_entropy(h, w, t, reduction="sum", ignore_index=IGNORE, **extra)

        path = "chunked (LinearCrossEntropyOptions)" if extra else "default path (no LinearCrossEntropyOptions)"
        methods["torch_linear_cross_entropy"] = (torch_lce, f"torch {torch.__version__}, {path}")
    methods["liger"] = _liger(device)
    methods.update(_cce(device))
    return methods


def _liger(device: str) -> tuple[Callable | None, str]:
    if importlib.util.find_spec("liger_kernel") is None:
        return None, "not installed"
    if device != "cuda":
        return None, f"needs CUDA (Triton); liger-kernel {_version('liger-kernel')} installed"
    try:
        import liger_kernel.transformers.functional as lf
    except Exception as exc:
        return None, f"installed, import failed: {_error(exc)}"
    cls = getattr(lf, "LigerFusedLinearCrossEntropyFunction", None)
    impl = os.environ.get("LIGER_KERNEL_IMPL") or "unset (default kernels)"
    ran = f"{cls.__module__}.{cls.__qualname__}" if cls is not None else "unknown"

    def liger(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = lf.liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE, reduction="sum")
        return out[0] if isinstance(out, tuple) else out

    return liger, f"liger-kernel {_version('liger-kernel')}: {ran}, LIGER_KERNEL_IMPL {impl}"


def _cce(device: str) -> dict[str, tuple[Callable | None, str]]:
    if importlib.util.find_spec("cut_cross_entropy") is None:
        return {"cce": (None, "not installed"), "cce_exact": (None, "not installed")}
    if device != "cuda":
        why = f"needs CUDA (Triton); cut-cross-entropy {_version('cut-cross-entropy')} installed"
        return {"cce": (None, why), "cce_exact": (None, why)}
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:
        why = f"installed, import failed: {_error(exc)}"
        return {"cce": (None, why), "cce_exact": (None, why)}

    def cce(impl: str) -> Callable:
        return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE, reduction="sum", impl=impl)

    version = _version("cut-cross-entropy")
    return {"cce": (cce("cce"), f"cut-cross-entropy {version}, impl cce (gradient filtering on)"),
            "cce_exact": (cce("cce_exact"), f"cut-cross-entropy {version}, impl cce_exact")}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _head_case(hidden: int, vocab: int, tokens: int, scale: Scale, methods: dict, seed: int) -> list[dict[str, Any]]:
    device, dtype = scale.device, getattr(torch, scale.head_dtype)
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    g = torch.Generator(device).manual_seed(seed)
    w0 = (torch.randn(vocab, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    h0 = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    t[::7] = IGNORE
    h_ref, w_ref = h0.to(ref_dtype).requires_grad_(), w0.to(ref_dtype).requires_grad_()
    loss_ref = torch.nn.functional.cross_entropy(h_ref @ w_ref.T, t, ignore_index=IGNORE, reduction="sum")
    loss_ref.backward()
    ref = (loss_ref.detach(), h_ref.grad, w_ref.grad)
    del h_ref, w_ref, loss_ref
    _free(device)
    rows = []
    for name in HEAD_METHODS:
        fn, what = methods[name]
        row: dict[str, Any] = {"hidden": hidden, "vocab": vocab, "tokens": tokens, "method": name, "ran": what}
        if fn is None:
            rows.append({**row, "status": what})
            continue
        try:
            row.update(_time_method(fn, h0, w0, t, ref, scale))
        except Exception as exc:
            row["status"] = _error(exc)
        _free(device)
        rows.append(row)
    full = next((r for r in rows if r["method"] == "full_logits" and r.get("status") == "ok"), None)
    for r in rows:
        if full is not None and r.get("status") == "ok":
            r["time_vs_full_logits"] = r["ms_median"] / full["ms_median"]
            if r.get("peak_mib") is not None and full.get("peak_mib"):
                r["peak_vs_full_logits"] = r["peak_mib"] / full["peak_mib"]
    return rows


def _time_method(fn: Callable, h0: torch.Tensor, w0: torch.Tensor, t: torch.Tensor, ref: tuple, scale: Scale) -> dict:
    device = scale.device
    h = h0.clone().requires_grad_()
    w = torch.nn.Parameter(w0.clone())
    times, peak = [], None
    for i in range(1 + scale.head_repeats):  # the first is a warm-up (kernel compilation)
        h.grad = w.grad = None
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = fn(h, w, t)
        loss.backward()
        _sync(device)
        if i:
            times.append(1e3 * (time.perf_counter() - start))
            if device == "cuda":
                peak = max(peak or 0.0, (torch.cuda.max_memory_allocated() - before) / 2**20)
    return {
        "status": "ok", "ms_median": statistics.median(times), "ms_all": [round(x, 3) for x in times],
        "peak_mib": peak, "loss_rel_err": _rel(loss.detach(), ref[0]), "grad_hidden_rel_err": _rel(h.grad, ref[1]),
        "grad_weight_rel_err": _rel(w.grad, ref[2]),
    }  # fmt: skip


def section_lm_head(scale: Scale, budget: Budget, emit: Callable[[dict], None]) -> dict[str, Any]:
    """The LM head's methods at each hidden x vocabulary and token count."""
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    methods = head_methods(scale.device)
    rows: list[dict[str, Any]] = []
    result = {"rows": rows, "dtype": scale.head_dtype, "repeats": scale.head_repeats, "tf32": False,
              "reference": "float64 full logits" if scale.head_dtype == "float32" else "float32 full logits",
              "methods": {k: v[1] for k, v in methods.items()}, "ignored_targets": "every 7th"}  # fmt: skip
    try:
        for i, (hidden, vocab) in enumerate(scale.head_shapes):
            for tokens in scale.head_tokens:
                if budget.over():
                    rows.append(budget.skipped(hidden=hidden, vocab=vocab, tokens=tokens))
                    continue
                try:
                    rows.extend(_head_case(hidden, vocab, tokens, scale, methods, seed=i))
                except Exception as exc:
                    rows.append({"hidden": hidden, "vocab": vocab, "tokens": tokens, "status": _error(exc)})
                _free(scale.device)
                emit(result)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    # the optional packages' rows may fail (recorded); the full logits and hf_gradacc's head must run in every case
    result["rows_ok"] = all(r.get("status") == "ok" for r in rows if r.get("method") in ("full_logits", "hf_gradacc_fused"))
    return result


RUNNERS: dict[str, Callable[[Scale, Budget, Callable[[dict], None]], dict[str, Any]]] = {
    "exactness": section_exactness, "device_reads": section_device_reads, "step_time": section_step_time,
    "lm_head": section_lm_head,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- driver
def environment(scale: Scale) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(), "machine": platform.machine(), "device": scale.device,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        **{d: _version(d) for d in ("transformers", "accelerate", "hf_gradacc", "liger-kernel", "cut-cross-entropy",
                                    "triton")},
    }  # fmt: skip
    if env["hf_gradacc"] is None:  # run from a checkout that is not installed (the device machine)
        import hf_gradacc

        env["hf_gradacc"] = hf_gradacc.__version__
    if scale.device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(Exception):
        root = Path(__file__).resolve().parents[1]
        env["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None  # fmt: skip
    return env


def run_section(name: str, scale: Scale, out: Path, budget_s: float) -> dict[str, Any]:
    """Run one section here, writing ``out/sections/<name>.json`` after every case and at the end."""
    path = out / "sections" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def emit(partial: dict, status: str = "running") -> None:
        record = {"section": name, "status": status, "seconds": time.monotonic() - start, "budget_s": budget_s,
                  **partial}  # fmt: skip
        path.write_text(json.dumps(record, indent=1, default=str))

    try:
        result = RUNNERS[name](scale, Budget(budget_s), emit)
        status = "ok" if not any(str(r.get("status", "ok")).startswith("skipped") for r in result["rows"]) else "cut"
    except Exception as exc:
        result, status = {"rows": []}, _error(exc)
    emit(result, status)
    return json.loads(path.read_text())


def _worker(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int | None, float]:
    """Run ``cmd``; its exit code (None: stopped at ``timeout``) and wall seconds."""
    start = time.monotonic()
    try:
        code = subprocess.run(cmd, timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - start


def run_all(sections: list[str], scale: Scale, out: Path, *, in_process: bool, total_s: float,
            cpu_fallback: bool) -> dict[str, Any]:  # fmt: skip
    results: dict[str, Any] = {}
    start = time.monotonic()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    for name in sections:
        left = total_s - (time.monotonic() - start)
        budget = BUDGETS_S[name]
        if left < 20:
            results[name] = {"section": name, "status": f"skipped: {total_s:.0f} s total budget spent", "rows": []}
            continue
        if in_process:
            results[name] = run_section(name, scale, out, min(budget, left))
            continue
        path = out / "sections" / f"{name}.json"
        path.unlink(missing_ok=True)  # a file left by an earlier run must not stand in for this one's
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--out", str(out), "--budget",
               str(min(budget, left - 10))] + (["--cpu-fallback"] if cpu_fallback else [])  # fmt: skip
        code, wall = _worker(cmd, min(budget + START_GRACE_S, left), env)
        record = json.loads(path.read_text()) if path.exists() else {"section": name, "rows": []}
        if code is None:
            record["status"] = f"stopped at the hard limit ({min(budget + START_GRACE_S, left):.0f} s); rows so far kept"
        elif code != 0:
            record["status"] = f"failed: exit code {code} (its output is in the log above)"
        record["process_seconds"] = wall
        results[name] = record
    return results


def verdict(record: dict[str, Any]) -> bool:
    """The section finished, its bands held (a) and its rows ran (b-d; in d the full logits' and hf_gradacc's)."""
    return record.get("status") == "ok" and record.get("bands_held") is not False and record.get("rows_ok") is not False


def _verdict_text(record: dict[str, Any]) -> str:
    if record.get("bands_held") is False:
        return "**bands not held**"
    if record.get("status") != "ok":
        return "**cut short**" if record.get("status") == "cut" or "stopped" in str(record.get("status")) else "**failed**"
    if record.get("rows_ok") is False:
        return "**a row failed**"
    return "bands held" if record.get("bands_held") else "ran"


def _fmt(x: Any, spec: str = ".2e", unit: str = "") -> str:
    if x is None:
        return "-"
    return (format(x, spec) if isinstance(x, (float, int)) and spec else str(x)) + unit


def markdown(report: dict[str, Any]) -> str:
    env, sections = report["environment"], report["sections"]
    lines = [f"# GPU tier, {env['date']}", "",
             f"{env.get('gpu') or env['device']}; torch {env['torch']} (CUDA {env['cuda']}), transformers "
             f"{env['transformers']}, accelerate {env['accelerate']}, liger-kernel {env['liger-kernel']}, "
             f"cut-cross-entropy {env['cut-cross-entropy']}, hf_gradacc {env['hf_gradacc']} ({env.get('commit')})"
             f"{'; CPU FALLBACK (tiny scale)' if report['cpu_fallback'] else ''}", "",
             "| section | status | seconds | budget | verdict |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, r in sections.items():
        lines.append(f"| {name} | {r.get('status')} | {_fmt(r.get('seconds'), '.1f')} | {_fmt(r.get('budget_s'), '.0f')} | {_verdict_text(r)} |")  # fmt: skip
    if "exactness" in sections:
        lines += ["", "## a. exactness: bf16 against the same run in float32, float32 against float64", "",
                  "| head | fp32 vs float64 rel err | bf16/fp32 norm ratio - 1 | bf16 vs fp32 cosine | bf16 vs fp32 rel err | bf16 vs float64 rel err | bands |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in sections["exactness"].get("rows", []):
            if r.get("status") != "ok":
                lines.append(f"| {r['task']} | {r.get('status')} | | | | | |")
                continue
            f, b, bf = r["fp32_vs_float64"], r["bf16_vs_float64"], r["bf16_vs_fp32"]
            ok = "yes" if r["fp32_exact"] and r["bf16_norm_within_band"] else "**no**"
            lines.append(f"| {r['task']} | {f['relative_error']:.2e} | {bf['norm_ratio'] - 1:+.2e} | {bf['cosine']:.6f} | {bf['relative_error']:.2e} | {b['relative_error']:.2e} | {ok} |")  # fmt: skip
    if "device_reads" in sections:
        lines += ["", "## b. device reads per optimizer step (steady: median of steps 2..N)", "",
                  "| trainer | sync warnings / step (steady) | per step | host reads / step (steady) | per step | most frequent reads |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in sections["device_reads"].get("rows", []):
            if r.get("status") != "ok":
                lines.append(f"| {r['trainer']} | {r.get('status')} | | | | |")
                continue
            top = ", ".join(f"{k} x{v}" for k, v in list(r["host_reads_by_name"].items())[:4])
            lines.append(f"| {r['trainer']} | {_fmt(r['sync_warnings_steady'], 'g')} | {_fmt(r['sync_warnings_per_step'])} | {_fmt(r['host_reads_steady'], 'g')} | {r['host_reads_per_step']} | {top} |")  # fmt: skip
    if "step_time" in sections:
        s = sections["step_time"]
        lines += ["", f"## c. step time: Llama of {_fmt(s.get('parameters'), ',')} parameters, bs {s.get('batch_size')}", "",
                  "| GA | trainer | step (median) | vs stock | real tokens / s | peak allocated |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in s.get("rows", []):
            if r.get("status") != "ok":
                lines.append(f"| {r['ga']} | {r['trainer']} | {r.get('status')} | | | |")
                continue
            lines.append(f"| {r['ga']} | {r['trainer']} | {r['step_ms_median']:.1f} ms | {_fmt(r['ratio_vs_stock'], '.3f')} | {r['real_tokens_per_s']:,.0f} | {_fmt(r['peak_allocated_gib'], '.2f', ' GiB')} |")  # fmt: skip
    if "lm_head" in sections:
        s = sections["lm_head"]
        lines += ["", f"## d. LM head: {s.get('dtype')}, forward + backward, errors against the {s.get('reference')}", "",
                  "| hidden x vocab | tokens | method | time (median) | vs full logits | peak above inputs | vs full logits | loss rel err | grad hidden rel err | grad weight rel err |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in s.get("rows", []):
            shape = f"{r.get('hidden')} x {r.get('vocab')}"
            if r.get("status") != "ok":
                lines.append(f"| {shape} | {r.get('tokens')} | {r.get('method', '-')} | {r.get('status')} | | | | | | |")
                continue
            lines.append(f"| {shape} | {r['tokens']} | {r['method']} | {r['ms_median']:.2f} ms | {_fmt(r.get('time_vs_full_logits'), '.2f', 'x')} | {_fmt(r['peak_mib'], ',.0f', ' MiB')} | {_fmt(r.get('peak_vs_full_logits'), '.2f', 'x')} | {r['loss_rel_err']:.1e} | {r['grad_hidden_rel_err']:.1e} | {r['grad_weight_rel_err']:.1e} |")  # fmt: skip
        lines += ["", "What ran: " + "; ".join(f"{k}: {v}" for k, v in s.get("methods", {}).items())]
    return "\n".join(lines) + "\n"


def _sections(text: str) -> list[str]:
    names = [LETTERS.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}: choose from a-d or {', '.join(SECTIONS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_tier.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_tier", help="folder for gpu_tier.json, gpu_tier.md and sections/")
    p.add_argument("--cpu-fallback", action="store_true", help="every section at a tiny scale on the CPU")
    p.add_argument("--sections", type=_sections, default=list(SECTIONS), help="a,b,c,d or their names (default all)")
    p.add_argument("--in-process", action="store_true", help="run the sections in this process (tests)")
    p.add_argument("--total-budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all sections together")
    p.add_argument("--tier", action="store_true", help=argparse.SUPPRESS)  # benchmarks/gpu.py passes it on
    p.add_argument("--worker", choices=SECTIONS, help=argparse.SUPPRESS)  # one section, in a process of its own
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scale = CPU if args.cpu_fallback else GPU
    out = Path(args.out)
    if args.worker:
        run_section(args.worker, scale, out, args.budget or BUDGETS_S[args.worker])
        return 0
    if not args.cpu_fallback and not torch.cuda.is_available():
        print("benchmarks/gpu_tier.py needs a CUDA device (torch.cuda.is_available() is False); --cpu-fallback runs "
              "every section at a tiny scale on the CPU.", file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    sections = run_all(args.sections, scale, out, in_process=args.in_process, total_s=args.total_budget,
                       cpu_fallback=args.cpu_fallback)  # fmt: skip
    report = {"environment": environment(scale), "cpu_fallback": args.cpu_fallback, "scale": asdict(scale),
              "seconds": time.monotonic() - start, "sections": sections,
              "all_held": all(verdict(r) for r in sections.values())}  # fmt: skip
    (out / "gpu_tier.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "gpu_tier.md").write_text(text)
    print(text)
    print(f"benchmarks/gpu_tier.py: {report['seconds']:.0f} s; wrote {out / 'gpu_tier.json'} and {out / 'gpu_tier.md'}")
    return 0 if report["all_held"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
