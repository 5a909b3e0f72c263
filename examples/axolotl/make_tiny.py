"""Write a tiny local Llama (causal LM and reward model) and two small JSONL datasets for the axolotl examples.

    python examples/axolotl/make_tiny.py ./axolotl-tiny
    AXOLOTL_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 axolotl train examples/axolotl/sft.yml --launcher python
    AXOLOTL_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 axolotl train examples/axolotl/reward.yml --launcher python

Everything is built locally (no Hub): a word-level tokenizer ("w3" ... "w95"), 8 completion samples already
tokenized (prompt tokens labelled -100: what `train_on_inputs: false` gives), 7 chosen / rejected pairs. Swap in
your model and dataset in the YAMLs; the `plugins:` and `gradacc:` lines stay as they are.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from hf_gradacc.testing.tiny import VOCAB_SIZE
from hf_gradacc.testing.trl_steps import word, word_tokenizer


def write_tiny(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=False, num_labels=1,
    )  # fmt: skip
    for name, model_class in (("model", LlamaForCausalLM), ("reward_model", LlamaForSequenceClassification)):
        torch.manual_seed(0)
        model_class(config).save_pretrained(root / name)
        word_tokenizer(VOCAB_SIZE).save_pretrained(root / name)
    rng = random.Random(0)
    with open(root / "completions.jsonl", "w") as f:
        for _ in range(8):  # prompts of 1-12 tokens (not trained on), completions of 1-6 tokens and EOS
            prompt, completion = rng.randint(1, 12), rng.randint(1, 6)
            ids = [rng.randint(3, VOCAB_SIZE - 1) for _ in range(prompt + completion)] + [1]
            row = {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * prompt + ids[prompt:]}
            f.write(json.dumps(row) + "\n")

    def words(n: int) -> str:
        return " ".join(word(rng.randint(3, VOCAB_SIZE - 1)) for _ in range(n))

    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(7):
            pair = {"system": "", "input": words(rng.randint(1, 8)), "chosen": words(rng.randint(1, 6))}
            f.write(json.dumps({**pair, "rejected": words(rng.randint(1, 6))}) + "\n")


if __name__ == "__main__":
    write_tiny(Path(sys.argv[1] if len(sys.argv) > 1 else "axolotl-tiny"))
