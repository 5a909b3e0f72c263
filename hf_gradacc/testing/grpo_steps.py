"""Tiny prompts, a deterministic reward, a recorder of the micro-batches a GRPO step trained on, and the float64
reference of that step, for TRL's GRPOTrainer with and without hf_gradacc.

GRPO's data are made during training (completions sampled from the policy), so the reference cannot be written
before the run: the trainer's micro-batches are recorded as ``compute_loss`` receives them (prompt and completion ids,
masks, advantages), and :func:`grpo_reference` recomputes every recorded completion's log-probabilities with a float64
copy of the initial model, each sequence on its own (no padding), the loss written out by hand per ``loss_type``. It
shares no code with TRL or the trainers.

At the first optimizer step the policy has not moved, so TRL's importance ratio is 1 (its clipping inactive) and every
loss type's gradient is ``-sum_i A_i grad log p(completion tokens of i)`` weighted as the loss type averages:

| ``loss_type`` | the step's loss (per-token value ``-A_i r_it``, ``r = p / p.detach()``) |
| --- | --- |
| ``dapo``, ``bnpo``, ``cispo``, ``vespo`` | sum over every completion token of the step / their number |
| ``grpo``, ``sapo`` | mean over the step's sequences of each sequence's token mean |
| ``luspo`` | mean over the step's sequences of each sequence's token sum |
| ``dr_grpo`` | sum over every completion token / (the step's sequences x ``max_completion_length``) |

and an entropy bonus subtracts ``coef x`` the mean entropy over the step's completion tokens; a mixture-of-experts
policy adds its router load-balancing loss per micro-batch, weighted by the micro-batch's share of the step's routed
tokens (:func:`~hf_gradacc.testing.trl_steps.router_term`). (``cispo`` and ``sapo``
have other loss VALUES at ratio 1, the same gradient.)

Example:
    ```python
    from hf_gradacc.testing.grpo_steps import (GRPOStepRecorder, build_tiny_policy, grpo_prompts, grpo_reference,
                                               grpo_tokenizer, length_reward)

    trainer_class = type("Recording", (GRPOStepRecorder, GradAccGRPOTrainer), {})
    trainer = trainer_class(model=policy, reward_funcs=length_reward, args=args, train_dataset=grpo_prompts(16),
                            processing_class=grpo_tokenizer())
    trainer.train()
    reference = grpo_reference(policy, trainer.recorded_micro_batches, loss_type="dapo", max_completion_length=8)
    ```
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from .trl_steps import EOS_TOKEN_ID, Reference, _backward, _float64, router_term, word, word_tokenizer

# A small vocabulary (<pad>, </s>, <unk>, w3 ... w7): a random policy ends a completion with </s> about once in 8
# tokens, so completions of one step have many different lengths (1 to max_completion_length).
GRPO_VOCAB_SIZE = 8
TOKEN_LOSS_TYPES = ("dapo", "bnpo", "cispo", "vespo")
SEQUENCE_MEAN_LOSS_TYPES = ("grpo", "sapo")
LOSS_TYPES = (*TOKEN_LOSS_TYPES, *SEQUENCE_MEAN_LOSS_TYPES, "luspo", "dr_grpo")


def build_tiny_policy(seed: int = 0, *, vocab_size: int = GRPO_VOCAB_SIZE) -> torch.nn.Module:
    """A tiny Llama causal LM (2 layers, hidden 16, untied head) over :func:`grpo_tokenizer`'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def build_tiny_moe_policy(seed: int = 0, *, router_aux_loss_coef: float = 0.5) -> torch.nn.Module:
    """A tiny Mixtral (2 layers, 4 experts, top-2) over :func:`grpo_tokenizer`'s vocabulary with a router
    load-balancing loss. Its config says ``output_router_logits=False``: transformers 5.23's ``generate`` fails on a
    Mixtral that returns router logits at every decoding step (the padded attention mask does not match one new
    token); TRL asks for them in its loss's forward pass whenever the config has the field."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=GRPO_VOCAB_SIZE,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=router_aux_loss_coef,
        output_router_logits=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=None,
    )
    return MixtralForCausalLM(config)


def grpo_tokenizer(vocab_size: int = GRPO_VOCAB_SIZE) -> Any:
    """:func:`~hf_gradacc.testing.trl_steps.word_tokenizer` padding on the left, as GRPO's generation needs."""
    tokenizer = word_tokenizer(vocab_size)
    tokenizer.padding_side = "left"
    return tokenizer


