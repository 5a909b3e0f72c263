"""What `hf-gradacc check` measures, apart from the command line: the model under test (built-in tiny, a scenario,
or a checkpoint loaded with the Auto classes), its synthetic data, the heads of the default run, and the trainer
variants of the scenarios.

Example:
    ```python
    from hf_gradacc.commands.check.scenarios import load_check_model, synthetic_samples

    loaded = load_check_model(task="masked_lm")  # the built-in tiny BERT
    samples = synthetic_samples(loaded.task, 8, seed=0, model=loaded.model)
    ```
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...errors import GradAccConfigError

# The Auto class that loads a checkpoint for each task of `hf_gradacc.testing.tiny.TASKS`.
AUTO_CLASSES: dict[str, str] = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "masked_lm": "AutoModelForMaskedLM",
    "token_classification": "AutoModelForTokenClassification",
    "sequence_classification": "AutoModelForSequenceClassification",
    "regression": "AutoModelForSequenceClassification",
    "multi_label_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}
_PROBLEM_TYPES: dict[str, str] = {
    "sequence_classification": "single_label_classification",
    "regression": "regression",
    "multi_label_classification": "multi_label_classification",
}
# The head of a checkpoint's architecture, read from its class name (None for a bare backbone or an ambiguous
# `...ForConditionalGeneration`, which may be a causal LM or a seq2seq model).
_ARCHITECTURE_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForSeq2SeqLM", "seq2seq"),
    ("ForTokenClassification", "token_classification"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForImageClassification", "image_classification"),
    ("ForQuestionAnswering", "question_answering"),
    ("ForMultipleChoice", "multiple_choice"),
    ("ForNextSentencePrediction", "next_sentence_prediction"),
    ("ForPreTraining", "pretraining"),
)
_SEQUENCE_HEADS = ("sequence_classification", "regression", "multi_label_classification")
MAX_SAMPLE_LENGTH = 40
SCENARIOS: tuple[str, ...] = (
    "default",
    "no_loss_kwargs",
    "plain_compute_loss",
    "moe_mixtral",
    "moe_qwen3",
    "moe_global",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadCase:
    """One row of the default `hf-gradacc check`: a built-in tiny model (``task``, ``scenario``) and the options
    that show it alone."""

    key: str
    task: str
    scenario: str = "default"

    @property
    def options(self) -> str:
        return f"--scenario {self.scenario}" if self.scenario != "default" else f"--task {self.task}"


# The default run: the heads where the stock Trainer goes wrong, and the one it gets right.
HEAD_CASES: tuple[HeadCase, ...] = (
    HeadCase(key="causal_lm", task="causal_lm"),
    HeadCase(key="causal_lm_no_loss_kwargs", task="causal_lm", scenario="no_loss_kwargs"),
    HeadCase(key="seq2seq", task="seq2seq"),
    HeadCase(key="masked_lm", task="masked_lm"),
    HeadCase(key="token_classification", task="token_classification"),
    HeadCase(key="sequence_classification", task="sequence_classification"),
    HeadCase(key="image_classification", task="image_classification"),
)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """The model under test, its task, the name the report shows, the collator's pad id, and what to warn about."""

    model: Any
    task: str
    name: str
    pad_token_id: int
    warnings: list[str] = field(default_factory=list)


def has_router_term(model: Any) -> bool:
    """Whether ``model``'s loss holds a mixture-of-experts router term (``output_router_logits`` on, a coefficient)."""
    from ...testing.reference import router_coefficient

    return router_coefficient(model) is not None


def load_check_model(
    *, model: str | None = None, task: str | None = None, scenario: str = "default", seed: int = 0
) -> LoadedModel:
    """The model `hf-gradacc check` measures: the built-in tiny model of ``task`` (default causal LM), a scenario's
    tiny model, or the checkpoint ``model`` (a folder or a Hub id) in float32 with dropout off, its task read from
    its config's ``architectures`` unless ``task`` is given.

    Raises :class:`~hf_gradacc.errors.GradAccConfigError` for a path that does not exist, a head it cannot tell,
    and ``task="causal_lm"`` on a checkpoint whose architecture is another head (loading it would check a new LM
    head on a model that is no causal LM).

    Example:
        ```python
        loaded = load_check_model(model="./my-checkpoint")  # task from config.architectures
        loaded.model, loaded.task, loaded.warnings
        ```
    """
    from ...testing.tiny import PAD_TOKEN_ID, build_tiny_model

    if scenario in ("no_loss_kwargs", "moe_mixtral", "moe_qwen3", "moe_global"):
        if model is not None or (task or "causal_lm") != "causal_lm":
            raise GradAccConfigError(f"`--scenario {scenario}` builds its own tiny causal LM: drop --model and --task")
        if scenario == "no_loss_kwargs":
            twin = no_loss_kwargs_llama(build_tiny_model("causal_lm", seed=seed))
            return LoadedModel(twin, "causal_lm", "built-in tiny model, accepts_loss_kwargs=False", PAD_TOKEN_ID)
        from ...testing.tiny import build_tiny_moe

        family = "qwen3_moe" if scenario == "moe_qwen3" else "mixtral"  # moe_global: Mixtral, three ways against B
        return LoadedModel(build_tiny_moe(family, seed=seed), "causal_lm", f"built-in tiny {family} MoE", PAD_TOKEN_ID)
    if model is None:
        task = task or "causal_lm"
        return LoadedModel(build_tiny_model(task, seed=seed), task, "built-in tiny model", PAD_TOKEN_ID)
    return _load_checkpoint(model, task)


