"""`router_balance="global_batch"`: the router load-balancing loss formed ONCE over every routed token of the step
(definition B) gives the same update at 8 x 1, 2 x 4 and 1 x 8 micro-batches, exact against the float64 reference
of B (hf_gradacc.testing.moe_reference, written from the definition), on tiny Mixtral and Qwen3-MoE with mixed
lengths and padding; a count off by one token, or per-micro-batch fractions, fail the same comparison."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccTrainer
from hf_gradacc.moe_balance import LOAD_KEY, StepRouting
from hf_gradacc.testing.moe_reference import global_balance_gradients
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare, reference_gradients
from hf_gradacc.testing.tiny import MOE_FAMILIES, PaddingCollator, build_tiny_moe, make_samples

TOLERANCE = 1e-5  # the whole update, float32 against float64
ROUTER_TOLERANCE = 5e-5  # the router weights alone (a small-norm slice; see test_moe.py)
NUM_SAMPLES = 8
SPLITS = [(8, 1), (2, 4), (1, 8)]  # (per_device_train_batch_size, gradient_accumulation_steps)


def _router(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g for n, g in update.items() if n.endswith("mlp.gate.weight")}


def _samples():
    return make_samples("causal_lm", NUM_SAMPLES, seed=27)  # mixed lengths, masked prompts, padding


def _train(family: str, bs: int, ga: int, *, coef: float = 0.1, **knobs):
    model = build_tiny_moe(family, router_aux_loss_coef=coef)
    args = one_step_args(per_device_train_batch_size=bs, gradient_accumulation_steps=ga, args_class=GradAccConfig,
                         router_balance="global_batch", **knobs)  # fmt: skip
    update, trainer = one_step_update(GradAccTrainer, model, _samples(), args)
    return model, update, trainer


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_global_batch_is_exact_and_split_invariant(family: str) -> None:
    reference = None
    for bs, ga in SPLITS:
        model, update, trainer = _train(family, bs, ga)
        if reference is None:
            reference = global_balance_gradients(model, _samples(), PaddingCollator())
        whole = compare(update, reference)
        router = compare(_router(update), _router(reference))
        assert whole.relative_error <= TOLERANCE, (bs, ga, whole)
        assert router.relative_error <= ROUTER_TOLERANCE, (bs, ga, router)
        logs = trainer.state.log_history[0]
        assert logs["loss"] == pytest.approx(logs["loss/main"] + logs["loss/aux"], rel=1e-6) and logs["loss/aux"] > 0
        assert logs[LOAD_KEY] >= 1.0 and f"{LOAD_KEY}/layer_1" in logs


@pytest.mark.parametrize("family", ["mixtral"])
def test_micro_batch_rule_is_not_definition_b(family: str) -> None:
    """The default per-micro-batch rule at 1 x 8 is far from B (what the reference must tell apart) and exact
    against its own definition; at 8 x 1 (one micro-batch) both rules are the same step."""
    model = build_tiny_moe(family, router_aux_loss_coef=0.1)
    reference_b = global_balance_gradients(model, _samples(), PaddingCollator())
    micro_batches: list = []
    args = one_step_args(per_device_train_batch_size=1, gradient_accumulation_steps=8, args_class=GradAccConfig)
    update, trainer = one_step_update(GradAccTrainer, model, _samples(), args, micro_batches=micro_batches)
    reference_a = reference_gradients(model, _samples(), "causal_lm", PaddingCollator(), micro_batches=micro_batches)
    assert compare(_router(update), _router(reference_a)).relative_error <= ROUTER_TOLERANCE
    assert compare(_router(update), _router(reference_b)).relative_error > 0.1
    assert trainer.state.log_history[0][LOAD_KEY] >= 1.0  # logged in both modes
    one = one_step_args(per_device_train_batch_size=8, gradient_accumulation_steps=1, args_class=GradAccConfig)
    single, _ = one_step_update(GradAccTrainer, model, _samples(), one)
    assert compare(_router(single), _router(reference_b)).relative_error <= ROUTER_TOLERANCE


def _one_token_moved(counts: torch.Tensor) -> torch.Tensor:
    moved = counts.clone()
    moved[..., 0] += 1
    moved[..., 1] -= 1
    return moved


@pytest.mark.parametrize("family", ["mixtral"])
def test_a_count_off_by_one_token_fails(family: str, monkeypatch) -> None:
    """One top-k assignment moved between two experts in the step's global count (or each micro-batch's own counts
    in place of the step's) and the router update leaves the tolerance."""
    model, exact, _ = _train(family, 2, 4)
    reference = global_balance_gradients(model, _samples(), PaddingCollator())
    assert compare(_router(exact), _router(reference)).relative_error <= ROUTER_TOLERANCE
    # the reference itself tells a one-token difference apart
    moved_reference = global_balance_gradients(model, _samples(), PaddingCollator(), perturb=_one_token_moved)
    assert compare(_router(moved_reference), _router(reference)).relative_error > 10 * ROUTER_TOLERANCE

    original = StepRouting.global_term

    def off_by_one(self, *args, **kwargs):
        if not getattr(self, "_moved", False):
            self.global_counts = self.global_counts.clone()
            self.global_counts[-1, 0] += 1
            self.global_counts[-1, 1] -= 1
            self._moved = True
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StepRouting, "global_term", off_by_one)
    _, moved, _ = _train(family, 2, 4)
    assert compare(_router(moved), _router(reference)).relative_error > 10 * ROUTER_TOLERANCE

    def per_micro_batch(self, outputs, attention_mask, coef, *, index, model_aux=None):
        self.global_counts = self.prepass[index]  # this micro-batch's own f (and R), as the micro_batch rule has
        return original(self, outputs, attention_mask, coef, index=index, model_aux=model_aux)

    monkeypatch.setattr(StepRouting, "global_term", per_micro_batch)
    _, local, _ = _train(family, 2, 4)
    assert compare(_router(local), _router(reference)).relative_error > 10 * ROUTER_TOLERANCE


