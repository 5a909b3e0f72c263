"""`fused_lm_head=True`: the causal LM's head only where a target counts, in tiles, no [tokens x vocabulary] logits.

Exact against the float64 full-batch reference (mixed lengths, many ignored labels, GA 4) for Llama, Llama with tied
embeddings, Llama with LoRA adapters on the head (PEFT), Gemma 2 (final-logit softcapping), Cohere (logit scale) and
mixtures of experts (Mixtral, Qwen3-MoE: the router term beside the fused loss); a 1 % denominator error is outside
the tolerance; the start-up check stops a model whose logit transform the fused head does not apply; no logit-sized
tensor is saved for backward; the head projects exactly the counted targets; evaluation keeps the full logits."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import transformers as tf

import hf_gradacc.fused.head as fused_head
from hf_gradacc import GradAccConfig, GradAccConfigError, GradAccLossError, GradAccTrainer, GradAccUsageError
from hf_gradacc.fused.head import LogitTransform, fused_cross_entropy_sum
from hf_gradacc.testing.one_step import compare_with_reference, one_step_args, one_step_update
from hf_gradacc.testing.tiny import VOCAB_SIZE, PaddingCollator, build_tiny_model, build_tiny_moe, make_samples

TOLERANCE = 1e-5  # float32 update against the float64 reference; a 1 % denominator error is 1e-2


def _small(config_class, **extra):
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)  # fmt: skip
    return config_class(**{**common, **extra})


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return build_tiny_model("causal_lm")
    if name == "llama_tied":
        return tf.LlamaForCausalLM(_small(tf.LlamaConfig, tie_word_embeddings=True))
    if name == "gemma2_softcap":  # logits up to ~7 and a cap of 2: the softcapping changes the loss a lot
        config = _small(tf.Gemma2Config, head_dim=8, final_logit_softcapping=2.0, attn_logit_softcapping=None,
                        query_pre_attn_scalar=8, sliding_window=256)  # fmt: skip
        config._attn_implementation = "eager"
        model = tf.Gemma2ForCausalLM(config)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(20.0)  # tied: the embeddings too
        return model
    if name == "llama_lora_on_head":  # PEFT: LoRA on the attention and on the LM head itself
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
        return peft.get_peft_model(build_tiny_model("causal_lm"), config)
    if name == "cohere_scale":
        return tf.CohereForCausalLM(_small(tf.CohereConfig, logit_scale=0.25, tie_word_embeddings=True))
    if name == "granite_scaling":  # Granite DIVIDES its logits by logits_scaling (Cohere multiplies by logit_scale)
        model = tf.GraniteForCausalLM(_small(tf.GraniteConfig, logits_scaling=4.0, embedding_multiplier=2.0,
                                             residual_multiplier=0.5, attention_multiplier=0.25))  # fmt: skip
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(20.0)  # logits well above 1: a scale x16 off is far from exact
        return model
    raise ValueError(name)


def _args(fused, **extra):
    return one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         fused_lm_head=fused, **extra)  # fmt: skip


@pytest.mark.parametrize(
    "name", ["llama", "llama_tied", "llama_lora_on_head", "gemma2_softcap", "cohere_scale", "granite_scaling"]
)
@pytest.mark.parametrize("check", [True, False])
def test_fused_head_is_exact(name: str, check: bool) -> None:
    """Exact with the start-up check on and off (off, only the comparison with float64 can see a wrong transform)."""
    model = _model(name)
    samples = make_samples("causal_lm", 8, seed=3)
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(True, check_loss_at_start=check))
    comparison = compare_with_reference(update, model, samples, "causal_lm")
    assert comparison.relative_error <= TOLERANCE, comparison
    changed = [n for n, u in update.items() if float(u.abs().max()) > 0]
    assert len(changed) == len(update), sorted(set(update) - set(changed))


def test_a_one_percent_denominator_error_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactness test can fail: the same fused run with every loss divided by 1.01 (a denominator 1 % too
    large) is far outside the tolerance."""
    original = fused_head.fused_cross_entropy_sum
    monkeypatch.setattr(fused_head, "fused_cross_entropy_sum", lambda *a, **k: original(*a, **k) / 1.01)
    model = _model("llama")
    samples = make_samples("causal_lm", 8, seed=3)
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(True, check_loss_at_start=False))
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error > 5e-3


