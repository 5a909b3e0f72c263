"""What one packed row costs against a padded batch of the same samples, on the benchmark's model.

    python benchmarks/packed_row_cost.py                    # the numbers quoted in docs/benchmarks.md
    python benchmarks/packed_row_cost.py --vocab-size 32000 --repeats 10

A packed row of T tokens is one sequence to the attention kernel: eager and sdpa compute all T x T scores and mask
the cross-sample ones, so a row's attention grows with T squared while a padded batch's grows with rows x longest
squared. This script times forward + backward of the same ten samples (about 1024 tokens, lengths 44 to 200) as one
packed row, as two packed rows, and as one padded batch, for each attention implementation, and prints milliseconds
per pass (median of the repeats after two warm-up passes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

from hf_gradacc.testing.benchmark import BenchSettings, build_bench_model  # noqa: E402

LENGTHS = (100, 80, 150, 60, 120, 90, 200, 70, 110, 44)  # 1024 tokens, a long-tailed-looking mix


def packed_batch(lengths, vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


def padded_batch(lengths, vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab_size, (len(lengths), max(lengths)))
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def time_passes(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], repeats: int) -> float:
    """Median milliseconds of forward + backward over all ``batches``."""
    for _ in range(2):
        for batch in batches:
            model(**batch).loss.backward()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            model(**batch).loss.backward()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    d = BenchSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size)
    parser.add_argument("--num-layers", type=int, default=d.num_layers)
    parser.add_argument("--num-heads", type=int, default=d.num_heads)
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    settings = BenchSettings(
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads, vocab_size=args.vocab_size
    )
    model = build_bench_model(settings)
    half = len(LENGTHS) // 2
    layouts = {
        f"one packed row [1, {sum(LENGTHS)}]": [packed_batch(LENGTHS, args.vocab_size)],
        "two packed rows [1, ~512]": [packed_batch(LENGTHS[:half], args.vocab_size),
                                      packed_batch(LENGTHS[half:], args.vocab_size)],
        f"padded [{len(LENGTHS)}, {max(LENGTHS)}]": [padded_batch(LENGTHS, args.vocab_size)],
    }  # fmt: skip
    print(f"model: hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads} heads, vocab {args.vocab_size}")
    print(f"{'attention':<10} " + " ".join(f"{name:>28}" for name in layouts))
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        row = [time_passes(model, batches, args.repeats) for batches in layouts.values()]
        print(f"{implementation:<10} " + " ".join(f"{ms:>25.1f} ms" for ms in row))


if __name__ == "__main__":
    main()
