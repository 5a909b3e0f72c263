"""A resumed mixture-of-experts model starts from its checkpoint's router and experts.

transformers 5 trains a tiny Mixtral / Qwen3-MoE / OLMoE / Qwen2-MoE with each layer's experts fused in one tensor
(``mlp.experts.gate_up_proj``) and saves them one per expert (Mixtral under ``block_sparse_moe``); the Trainer loads
the checkpoint by name and only logs "missing keys", so the resumed experts (and Mixtral's router) kept their
initial values. GradAccTrainer converts them as ``from_pretrained`` does (:func:`hf_gradacc.checkpoints.restore_weights`):
2 steps saved at each, resumed from checkpoint-1, end where the uninterrupted run ends. A checkpoint that still does
not restore the model (no conversion for it, a saved tensor the model does not take) is refused by name, on every rank.
"""

from __future__ import annotations

import importlib
import logging
import os

import pytest
import safetensors.torch
import torch
import transformers

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer, checkpoints
from hf_gradacc import checkpoints as ckpt
from hf_gradacc.testing.one_step import one_step_args
from hf_gradacc.testing.tiny import (
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    ListDataset,
    PaddingCollator,
    build_tiny_moe,
    make_samples,
)

BS, GA, STEPS = 2, 2, 2
TOLERANCE = 1e-5  # ||resumed - uninterrupted|| / ||uninterrupted - initial|| (measured 0.0: the same float32 ops)


def _tiny(family: str) -> torch.nn.Module:
    """The tiny MoE of ``family``: hf_gradacc.testing's Mixtral and Qwen3-MoE, and OLMoE / Qwen2-MoE alike (2 layers,
    4 experts, top-2, the router term in the loss)."""
    if family in ("mixtral", "qwen3_moe"):
        return build_tiny_moe(family)
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, num_experts=4,
                  num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True,
                  tie_word_embeddings=False, pad_token_id=PAD_TOKEN_ID, eos_token_id=1, bos_token_id=1)  # fmt: skip
    if family == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common))
    config = transformers.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, **common)
    return transformers.Qwen2MoeForCausalLM(config)


FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")


def _trainer(family: str, out: str, balance: str = "micro_batch") -> GradAccTrainer:
    args = one_step_args(out, args_class=GradAccConfig, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                         max_steps=STEPS, save_strategy="steps", save_steps=1, optim="adamw_torch",
                         learning_rate=1e-2, router_balance=balance)  # fmt: skip
    samples = make_samples("causal_lm", BS * GA * STEPS, seed=5)
    return GradAccTrainer(model=_tiny(family), args=args, train_dataset=ListDataset(samples),
                          data_collator=PaddingCollator())  # fmt: skip


def _params(trainer: GradAccTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[n].double() - b[n].double()).norm() ** 2) for n in a) ** 0.5
    change = sum(float((b[n].double() - initial[n].double()).norm() ** 2) for n in b) ** 0.5
    return diff / change


def _experts(names) -> list[str]:
    return sorted(n for n in names if ".experts." in n or n.endswith("mlp.gate.weight"))


@pytest.mark.parametrize("balance", ["micro_batch", "global_batch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_moe_model_ends_where_the_uninterrupted_run_ends(family, balance, tmp_path, caplog) -> None:
    initial = _params(_trainer(family, str(tmp_path / "unused")))
    full = _trainer(family, str(tmp_path / "full"), balance)
    full.train()
    uninterrupted = _params(full)
    assert all(not torch.equal(uninterrupted[n], initial[n]) for n in initial), "every parameter trains"
    saved = safetensors.torch.load_file(str(tmp_path / "full" / "checkpoint-1" / "model.safetensors"))
    assert not {n for n in initial if ".experts." in n} & set(saved), "the checkpoint holds the experts in another layout"
    resumed = _trainer(family, str(tmp_path / "resumed"), balance)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert resumed.state.global_step == STEPS
    error = _relative(_params(resumed), uninterrupted, initial)
    assert error <= TOLERANCE, (family, balance, error)
    restored = [r.getMessage() for r in caplog.records if "restored them through transformers' conversion" in r.getMessage()]
    assert len(restored) == 1 and all(n in restored[0] for n in _experts(initial)[:2]), restored


@pytest.fixture(scope="module")
def mixtral_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("mixtral"))
    _trainer("mixtral", out).train()
    return out


def test_without_a_conversion_for_the_model_the_resume_is_refused_by_name(mixtral_run, tmp_path, monkeypatch) -> None:
    """A transformers whose conversion mapping does not cover the model (faked: no mapping): the experts would train
    on from their initial values, so the resume is a GradAccConfigError naming them, the version and the way out."""
    mapping = importlib.import_module("transformers.conversion_mapping")
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model, **_: [])
    with pytest.raises(GradAccConfigError) as info:
        _trainer("mixtral", str(tmp_path)).train(resume_from_checkpoint=os.path.join(mixtral_run, "checkpoint-1"))
    message = str(info.value)
    for part in ("model.layers.0.mlp.experts.down_proj", "block_sparse_moe.experts.0.w1.weight",
                 f"transformers {transformers.__version__}", "MixtralForCausalLM.from_pretrained(",
                 "without `resume_from_checkpoint`"):  # fmt: skip
        assert part in message, (part, message)