def test_activation_checkpointing_counts_once(monkeypatch) -> None:
    """With gradient checkpointing the routers run twice per micro-batch in training (forward, recomputation) besides
    the pre-pass; the step's counts come from the pre-pass and each training forward's returned router logits, never
    from the recomputation: exact, and the logged load is the same as without checkpointing."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    calls = []
    original = MixtralTopKRouter.forward
    monkeypatch.setattr(MixtralTopKRouter, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    model, plain, plain_trainer = _train("mixtral", 2, 4)
    assert len(calls) == 2 * 4 * 2  # 2 layers x 4 micro-batches x (pre-pass, forward)
    calls.clear()
    _, checkpointed, trainer = _train("mixtral", 2, 4, gradient_checkpointing=True)
    assert len(calls) == 2 * 4 * 3  # ... and the recomputation
    reference = global_balance_gradients(model, _samples(), PaddingCollator())
    assert trainer.model.is_gradient_checkpointing
    assert compare(checkpointed, reference).relative_error <= TOLERANCE
    assert compare(_router(checkpointed), _router(reference)).relative_error <= ROUTER_TOLERANCE
    before, after = plain_trainer.state.log_history[0], trainer.state.log_history[0]
    assert after[LOAD_KEY] == pytest.approx(before[LOAD_KEY], rel=1e-12)


def test_regrouped_is_exact() -> None:
    model, update, _ = _train("qwen3_moe", 2, 4, regroup_micro_batches=True)
    reference = global_balance_gradients(model, _samples(), PaddingCollator())
    assert compare(update, reference).relative_error <= TOLERANCE
    assert compare(_router(update), _router(reference)).relative_error <= ROUTER_TOLERANCE


def test_packed_fused_head_and_backward_per_term_are_exact(monkeypatch) -> None:
    """Packed rows (no attention mask: every position is a routed token, as the model counts it), the fused LM head
    (the router logits come from the backbone's outputs) and one backward pass per term: each exact against B."""
    from hf_gradacc.data.attention_cost import AttentionCostModel

    # lay every micro-batch out as one packed row, as on a device with a variable-length attention kernel
    monkeypatch.setattr(AttentionCostModel, "for_model", classmethod(lambda cls, model, padded_layout=True: None))
    packed_seen = []
    original = StepRouting.global_term

    def record(self, outputs, attention_mask, coef, *, index, model_aux=None):
        packed_seen.append(attention_mask is None)
        return original(self, outputs, attention_mask, coef, index=index, model_aux=model_aux)

    monkeypatch.setattr(StepRouting, "global_term", record)
    model, packed, trainer = _train("mixtral", 2, 4, pack_micro_batches=True)
    assert packed_seen and all(packed_seen)  # every training forward ran on a packed row (no attention mask)
    monkeypatch.setattr(StepRouting, "global_term", original)
    _, fused, fused_trainer = _train("mixtral", 2, 4, fused_lm_head=True)
    assert fused_trainer.step_engine.fused_head_ran
    _, per_term, _ = _train("mixtral", 2, 4, backward_per_term=True)
    reference = global_balance_gradients(model, _samples(), PaddingCollator())
    for update in (packed, fused, per_term):
        assert compare(update, reference).relative_error <= TOLERANCE
        assert compare(_router(update), _router(reference)).relative_error <= ROUTER_TOLERANCE


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"defer_normalization": True}, "defer_normalization"),
        ({"auto_micro_batch": True}, "auto_micro_batch"),
    ],
)
def test_refused_by_name(knobs: dict, match: str) -> None:
    model = build_tiny_moe("mixtral")
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         router_balance="global_batch", **knobs)  # fmt: skip
    with pytest.raises(GradAccConfigError, match=rf"router_balance='global_batch'.*{match}"):
        one_step_update(GradAccTrainer, model, _samples(), args)


