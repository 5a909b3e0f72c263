"""Tiny data and float64 references for TRL's SFT, DPO and reward trainers, and a fixed micro-batch layout.

The references share no code with TRL or the trainers: a float64 copy of the initial model, every sample of the
optimizer step on its own (no padding), the loss written out by hand (explicit shift and masks), the mean over ALL
the step's completion tokens (SFT) or pairs (DPO, reward). `hf-gradacc check --trainer` and the tests (one process
and 2 ranks) use them.

:func:`with_batch_layout` gives a trainer class whose training dataloader deals batches of given sizes, in dataset
order, round-robin over the ranks (accelerate's dealing): the way to put micro-batches of DIFFERENT sizes into one
step on several ranks, which accelerate's default ``even_batches=True`` never does (it fills the last batch with
repeats) and which TRL's per-row metric gathers need to be equal across ranks at every micro-batch.

Example:
    ```python
    from hf_gradacc.testing.trl_steps import (
        dpo_dataset,
        dpo_pairs,
        dpo_reference,
        uneven_batch_sizes,
        with_batch_layout,
    )

    pairs = dpo_pairs(14)
    trainer_class = with_batch_layout(GradAccDPOTrainer, uneven_batch_sizes(2, 4, num_processes=2))  # 2+2+2+1 per rank
    reference = dpo_reference(model, pairs, beta=0.1)  # .grads, .loss, .norm
    ```
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .reference import float64_copy
from .tiny import VOCAB_SIZE

SPECIAL_TOKENS = {0: "<pad>", 1: "</s>", 2: "<unk>"}
EOS_TOKEN_ID = 1


# ---------------------------------------------------------------------------------------------- tokenizer, data
def cpu_config_flags(config_class: type) -> dict[str, bool]:
    """TRL config flags for a float32 CPU step: ``bf16=False`` (TRL's default is True) and, where the config has it
    (a `TrainingArguments` field of transformers 5.24; not 5.16.1), ``activation_checkpointing=False``."""
    fields = getattr(config_class, "__dataclass_fields__", {})
    return {name: False for name in ("bf16", "activation_checkpointing") if name in fields}


def word(token_id: int) -> str:
    """The word of ``token_id`` in :func:`word_tokenizer`'s vocabulary."""
    return SPECIAL_TOKENS.get(token_id, f"w{token_id}")


def word_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A word-level fast tokenizer: <pad> 0, </s> 1, <unk> 2, then "w3" ... It adds no special tokens, so text of
    space-separated words tokenizes to exactly their ids. Built locally (no Hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={word(i): i for i in range(vocab_size)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def save_tiny_checkpoint(path: str | Any, texts: Sequence[str], *, seed: int = 0) -> str:
    """A tiny Llama causal LM and a word-level tokenizer over the words of ``texts`` (plus <pad> 0, </s> 1, <unk> 2),
    written with ``save_pretrained`` to ``path``: a local checkpoint that ``from_pretrained`` loads like any other."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = sorted({w for text in texts for w in text.split()} - set(SPECIAL_TOKENS.values()))
    vocabulary = {w: i for i, w in enumerate([*SPECIAL_TOKENS.values(), *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocabulary),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randint(3, vocab_size - 1) for _ in range(n)]


def sft_rows(num_samples: int = 7, seed: int = 0, *, vocab_size: int = VOCAB_SIZE) -> list[dict[str, list[int]]]:
    """Prompt-completion samples, tokenized (``input_ids``, ``completion_mask``): prompts of 1-12 tokens (not
    trained on), completions of 1-6."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        prompt, completion = rng.randint(1, 12), rng.randint(1, 6)
        rows.append(
            {
                "input_ids": _ids(rng, prompt + completion, vocab_size),
                "completion_mask": [0] * prompt + [1] * completion,
            }
        )
    return rows


def sft_text_dataset(rows: Sequence[dict[str, list[int]]]) -> tuple[Any, list[dict[str, list[int]]]]:
    """``rows`` (:func:`sft_rows`) as the prompt-completion TEXT dataset that TRL's SFTTrainer tokenizes itself, and
    the rows TRL will train on: TRL appends the end-of-sequence token to every completion, so each reference row gets
    ``EOS_TOKEN_ID`` as one more completion token."""
    from datasets import Dataset

    def text(ids: Sequence[int]) -> str:
        return " ".join(word(i) for i in ids)

    texts, trained = [], []
    for row in rows:
        prompt = row["completion_mask"].index(1)
        texts.append({"prompt": text(row["input_ids"][:prompt]), "completion": " " + text(row["input_ids"][prompt:])})
        trained.append(
            {"input_ids": [*row["input_ids"], EOS_TOKEN_ID], "completion_mask": [*row["completion_mask"], 1]}
        )
    return Dataset.from_list(texts), trained


# A chat template for :func:`word_tokenizer` with `{% generation %}` markers around each assistant turn and its end of
# sequence token (what TRL's `assistant_only_loss=True` reads); words are separated by single spaces.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} </s>"
    "{% endgeneration %} {% else %}{{ m['content'] }} {% endif %}{% endfor %}"
)


def chat_conversations(
    num_samples: int = 7, seed: int = 4, *, vocab_size: int = VOCAB_SIZE
) -> tuple[Any, list[dict[str, list[int]]]]:
    """Conversations of one or two user / assistant turns (``messages``, for :data:`CHAT_TEMPLATE`), and the rows
    TRL's ``assistant_only_loss=True`` trains on, written out here: every token, with ``completion_mask`` 1 on the
    assistant turns and their end-of-sequence token."""
    from datasets import Dataset

    rng = random.Random(seed)
    conversations, trained = [], []
    for _ in range(num_samples):
        messages, ids, mask = [], [], []
        for _turn in range(rng.randint(1, 2)):
            user, assistant = _ids(rng, rng.randint(1, 6), vocab_size), _ids(rng, rng.randint(1, 4), vocab_size)
            messages += [
                {"role": "user", "content": " ".join(word(i) for i in user)},
                {"role": "assistant", "content": " ".join(word(i) for i in assistant)},
            ]
            ids += [*user, *assistant, EOS_TOKEN_ID]
            mask += [0] * len(user) + [1] * (len(assistant) + 1)
        conversations.append({"messages": messages})
        trained.append({"input_ids": ids, "completion_mask": mask})
    return Dataset.from_list(conversations), trained


def dpo_pairs(num_pairs: int = 7, seed: int = 1, *, vocab_size: int = VOCAB_SIZE) -> list[dict[str, list[int]]]:
    """Preference pairs as token ids: a prompt of 1-8 tokens, chosen and rejected completions of 1-6 plus eos."""
    rng = random.Random(seed)
    return [
        {
            "prompt": _ids(rng, rng.randint(1, 8), vocab_size),
            "chosen": _ids(rng, rng.randint(1, 6), vocab_size) + [EOS_TOKEN_ID],
            "rejected": _ids(rng, rng.randint(1, 6), vocab_size) + [EOS_TOKEN_ID],
        }
        for _ in range(num_pairs)
    ]


def dpo_dataset(pairs: Sequence[dict[str, list[int]]]) -> Any:
    """``pairs`` as the text dataset TRL's DPOTrainer takes (``prompt``, ``chosen``, ``rejected``)."""
    from datasets import Dataset

    def text(ids: list[int]) -> str:
        return " ".join(word(i) for i in ids)

    return Dataset.from_list(
        [
            {"prompt": text(p["prompt"]), "chosen": " " + text(p["chosen"]), "rejected": " " + text(p["rejected"])}
            for p in pairs
        ]
    )


def reward_rows(num_pairs: int = 7, seed: int = 2, *, vocab_size: int = VOCAB_SIZE) -> list[dict[str, Any]]:
    """Tokenized preference pairs for TRL's RewardTrainer (``chosen_ids``, ``rejected_ids``, ``margin``)."""
    rng = random.Random(seed)
    return [
        {
            "chosen_ids": _ids(rng, rng.randint(2, 10), vocab_size),
            "rejected_ids": _ids(rng, rng.randint(2, 10), vocab_size),
            "margin": round(rng.random(), 3),
        }
        for _ in range(num_pairs)
    ]


def build_tiny_reward_model(seed: int = 0) -> torch.nn.Module:
    """A tiny Llama sequence classifier with one output (a reward model)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        num_labels=1,
    )
    return tf.LlamaForSequenceClassification(config)


# ---------------------------------------------------------------------------------------------- float64 references
@dataclass(frozen=True)
class Reference:
    """The float64 full-batch gradient of one step (``grads``, by parameter name), its loss and gradient norm."""

    grads: dict[str, torch.Tensor]
    loss: float

    @property
    def norm(self) -> float:
        return math.sqrt(sum(float(g.double().pow(2).sum()) for g in self.grads.values()))


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    """:func:`float64_copy`, refusing a model whose forward was replaced on the instance: TRL's trainers replace a
    model's ``forward`` with a closure over the original (their fused LM head), which a copy would still run, in
    float32, on the original's parameters."""
    patched = [name or type(model).__name__ for name, module in model.named_modules() if "forward" in vars(module)]
    if patched:
        raise ValueError(
            f"the model's forward was replaced on the instance ({patched[0]}), as TRL's trainers do: pass the model "
            "from before a trainer was built on it (or a fresh one with the same values)"
        )
    return float64_copy(model)


def _backward(model: torch.nn.Module, loss: torch.Tensor) -> Reference:
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Reference(grads=grads, loss=float(loss.detach()))


def completion_logps(model: torch.nn.Module, ids: list[int], mask: list[int]) -> torch.Tensor:
    """log p(token | prefix) of every token whose mask is 1 (a causal LM predicts token i from positions < i)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return logp[torch.tensor(mask[1:], dtype=torch.bool)]


def router_term(model: torch.nn.Module, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """sum_m (routed tokens of m / of the step) x coef x aux(m): a router loss is defined per forward pass."""
    routed = [int(mb["attention_mask"].sum()) for mb in micro_batches]
    total = torch.zeros((), dtype=torch.float64)
    for mb, n in zip(micro_batches, routed, strict=True):
        aux = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True).aux_loss
        total = total + model.config.router_aux_loss_coef * aux * n / sum(routed)
    return total


def sft_reference(
    model: torch.nn.Module, rows: Sequence[dict[str, list[int]]], *, dft: bool = False, micro_batches: Any = None
) -> Reference:
    """The step's loss: the mean over ALL completion tokens of -log p (``dft``: times p, not differentiated); for a
    mixture-of-experts model plus :func:`router_term` over the step's (collated) ``micro_batches``."""
    ref = _float64(model)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for row in rows:
        logp = completion_logps(ref, row["input_ids"], row["completion_mask"])
        total = total - (logp * logp.exp().detach()).sum() if dft else total - logp.sum()
        count += logp.numel()
    loss = total / count
    if micro_batches is not None:
        loss = loss + router_term(ref, micro_batches)
    return _backward(ref, loss)


def dpo_reference(
    model: torch.nn.Module, pairs: Sequence[dict[str, list[int]]], *, beta: float, micro_batches: Any = None
) -> Reference:
    """Sigmoid DPO: the mean over ALL pairs of -log sigmoid(beta x (policy - reference log-ratio margin)); the
    reference model is the initial model, each completion's log-probability summed over its tokens. A mixture of
    experts adds the policy's :func:`router_term` over the step's micro-batches."""
    policy, frozen = _float64(model), _float64(model)
    losses = []
    for pair in pairs:
        margins = []
        for net in (policy, frozen):
            with contextlib.nullcontext() if net is policy else torch.no_grad():
                seq = {k: pair["prompt"] + pair[k] for k in ("chosen", "rejected")}
                mask = {k: [0] * len(pair["prompt"]) + [1] * len(pair[k]) for k in ("chosen", "rejected")}
                chosen = completion_logps(net, seq["chosen"], mask["chosen"]).sum()
                rejected = completion_logps(net, seq["rejected"], mask["rejected"]).sum()
                margins.append(chosen - rejected)
        losses.append(-F.logsigmoid(beta * (margins[0] - margins[1])))
    loss = torch.stack(losses).mean()
    if micro_batches is not None:
        loss = loss + router_term(policy, micro_batches)
    return _backward(policy, loss)


def reward_reference(model: torch.nn.Module, rows: Sequence[dict[str, Any]], *, center: float) -> Reference:
    """Bradley-Terry with margins: the mean over ALL pairs of -log sigmoid(r_chosen - r_rejected - margin), plus
    ``center`` x the mean over pairs of (r_chosen + r_rejected)^2; r is the score of the sequence's last token."""
    ref = _float64(model)
    losses = []
    for row in rows:
        r_c = ref(input_ids=torch.tensor([row["chosen_ids"]])).logits.reshape(())
        r_r = ref(input_ids=torch.tensor([row["rejected_ids"]])).logits.reshape(())
        losses.append(-F.logsigmoid(r_c - r_r - row["margin"]) + center * (r_c + r_r) ** 2)
    return _backward(ref, torch.stack(losses).mean())


# ---------------------------------------------------------------------------------------------- micro-batch layout
def uneven_batch_sizes(batch_size: int, gradient_accumulation_steps: int, num_processes: int = 1) -> list[int]:
    """Batch sizes, in dealing order, that give EVERY rank the micro-batches ``batch_size`` x (GA - 1) then
    ``batch_size - 1`` (when ``batch_size`` > 1): one optimizer step of ``num_processes x (batch_size x GA - 1)``
    samples whose micro-batches differ in size, alike on every rank."""
    last = batch_size - 1 if batch_size > 1 else 1
    per_rank = [batch_size] * (gradient_accumulation_steps - 1) + [last]
    return [size for size in per_rank for _ in range(num_processes)]


class LayoutBatchSampler(torch.utils.data.Sampler):
    """Batches of the given sizes over the dataset, in order. It has no ``batch_size``: accelerate then deals the
    batches round-robin over the ranks as they are (batch ``i`` to rank ``i % num_processes``)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(int(s) for s in sizes)

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


class _FixedBatchLayout:
    """Trainer mixin: the training dataloader is :class:`LayoutBatchSampler` over ``batch_layout``."""

    batch_layout: tuple[int, ...] = ()

    def get_train_dataloader(self):
        from torch.utils.data import DataLoader

        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:  # pragma: no cover - datasets comes with TRL
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if sum(self.batch_layout) != len(dataset):
            raise ValueError(
                f"the batch layout {self.batch_layout} covers {sum(self.batch_layout)} samples, the "
                f"dataset holds {len(dataset)}"
            )
        loader = DataLoader(dataset, batch_sampler=LayoutBatchSampler(self.batch_layout), collate_fn=collator)
        # accelerate 1.11-1.13 refuse a batch sampler without a batch size with `even_batches=True`; the layout deals
        # every rank the same number of batches, so sharding it unevenly deals the same batches (compat.py)
        from ..compat import shard_even_batches

        even = self.accelerator.even_batches
        self.accelerator.even_batches = shard_even_batches(even)
        try:
            return self.accelerator.prepare(loader)
        finally:
            self.accelerator.even_batches = even


def with_batch_layout(trainer_class: type, sizes: Sequence[int]) -> type:
    """``trainer_class`` whose training dataloader deals batches of ``sizes`` (see :func:`uneven_batch_sizes`)."""
    return type(
        f"{trainer_class.__name__}WithLayout", (_FixedBatchLayout, trainer_class), {"batch_layout": tuple(sizes)}
    )