def _load_checkpoint(name: str, task: str | None) -> LoadedModel:
    import torch
    import transformers
    from transformers import AutoConfig

    from ...testing.tiny import PAD_TOKEN_ID

    source = os.path.expanduser(name)
    if source.startswith((".", os.sep)) or os.path.exists(source):
        if not os.path.exists(source):
            raise GradAccConfigError(
                f"`--model` ({name!r}) is a local path that does not exist ({os.path.abspath(source)}): pass a "
                "save_pretrained folder, or a Hub id (owner/name) without a leading './' or '/'"
            )
        if not os.path.isdir(source):
            raise GradAccConfigError(
                f"`--model` ({name!r}) is not a directory; pass a save_pretrained folder or a Hub id"
            )
    config = AutoConfig.from_pretrained(source)
    disable_dropout(config)
    warnings: list[str] = []
    if task is None:
        model = _load_from_architectures(source, config)
        task = task_of(model)
    else:
        warnings += _check_architecture(name, config, task)
        kwargs: dict[str, Any] = {}
        if task in _PROBLEM_TYPES:
            config.problem_type = _PROBLEM_TYPES[task]
            if task == "regression" and getattr(config, "num_labels", 1) != 1:
                # The check is about the gradient, not the head's weights: a fresh 1-output head is fine.
                config.num_labels = 1
                kwargs["ignore_mismatched_sizes"] = True
        auto_class = getattr(transformers, AUTO_CLASSES[task])
        try:
            model = auto_class.from_pretrained(source, config=config, dtype=torch.float32, **kwargs)
        except ValueError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GradAccConfigError(
                f"{AUTO_CLASSES[task]} cannot load {name!r} for `--task {task}` ({reason}); pick another --task"
            ) from None
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    pad_token_id = getattr(model.config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = PAD_TOKEN_ID
        # Sequence-classification heads of decoder models find the last token through pad_token_id.
        model.config.pad_token_id = pad_token_id
    return LoadedModel(model, task, name, int(pad_token_id), warnings)


def architecture_head(architecture: str) -> str | None:
    """The head of a class named ``architecture`` (``"BertForSequenceClassification"`` -> sequence
    classification), or None when the name does not tell (a backbone, ``...ForConditionalGeneration``)."""
    for suffix, head in _ARCHITECTURE_SUFFIXES:
        if architecture.endswith(suffix):
            return head
    return None


def _check_architecture(name: str, config: Any, task: str) -> list[str]:
    """Refuse ``--task causal_lm`` on another head's checkpoint; a warning for any other head that is not the
    checkpoint's own (that head is new, randomly initialised)."""
    architectures = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    heads = {a: architecture_head(a) for a in architectures}
    known = {a: h for a, h in heads.items() if h is not None}
    wanted = "sequence_classification" if task in _SEQUENCE_HEADS else task
    if not known or wanted in known.values() or any(h is None for h in heads.values()):
        return []
    architecture, head = next(iter(known.items()))
    if task == "causal_lm":
        raise GradAccConfigError(
            f"`--task causal_lm`, but {name!r} is a {architecture} (config `architectures`), a {head} model, not a "
            "causal LM: loading it as one would check a new, randomly initialised LM head on a model that does not "
            f"predict the next token. Drop `--task` to check its own head ({head}), or pass a causal LM checkpoint."
        )
    return [
        f"`--task {task}` loads {name!r}, a {architecture} ({head} head in config `architectures`), with a new, "
        f"randomly initialised {task} head; the check measures that head's gradient. Drop `--task` to check the "
        "checkpoint's own head."
    ]


def disable_dropout(config: Any) -> None:
    """Set every dropout probability > 0 of ``config`` (and its sub-configs) to 0: the reference is deterministic;
    with dropout on, the trainers' step would differ from it by the masks."""
    for name, value in list(vars(config).items()):
        if "dropout" in name and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
    for sub_config in ("text_config", "vision_config", "encoder", "decoder"):
        inner = getattr(config, sub_config, None)
        if inner is not None and hasattr(inner, "to_dict"):
            disable_dropout(inner)


def _load_from_architectures(path: str, config: Any) -> Any:
    import torch
    import transformers

    from ...testing.tiny import TASKS

    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        model_class = getattr(transformers, name, None)
        if model_class is not None:
            return model_class.from_pretrained(path, config=config, dtype=torch.float32)
    raise GradAccConfigError(
        f"cannot tell which head to load for {path!r} from its config (`architectures` = {architectures or None}); "
        f"pass --task, one of {', '.join(TASKS)}"
    )


def task_of(model: Any) -> str:
    """The `hf-gradacc check` task of ``model`` (its head family; the problem type for sequence classification)."""
    from ...heads import detect_head_type
    from ...testing.tiny import TASKS

    head = detect_head_type(model)
    if head is None or head not in TASKS:
        raise GradAccConfigError(
            f"cannot tell the task of {type(model).__name__} from its class; pass --task, one of {', '.join(TASKS)}"
        )
    if head != "sequence_classification":
        return head
    problem_type = getattr(model.config, "problem_type", None)
    if problem_type == "regression" or (problem_type is None and model.config.num_labels == 1):
        return "regression"
    if problem_type == "multi_label_classification":
        return "multi_label_classification"
    return "sequence_classification"


def synthetic_samples(task: str, num_samples: int, seed: int, model: Any) -> list[dict[str, Any]]:
    """`tiny.make_samples`, redrawn within ``model``'s vocabulary and label count when they differ from the tiny's.

    Example:
        ```python
        samples = synthetic_samples("token_classification", 8, seed=0, model=model)
        ```
    """
    import torch

    from ...loss import IGNORE_INDEX
    from ...testing.tiny import NUM_LABELS, PAD_TOKEN_ID, VOCAB_SIZE, make_image_samples_for, make_samples

    if task == "image_classification":
        return make_image_samples_for(model, num_samples, seed=seed)
    config = model.config
    vocab_size = int(getattr(config, "vocab_size", None) or VOCAB_SIZE)
    num_labels = int(getattr(config, "num_labels", NUM_LABELS))
    pad = getattr(config, "pad_token_id", PAD_TOKEN_ID)
    max_positions = getattr(config, "max_position_embeddings", None) or MAX_SAMPLE_LENGTH
    max_length = max(4, min(MAX_SAMPLE_LENGTH, int(max_positions) - 2))
    samples = make_samples(task, num_samples, seed=seed, max_length=max_length)
    token_task = task in ("causal_lm", "seq2seq", "masked_lm", "token_classification")
    if (
        vocab_size == VOCAB_SIZE
        and (num_labels == NUM_LABELS or token_task and task != "token_classification")
        and (pad is None or not 2 <= pad < VOCAB_SIZE)
        and task != "regression"
    ):
        return samples
    if vocab_size < 4:
        raise GradAccConfigError(
            f"the model's `vocab_size` ({vocab_size}) is too small for synthetic data (needs >= 4)"
        )

    g = torch.Generator().manual_seed(seed + 1)

    def token_ids(n: int) -> list[int]:
        ids = torch.randint(2, vocab_size, (n,), generator=g)
        if pad is not None and 2 <= pad < vocab_size:
            ids[ids == pad] = 2 if pad != 2 else 3  # a pad id inside a row would be read as padding
        return ids.tolist()

    for sample in samples:
        ids = token_ids(len(sample["input_ids"]))
        sample["input_ids"] = ids
        labels = sample["labels"]
        if task in ("causal_lm", "masked_lm"):
            sample["labels"] = [IGNORE_INDEX if old == IGNORE_INDEX else new for old, new in zip(labels, ids)]
        elif task == "token_classification":
            drawn = torch.randint(0, num_labels, (len(labels),), generator=g).tolist()
            sample["labels"] = [IGNORE_INDEX if old == IGNORE_INDEX else new for old, new in zip(labels, drawn)]
        elif task == "seq2seq":
            sample["labels"] = token_ids(len(labels))
        elif task == "sequence_classification":
            sample["labels"] = int(torch.randint(0, num_labels, (), generator=g))
        elif task == "multi_label_classification":
            sample["labels"] = [float(x) for x in torch.randint(0, 2, (num_labels,), generator=g)]
        elif num_labels != 1:  # regression with several outputs: one target per output
            sample["labels"] = [float(x) for x in torch.randn(num_labels, generator=g)]
    return samples


def no_loss_kwargs_llama(model: Any) -> Any:
    """The tiny causal LM as a class that, like most VLMs, tells the Trainer its loss ignores num_items_in_batch."""
    from transformers import LlamaForCausalLM

    cls = type("LlamaNoLossKwargsForCausalLM", (LlamaForCausalLM,), {"accepts_loss_kwargs": False})
    twin = cls(model.config)
    twin.load_state_dict(model.state_dict())
    return twin


def plain_compute_loss(trainer_class: type) -> type:
    """``trainer_class`` whose compute_loss returns the model's ``outputs.loss`` (the common override)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    return type(f"PlainLoss{trainer_class.__name__}", (trainer_class,), {"compute_loss": compute_loss})