def test_many_tiles_per_micro_batch_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 3 rows (the tiny vocabulary otherwise fits one tile): the weight gradient is summed over many tiles."""
    monkeypatch.setattr(fused_head, "tile_rows_for", lambda vocab_size, tile_elements=0: 3)
    model = _model("llama")
    samples = make_samples("causal_lm", 8, seed=3)
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(True))
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOLERANCE


def _update_distance(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in b)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


@pytest.mark.parametrize("off_by", [1.0, 1.01])
@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_bf16_fused_head_is_as_close_to_the_float32_run_as_the_full_logits(
    monkeypatch: pytest.MonkeyPatch, mode: str, off_by: float
) -> None:
    """bf16 (``bf16=True``: autocast; or a model cast to bf16) with tiles of 3 rows: the fused update is as far from
    the same run in float32 as the full-logits update in bf16 is (within 15 %), and a loss 1 % off is not."""
    samples = make_samples("causal_lm", 16, seed=1, min_length=4, max_length=60)

    def update(fused: bool, bf16: bool):
        model = _model("llama")
        if bf16 and mode == "bf16_weights":
            model = model.to(torch.bfloat16)
        extra = {"bf16": True} if bf16 and mode == "autocast" else {}
        args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=8, args_class=GradAccConfig,
                             fused_lm_head=fused, check_loss_at_start=False, **extra)  # fmt: skip
        return one_step_update(GradAccTrainer, model, samples, args)[0]

    float32 = update(False, False)
    head = {"lm_head.weight": float32["lm_head.weight"]}  # summed over the tiles: where the rounding would add up
    bf16_full = update(False, True)
    full_logits, full_head = _update_distance(bf16_full, float32), _update_distance(bf16_full, head)
    monkeypatch.setattr(fused_head, "tile_rows_for", lambda vocab_size, tile_elements=0: 3)
    original = fused_head.fused_cross_entropy_sum
    monkeypatch.setattr(fused_head, "fused_cross_entropy_sum", lambda *a, **k: original(*a, **k) / off_by)
    bf16_fused = update(True, True)
    fused, fused_head_distance = _update_distance(bf16_fused, float32), _update_distance(bf16_fused, head)
    assert 0 < full_logits < 3e-2
    if off_by == 1.0:
        assert fused <= 1.15 * full_logits, (fused, full_logits)
        assert fused_head_distance <= 1.1 * full_head, (fused_head_distance, full_head)
    else:  # the tier catches a denominator 1 % off
        assert fused > 1.15 * full_logits, (fused, full_logits)


def test_the_start_up_check_stops_a_transform_the_fused_head_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_head.LogitTransform, "of", classmethod(lambda cls, model: cls()))  # softcap forgotten
    model = _model("gemma2_softcap")
    samples = make_samples("causal_lm", 8, seed=3)
    with pytest.raises(GradAccLossError, match=r"differs from the model's own loss.*fused_lm_head"):
        one_step_update(GradAccTrainer, model, samples, _args(True))


def test_the_transform_is_read_from_the_model() -> None:
    assert LogitTransform.of(_model("gemma2_softcap")) == LogitTransform(scale=1.0, softcap=2.0)
    assert LogitTransform.of(_model("cohere_scale")) == LogitTransform(scale=0.25, softcap=None)
    assert LogitTransform.of(_model("granite_scaling")) == LogitTransform(scale=0.25, softcap=None)
    assert LogitTransform.of(_model("llama")) == LogitTransform()


TRANSFORMS = {  # softcapping or smoothing: autograd on the tile's logits; a scale alone: the softmax written by hand
    "softcap_smoothing": (LogitTransform(scale=0.7, softcap=2.0), 0.1),
    "scale": (LogitTransform(scale=0.7), 0.0),
    "none": (LogitTransform(), 0.0),
}


@pytest.mark.parametrize("transform_name", list(TRANSFORMS))
@pytest.mark.parametrize("path", ["linear", "generic_module", "frozen_bias"])
def test_tiles_equal_the_full_logits_and_an_empty_tile_reaches_the_head(path: str, transform_name: str) -> None:
    # "linear": the head's own bound forward (as the trainer passes it), gradients written by hand; "generic_module":
    # the module itself, any layer (PEFT adapters on the head go this way), gradients by autograd per tile
    transform, smoothing = TRANSFORMS[transform_name]
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    if path == "frozen_bias":
        head.bias.requires_grad_(False)
    call = head if path == "generic_module" else head.forward
    hidden = torch.randn(23, 8, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    targets[::4] = -100
    tiled = fused_cross_entropy_sum(hidden, call, targets, transform=transform, tile_rows=5, label_smoothing=smoothing)
    (tiled * 0.37).backward()  # the backward pass scales the gradients computed in the forward pass
    trained = [head.weight] + ([head.bias] if head.bias.requires_grad else [])
    tiled_grads = [hidden.grad.clone()] + [p.grad.clone() for p in trained]
    hidden.grad = None
    for p in trained:
        p.grad = None
    full = torch.nn.functional.cross_entropy(
        transform(head(hidden)), targets, reduction="sum", label_smoothing=smoothing
    )
    (full * 0.37).backward()
    torch.testing.assert_close(tiled, full)
    for a, b in zip(tiled_grads, [hidden.grad] + [p.grad for p in trained]):
        torch.testing.assert_close(a, b)
    assert path != "frozen_bias" or head.bias.grad is None
    head.weight.grad = None
    empty = fused_cross_entropy_sum(hidden[:0], call, targets[:0])
    empty.backward()
    assert float(empty.detach()) == 0.0 and head.weight.grad is not None and float(head.weight.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("path", ["linear", "generic_module"])
def test_bf16_tiles_are_as_close_to_float64_as_the_full_logits(path: str) -> None:
    """A bf16 head and bf16 hidden states, the loss divided by 3 (1/3 is not a bf16 number): the tiles' gradients are
    no further from float64 than the full logits' bf16 gradients, with no scale error (a factor rounded to bf16
    would be 0.19 % off on every element). "generic_module": the head called as a module (PEFT's `modules_to_save`
    copy, adapters), each tile differentiated by autograd: its bf16 gradients are summed over the tiles in float32
    too (summed in bf16, the head's gradient is 1.8x as far from float64 as the full logits')."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False).to(torch.bfloat16)
    hidden = torch.randn(400, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 500, (400,))
    call = head.forward if path == "linear" else head
    (fused_cross_entropy_sum(hidden, call, targets, tile_rows=37) / 3).backward()
    fused = [hidden.grad.double(), head.weight.grad.double()]
    hidden.grad, head.weight.grad = None, None
    (torch.nn.functional.cross_entropy(head(hidden).float(), targets, reduction="sum") / 3).backward()
    full = [hidden.grad.double(), head.weight.grad.double()]
    h64, w64 = hidden.detach().double().requires_grad_(True), head.weight.detach().double().requires_grad_(True)
    (torch.nn.functional.cross_entropy(h64 @ w64.T, targets, reduction="sum") / 3).backward()
    for ours, theirs, exact in zip(fused, full, [h64.grad, w64.grad]):
        assert abs(float(ours.norm() / exact.norm()) - 1) < 6e-4
        assert float((ours - exact).norm()) <= 1.05 * float((theirs - exact).norm())