def test_a_saved_tensor_the_model_does_not_take_is_refused(mixtral_run, tmp_path) -> None:
    """Restored less than it saved: a checkpoint tensor that no tensor of the model takes (here one added to the
    file, the marker rewritten) is named, with the tensors restored all the same."""
    import shutil

    folder = tmp_path / "checkpoint-1"
    shutil.copytree(os.path.join(mixtral_run, "checkpoint-1"), folder)
    weights = str(folder / "model.safetensors")
    state = safetensors.torch.load_file(weights)
    safetensors.torch.save_file({**state, "model.layers.0.extra.weight": torch.ones(2)}, weights, metadata={"format": "pt"})
    ckpt._write_marker(str(folder))
    with pytest.raises(GradAccConfigError, match=r"1 saved tensors go to no tensor of the model \(model\.layers\.0\.extra\.weight\)"):
        _trainer("mixtral", str(tmp_path / "out")).train(resume_from_checkpoint=str(folder))


def test_another_ranks_unrestored_checkpoint_stops_every_rank(mixtral_run, tmp_path, monkeypatch) -> None:
    """The verdict is gathered (faked: rank 1 found a tensor missing): this rank, whose load is whole, raises too."""
    gathered = checkpoints._gathered  # the checkpoint's other verdicts (its folder, its record) as they are

    def rank_1_found_one(value):
        if value is None or isinstance(value, str):  # the restore's verdict
            return [value, "rank 1: the checkpoint's weights do not restore X"]
        return gathered(value)

    monkeypatch.setattr(checkpoints, "_gathered", rank_1_found_one)
    with pytest.raises(GradAccConfigError, match="rank 1: the checkpoint's weights do not restore X"):
        _trainer("mixtral", str(tmp_path)).train(resume_from_checkpoint=os.path.join(mixtral_run, "checkpoint-1"))


def test_tied_weights_saved_once_are_restored_through_their_twin(tmp_path) -> None:
    """A model whose output head shares the embedding (saved once, under one of the two names) resumes as the
    uninterrupted run: the other name holds the same memory, so it is restored too, and nothing is refused."""
    from hf_gradacc.testing.tiny import build_tiny_model

    def trainer(out: str) -> GradAccTrainer:
        model = build_tiny_model("causal_lm")
        model.config.tie_word_embeddings = True
        model.tie_weights()
        args = one_step_args(out, args_class=GradAccConfig, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                             max_steps=STEPS, save_strategy="steps", save_steps=1, optim="adamw_torch", learning_rate=1e-2)  # fmt: skip
        return GradAccTrainer(model=model, args=args, train_dataset=ListDataset(make_samples("causal_lm", BS * GA * STEPS, seed=5)),
                              data_collator=PaddingCollator())  # fmt: skip

    full = trainer(str(tmp_path / "full"))
    assert full.model.lm_head.weight is full.model.model.embed_tokens.weight
    full.train()
    saved = safetensors.torch.load_file(str(tmp_path / "full" / "checkpoint-1" / "model.safetensors"))
    assert len({"lm_head.weight", "model.embed_tokens.weight"} & set(saved)) == 1, "saved once"
    resumed = trainer(str(tmp_path / "resumed"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), dict(full.model.named_parameters())[name].detach(), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_load_best_model_at_end_restores_the_best_checkpoints_experts(family, tmp_path, caplog) -> None:
    """`load_best_model_at_end=True` loads the best checkpoint by name too: with the best one an earlier step's
    (greater eval loss is better here), the model ends with every weight of that checkpoint, converted as
    `from_pretrained` converts it, not with the last step's experts and router."""
    args = one_step_args(str(tmp_path / "run"), args_class=GradAccConfig, per_device_train_batch_size=BS,
                         gradient_accumulation_steps=GA, max_steps=STEPS, save_strategy="steps", save_steps=1,
                         eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                         metric_for_best_model="loss", greater_is_better=True, optim="adamw_torch",
                         learning_rate=1e-2)  # fmt: skip
    samples = make_samples("causal_lm", BS * GA * STEPS, seed=5)
    trainer = GradAccTrainer(model=_tiny(family), args=args, train_dataset=ListDataset(samples),
                             eval_dataset=ListDataset(samples[:4]), data_collator=PaddingCollator())  # fmt: skip
    last = {}

    class KeepLast(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):  # the last one: before the best is loaded
            last.update({n: p.detach().clone() for n, p in model.named_parameters()})

    trainer.add_callback(KeepLast())
    with caplog.at_level(logging.WARNING):
        trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-1"), best
    expected = dict(type(trainer.model).from_pretrained(best).named_parameters())
    experts = _experts(expected)
    assert experts and any(not torch.equal(last[n], expected[n]) for n in experts), "the best step's experts differ"
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name].detach(), rtol=0, atol=0, msg=name)
    assert any("`load_best_model_at_end`" in r.getMessage() for r in caplog.records)
