"""The cost of `router_balance="global_batch"` (one routing pre-pass per step) against `"micro_batch"`: optimizer-step
time and peak memory of the same steps, in one process, the two modes taking turns run by run (so that the load
of a shared machine falls on both alike), and the distance of each mode's update from definition B.

    python benchmarks/moe_global_balance.py [--steps 12] [--rounds 3] [--layers 4] [--hidden 128] [--experts 8] [--checkpointing]

Prints a markdown table (docs/moe.md, docs/benchmarks.md). Step time: median over every run's steps after its first;
peak memory: the largest resident-set increase within a step (CPU; the CUDA allocator's peak on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import tempfile
import time

import torch
import transformers
from transformers import TrainerCallback

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.moe_reference import global_balance_gradients
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import VOCAB_SIZE, ListDataset, PaddingCollator, make_samples


def _rss(key: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 32 * 1024)  # M_MMAP_THRESHOLD: large tensors go back to the OS when freed
            libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            self.base = _rss()

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _rss("VmHWM") - self.base


class Turns(TrainerCallback):
    """Times each optimizer step and its peak memory."""

    def __init__(self, peak: Peak) -> None:
        self.peak, self.times, self.peaks = peak, [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.peak.start()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)
        self.peaks.append(self.peak.stop())


def build_model(layers: int, hidden: int, experts: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, output_router_logits=True, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ga", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--checkpointing", action="store_true")
    ns = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    model = build_model(ns.layers, ns.hidden, ns.experts)
    per_step = ns.batch * ns.ga
    samples = make_samples("causal_lm", per_step * ns.steps, seed=1, min_length=16, max_length=ns.max_length)
    peak = Peak()
    turns = {mode: Turns(peak) for mode in ("micro_batch", "global_batch")}
    for _ in range(ns.rounds):  # the modes take turns, a whole run each: the machine's load falls on both alike
        for mode, turn in turns.items():
            args = one_step_args(tempfile.mkdtemp(), per_device_train_batch_size=ns.batch,
                                 gradient_accumulation_steps=ns.ga, args_class=GradAccConfig, router_balance=mode,
                                 max_steps=ns.steps, logging_steps=10**6, gradient_checkpointing=ns.checkpointing,
                                 learning_rate=1e-3, seed=3)  # fmt: skip
            GradAccTrainer(model=copy.deepcopy(model), args=args, train_dataset=ListDataset(samples),
                           data_collator=PaddingCollator(), callbacks=[turn]).train()  # fmt: skip
            del turn.times[-ns.steps], turn.peaks[-ns.steps]  # a run's first step (warm-up) is not counted
    micro, glob = turns["micro_batch"], turns["global_batch"]
    t_micro, t_glob = statistics.median(micro.times), statistics.median(glob.times)
    p_micro, p_glob = max(micro.peaks), max(glob.peaks)
    # distance from B of one step of each mode, on the first step's samples (float64 reference)
    distance = {}
    for mode in ("micro_batch", "global_batch"):
        one = one_step_args(tempfile.mkdtemp(), per_device_train_batch_size=ns.batch, gradient_accumulation_steps=ns.ga,
                            args_class=GradAccConfig, router_balance=mode)  # fmt: skip
        work = copy.deepcopy(model)
        before = {n: p.detach().clone() for n, p in work.named_parameters()}
        GradAccTrainer(model=work, args=one, train_dataset=ListDataset(samples[:per_step]),
                       data_collator=PaddingCollator()).train()  # fmt: skip
        update = {n: before[n] - p.detach() for n, p in work.named_parameters()}
        reference = global_balance_gradients(model, samples[:per_step], PaddingCollator())
        router = [n for n in reference if n.endswith("gate.weight")]
        distance[mode] = compare({n: update[n] for n in router}, {n: reference[n] for n in router}).relative_error
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"Mixtral {ns.layers} layers, hidden {ns.hidden}, {ns.experts} experts top-2, {ns.batch} x GA {ns.ga}, "
          f"lengths 16-{ns.max_length}, {ns.rounds} x {ns.steps} steps, checkpointing {ns.checkpointing}, {device}")  # fmt: skip
    print("| router_balance | step time (median) | peak memory / step | router update vs definition B |")
    print("| --- | --- | --- | --- |")
    print(f"| micro_batch | {t_micro * 1e3:.0f} ms | {p_micro / 2**20:.1f} MiB | {distance['micro_batch']:.2e} |")
    print(f"| global_batch | {t_glob * 1e3:.0f} ms ({t_glob / t_micro:.2f}x) | {p_glob / 2**20:.1f} MiB "
          f"({p_glob / max(p_micro, 1):.2f}x) | {distance['global_batch']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