def grpo_prompts(num_prompts: int = 16, seed: int = 3, *, vocab_size: int = GRPO_VOCAB_SIZE) -> Any:
    """A text dataset of ``num_prompts`` prompts of 1-5 words (``prompt``), as GRPOTrainer takes it."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list(
        [
            {"prompt": " ".join(word(rng.randint(3, vocab_size - 1)) for _ in range(rng.randint(1, 5)))}
            for _ in range(num_prompts)
        ]
    )


def length_reward(completions: Sequence[str], **kwargs: Any) -> list[float]:
    """A deterministic reward: +1 per word whose id is a multiple of 3, -0.25 per word (so groups of completions
    rarely tie and advantages are rarely all zero)."""
    rewards = []
    for completion in completions:
        words = completion.split()
        rewards.append(sum(1.0 for w in words if w[1:].isdigit() and int(w[1:]) % 3 == 0) - 0.25 * len(words))
    return rewards


class GRPOStepRecorder:
    """Trainer mixin (put it first): keeps every micro-batch ``compute_loss`` receives in training, on CPU
    (``recorded_micro_batches``: prompt and completion ids and masks, advantages), for :func:`grpo_reference`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
            recorded = {k: inputs[k].detach().cpu().clone() for k in keys}
            self.recorded_micro_batches = [*getattr(self, "recorded_micro_batches", []), recorded]
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


def recorded_sequences(micro_batches: Sequence[dict[str, torch.Tensor]]) -> list[tuple[list[int], list[int], float]]:
    """``(prompt ids, completion ids, advantage)`` of every recorded row, padding removed."""
    rows = []
    for mb in micro_batches:
        for i in range(mb["prompt_ids"].shape[0]):
            prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()].tolist()
            completion = mb["completion_ids"][i][mb["completion_mask"][i].bool()].tolist()
            rows.append((prompt, completion, float(mb["advantages"][i])))
    return rows


def completion_logps_and_entropies(
    model: torch.nn.Module, prompt: list[int], completion: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(completion token | prefix) and the entropy of the next-token distribution at each completion position,
    for ``prompt + completion`` on its own (positions from 0, no padding)."""
    ids = prompt + completion
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # position j predicts token j + 1
    picked = logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def grpo_reference(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    loss_type: str,
    max_completion_length: int,
    entropy_coef: float = 0.0,
) -> Reference:
    """The float64 full-batch step over every recorded completion (of every micro-batch and, when the caller passes
    them, every rank), at importance ratio 1 (the first optimizer step, ``beta=0``); see the module docstring."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"no reference for loss_type {loss_type!r}; one of {LOSS_TYPES}")
    policy = _float64(model)
    rows = recorded_sequences(micro_batches)
    token_values, sequence_means, sequence_sums, entropies = [], [], [], []
    for prompt, completion, advantage in rows:
        if not completion:  # a completion masked out entirely (mask_truncated_completions) adds 0 to every sum
            sequence_means.append(torch.zeros((), dtype=torch.float64))
            sequence_sums.append(torch.zeros((), dtype=torch.float64))
            continue
        logp, entropy = completion_logps_and_entropies(policy, prompt, completion)
        values = -advantage * torch.exp(logp - logp.detach())  # value -A, gradient -A grad log p
        token_values.append(values)
        sequence_means.append(values.mean())
        sequence_sums.append(values.sum())
        entropies.append(entropy)
    num_tokens = sum(v.numel() for v in token_values)
    token_sum = torch.cat(token_values).sum() if token_values else torch.zeros((), dtype=torch.float64)
    if loss_type in TOKEN_LOSS_TYPES:
        loss = token_sum / max(num_tokens, 1)
    elif loss_type in SEQUENCE_MEAN_LOSS_TYPES:
        loss = torch.stack(sequence_means).mean()
    elif loss_type == "luspo":
        loss = torch.stack(sequence_sums).mean()
    else:  # dr_grpo
        loss = token_sum / (len(rows) * max_completion_length)
    if entropy_coef:
        loss = loss - entropy_coef * torch.cat(entropies).sum() / max(num_tokens, 1)
    if hasattr(policy.config, "output_router_logits") and getattr(policy.config, "router_aux_loss_coef", 0.0):
        loss = loss + router_term(policy, [forward_inputs(mb) for mb in micro_batches])
    return _backward(policy, loss)


def forward_inputs(micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The padded ``input_ids`` / ``attention_mask`` of a recorded micro-batch's forward pass (prompt, completion)."""
    return {
        "input_ids": torch.cat([micro_batch["prompt_ids"], micro_batch["completion_ids"]], dim=1),
        "attention_mask": torch.cat([micro_batch["prompt_mask"], micro_batch["completion_mask"]], dim=1),
    }


def step_counts(micro_batches: Sequence[dict[str, torch.Tensor]]) -> tuple[int, int]:
    """``(completion tokens, sequences)`` of the recorded step: the denominators of the full-batch step."""
    tokens = sum(int(mb["completion_mask"].sum()) for mb in micro_batches)
    return tokens, sum(int(mb["completion_mask"].shape[0]) for mb in micro_batches)