def test_random_routing_is_refused_by_name() -> None:
    model = build_tiny_moe("mixtral")
    model.config.router_jitter_noise = 0.1
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         router_balance="global_batch")  # fmt: skip
    with pytest.raises(GradAccConfigError, match=r"router_jitter_noise=0.1"):
        one_step_update(GradAccTrainer, model, _samples(), args)


def test_unreadable_router_statistics_are_refused_by_name() -> None:
    """A model without the `num_experts` / `num_experts_per_tok` its balance loss is called with is refused at
    ``train()``, before any forward; one whose own aux_loss is not E x sum f x P of its router logits is refused on
    its first forward."""
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         router_balance="global_batch")  # fmt: skip
    model = build_tiny_moe("qwen3_moe")
    del model.num_experts
    with pytest.raises(GradAccConfigError, match=r"Qwen3MoeForCausalLM's router statistics cannot be read"):
        one_step_update(GradAccTrainer, model, _samples(), args)

    class DoubledAux(type(build_tiny_moe("mixtral"))):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            outputs = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
            outputs.aux_loss = outputs.aux_loss * 2
            return outputs

    base = build_tiny_moe("mixtral")
    doubled = DoubledAux(base.config)
    doubled.load_state_dict(base.state_dict())
    with pytest.raises(GradAccConfigError, match=r"own load-balancing loss .* is not E x sum_e f_e x P_e"):
        one_step_update(GradAccTrainer, doubled, _samples(), args)


def test_cli_check_scenario_moe_global(tmp_path, capsys) -> None:
    """`hf-gradacc check --scenario moe_global`: three rows against definition B; only the global one is exact."""
    import json

    from hf_gradacc.commands.check.moe_rows import GLOBAL_NAME, MICRO_NAME, STOCK_NAME
    from hf_gradacc.commands.hf_gradacc_cli import main

    report = tmp_path / "check.json"
    assert main(["check", "--scenario", "moe_global", "--json", str(report)]) == 0
    results = json.loads(report.read_text())["results"]
    assert results[GLOBAL_NAME]["relative_error"] <= TOLERANCE
    assert results[MICRO_NAME]["relative_error"] > 100 * TOLERANCE and results[STOCK_NAME]["relative_error"] > 1e-3
    out = capsys.readouterr().out
    assert "definition B" in out and "The router weights alone" in out


