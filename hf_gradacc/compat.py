"""Every private member of transformers' `Trainer`, TRL's trainers and accelerate that hf_gradacc overrides or reads,
named in one place, with the versions each was checked on.

hf_gradacc replaces the body of one optimizer step inside `Trainer` (``_run_epoch``), so it rests on a few members
upstream does not promise to keep. A release that renames or re-signs one of them would otherwise break training
somewhere deep, with an ``AttributeError`` three calls down. Instead, every trainer built with
:class:`~hf_gradacc.GradAccMixin` checks them once at construction (:func:`check_trainer_class`) and raises a
:class:`~hf_gradacc.GradAccCompatibilityError` naming the member, the installed version and the supported range.

``tests/unit/test_compat.py`` scans the package for private names it reads or overrides that exist upstream and
fails when one is not declared here.

Private members of torch and DeepSpeed (FSDP2 parameter internals, ZeRO optimizer buffers, gloo timeouts) are not
listed: each use is guarded where it is made (``getattr`` with a fallback and a clear error or warning), see
hf_gradacc/backends/ and hf_gradacc/backends/distributed.py.

Example:
    ```python
    from hf_gradacc.compat import SUPPORTED_VERSIONS, TRAINER_MEMBERS

    print(SUPPORTED_VERSIONS["transformers"])      # '>=5.6,<6'
    print([m.name for m in TRAINER_MEMBERS][:3])    # ['_run_epoch', '_init_training_state', ...]
    ```
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Literal

from .errors import GradAccCompatibilityError

# The ranges pyproject.toml declares (a test keeps them equal) and the versions CI runs the compatibility subset on.
SUPPORTED_VERSIONS: dict[str, str] = {
    "transformers": ">=5.6,<6",
    "accelerate": ">=1.11,<2",
    "trl": ">=1.9,<2",
    "peft": ">=0.18.1",
    "deepspeed": ">=0.18.6",
}
CHECKED_ON: dict[str, tuple[str, ...]] = {
    "transformers": ("5.6.0", "5.16.1", "5.24.0"),
    "accelerate": ("1.11.0", "1.13.0", "1.15.0"),
    "trl": ("1.9.0", "1.16.0"),
    "peft": ("0.18.1", "0.20.0", "0.21.2"),
    "deepspeed": ("0.18.6", "0.19.8"),
}

Kind = Literal["override", "call", "attribute"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrivateMember:
    """One upstream member hf_gradacc depends on.

    ``kind``: ``"override"`` (hf_gradacc defines it, upstream calls it: the parameters must match exactly),
    ``"call"`` (hf_gradacc calls it: ``params`` must be its leading parameters, in order) or ``"attribute"`` (an
    instance attribute upstream sets and hf_gradacc reads or updates: upstream's source must assign it).
    """

    owner: str
    name: str
    kind: Kind
    used_by: str
    params: tuple[str, ...] = ()

    @property
    def qualname(self) -> str:
        return f"{self.owner.rsplit('.', 1)[-1]}.{self.name}"


def _trainer(name: str, kind: Kind, used_by: str, *params: str) -> PrivateMember:
    return PrivateMember(owner="transformers.Trainer", name=name, kind=kind, used_by=used_by, params=params)


# transformers.Trainer: the step loop (mixin.py, step.py), the data path (data/loader.py) and callbacks.
TRAINER_MEMBERS: tuple[PrivateMember, ...] = (
    _trainer(
        "_run_epoch",
        "override",
        "mixin.py: one window per optimizer step",
        "model",
        "epoch",
        "train_dataloader",
        "steps_in_epoch",
        "num_update_steps_per_epoch",
        "trial",
        "ignore_keys_for_eval",
        "start_time",
        "resume_from_checkpoint",
        "epochs_trained",
        "steps_trained_in_current_epoch",
    ),
    _trainer(
        "_init_training_state",
        "override",
        "mixin.py: resuming under an accumulation schedule",
        "max_steps",
        "num_update_steps_per_epoch",
        "num_train_epochs",
        "resume_from_checkpoint",
        "trial",
    ),
    _trainer("_load_rng_state", "call", "mixin.py: RNG state when resuming", "checkpoint"),
    _trainer("_load_best_model", "override", "mixin.py: the best checkpoint's converted weights restored too"),
    _trainer(
        "_maybe_log_save_evaluate",
        "call",
        "mixin.py: logging, saving, evaluating after a step",
        "tr_loss",
        "grad_norm",
        "model",
        "trial",
        "epoch",
        "ignore_keys_for_eval",
        "start_time",
        "learning_rate",
    ),
    _trainer("_prepare_inputs", "call", "mixin.py, callbacks/batchnorm.py: inputs to the device", "inputs"),
    _trainer("_get_learning_rate", "call", "step.py: the learning rate a step used"),
    _trainer("_remove_unused_columns", "call", "data/loader.py, callbacks/batchnorm.py", "dataset", "description"),
    _trainer(
        "_get_collator_with_removed_columns",
        "call",
        "data/loader.py, callbacks/batchnorm.py",
        "data_collator",
        "description",
    ),
    _trainer("_get_train_sampler", "call", "data/loader.py: the sampler regrouping reorders", "train_dataset"),
    _trainer(
        "_save_checkpoint",
        "override",
        "mixin.py, checkpoints.py: a save bracketed by a completeness marker",
        "model",
        "trial",
    ),
    _trainer("_get_output_dir", "call", "checkpoints.py: where the checkpoint is written", "trial"),
    _trainer("_tr_loss", "attribute", "mixin.py: the running loss the step adds to"),
    _trainer("_globalstep_last_logged", "attribute", "mixin.py: logging_nan_inf_filter"),
    _trainer("_train_batch_size", "attribute", "data/loader.py: the micro-batch size of the training loader"),
)

# TRL's trainers, by the hf_gradacc.trl class that relies on them.
TRL_MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember(
        owner="trl.SFTTrainer",
        name="_is_vision_dataset",
        kind="attribute",
        used_by="trl/sft.py: packing refused for vision data",
    ),
    PrivateMember(
        owner="trl.GRPOTrainer",
        name="_prepare_inputs",
        kind="override",
        used_by="trl/grpo.py: generation while the step's micro-batches are fetched",
        params=("generation_batch",),
    ),
    PrivateMember(
        owner="trl.GRPOTrainer",
        name="_step",
        kind="attribute",
        used_by="trl/grpo.py: TRL's micro-batch counter, advanced as TRL's training_step would",
    ),
    PrivateMember(owner="trl.GRPOTrainer", name="_metrics", kind="attribute", used_by="trl/grpo.py: step_time metric"),
    PrivateMember(
        owner="trl.GRPOTrainer",
        name="_current_train_step_time",
        kind="attribute",
        used_by="trl/grpo.py: step_time metric",
    ),
    PrivateMember(
        owner="trl.GRPOTrainer",
        name="_entropy_bonus_enabled",
        kind="attribute",
        used_by="trl/grpo.py: the entropy bonus kept as its own term",
    ),
    PrivateMember(
        owner="trl.GRPOTrainer",
        name="_last_world_entropy",
        kind="attribute",
        used_by="trl/grpo.py: the entropy coefficient a step used (adaptive entropy)",
    ),
    PrivateMember(
        owner="trl.KTOTrainer",
        name="_compute_kl_logps",
        kind="override",
        params=("model", "batch"),
        used_by="trl/kto.py: the step's KL estimate handed to TRL's loss",
    ),
    PrivateMember(owner="trl.KTOTrainer", name="calculate_KL", kind="attribute", used_by="trl/kto.py: KL estimate"),
    *(
        PrivateMember(
            owner=f"trl.{t}",
            name=name,
            kind=kind,
            used_by=f"trl/{t[:-7].lower()}.py: generation at fetch",
            params=("generation_batch",) if kind == "override" else (),
        )
        for t in ("RLOOTrainer", "DistillationTrainer")
        for name, kind in (
            ("_prepare_inputs", "override"),
            ("_step", "attribute"),
            ("_current_train_step_time", "attribute"),
        )
    ),
    PrivateMember(
        owner="trl.DistillationTrainer",
        name="_logs",
        kind="attribute",
        used_by="trl/distillation.py: the completion log resized to the step `total_train_batch_size` makes",
    ),
)

# accelerate: the sync flag the Trainer and accelerate's optimizer wrapper read, and what the opt-in CPU patches touch.
ACCELERATE_MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember(
        owner="accelerate.state.GradientState",
        name="_set_sync_gradients",
        kind="call",
        used_by="step.py: sync flag per micro-batch",
        params=("sync_gradients",),
    ),
    PrivateMember(
        owner="accelerate.state.PartialState",
        name="_prepare_backend",
        kind="override",
        used_by="patches/cpu_distributed.py (opt-in)",
        params=("cpu", "sagemaker_dp", "backend"),
    ),
    PrivateMember(
        owner="accelerate.state.PartialState",
        name="_shared_state",
        kind="attribute",
        used_by="patches/cpu_distributed.py, patches/fsdp_cpu.py (opt-in)",
    ),
    PrivateMember(
        owner="accelerate.state.AcceleratorState",
        name="_shared_state",
        kind="attribute",
        used_by="patches/cpu_distributed.py (opt-in)",
    ),
    PrivateMember(
        owner="accelerate.state.AcceleratorState",
        name="_mixed_precision",
        kind="attribute",
        used_by="patches/fsdp_cpu.py (opt-in)",
    ),
)

# Members only some runs or versions reach: checked where they are used, not at every construction (an older
# transformers of the supported range lacks the context-parallel entry; the GRPO reference is test code).
OPTIONAL_MEMBERS: tuple[PrivateMember, ...] = (
    _trainer(
        "_prepare_context_parallel_inputs",
        "call",
        "context_parallel.py: a micro-batch sharded through the Trainer's own entry (cp_size > 1)",
        "model",
        "inputs",
    ),
    _trainer("_set_signature_columns_if_needed", "call", "weights.py: the forward's columns, loss_weights kept"),
    _trainer("_signature_columns", "attribute", "weights.py: loss_weights kept through remove_unused_columns"),
    PrivateMember(
        owner="trl.GRPOTrainer",
        name="_generate_and_score_completions",
        kind="override",
        used_by="testing/grpo_reference.py: the test recorder notes each completion's generation step",
        params=("inputs",),
    ),
)

ALL_MEMBERS: tuple[PrivateMember, ...] = TRAINER_MEMBERS + TRL_MEMBERS + ACCELERATE_MEMBERS + OPTIONAL_MEMBERS


def is_supported(package: str, version: str) -> bool:
    """Whether ``version`` of ``package`` lies in :data:`SUPPORTED_VERSIONS` (a package not listed: True)."""
    from packaging.specifiers import SpecifierSet

    spec = SUPPORTED_VERSIONS.get(package)
    return spec is None or SpecifierSet(spec).contains(version, prereleases=True)


@functools.cache
def accelerate_shards_variable_batches() -> bool:
    """Whether accelerate's ``BatchSamplerShard`` takes a batch sampler WITHOUT a fixed ``batch_size`` (hf_gradacc's
    regrouping and packing samplers) when ``even_batches=True``. Newer accelerate does (it circles back whole
    batches); older releases (1.11 to 1.13 at least) raise "You need to use `even_batches=False`" in its
    constructor."""
    from accelerate.data_loader import BatchSamplerShard

    class _VariableBatches:
        batch_size = None
        drop_last = False

        def __iter__(self):
            return iter(())

        def __len__(self) -> int:
            return 0

    try:
        BatchSamplerShard(_VariableBatches(), num_processes=2, process_index=0, even_batches=True)
    except ValueError:
        return False
    return True


def shard_even_batches(even_batches: bool) -> bool:
    """The ``even_batches`` to give accelerate's ``BatchSamplerShard`` for an hf_gradacc window sampler planned with
    ``even_batches``. The window samplers already deal every rank the same number of micro-batches per round when
    planned with ``even_batches=True``, so where accelerate cannot shard variable batches evenly (see
    :func:`accelerate_shards_variable_batches`), sharding them unevenly deals exactly the same batches."""
    return even_batches and accelerate_shards_variable_batches()


@functools.cache
def has_sampling_strategy(name: str) -> bool:
    """Whether this transformers' `Trainer` knows ``train_sampling_strategy=name``. ``"batch_rebalance"`` is in 5.24
    but not in 5.6 or 5.16, whose Trainer takes an unknown value silently as random order."""
    from transformers import Trainer

    try:
        return f'"{name}"' in inspect.getsource(Trainer._get_train_sampler)
    except (OSError, TypeError):  # no source to read: assume it is there, as in the newest release
        return True


def package_of(member: PrivateMember) -> str:
    return member.owner.split(".", 1)[0]


def installed_version(package: str) -> str:
    try:
        return importlib.import_module(package).__version__
    except Exception:  # noqa: BLE001 - absent, or without a version attribute
        return "not installed"


@functools.cache
def trl_at_least(version: str) -> bool:
    """Whether the installed TRL is ``version`` or newer (False without TRL). The one place hf_gradacc.trl and its
    tests ask which TRL feature this installation has (docs/compatibility.md, "What depends on the version")."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(installed_version("trl")) >= Version(version)
    except InvalidVersion:  # "not installed"
        return False


