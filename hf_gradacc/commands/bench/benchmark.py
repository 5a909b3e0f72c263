"""`hf-gradacc bench`: what users would pick instead — the stock `Trainer` (random order, `group_by_length`,
`batch_rebalance`, padding-free `DataCollatorWithFlattening`) — against `GradAccTrainer` (plain, regrouped, token
budget, packed, and the last two with the fused LM head), in ONE run.

Every trainer trains its own copy of the same model on the same samples in the same order (same seed, so every
optimizer step holds the same samples). The trainers run side by side, one optimizer step at a time, in turns that
rotate every round: step ``s`` of every trainer runs within the same few seconds, so machine noise hits them alike,
and each step time is compared with the stock Trainer's step ``s`` (the median of those pair ratios is reported).

Columns:

* step time ratio: median over timed steps of (trainer's step time / stock step time), pair by pair;
* CPU time ratio: the same with the process's CPU time over each step (``time.process_time``: one trainer runs at a
  time, so it is that trainer's; less moved by other processes on a busy machine than the wall time), summed over
  every rank on several processes (each rank's own times are kept in ``step_cpu_times_per_rank_s``);
* total CPU time ratio: sum of timed steps' CPU time / the stock sum (what ``benchmarks/targets.py`` judges);
* total time ratio: sum of timed step times / the stock sum;
* computed / real tokens: token positions the model computed (``input_ids`` size: padding included) per real token;
* peak memory: the largest increase of memory within one step, EVERY step included (the first one, with its
  start-up loss check and the optimizer state it allocates, too): CPU, the resident set size high-water mark, reset
  before each step; CUDA, ``max_memory_allocated``; and its ratio over the stock one;
* LM-head rows per counted target: rows the model's output layer computed (its input's rows, counted by a forward
  hook) per target that counts in the loss (labels that are not -100, after the causal shift); 1.00 is the limit,
  where the head runs only where a target counts;
* reductions / step: DDP gradient reductions (comm-hook calls) per optimizer step; ``n/a`` on one process;
* update diff: relative L2 difference of the final parameters' change from the plain GradAccTrainer's.

The command line is ``hf-gradacc bench`` (:mod:`hf_gradacc.commands.bench`).

Example:
    ```python
    from hf_gradacc.commands.bench.bench_report import format_table
    from hf_gradacc.commands.bench.benchmark import BenchSettings, run_benchmark

    rows = run_benchmark(BenchSettings(num_steps=3))
    print(format_table(rows))
    ```
"""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import logging
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...compat import has_sampling_strategy
from ...errors import GradAccConfigError, GradAccUsageError  # noqa: F401
from . import bench_moe

logger = logging.getLogger(__name__)

# equal lengths; long-tailed lengths with a random prompt prefix of up to 30 % ignored; long-tailed lengths with the
# first half of every sample ignored (completion-only fine-tuning: the prompt carries no target).
DATASETS: tuple[str, ...] = ("equal", "long_tailed", "completion_only")
QWEN_VOCAB_SIZE = 151_936  # the vocabulary of the Qwen2 / Qwen2.5 / Qwen3 models: where the LM head dominates memory
TRAINERS: tuple[str, ...] = (
    "stock",
    "stock_group_by_length",
    "stock_batch_rebalance",
    "stock_flatten",
    "plain",
    "regroup",
    "budget",
    "pack",
)
_TRAINER_LABELS = {
    "stock": "Trainer (stock)",
    "stock_group_by_length": "Trainer, group_by_length",
    "stock_batch_rebalance": "Trainer, batch_rebalance",
    "stock_flatten": "Trainer, DataCollatorWithFlattening",
    "plain": "GradAccTrainer",
    "regroup": "GradAccTrainer + regroup",
    "budget": "GradAccTrainer + token budget",
    "pack": "GradAccTrainer + packed",
    "fused": "GradAccTrainer + fused LM head",
    "budget_fused": "GradAccTrainer + token budget + fused LM head",
    "pack_fused": "GradAccTrainer + packed + fused LM head",
    "stock_liger": "Trainer, Liger kernels (fused linear cross-entropy)",
    **bench_moe.MOE_LABELS,
}
# Every trainer a run can name; the ``fused`` ones (``fused_lm_head=True``: alone, with the token budget, packed) are
# not in the default set yet. ``stock_liger``: the stock Trainer with ``use_liger_kernel=True`` (Liger-Kernel's
# Triton kernels, its fused linear cross-entropy among them: a GPU and the ``liger-kernel`` package). The ``moe``
# rows (router_balance, hf_gradacc.commands.bench.bench_moe) make every row of their run train a tiny Mixtral.
ALL_TRAINERS: tuple[str, ...] = (
    *TRAINERS,
    "fused",
    "budget_fused",
    "pack_fused",
    "stock_liger",
    *bench_moe.MOE_TRAINERS,
)