def test_example_prints_its_numbers(tmp_path) -> None:
    """examples/moe_global_balance.py: global_batch within the router tolerance at both splits, micro_batch off by
    more than 1 % and different at the two splits; training logs the expert load."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "moe_global_balance.py"
    spec = importlib.util.spec_from_file_location("moe_global_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_global_example"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    result = module.main(["--output_dir", str(tmp_path), "--max_steps", "1", "--num_samples", "16", "--report_to",
                          "none", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                          "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"])  # fmt: skip
    assert result["global_batch_2x4"] <= ROUTER_TOLERANCE and result["global_batch_1x8"] <= ROUTER_TOLERANCE
    assert min(result["micro_batch_2x4"], result["micro_batch_1x8"]) > 1e-2
    assert abs(result["micro_batch_2x4"] - result["micro_batch_1x8"]) > 1e-2
    assert result["steps"] == 1 and result["load"] >= 1.0


def _tiny_other_moe(name: str) -> torch.nn.Module:
    import transformers as tf

    from hf_gradacc.testing.tiny import PAD_TOKEN_ID, VOCAB_SIZE

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, num_experts_per_tok=2, router_aux_loss_coef=0.1,
                  output_router_logits=True, tie_word_embeddings=False, pad_token_id=PAD_TOKEN_ID)  # fmt: skip
    if name == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(num_experts=4, **common))
    if name == "qwen2_moe":  # a shared expert beside the routed ones
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=32, **common))  # fmt: skip
    if name == "granitemoe":
        return tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(num_local_experts=4, **common))
    if name == "gpt_oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(num_local_experts=4, head_dim=8, layer_types=["full_attention"] * 2,
                                                    **common))  # fmt: skip
    return tf.PhimoeForCausalLM(tf.PhimoeConfig(num_local_experts=4, **common))  # router_jitter_noise 0.01 by default


def test_other_architectures() -> None:
    """OLMoE, Qwen2-MoE (shared expert), GraniteMoE and gpt-oss read the same way: exact against B at 2 x 4. PhiMoE
    routes at random in training (router jitter 0.01 by default): refused by name."""
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         router_balance="global_batch")  # fmt: skip
    for name in ("olmoe", "qwen2_moe", "granitemoe", "gpt_oss"):
        model = _tiny_other_moe(name)
        update, _ = one_step_update(GradAccTrainer, model, _samples(), args)
        reference = global_balance_gradients(model, _samples(), PaddingCollator())
        router = [n for n in reference if n.endswith("gate.weight") or n.endswith("router.weight")]
        assert router, name
        assert compare(update, reference).relative_error <= TOLERANCE, name
        assert compare({n: update[n] for n in router}, {n: reference[n] for n in router}).relative_error <= ROUTER_TOLERANCE
    with pytest.raises(GradAccConfigError, match=r"router_jitter_noise=0.01"):
        one_step_update(GradAccTrainer, _tiny_other_moe("phimoe"), _samples(), args)


def test_make_exact_takes_router_balance() -> None:
    """`make_exact(Trainer(...), router_balance="global_batch")` trains definition B too."""
    from transformers import Trainer

    from hf_gradacc import make_exact
    from hf_gradacc.testing.tiny import ListDataset

    model = build_tiny_moe("mixtral", router_aux_loss_coef=0.1)
    work = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in work.named_parameters()}
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    trainer = Trainer(model=work, args=args, train_dataset=ListDataset(_samples()), data_collator=PaddingCollator())
    make_exact(trainer, router_balance="global_batch").train()
    update = {n: before[n] - p.detach() for n, p in work.named_parameters()}
    reference = global_balance_gradients(model, _samples(), PaddingCollator())
    assert compare(update, reference).relative_error <= TOLERANCE
    assert compare(_router(update), _router(reference)).relative_error <= ROUTER_TOLERANCE


def test_accumulation_schedule_window_is_the_pre_pass_window() -> None:
    """Under `accumulation_schedule` the step's window (here 4 micro-batches where GA says 1) is what the pre-pass
    counts: exact against B over the 8 samples of the scheduled step."""
    model, update, trainer = _train("mixtral", 2, 1, accumulation_schedule="0:4")
    assert trainer.state.global_step == 1
    reference = global_balance_gradients(model, _samples(), PaddingCollator())
    assert compare(update, reference).relative_error <= TOLERANCE
    assert compare(_router(update), _router(reference)).relative_error <= ROUTER_TOLERANCE


def test_trl_sft_trainer_is_refused_by_name(tmp_path) -> None:
    """GradAccSFTTrainer computes its own loss (TRL's): `"global_batch"` is refused by name at construction."""
    pytest.importorskip("trl")
    from datasets import Dataset

    from hf_gradacc.testing.trl_steps import sft_rows, word_tokenizer
    from hf_gradacc.trl import GradAccSFTConfig, GradAccSFTTrainer

    args = one_step_args(str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         args_class=GradAccSFTConfig, bf16=False, router_balance="global_batch")  # fmt: skip
    with pytest.raises(GradAccConfigError, match=r"router_balance='global_batch'.*GradAccSFTTrainer computes its own loss"):
        GradAccSFTTrainer(model=build_tiny_moe("mixtral"), args=args, train_dataset=Dataset.from_list(sft_rows()),
                          processing_class=word_tokenizer())