@pytest.mark.parametrize("retain_graph", [False, True])
def test_the_tiles_gradients_are_handed_on_once_and_then_dropped(retain_graph: bool) -> None:
    """The backward pass drops the loss node's reference to the tiles' gradients (so the head's `.grad` can be that
    buffer, with no copy, also under retain_graph), and a second backward pass through the same fused loss is refused
    by name instead of handing on gradients scaled twice."""
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(6, 8, requires_grad=True)
    total = fused_cross_entropy_sum(hidden, head.forward, torch.randint(0, 50, (6,)), tile_rows=2)
    assert total.grad_fn.grads is not None
    total.backward(retain_graph=retain_graph)
    assert total.grad_fn.grads is None
    with pytest.raises(GradAccUsageError, match="second backward pass through the same fused LM-head loss"):
        total.backward()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_no_logit_sized_tensor_is_saved_and_the_head_projects_only_counted_targets(smoothing: float) -> None:
    # smoothing 0: the hand-written softmax saves nothing; 0.1: each tile goes through autograd, which saves its
    # logits while the tile's gradients are computed
    from tests.unit.test_startup_check_memory import HIDDEN, MIN_LENGTH, LiveLogitSizedSaves

    model = build_tiny_model("causal_lm", hidden_size=HIDDEN)
    samples = make_samples("causal_lm", 4, seed=1, min_length=MIN_LENGTH, max_length=MIN_LENGTH + 8)
    rows: list[int] = []

    class Counting(GradAccTrainer):
        def create_optimizer(self, *args, **kwargs):
            def count(_module, _args, output):
                # the training forward: not the start-up check's row (no gradient), not a backward recomputation
                if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                    rows.append(getattr(output, "fused_rows", -1))

            self.model.get_output_embeddings().register_forward_hook(count)
            return super().create_optimizer(*args, **kwargs)

    probe = LiveLogitSizedSaves(VOCAB_SIZE)
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=2, args_class=GradAccConfig,
                         fused_lm_head=True, label_smoothing_factor=smoothing)  # fmt: skip
    live_at_backward: list[int] = []
    backward = torch.autograd.backward

    def counting_backward(*args, **kwargs):
        live_at_backward.append(len(set(probe.live.values())))
        return backward(*args, **kwargs)

    with probe.hooks(), mock.patch.object(torch.autograd, "backward", counting_backward):
        update, _ = one_step_update(Counting, model, samples, args)
    # each tile's logits are saved only while its gradients are computed, in the forward pass: none is alive when
    # the backward pass starts, and at most one tile's (its logits and their softmax) at any time
    assert live_at_backward == [0, 0] and probe.peak <= 2
    assert (probe.num_saved > 0) == (smoothing > 0)  # what the peak is measured on: tiles that do save their logits
    batches = [PaddingCollator()(samples[i : i + 2]) for i in (0, 2)]
    counted = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    assert sum(rows) == counted and len(rows) == 2
    if smoothing == 0.0:  # the reference has no label smoothing (its fused exactness: test_label_smoothing_goes_through_the_fused_head)
        assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOLERANCE


def test_evaluation_keeps_the_full_logits() -> None:
    model = _model("llama")
    samples = make_samples("causal_lm", 4, seed=3)
    from hf_gradacc.testing.tiny import ListDataset

    trainer = GradAccTrainer(model=model, args=_args(True), train_dataset=ListDataset(samples),
                             eval_dataset=ListDataset(samples), data_collator=PaddingCollator())  # fmt: skip
    output = trainer.predict(ListDataset(samples))
    assert output.predictions.shape[-1] == VOCAB_SIZE and output.metrics["test_loss"] > 0


def test_unsupported_setups_are_refused() -> None:
    samples = make_samples("sequence_classification", 4, seed=3)
    with pytest.raises(GradAccConfigError, match=r"fused_lm_head=True.*'sequence_classification'"):
        one_step_update(GradAccTrainer, build_tiny_model("sequence_classification"), samples, _args(True))
    with pytest.raises(GradAccConfigError, match="fused_lm_head"):
        one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=1, args_class=GradAccConfig,
                      fused_lm_head="yes")  # fmt: skip


def test_on_several_processes_only_the_causal_lm_head_is_accepted() -> None:
    """Several processes: every backend GradAccTrainer resolves (DDP, DeepSpeed, FSDP2; others are refused by
    ``resolve_backend``) runs the fused causal-LM head (tests/distributed/test_fused_head.py); the seq2seq and
    masked-LM heads are refused there, naming the head."""
    model = build_tiny_model("causal_lm")
    assert fused_head.fused_support_problem(model, "causal_lm") is None  # one process
    assert fused_head.fused_support_problem(model, "causal_lm", distributed=True) is None
    problem = fused_head.fused_support_problem(build_tiny_model("masked_lm"), "masked_lm", distributed=True)
    assert problem is not None and "'masked_lm' head is tested on one process only" in problem


def test_the_setting_is_checked_once_at_construction(monkeypatch) -> None:
    """A model the fused head cannot run is refused when the trainer is built, and the step does not check again."""
    from hf_gradacc.testing.tiny import ListDataset, PaddingCollator

    args = _args(True)
    with pytest.raises(GradAccConfigError, match=r"fused_lm_head=True.*'sequence_classification'"):
        GradAccTrainer(model=build_tiny_model("sequence_classification"), args=args,
                       train_dataset=ListDataset(make_samples("sequence_classification", 4)),
                       data_collator=PaddingCollator())  # fmt: skip
    calls = []
    original = fused_head.fused_support_problem
    monkeypatch.setattr(fused_head, "fused_support_problem", lambda *a, **k: calls.append(1) or original(*a, **k))
    one_step_update(GradAccTrainer, build_tiny_model("causal_lm"), make_samples("causal_lm", 8, seed=3), args)
    assert calls == [1]