def describe_trainers() -> str:
    """What ``hf-gradacc bench`` compares, from the rows' labels: one source for its help and the top-level help."""
    stock = [_TRAINER_LABELS[n].split(", ", 1)[1] for n in ALL_TRAINERS if n.startswith("stock_")]
    ours = [
        _TRAINER_LABELS[n].replace("GradAccTrainer", "", 1).strip() or "plain"
        for n in ALL_TRAINERS
        if not n.startswith("stock")
    ]
    return (
        f"time the stock Trainer (as is; {'; '.join(stock)}) against GradAccTrainer ({'; '.join(ours)}), one "
        "optimizer step per trainer in turn, in one run"
    )


# The stock samplers of transformers 5.23 (`train_sampling_strategy`) each stock variant uses.
_STOCK_SAMPLING = {"stock_group_by_length": "group_by_length", "stock_batch_rebalance": "batch_rebalance"}
_TURN_TIMEOUT_S = 1800.0  # a step that takes longer than this is a hang, not a measurement


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    """What to measure. The defaults are the CPU scale of the issue: tiny causal LM, bs 8 x GA 8.

    Lengths: ``equal`` samples all have ``equal_length`` tokens; ``long_tailed`` ones are log-normal with median
    ``median_length`` and shape ``sigma``, clipped to ``[min_length, max_length]``; ``completion_only`` ones have
    the long-tailed lengths with the first half of every sample labelled -100.

    Budgets: ``budget`` trainers get ``max_tokens_per_micro_batch``; ``pack`` trainers ``pack_max_tokens``, whose
    default ``None`` is what ``pack_micro_batches=True`` alone does (per step, the padded size of the step's largest
    stock micro-batch).
    """

    device: str = "cpu"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    vocab_size: int = 96
    vocab_sizes: tuple[int, ...] = ()  # several models, one per vocabulary size (empty: `vocab_size` alone)
    bf16: bool = False
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 8
    num_steps: int = 6
    num_warmup_steps: int = 1
    equal_length: int = 100
    median_length: int = 100
    sigma: float = 1.0
    min_length: int = 8
    max_length: int = 1024
    max_tokens_per_micro_batch: int = 1024
    pack_max_tokens: int | None = None  # the packed rows' budget; None: the trainer's default (see below)
    learning_rate: float = 1e-4
    seed: int = 0
    num_threads: int | None = 1
    datasets: tuple[str, ...] = DATASETS
    trainers: tuple[str, ...] = TRAINERS


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRow:
    """One trainer on one dataset."""

    dataset: str
    trainer: str
    vocab_size: int
    median_step_time_s: float
    step_time_ratio: float
    total_time_ratio: float
    computed_per_real_token: float
    peak_memory_bytes: int
    peak_memory_ratio: float
    reductions_per_step: float | None
    micro_batches_per_step: float
    relative_update_difference: float | None
    real_tokens_per_s: float = float("nan")
    first_step_peak_memory_bytes: int = 0
    lm_head_rows_per_target: float = float("nan")
    step_times_s: tuple[float, ...] = field(default=())
    step_peaks_bytes: tuple[int, ...] = field(default=())
    median_step_cpu_time_s: float = float("nan")
    cpu_time_ratio: float = float("nan")
    step_cpu_times_s: tuple[float, ...] = field(default=())
    total_cpu_time_ratio: float = float("nan")
    step_cpu_times_per_rank_s: tuple[tuple[float, ...], ...] = field(default=())