def resolve_owner(member: PrivateMember) -> type:
    module, _, name = member.owner.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def _class_source(cls: type) -> str:
    """The source of ``cls`` and its bases (where an attribute is assigned may be a base's method)."""
    texts = []
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            texts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
    return "\n".join(texts)


def problem_with(member: PrivateMember, owner: type) -> str | None:
    """What is wrong with ``member`` on ``owner`` (the upstream class), or None when it is as hf_gradacc expects."""
    if member.kind == "attribute":
        if member.name in getattr(owner, "__dict__", {}) or hasattr(owner, member.name):
            return None
        source = _class_source(owner)
        if not source or f"self.{member.name}" in source or f".{member.name} =" in source:
            return None  # assigned on the instance (or no source to read: not judged)
        return "is no longer set"
    function = inspect.getattr_static(owner, member.name, None)
    if function is None:
        return "is missing"
    if isinstance(function, (staticmethod, classmethod)):
        function = function.__func__
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin or C method: nothing to compare
    names = [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    expected = list(member.params)
    if member.kind == "override" and names != expected:
        return f"has parameters ({', '.join(names)}), expected ({', '.join(expected)})"
    if member.kind == "call" and names[: len(expected)] != expected:
        return f"has parameters ({', '.join(names)}), expected them to start with ({', '.join(expected)})"
    return None


def check_members(members: tuple[PrivateMember, ...], owners: dict[str, type] | None = None) -> None:
    """Raise :class:`~hf_gradacc.GradAccCompatibilityError` naming every member of ``members`` that is missing or
    changed. ``owners`` maps an owner name to the class to check (default: the upstream class itself)."""
    problems = []
    for member in members:
        owner = (owners or {}).get(member.owner) or resolve_owner(member)
        problem = problem_with(member, owner)
        if problem is not None:
            problems.append((member, problem))
    if not problems:
        return
    lines = []
    packages = []
    for member, problem in problems:
        package = package_of(member)
        if package not in packages:
            packages.append(package)
        lines.append(f"  - `{member.qualname}` {problem} (hf_gradacc uses it in {member.used_by})")
    versions = "; ".join(
        f"{p} {installed_version(p)} is installed, hf_gradacc supports {p}{SUPPORTED_VERSIONS.get(p, '')} "
        f"(checked on {', '.join(CHECKED_ON.get(p, ()))})"
        for p in packages
    )
    pins = " ".join(f"'{p}{SUPPORTED_VERSIONS[p]}'" for p in packages if p in SUPPORTED_VERSIONS)
    raise GradAccCompatibilityError(
        "hf_gradacc relies on private members that this installation does not provide as expected:\n"
        + "\n".join(lines)
        + f"\n{versions}. Install a checked version (pip install {pins}), or report the new version at the "
        "hf_gradacc issue tracker."
    )


def check_trainer_class(trainer_class: type) -> None:
    """The check every GradAcc trainer runs at construction: `Trainer`'s and accelerate's members, and TRL's for a
    trainer built on one of TRL's classes. Cheap (signatures and a cached source read)."""
    check_members(TRAINER_MEMBERS + ACCELERATE_MEMBERS)
    trl_members = tuple(m for m in TRL_MEMBERS if _derives_from(trainer_class, m.owner))
    if trl_members:
        check_members(trl_members)
    warn_replaced_trainer_methods(trainer_class)


# `Trainer` methods a library may replace at class level on import (unsloth's gradient-accumulation fix replaces
# `get_batch_samples`, `compute_loss`, `training_step` and `_inner_training_loop` on a GPU).
PATCHABLE_TRAINER_METHODS = ("compute_loss", "get_batch_samples", "training_step", "_inner_training_loop")
# Replacements known to compose with hf_gradacc's step, not warned: {method: the module that replaced it}. A framework
# integration adds its framework's own (hf_gradacc/integrations/axolotl_core.py: AXOLOTL_TRAINER_PATCHES).
RECOGNISED_TRAINER_PATCHES: dict[str, str] = {}


def replaced_trainer_methods() -> dict[str, str]:
    """``{method: module}`` for every method of :data:`PATCHABLE_TRAINER_METHODS` and every declared `Trainer`
    member whose function on `transformers.Trainer` no longer comes from transformers."""
    from transformers import Trainer

    names = {*PATCHABLE_TRAINER_METHODS, *(m.name for m in TRAINER_MEMBERS if m.kind != "attribute")}
    replaced = {}
    for name in sorted(names):
        function = inspect.getattr_static(Trainer, name, None)
        module = getattr(function, "__module__", None) or ""
        if function is not None and module.split(".")[0] != "transformers":
            replaced[name] = module
    return replaced


def warn_replaced_trainer_methods(trainer_class: type) -> None:
    """Compose with a library that patched `Trainer` at class level (unsloth): hf_gradacc's own ``training_step``,
    ``get_batch_samples``, ``compute_loss`` and ``_run_epoch`` run instead of the patched ones, so the step stays
    exact; what can still reach a patched method is an override in the trainer's class calling ``super()`` past the
    mixin (``compute_loss`` in a `Trainer` subclass): warned, with the way out."""
    replaced = {n: m for n, m in replaced_trainer_methods().items() if RECOGNISED_TRAINER_PATCHES.get(n) != m}
    if not replaced:
        return
    import logging

    listed = ", ".join(f"Trainer.{name} (now from {module})" for name, module in replaced.items())
    logging.getLogger("hf_gradacc").warning(
        f"{listed}: another library replaced these transformers.Trainer methods at class level (unsloth does on "
        f"import). {trainer_class.__name__} runs hf_gradacc's own step, training_step, get_batch_samples and built-in "
        "loss instead, so the step stays exact; a compute_loss override that calls super() past hf_gradacc reaches "
        "the replaced one, whose normalisation hf_gradacc cannot see: return the loss from the model (or an "
        "hf_gradacc.LossTerm) instead, and check with `hf-gradacc check`."
    )


def _derives_from(cls: type, owner: str) -> bool:
    module, _, name = owner.rpartition(".")
    return any(klass.__name__ == name and klass.__module__.split(".")[0] == module for klass in cls.__mro__)