@pytest.mark.parametrize(("family", "per_term"), [("mixtral", False), ("qwen3_moe", False), ("mixtral", True)])
def test_the_router_term_of_a_mixture_of_experts_joins_the_fused_loss(family: str, per_term: bool) -> None:
    """The router load-balancing term comes back in the model's outputs and is kept as its own LossTerm (weighted by
    routed tokens, as without the fused head); the start-up check takes it out of the model's own loss.
    ``backward_per_term``: two backward passes through one forward per micro-batch (the fused loss first, with
    ``retain_graph``), the same update."""
    from hf_gradacc.testing.reference import compare, reference_gradients

    model = build_tiny_moe(family)
    samples = make_samples("causal_lm", 7, seed=4)  # a short last micro-batch
    micro_batches: list = []
    args = one_step_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, args_class=GradAccConfig,
                         fused_lm_head=True, backward_per_term=per_term)  # fmt: skip
    update, trainer = one_step_update(GradAccTrainer, model, samples, args, micro_batches=micro_batches)
    reference = reference_gradients(model, samples, "causal_lm", PaddingCollator(), micro_batches=micro_batches)
    assert compare(update, reference).relative_error <= TOLERANCE
    router = [n for n in reference if n.endswith("mlp.gate.weight")]
    assert len(router) == 2
    routed = compare({n: update[n] for n in router}, {n: reference[n] for n in router})
    assert routed.relative_error <= 5e-5  # a small share of the update: as tests/unit/test_moe.py
    logs = trainer.state.log_history[0]
    assert logs["loss"] == pytest.approx(logs["loss/main"] + logs["loss/aux"], rel=1e-6) and logs["loss/aux"] > 0


def test_fused_head_on_packed_micro_batches_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_gradacc.builtin_loss as builtin_loss_module

    rows: list[int] = []
    original = builtin_loss_module.fused_causal_lm_sum

    def spy(model, inputs, targets, **kwargs):
        rows.append(int(targets.shape[0]))
        return original(model, inputs, targets, **kwargs)

    monkeypatch.setattr(builtin_loss_module, "fused_causal_lm_sum", spy)
    model = build_tiny_model("causal_lm")
    model.config._attn_implementation = "sdpa"
    samples = make_samples("causal_lm", 8, seed=3)  # one optimizer step
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(True, pack_micro_batches=True,
                                                                       max_tokens_per_micro_batch=40))  # fmt: skip
    assert len(rows) > 1 and set(rows) == {1}  # several packed rows, each through the fused head
    assert compare_with_reference(update, model, samples, "causal_lm").relative_error <= TOLERANCE