# ---------------------------------------------------------------------------------------------- data and model
def make_bench_samples(settings: BenchSettings, dataset: str, num_samples: int) -> list[dict[str, Any]]:
    """Causal-LM samples with ``equal`` or long-tailed lengths; a random prompt prefix of each row is ignored (up to
    30 %), or its first half (``completion_only``)."""
    if dataset not in DATASETS:
        raise GradAccConfigError(f"`dataset` ({dataset!r}) must be one of {DATASETS}")
    g = torch.Generator().manual_seed(settings.seed + (0 if dataset == "equal" else 1))
    samples = []
    for _ in range(num_samples):
        if dataset == "equal":
            length = settings.equal_length
        else:
            z = float(torch.randn((), generator=g))
            length = int(round(settings.median_length * math.exp(settings.sigma * z)))
            length = min(settings.max_length, max(settings.min_length, length))
        ids = torch.randint(2, settings.vocab_size, (length,), generator=g).tolist()
        prompt = int(length * 0.3 * float(torch.rand((), generator=g)))
        if dataset == "completion_only":
            prompt = length // 2
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return samples


def build_bench_model(settings: BenchSettings) -> torch.nn.Module:
    """A randomly initialised Llama causal LM of the requested size (dropout off, positions up to max_length); a
    Mixtral of that size where ``settings.trainers`` names a mixture-of-experts row (:mod:`.bench_moe`)."""
    import transformers as tf

    dims = {
        "vocab_size": settings.vocab_size,
        "hidden_size": settings.hidden_size,
        "intermediate_size": 2 * settings.hidden_size,
        "num_hidden_layers": settings.num_layers,
        "num_attention_heads": settings.num_heads,
        "num_key_value_heads": max(1, settings.num_heads // 2),
        "max_position_embeddings": max(settings.max_length, settings.equal_length),
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(settings.seed)
    if bench_moe.uses_moe(settings.trainers):
        return bench_moe.build_bench_moe_model(dims)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**dims))


