"""hf_gradacc.compat: every private upstream member the library overrides or reads is declared in one place, checked at
trainer construction, and the declared version ranges are the ones pyproject.toml promises."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
from pathlib import Path

import pytest
from transformers import Trainer

from hf_gradacc import GradAccCompatibilityError, GradAccTrainer
from hf_gradacc.compat import (
    ALL_MEMBERS,
    OPTIONAL_MEMBERS,
    SUPPORTED_VERSIONS,
    TRAINER_MEMBERS,
    PrivateMember,
    check_members,
    check_trainer_class,
    installed_version,
    is_supported,
)
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_gradacc"
UPSTREAM_CLASSES = (
    "transformers.Trainer",
    "transformers.Seq2SeqTrainer",
    "trl.SFTTrainer",
    "trl.DPOTrainer",
    "trl.RewardTrainer",
    "trl.GRPOTrainer",
    "accelerate.Accelerator",
    "accelerate.state.GradientState",
    "accelerate.state.PartialState",
    "accelerate.state.AcceleratorState",
)
# hf_gradacc's own private names that happen to exist on an upstream class too (same name, another object).
OWN_NAMES = {
    "_check": "grads.py: GradAccess._check, its own guard",
    "_load_model": "commands/check.py: its own loader function",
    "_log": "callbacks/token_stats.py: the callback's own method",
    "_model": "trl/_common.py: ForwardRecorder._model, the wrapped model",
    "_pending": "callbacks and testing recorders: their own buffers",
    "_cp": "mixin.py: the trainer's ContextParallel helper (the scan's `self._cp` also matches accelerate's `self._cp_*`)",
}


def _private_names_used() -> dict[str, set[str]]:
    """Every private (single underscore) name the package reads, writes, overrides or looks up by string."""
    used: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.FunctionDef):
                name = node.name
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "hasattr", "setattr"}
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
            if name and name.startswith("_") and not name.startswith("__"):
                used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return used


def _upstream_classes() -> list[type]:
    classes = []
    for spec in UPSTREAM_CLASSES:
        module, _, name = spec.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue  # TRL is optional; its members are declared all the same
    return classes


@functools.cache
def _source(cls: type) -> str:
    texts = []
    for klass in cls.__mro__:
        try:
            texts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
    return "\n".join(texts)


def _upstream_has(cls: type, name: str) -> bool:
    return hasattr(cls, name) or f"self.{name}" in _source(cls)


def test_every_private_upstream_member_used_is_declared():
    declared = {m.name for m in ALL_MEMBERS}
    upstream = _upstream_classes()
    undeclared = {
        name: sorted(files)
        for name, files in _private_names_used().items()
        if name not in declared and name not in OWN_NAMES and any(_upstream_has(cls, name) for cls in upstream)
    }
    assert not undeclared, (
        "hf_gradacc uses private upstream members that hf_gradacc/compat.py does not declare (add them to "
        f"TRAINER_MEMBERS / TRL_MEMBERS / ACCELERATE_MEMBERS): {undeclared}"
    )


def test_the_scan_sees_a_new_private_read(tmp_path, monkeypatch):
    """The scan is not vacuous: a module reading `Trainer._inner_training_loop` would be reported."""
    extra = PACKAGE / "_compat_probe_tmp.py"
    extra.write_text("def f(trainer):\n    return trainer._inner_training_loop\n")
    try:
        used = _private_names_used()
    finally:
        extra.unlink()
    assert "_inner_training_loop" in used
    assert _upstream_has(Trainer, "_inner_training_loop")
    assert "_inner_training_loop" not in {m.name for m in ALL_MEMBERS}


def test_declared_members_hold_on_the_installed_stack():
    check_trainer_class(GradAccTrainer)
    for member in TRAINER_MEMBERS:
        assert member.name in {m.name for m in ALL_MEMBERS}


def _trainer_kwargs():
    model = build_tiny_model("sequence_classification")
    return dict(
        model=model,
        args=None,
        train_dataset=ListDataset(make_samples("sequence_classification", 4)),
        data_collator=PaddingCollator(),
    )


def test_a_renamed_private_trainer_method_is_named_at_construction(monkeypatch, helpers):
    monkeypatch.delattr(Trainer, "_run_epoch")
    kwargs = _trainer_kwargs()
    kwargs["args"] = helpers.make_args()
    with pytest.raises(GradAccCompatibilityError) as info:
        GradAccTrainer(**kwargs)
    message = str(info.value)
    assert "`Trainer._run_epoch` is missing" in message
    assert f"transformers {installed_version('transformers')} is installed" in message
    assert SUPPORTED_VERSIONS["transformers"] in message


def test_a_re_signed_private_trainer_method_is_named_at_construction(monkeypatch, helpers):
    def _init_training_state(self, max_steps, num_train_epochs, resume_from_checkpoint, trial):  # one parameter gone
        raise AssertionError("never called")

    monkeypatch.setattr(Trainer, "_init_training_state", _init_training_state)
    kwargs = _trainer_kwargs()
    kwargs["args"] = helpers.make_args()
    with pytest.raises(GradAccCompatibilityError, match=r"Trainer\._init_training_state` has parameters"):
        GradAccTrainer(**kwargs)


def test_an_attribute_upstream_stops_setting_is_named():
    class Upstream:
        def __init__(self):
            self.visible = 1

    member = PrivateMember(owner="transformers.Trainer", name="_gone", kind="attribute", used_by="a test")
    with pytest.raises(GradAccCompatibilityError, match=r"`Trainer\._gone` is no longer set"):
        check_members((member,), owners={"transformers.Trainer": Upstream})
    present = PrivateMember(owner="transformers.Trainer", name="visible", kind="attribute", used_by="a test")
    check_members((present,), owners={"transformers.Trainer": Upstream})


def test_declared_ranges_are_the_pyproject_ranges():
    text = (ROOT / "pyproject.toml").read_text()
    for package, spec in SUPPORTED_VERSIONS.items():
        assert f'"{package}{spec}"' in text, f"pyproject.toml does not declare {package}{spec}"


def test_installed_stack_is_in_the_declared_ranges():
    for package in ("transformers", "accelerate", "trl", "peft", "deepspeed"):
        version = installed_version(package)
        if version != "not installed":
            assert is_supported(package, version), f"{package} {version} is outside {SUPPORTED_VERSIONS[package]}"


def test_trl_below_the_supported_range_is_refused_with_the_extra(monkeypatch):
    trl = pytest.importorskip("trl")
    monkeypatch.setattr(trl, "__version__", "1.8.0")
    monkeypatch.delitem(sys.modules, "hf_gradacc.trl", raising=False)
    from hf_gradacc.errors import GradAccError

    with pytest.raises(GradAccError) as info:
        importlib.import_module("hf_gradacc.trl")
    assert isinstance(info.value, ImportError)
    assert "trl 1.8.0 is installed" in str(info.value)
    assert 'hf_gradacc[trl]' in str(info.value)
    monkeypatch.delitem(sys.modules, "hf_gradacc.trl", raising=False)


@pytest.mark.parametrize("upstream_end", [False, True])
def test_end_works_without_an_upstream_end(monkeypatch, helpers, upstream_end: bool):
    """transformers 5.6 / 5.16 have no `Trainer.end`: GradAccTrainer.end must not raise there (it raised
    AttributeError, 'super' object has no attribute 'end'); where upstream has one, it runs once, after the process
    group is finished."""
    import hf_gradacc.mixin as mixin

    calls: list[str] = []
    monkeypatch.setattr(mixin, "finish_distributed", lambda: calls.append("finish_distributed"))
    if upstream_end:
        monkeypatch.setattr(Trainer, "end", lambda self: calls.append("Trainer.end"), raising=False)
    elif hasattr(Trainer, "end"):
        monkeypatch.delattr(Trainer, "end")
    kwargs = _trainer_kwargs()
    kwargs["args"] = helpers.make_args()
    trainer = GradAccTrainer(**kwargs)
    assert trainer.end() is None
    assert calls == (["finish_distributed", "Trainer.end"] if upstream_end else ["finish_distributed"])


def test_an_override_that_gains_a_parameter_upstream_is_named_at_construction(monkeypatch, helpers):
    """An override's parameters are compared exactly, not as a prefix: upstream adding one (even with a default) to
    a method hf_gradacc overrides would pass it to an override that cannot take it."""

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial, new_upstream_flag=False):  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(Trainer, "_init_training_state", _init_training_state)
    kwargs = _trainer_kwargs()
    kwargs["args"] = helpers.make_args()
    with pytest.raises(GradAccCompatibilityError, match=r"Trainer\._init_training_state` has parameters \(.*, "
                       r"new_upstream_flag\), expected \(max_steps, .*, trial\)"):  # fmt: skip
        GradAccTrainer(**kwargs)


def _trl_trainer_deriving_from(owner: str) -> type:
    import hf_gradacc.trl as ours

    name = owner.rpartition(".")[2]
    return getattr(ours, f"GradAcc{name}")


# compat.OPTIONAL_MEMBERS are checked where they are used (or are test code), not at construction.
TRL_MEMBER_IDS = [
    f"{m.owner.rpartition('.')[2]}.{m.name}"
    for m in ALL_MEMBERS
    if m.owner.startswith("trl.") and m not in OPTIONAL_MEMBERS
]


@pytest.mark.parametrize("member_id", TRL_MEMBER_IDS)
def test_a_trl_member_missing_upstream_is_named_at_construction(monkeypatch, member_id: str):
    """Every TRL private member hf_gradacc.trl relies on is checked when its trainer is constructed, before any
    argument is read: a method re-signed, or an attribute TRL's source no longer sets (a release that renamed it),
    is a GradAccCompatibilityError naming the member and the installed TRL."""
    pytest.importorskip("trl")
    import hf_gradacc.compat as compat
    from hf_gradacc.trl import TRL_MORE_TRAINERS

    member = next(m for m in ALL_MEMBERS if f"{m.owner.rpartition('.')[2]}.{m.name}" == member_id)
    if member.owner in ("trl.KTOTrainer", "trl.RLOOTrainer", "trl.DistillationTrainer"):
        if not compat.trl_at_least(TRL_MORE_TRAINERS):
            pytest.skip(f"GradAcc{member.owner[4:]} needs TRL >= {TRL_MORE_TRAINERS} (installed {installed_version('trl')})")
    owner = compat.resolve_owner(member)
    trainer_class = _trl_trainer_deriving_from(member.owner)
    compat.check_trainer_class(trainer_class)  # as installed: every member present
    if member.kind == "attribute":
        real = compat._class_source

        def renamed(cls: type) -> str:  # TRL's source as if a release renamed the attribute
            return real(cls).replace(f"self.{member.name}", "self._renamed").replace(f".{member.name} =", "._x =")

        monkeypatch.setattr(compat, "_class_source", renamed)
        expected = "is no longer set"
    else:
        monkeypatch.setattr(owner, member.name, lambda self, renamed_argument: None)
        expected = "has parameters (renamed_argument)"
    with pytest.raises(GradAccCompatibilityError) as info:
        trainer_class()  # the check comes first: no argument is needed to reach it
    assert f"`{member.qualname}` {expected}" in str(info.value)
    assert f"trl {installed_version('trl')} is installed" in str(info.value)


def _fake_optimizer(name: str, *, coalescing: bool) -> object:
    attrs = {"_coalesce_grad_reduction": False} if coalescing else {}
    return type(name, (), attrs)()


def test_per_window_reduction_is_refused_where_deepspeed_cannot_coalesce():
    """DeepSpeed 0.18.6 (axolotl's pin) has no `engine.coalesce_grad_reduction`: `zero_reduction='per_window'` is
    refused with the way out, the default `per_micro_batch` is accepted (tests/distributed/test_compat_stack.py runs
    it on 0.18.6)."""
    pytest.importorskip("deepspeed")
    from hf_gradacc import UnsupportedBackendError
    from hf_gradacc.backends.deepspeed import check_zero_optimizer

    old = _fake_optimizer("DeepSpeedZeroOptimizer", coalescing=False)
    check_zero_optimizer(old, 2, "per_micro_batch", has_coalescing=False)
    with pytest.raises(UnsupportedBackendError, match=r"zero_reduction='per_micro_batch'.*or upgrade DeepSpeed"):
        check_zero_optimizer(old, 2, "per_window", has_coalescing=False)
    new = _fake_optimizer("DeepSpeedZeroOptimizer_Stage3", coalescing=True)
    check_zero_optimizer(new, 3, "per_window", has_coalescing=True)
    with pytest.raises(UnsupportedBackendError, match="BF16_Optimizer"):
        check_zero_optimizer(_fake_optimizer("BF16_Optimizer", coalescing=False), 1, "per_micro_batch",
                             has_coalescing=True)  # fmt: skip


def test_trainer_methods_replaced_by_another_library_are_named(monkeypatch, helpers, caplog):
    """unsloth replaces `Trainer.compute_loss` / `training_step` / `get_batch_samples` at class level on a GPU:
    hf_gradacc composes (its own methods run) and names what was replaced, once per construction."""
    from hf_gradacc.compat import replaced_trainer_methods

    assert replaced_trainer_methods() == {}
    namespace: dict = {}
    exec("def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):\n    raise AssertionError",
         {"__name__": "unsloth_zoo.patching"}, namespace)  # fmt: skip
    monkeypatch.setattr(Trainer, "compute_loss", namespace["compute_loss"])
    assert replaced_trainer_methods() == {"compute_loss": "unsloth_zoo.patching"}
    kwargs = _trainer_kwargs()
    kwargs["args"] = helpers.make_args(max_steps=1)
    with caplog.at_level("WARNING", logger="hf_gradacc"):
        trainer = GradAccTrainer(**kwargs)
    assert "Trainer.compute_loss (now from unsloth_zoo.patching)" in caplog.text
    trainer.train()  # hf_gradacc's own compute_loss runs, never the replaced one
    assert trainer.state.global_step == 1