def test_fused_lm_head_with_an_own_loss_is_warned_as_ignored(caplog: pytest.LogCaptureFixture) -> None:
    """A trainer that computes its loss itself never reaches the fused head: the setting is ignored, with a warning."""
    from hf_gradacc.testing.tiny import ListDataset

    class OwnLoss(GradAccTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    samples = ListDataset(make_samples("causal_lm", 4, seed=3))
    tf.utils.logging.enable_propagation()
    with caplog.at_level("WARNING"):
        OwnLoss(model=_model("llama"), args=_args(True), train_dataset=samples, data_collator=PaddingCollator())
    assert "`fused_lm_head=True` is ignored: OwnLoss computes its loss itself" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        GradAccTrainer(model=_model("llama"), args=_args(True), train_dataset=samples, data_collator=PaddingCollator())
    assert "is ignored" not in caplog.text


def test_a_training_step_that_bypasses_the_built_in_loss_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    """An overridden `training_step` that runs the model itself never reaches the fused head: warned as ignored. One
    that calls `self.compute_loss` gets the fused loss (no warning), and a second backward pass through it is refused
    by name."""
    from hf_gradacc.loss import normalize

    class ModelItself(GradAccTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = model(**inputs).loss  # the model's own mean: the full logits
            self.backward(loss, final=self.is_last_micro_batch)
            return loss.detach()

    class TwoPassesThroughTheFusedLoss(GradAccTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = normalize(self.compute_loss(model, inputs).total, self.current_window.global_count("tokens"), 1)
            self.backward(loss / 2, final=False, retain_graph=True)
            self.backward(loss / 2, final=self.is_last_micro_batch)
            return loss.detach()

    samples = make_samples("causal_lm", 8, seed=3)
    tf.utils.logging.enable_propagation()
    with caplog.at_level("WARNING"):
        one_step_update(ModelItself, _model("llama"), samples, _args(True, check_loss_at_start=False))
    assert "`fused_lm_head=True` is ignored: ModelItself.training_step computed a micro-batch's loss" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"), pytest.raises(GradAccUsageError, match="second backward pass through the same"):
        one_step_update(TwoPassesThroughTheFusedLoss, _model("llama"), samples, _args(True))
    assert "is ignored" not in caplog.text


def test_label_smoothing_goes_through_the_fused_head() -> None:
    """`label_smoothing_factor` is applied per tile, as the full logits' loss applies it: exact against the smoothed
    float64 reference of tests/unit/test_label_smoothing.py."""
    from hf_gradacc.testing.reference import compare
    from tests.unit.test_label_smoothing import EPS, _smoothed_reference

    model = build_tiny_model("causal_lm")
    samples = make_samples("causal_lm", 7, seed=41)
    update, _ = one_step_update(GradAccTrainer, model, samples, _args(True, label_smoothing_factor=EPS))
    assert compare(update, _smoothed_reference(model, samples, "causal_lm")).relative_error <= TOLERANCE


@pytest.mark.parametrize("task", ["seq2seq", "masked_lm"])
def test_seq2seq_and_masked_lm_heads_are_exact(task: str) -> None:
    """T5 (the decoder's positions; its tied-embedding rescaling happens before the head) and BERT's masked LM (the
    head's transform runs in the model, the decoder layer in tiles): exact, each counted label projected once."""
    rows: list[int] = []
    original = fused_head._Capture.__call__

    def counting(self, hidden, *args, **kwargs):
        out = original(self, hidden, *args, **kwargs)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            rows.append(self.rows)
        return out

    model = build_tiny_model(task)
    samples = make_samples(task, 8, seed=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_head._Capture, "__call__", counting)
        update, _ = one_step_update(GradAccTrainer, model, samples, _args(True))
    assert compare_with_reference(update, model, samples, task).relative_error <= TOLERANCE
    assert sum(rows) == sum(sum(label != -100 for label in s["labels"]) for s in samples) and len(rows) == 4


def test_a_final_logits_bias_is_refused() -> None:
    model = build_tiny_model("seq2seq")
    model.register_buffer("final_logits_bias", torch.zeros(1, VOCAB_SIZE))
    assert fused_head.fused_support_problem(model, "seq2seq") is None  # zero: nothing to add
    model.final_logits_bias[0, 3] = 1.0
    assert "final_logits_bias" in fused_head.fused_support_problem(model, "seq2seq")


@pytest.mark.parametrize(
    ("task", "fused"),
    [("causal_lm", True), ("causal_lm", False), ("seq2seq", True), ("seq2seq", False), ("sequence_classification", False)],
)
def test_any_ignore_index_is_exact_and_checked_at_start(task: str, fused: bool, caplog: pytest.LogCaptureFixture) -> None:
    """`ignore_index=-1` (labels and padding -1, about half the labels ignored): exact against the float64 reference
    with and without the fused head, and the start-up loss check runs (the model is handed its own -100, not -1,
    which it would take as a target: an IndexError with the fused head, a skipped check without it)."""
    samples = make_samples(task, 8, seed=3)
    for i, sample in enumerate(samples):
        if task == "sequence_classification":  # one label per row: every third row ignored
            sample["labels"] = -1 if i % 3 == 0 else sample["labels"]
        else:
            sample["labels"] = [-1 if label == -100 else label for label in sample["labels"]]
    collate = PaddingCollator(ignore_index=-1)
    model = build_tiny_model(task) if task != "causal_lm" else _model("llama")
    tf.utils.logging.enable_propagation()
    with caplog.at_level("WARNING"):
        update, _ = one_step_update(GradAccTrainer, model, samples, _args(fused, ignore_index=-1), data_collator=collate)
    assert "start-up loss check is skipped" not in caplog.text
    comparison = compare_with_reference(update, model, samples, task, data_collator=collate, ignore_index=-1)
    assert comparison.relative_error <= TOLERANCE, comparison