# ---------------------------------------------------------------------------------------------- probes
# What the bench measures besides wall time: the peak memory within a step (MemoryProbe) and every rank's
# process CPU time (cpu_times_of_every_rank), which a busy machine does not inflate the way it inflates wall time.
class MemoryProbe:
    """Peak memory increase within an interval: CUDA allocator stats, or the process's RSS high-water mark."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.baseline = 0
        self.available = True
        if not self.cuda:
            try:
                # Fixed thresholds: large tensors are mmap'd and handed back on free, so RSS follows live tensors
                # instead of what glibc keeps cached (its adaptive threshold would hide a later trainer's peak).
                libc = ctypes.CDLL("libc.so.6")
                libc.mallopt(-3, 32 * 1024)  # M_MMAP_THRESHOLD
                libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
                self._reset_hwm()
            except OSError:
                self.available = False

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise OSError(f"{key} not in /proc/self/status")

    @staticmethod
    def _reset_hwm() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        elif self.available:
            self._reset_hwm()
            self.baseline = self._status("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        if not self.available:
            return 0
        return self._status("VmHWM") - self.baseline


def cpu_times_of_every_rank(local: dict[str, list[float]], world_size: int) -> dict[str, list[list[float]]]:
    """Each trainer's step CPU times on every rank (one gather; every rank calls it once per dataset, in the same
    order): on a shared machine the process CPU time is what a rank spent, whatever the others' load."""
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return {name: [times] for name, times in local.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {name: [ranks[name] for ranks in gathered] for name in local}


# ---------------------------------------------------------------------------------------------- turns
class _Counting:
    """Put in front of a Trainer class: counts, from the batches each step fetches, the token positions the model
    computes (``input_ids`` size), the real tokens (the attention mask's ones; every position of a padding-free
    row), the targets that count (labels other than -100 after the causal shift) and the micro-batches;
    :func:`_count_head_rows` adds the rows the LM head computed."""

    computed = 0
    real = 0
    targets = 0
    head_rows = 0
    micro_batches = 0

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        for batch in batches:
            computed = int(batch["input_ids"].numel())
            mask = batch.get("attention_mask")
            self.computed += computed
            self.real += int(mask.sum()) if mask is not None else computed
            shifted = batch.get("shift_labels")
            shifted = shifted if shifted is not None else batch["labels"][..., 1:]
            self.targets += int((shifted != -100).sum())
            self.micro_batches += 1
        return batches, num_items


def _count_head_rows(trainer: Any) -> None:
    """Count the rows the model's output layer computes (a forward hook on ``get_output_embeddings()``)."""

    def count(_module: Any, args: tuple, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a backward pass recomputing a checkpointed forward: those rows were counted once already
        rows = getattr(output, "fused_rows", None)  # fused_lm_head: the rows its tiles projected
        if rows is None and isinstance(output, torch.Tensor) and output.shape[-1] == 1:
            return  # router_balance's routing pre-pass: the head skipped, a [..., 1] placeholder (moe_balance)
        trainer.head_rows += int(rows) if rows is not None else int(args[0].shape[:-1].numel())

    trainer.model.get_output_embeddings().register_forward_hook(count)


def _turn_callback(name: str, probe: MemoryProbe, world_size: int):
    from transformers import TrainerCallback

    class Turns(TrainerCallback):
        """Runs its trainer one optimizer step per turn; times each step and its peak memory."""

        def __init__(self) -> None:
            self.name = name
            self.ready = threading.Semaphore(0)
            self.go = threading.Semaphore(0)
            self.done = threading.Semaphore(0)
            self.step_times: list[float] = []
            self.step_cpu_times: list[float] = []
            self.step_peaks: list[int] = []
            self.step_real_tokens: list[int] = []
            self.reductions = 0
            self.error: BaseException | None = None
            self.trainer = None
            self._t0 = 0.0
            self._cpu0 = 0.0
            self._real0 = 0

        def _wait_turn(self) -> None:
            if not self.go.acquire(timeout=_TURN_TIMEOUT_S):
                raise TimeoutError(f"bench: {self.name} waited {_TURN_TIMEOUT_S:.0f}s for its turn")
            probe.start()
            self._real0 = getattr(self.trainer, "real", 0)
            self._cpu0 = time.process_time()
            self._t0 = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            wrapped = getattr(self.trainer, "model_wrapped", None)
            if world_size > 1 and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                def count(counter, bucket):
                    counter.reductions += 1
                    return default_hooks.allreduce_hook(None, bucket)

                wrapped.register_comm_hook(self, count)
            self.ready.release()
            self._wait_turn()

        def on_step_end(self, args, state, control, **kwargs):
            if probe.cuda:
                torch.cuda.synchronize()
            self.step_times.append(time.perf_counter() - self._t0)
            self.step_cpu_times.append(time.process_time() - self._cpu0)
            self.step_peaks.append(probe.peak())
            self.step_real_tokens.append(getattr(self.trainer, "real", 0) - self._real0)
            self.done.release()
            self._wait_turn()

    return Turns()


def _run_in_turns(trainers: dict[str, Any], turns: dict[str, Any], num_steps: int) -> None:
    """Start the trainers one by one (set-up is not concurrent), then grant one step per trainer per round, in an
    order that rotates each round; at the end let each finish in turn."""
    names = list(trainers)
    threads = {}

    def target(name: str) -> None:
        try:
            trainers[name].train()
        except BaseException as err:  # surfaced in the main thread
            turns[name].error = err
            turns[name].ready.release()
            turns[name].done.release()

    def check(name: str) -> None:
        if turns[name].error is not None:
            raise GradAccUsageError(f"bench: the {name} trainer failed") from turns[name].error

    for name in names:
        threads[name] = threading.Thread(target=target, args=(name,), name=f"bench-{name}", daemon=True)
        threads[name].start()
        turns[name].ready.acquire()
        check(name)
    for step in range(num_steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            turns[name].go.release()
            if not turns[name].done.acquire(timeout=_TURN_TIMEOUT_S):
                raise TimeoutError(f"bench: {name} step {step} did not finish in {_TURN_TIMEOUT_S:.0f}s")
            check(name)
    for name in names:
        turns[name].go.release()
        threads[name].join()
        check(name)


# ---------------------------------------------------------------------------------------------- one dataset
def _trainer_args(settings: BenchSettings, name: str, output_dir: str, world_size: int):
    from transformers import TrainingArguments

    from ...config import GradAccConfig

    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=settings.per_device_train_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        max_steps=settings.num_warmup_steps + settings.num_steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=settings.seed,
        data_seed=settings.seed,
        dataloader_num_workers=0,
        use_cpu=settings.device == "cpu",
        bf16=settings.bf16,
    )
    if world_size > 1:
        kwargs["ddp_backend"] = "gloo" if settings.device == "cpu" else "nccl"
    if name.startswith("stock"):
        if name in _STOCK_SAMPLING:
            kwargs["train_sampling_strategy"] = _STOCK_SAMPLING[name]
        if name == "stock_liger":
            kwargs["use_liger_kernel"] = True
        return TrainingArguments(**kwargs)
    if name == "regroup":
        kwargs["regroup_micro_batches"] = True
    elif name.startswith("budget"):
        kwargs["max_tokens_per_micro_batch"] = settings.max_tokens_per_micro_batch
    elif name.startswith("pack"):
        kwargs.update(pack_micro_batches=True, max_tokens_per_micro_batch=settings.pack_max_tokens)
    elif name in bench_moe.MOE_TRAINERS:
        kwargs.update(bench_moe.moe_trainer_kwargs(name))
    if name.endswith("fused"):
        kwargs["fused_lm_head"] = True
    return GradAccConfig(**kwargs)


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1).cpu() for _, p in sorted(model.named_parameters())])


