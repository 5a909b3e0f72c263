"""Every ```python block of the README and the docs pages runs as printed.

Each block is executed on its own, in a fresh namespace that holds only the placeholders the pages leave to the
reader (``model``, ``train_dataset``, ``data_collator``, ``tokenizer``, ...: see :func:`_placeholders`), filled with
tiny local objects from :mod:`hf_gradacc.testing.tiny` and :mod:`hf_gradacc.testing.trl_steps`; everything else a
block uses it must import or define itself. ``"path/to/checkpoint"`` is a real directory: the blocks run in a
temporary working directory where a tiny checkpoint was saved under that path.

To keep the file under a minute or two on 2 CPU cores, every ``TrainingArguments`` a block builds (``GradAccConfig``,
TRL's configs, ...) gets ``max_steps=1``: ``TrainingArguments.__post_init__`` is wrapped to set it, so a block that
trains runs one optimizer step. Nothing else of a block is changed.

A block that cannot run here (a Hub model id, a GPU, a launcher) is skipped only by a visible marker on the line
right before its fence in the Markdown, ``<!-- snippet: skip (the reason) -->``; the skip reason shows in
``pytest -rs``.
"""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
CHECKPOINT = "path/to/checkpoint"


def _page_blocks(name: str, text: str) -> list[pytest.param]:
    """The ```python blocks of one page, each a param named ``page:line``, skipped where the marker says so."""
    params = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        block = f"{name}:{line}"
        marks = [pytest.mark.skip(reason=f"{block}: {skip['reason']}")] if skip else []
        params.append(pytest.param(block, match.group(1), marks=marks, id=block))
    return params


def _blocks() -> list[pytest.param]:
    return [b for page in PAGES for b in _page_blocks(str(page.relative_to(REPO)), page.read_text(encoding="utf-8"))]


BLOCKS = _blocks()


def test_the_pages_have_snippets() -> None:
    assert len(BLOCKS) >= 19, [b.id for b in BLOCKS]


def test_a_skip_marker_right_before_the_fence_skips_that_block_only() -> None:
    page = "```python\nrun_me()\n```\n\n<!-- snippet: skip (a Hub model id) -->\n```python\nfrom_hub()\n```\n"
    first, second = _page_blocks("page.md", page)
    assert (first.id, first.values[1], list(first.marks)) == ("page.md:1", "run_me()\n", [])
    assert second.id == "page.md:6" and second.marks[0].kwargs["reason"] == "page.md:6: a Hub model id"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf_gradacc.testing.trl_steps import save_tiny_checkpoint, word

    root = tmp_path_factory.mktemp("snippets")
    save_tiny_checkpoint(root / CHECKPOINT, [" ".join(word(i) for i in range(3, 96))])
    return root


def _placeholders() -> dict[str, object]:
    """The names the pages use without defining them, each a tiny local object."""
    from hf_gradacc import GradAccTrainer
    from hf_gradacc.testing import tiny
    from hf_gradacc.testing.grpo_steps import grpo_prompts, length_reward
    from hf_gradacc.testing.trl_steps import dpo_dataset, dpo_pairs

    train_dataset = tiny.ListDataset(tiny.make_samples("causal_lm", 32))
    data_collator = tiny.PaddingCollator()
    resnet = tiny.build_tiny_image_model("resnet")

    def build_trainer(config: object) -> transformers.Trainer:  # a framework's Trainer of its own class
        class FrameworkTrainer(transformers.Trainer):
            pass

        args = transformers.TrainingArguments(output_dir="out", per_device_train_batch_size=4, report_to=[])
        return FrameworkTrainer(
            model=tiny.build_tiny_model("causal_lm"),
            args=args,
            train_dataset=train_dataset,
            data_collator=data_collator,
        )

    class MyOwnTrainer(transformers.Trainer):
        pass

    return {
        "model": tiny.build_tiny_model("causal_lm"),
        "train_dataset": train_dataset,
        "data_collator": data_collator,
        "tokenizer": transformers.AutoTokenizer.from_pretrained(CHECKPOINT),
        "trainer": GradAccTrainer(
            model=tiny.build_tiny_model("causal_lm"),
            args=transformers.TrainingArguments(output_dir="out", gradient_accumulation_steps=2, report_to=[]),
            train_dataset=train_dataset,
            data_collator=data_collator,
        ),
        "my_shard_hook": lambda name, grad: None,
        "MyOwnTrainer": MyOwnTrainer,
        "framework": types.SimpleNamespace(build_trainer=build_trainer),
        "config": None,
        "resnet": resnet,
        "images": tiny.ListDataset(tiny.make_image_samples_for(resnet, 16)),
        "val_images": tiny.ListDataset(tiny.make_image_samples_for(resnet, 4, seed=1)),
        "image_collator": tiny.ImageCollator(),
        "pairs": dpo_dataset(dpo_pairs(8)),
        "prompts": grpo_prompts(8, vocab_size=96),
        "my_reward": length_reward,
    }


@pytest.fixture
def one_step_runs(monkeypatch: pytest.MonkeyPatch, checkpoint_dir: Path) -> None:
    """Blocks run in a directory holding ``path/to/checkpoint``, with ``max_steps=1`` on every TrainingArguments,
    the command line empty (a block may parse it) and no tracker."""
    monkeypatch.chdir(checkpoint_dir)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setenv("WANDB_DISABLED", "true")
    original = transformers.TrainingArguments.__post_init__

    def post_init(self: transformers.TrainingArguments) -> None:
        original(self)
        self.max_steps = 1

    monkeypatch.setattr(transformers.TrainingArguments, "__post_init__", post_init)


@pytest.fixture
def train_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[transformers.Trainer, object]]:
    """``(trainer, TrainOutput)`` of every ``train()`` a block runs (any Trainer class: they all reach
    ``transformers.Trainer.train``)."""
    runs: list[tuple[transformers.Trainer, object]] = []
    original = transformers.Trainer.train

    def train(self: transformers.Trainer, *args: object, **kwargs: object) -> object:
        output = original(self, *args, **kwargs)
        runs.append((self, output))
        return output

    monkeypatch.setattr(transformers.Trainer, "train", train)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name, code", BLOCKS)
def test_snippet_runs_as_printed(name: str, code: str, one_step_runs: None, train_runs: list) -> None:
    """The block runs to its end (its own asserts included), defines or imports something, and every training run
    it starts takes its optimizer step (``max_steps=1``) with a finite training loss."""
    torch.manual_seed(0)
    placeholders = _placeholders()
    namespace = {"__name__": "__snippet__", **placeholders}
    exec(compile(code, name, "exec"), namespace)  # noqa: S102  (the docs' own code)
    new = {key for key in namespace if key not in placeholders and key not in ("__name__", "__builtins__")}
    assert new or train_runs, f"{name}: the block neither defines anything nor trains"
    for trainer, output in train_runs:
        assert trainer.state.global_step >= 1, f"{name}: {type(trainer).__name__}.train() took no optimizer step"
        loss = getattr(output, "training_loss", None)
        assert loss is not None and math.isfinite(loss), f"{name}: {type(trainer).__name__} training loss {loss}"