def bench_dataset(settings: BenchSettings, dataset: str) -> list[BenchRow]:
    """Measure every trainer of ``settings.trainers`` on ``dataset`` in one interleaved run."""
    import transformers
    from transformers import DataCollatorWithFlattening, PrinterCallback, Trainer

    from ...testing.tiny import ListDataset, PaddingCollator
    from ...trainer import GradAccTrainer

    unknown = sorted(set(settings.trainers) - set(ALL_TRAINERS))
    if unknown or "stock" not in settings.trainers:
        raise GradAccConfigError(f"`trainers` ({settings.trainers}) must include 'stock' and come from {ALL_TRAINERS}")
    if "stock_liger" in settings.trainers and (
        importlib.util.find_spec("liger_kernel") is None or settings.device == "cpu"
    ):
        raise GradAccConfigError(
            "The `stock_liger` row needs the `liger-kernel` package and a GPU (Liger's kernels are Triton kernels); "
            f"installed: {importlib.util.find_spec('liger_kernel') is not None}, device: {settings.device!r}. "
            "Leave `stock_liger` out of `--trainers`, or `pip install liger-kernel` on a GPU machine."
        )
    missing = [
        n for n, strategy in _STOCK_SAMPLING.items() if n in settings.trainers and not has_sampling_strategy(strategy)
    ]
    if missing:  # an unknown strategy would silently run in random order under that row's name
        logger.warning(
            f"bench: transformers {transformers.__version__} has no train_sampling_strategy "
            f"{[_STOCK_SAMPLING[n] for n in missing]}; the rows {missing} are left out."
        )
        settings = replace(settings, trainers=tuple(n for n in settings.trainers if n not in missing))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    num_samples = (
        settings.per_device_train_batch_size
        * settings.gradient_accumulation_steps
        * world_size
        * (settings.num_warmup_steps + settings.num_steps)
    )
    samples = make_bench_samples(settings, dataset, num_samples)
    longest = max(len(s["input_ids"]) for s in samples)
    if any(n.startswith("budget") for n in settings.trainers) and longest > settings.max_tokens_per_micro_batch:
        settings = replace(settings, max_tokens_per_micro_batch=longest)
        logger.warning(f"bench: token budget raised to the longest sample ({longest} tokens)")
    if any(n.startswith("pack") for n in settings.trainers) and longest > (settings.pack_max_tokens or longest):
        settings = replace(settings, pack_max_tokens=longest)
        logger.warning(f"bench: packed rows' budget raised to the longest sample ({longest} tokens)")
    model = build_bench_model(settings)
    initial = _flat_params(model)
    probe = MemoryProbe(settings.device)
    trainers: dict[str, Any] = {}
    turns: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hf_gradacc_bench_") as tmp:
        for name in settings.trainers:
            turns[name] = _turn_callback(name, probe, world_size)
            base = Trainer if name.startswith("stock") else GradAccTrainer
            trainer_class = type(f"Counting{base.__name__}", (_Counting, base), {})
            collator = DataCollatorWithFlattening() if name == "stock_flatten" else PaddingCollator()
            trainers[name] = trainer_class(
                model=copy.deepcopy(model),
                args=_trainer_args(settings, name, os.path.join(tmp, name), world_size),
                train_dataset=ListDataset(samples),
                data_collator=collator,
                callbacks=[turns[name]],
            )
            trainers[name].remove_callback(PrinterCallback)  # disable_tqdm prints every log line otherwise
            _count_head_rows(trainers[name])
            turns[name].trainer = trainers[name]
        _run_in_turns(trainers, turns, settings.num_warmup_steps + settings.num_steps)

    finals = {n: _flat_params(t.accelerator.unwrap_model(t.model)) for n, t in trainers.items()}
    skip = settings.num_warmup_steps
    per_rank = cpu_times_of_every_rank({n: turns[n].step_cpu_times[skip:] for n in settings.trainers}, world_size)
    cpu_of = {n: [sum(step) for step in zip(*ranks)] for n, ranks in per_rank.items()}  # every rank's CPU time, summed
    stock_times = turns["stock"].step_times[skip:]
    stock_cpu = cpu_of["stock"]
    stock_peak = max(turns["stock"].step_peaks or [0])  # every step: the first one is no less real
    rows = []
    for name in settings.trainers:
        times = turns[name].step_times[skip:]
        peak = max(turns[name].step_peaks or [0])
        ratios = [t / s for t, s in zip(times, stock_times)]
        cpu = cpu_of[name]
        cpu_ratios = [t / s for t, s in zip(cpu, stock_cpu) if s > 0]
        diff = None
        if "plain" in finals:
            reference = finals["plain"] - initial
            diff = float((finals[name] - finals["plain"]).norm() / reference.norm())
        steps = len(turns[name].step_times)
        counter = trainers[name]
        rows.append(
            BenchRow(
                dataset=dataset,
                trainer=name,
                vocab_size=settings.vocab_size,
                median_step_time_s=statistics.median(times),
                step_time_ratio=statistics.median(ratios),
                total_time_ratio=sum(times) / sum(stock_times),
                computed_per_real_token=counter.computed / max(counter.real, 1),
                peak_memory_bytes=peak,
                peak_memory_ratio=peak / stock_peak if stock_peak > 0 else float("nan"),
                reductions_per_step=turns[name].reductions / steps if world_size > 1 else None,
                micro_batches_per_step=counter.micro_batches / steps,
                relative_update_difference=diff,
                real_tokens_per_s=sum(turns[name].step_real_tokens[skip:]) / sum(times)
                if sum(times)
                else float("nan"),
                step_times_s=tuple(times),
                median_step_cpu_time_s=statistics.median(cpu),
                cpu_time_ratio=statistics.median(cpu_ratios) if cpu_ratios else float("nan"),
                step_cpu_times_s=tuple(cpu),
                total_cpu_time_ratio=sum(cpu) / sum(stock_cpu) if sum(stock_cpu) > 0 else float("nan"),
                step_cpu_times_per_rank_s=tuple(tuple(r) for r in per_rank[name]),
                step_peaks_bytes=tuple(turns[name].step_peaks[skip:]),
                first_step_peak_memory_bytes=(turns[name].step_peaks or [0])[0],
                lm_head_rows_per_target=counter.head_rows / counter.targets if counter.targets else float("nan"),
            )
        )
    return rows


def run_benchmark(settings: BenchSettings) -> list[BenchRow]:
    """Every dataset of ``settings``; the trainers of one dataset are measured in one interleaved run."""
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise GradAccUsageError(f"bench: `device` is {settings.device!r} but torch.cuda.is_available() is False")
    if settings.num_threads is not None and not settings.device.startswith("cuda"):
        torch.set_num_threads(settings.num_threads)
    rows = []
    for vocab_size in settings.vocab_sizes or (settings.vocab_size,):
        for dataset in settings.datasets:
            rows += bench_dataset(replace(settings, vocab_size=vocab_size), dataset)
    return rows


# ---------------------------------------------------------------------------------------------- record
def environment() -> dict[str, str]:
    """Versions and machine, for the benchmark record."""
    import accelerate
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "machine": platform.machine(),
        "cpus": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
