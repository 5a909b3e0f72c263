"""Resuming only from a checkpoint that can be resumed: every file the resume reads is there, for every rank, and
readable.

`Trainer._save_checkpoint` writes the model, the optimizer, the scheduler and one RNG state per rank (each rank its
own), then ``trainer_state.json`` from the main process, with no barrier in between. A run killed while saving can
leave a ``checkpoint-N`` folder whose ``trainer_state.json`` parses while another rank's ``rng_state_1.pth`` is
missing, or whose ``model.safetensors`` / ``optimizer.pt`` is truncated;
`transformers.trainer_utils.get_last_checkpoint` still picks it (the highest N). The stock resume then fails deep
inside loading with a raw safetensors / zip error, or resumes silently with fresh optimizer moments (it loads
``optimizer.pt`` only when the file is there).

hf_gradacc brackets each save with two markers (:func:`checkpoint_save`): ``hf_gradacc_saving`` first, then, after
every rank saved (a barrier), ``hf_gradacc_complete.json`` LAST, listing every file of the folder with its size.
Older checkpoints are rotated away (``save_total_limit``) only after the new one's marker is written, so a kill at
any point leaves the old checkpoint or a complete new one. :func:`checkpoint_problems` checks a folder against its
marker (or, for a checkpoint saved without hf_gradacc, against what the resume reads) and reads the header of every
file: the safetensors header, the zip directory of a ``torch.save`` file, the whole of a JSON file.

On a distributed run every rank checks its own disk (node-local disks hold only the files their node wrote) and the
ranks merge what they found, so that every rank resumes the same folder, at rank 0's data record (docs/reliability.md,
"Checkpoints on node-local disks").
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers.utils import logging

from .backends.distributed import gather_objects, is_collective_failure, save_failure
from .backends.sharded_model import distributed_config_of
from .errors import GradAccConfigError, GradAccDistributedError

logger = logging.get_logger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
SAVING_NAME = "hf_gradacc_saving"  # written first: hf_gradacc is saving this folder
COMPLETE_NAME = "hf_gradacc_complete.json"  # written last, after every rank saved: the folder's files and sizes
DATA_NAME = "hf_gradacc_data.json"  # what the data position means: batch, GA / schedule, world size, dataset, seed
_MARKERS = (SAVING_NAME, COMPLETE_NAME, f".{COMPLETE_NAME}.tmp")
# What `Trainer._load_from_checkpoint` accepts as model weights (full, sharded, PEFT adapter, FSDP, DeepSpeed).
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "pytorch_model_fsdp.bin",
)
_OPTIMIZER = ("optimizer.pt", "optimizer.bin")
_SCHEDULER = "scheduler.pt"
_TORCH_SAVE = (".pt", ".pth", ".bin")


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a ``trainer_state.json`` that parses (enough to PLOT a run; to resume from a folder use
    :func:`checkpoint_problems`)."""
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "global_step" in state


# ---------------------------------------------------------------------------------------------- reading headers
def file_problem(path: str) -> str | None:
    """Why the file at ``path`` cannot be read (missing, truncated, not what its name says), or None. Reads only the
    header of a safetensors file, the zip directory of a ``torch.save`` file, the whole of a JSON file."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"{name} is missing"
    try:
        if name.endswith(".safetensors"):
            return _safetensors_problem(path)
        if name.endswith(_TORCH_SAVE):
            with zipfile.ZipFile(path) as archive:  # reads the central directory, written last by torch.save
                archive.infolist()
            return None
        if name.endswith(".json"):
            with open(path) as f:
                json.load(f)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        return f"{name} is unreadable ({type(error).__name__}: {error})"
    return None


def _safetensors_problem(path: str) -> str | None:
    name, size = os.path.basename(path), os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_size < 0 or 8 + header_size > size:
            return f"{name} is truncated ({size} bytes: no complete safetensors header)"
        header = json.loads(f.read(header_size))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_size + end > size:
        return f"{name} is truncated ({size} bytes where its header describes {8 + header_size + end})"
    return None


# ---------------------------------------------------------------------------------------------- one folder
def _listing(path: str) -> dict[str, int]:
    """Every file under ``path`` (relative names, markers excluded) and its size."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel not in _MARKERS and os.path.isfile(full):
                files[rel] = os.path.getsize(full)
    return files


def _resume_needs(path: str, files: dict[str, int], world_size: int, rank: int | None = None) -> list[str]:
    """What the resume reads and is not in ``files``: the trainer state, the model weights, the optimizer state (the
    stock resume silently starts with fresh moments without it) and the scheduler, one RNG state per rank that saved
    one: every rank's (``rank`` None: a folder every rank wrote into) or rank ``rank``'s own (it reads only its own;
    on node-local disks each node's folder holds only the RNG states of its own ranks)."""
    missing = []
    if TRAINER_STATE_NAME not in files:
        missing.append(f"{TRAINER_STATE_NAME} is missing")
    deepspeed_dir = _deepspeed_dir(path)
    sharded = [d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))]
    if (
        not any(n in files for n in _WEIGHTS)
        and deepspeed_dir is None
        and not any("pytorch_model_fsdp" in d for d in sharded)
    ):
        missing.append(f"the model weights are missing (none of {list(_WEIGHTS[:2])})")
    if deepspeed_dir is None:
        if not any(n in files for n in _OPTIMIZER) and not any(d.startswith("optimizer") for d in sharded):
            missing.append(
                _missing("optimizer.pt") + "; a checkpoint saved with `save_only_model=True` cannot be resumed"
            )
        elif _SCHEDULER not in files:
            missing.append(
                f"{_SCHEDULER} is missing (the stock resume then loads neither the optimizer nor the scheduler)"
            )
    rng = [n for n in files if re.fullmatch(r"rng_state(_\d+)?\.pth", n)]
    if world_size > 1 and any(n != "rng_state.pth" for n in rng):
        saved = min(world_size, _saved_world_size(path) or world_size)  # a rank the save did not have reads none
        ranks = range(saved) if rank is None else [rank] if rank < saved else []
        missing += [f"rng_state_{r}.pth is missing" for r in ranks if f"rng_state_{r}.pth" not in files]
    return missing


def _saved_world_size(path: str) -> int | None:
    """The world size the checkpoint's data record names, or None."""
    try:
        with open(os.path.join(path, DATA_NAME)) as f:
            value = json.load(f).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _missing(rel: str) -> str:
    if os.path.basename(rel) in _OPTIMIZER:
        return f"{rel} is missing (the stock resume would start with fresh optimizer moments, silently)"
    return f"{rel} is missing"


def _deepspeed_dir(path: str) -> str | None:
    """The ``global_stepN`` folder a DeepSpeed checkpoint's ``latest`` file names, or None."""
    try:
        with open(os.path.join(path, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    return tag or None


def checkpoint_problems(path: str, *, world_size: int = 1, rank: int | None = None) -> list[str]:
    """Why the checkpoint folder ``path`` cannot be resumed (each problem names its file), or ``[]`` when every file
    the resume reads is there and readable.

    A folder saved by hf_gradacc is checked against its ``hf_gradacc_complete.json`` (every file it lists there, with
    its size); one whose save started and never finished (``hf_gradacc_saving`` without the marker) is incomplete.
    A folder saved by the stock Trainer is checked against what the resume reads, with ``world_size`` ranks. With
    ``rank``, only that rank's own RNG state is required (what it reads; on node-local disks a node's folder holds
    its own ranks' RNG states only), else every rank's.

    Example:
        ```python
        assert not checkpoint_problems("out/checkpoint-500", world_size=2)
        ```
    """
    if not os.path.isdir(path):
        return [f"{path} is not a folder"]
    marker = os.path.join(path, COMPLETE_NAME)
    if os.path.isfile(marker):
        try:
            with open(marker) as f:
                files = dict(json.load(f)["files"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            return [f"{COMPLETE_NAME} is unreadable ({type(error).__name__}: {error})"]
        # The marker lists the files of every rank that shares this disk. With `rank`, this rank's own RNG state must
        # be on the disk, listed or not (a folder copied from rank 0's disk to this node's lists rank 0's files).
        own = {} if rank is None else {n: s for n, s in _listing(path).items() if n == f"rng_state_{rank}.pth"}
        problems = _resume_needs(path, {**files, **own}, world_size=world_size if rank is not None else 1, rank=rank)
    else:
        problems = []
        if os.path.isfile(os.path.join(path, SAVING_NAME)):
            problems.append(
                f"the save never finished ({SAVING_NAME} without {COMPLETE_NAME}: the run was likely "
                "killed while saving)"
            )
        files = _listing(path)
        problems += _resume_needs(path, files, world_size, rank)
    for rel, size in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            problems.append(_missing(rel))
        elif os.path.getsize(full) != size:
            problems.append(f"{rel} has {os.path.getsize(full)} bytes where the save wrote {size}")
        elif problem := file_problem(full):
            problems.append(problem if os.sep not in rel else problem.replace(os.path.basename(rel), rel, 1))
    return problems


# ---------------------------------------------------------------------------------------------- choosing one
def _checkpoints(output_dir: str) -> list[tuple[int, str]]:
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    found = ((m, name) for name in names if (m := _CHECKPOINT.match(name)))
    return sorted((int(m.group(1)), name) for m, name in found if os.path.isdir(os.path.join(output_dir, name)))


def _gathered(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` on one process): one collective (the backends')."""
    return gather_objects(value)


# What a rank's folder lacks when the rank does not share rank 0's disk (files the Trainer writes on rank 0 only).
_RANK_ZERO_FILES = (f"{TRAINER_STATE_NAME} is missing", "the model weights are missing")
_NODE_LOCAL = (
    "this rank's disk lacks files rank 0's holds, so the ranks do not share `output_dir`'s disk: the Trainer writes "
    "the model weights on global rank 0 only (transformers' `save_pretrained`, also with `save_on_each_node=True`), "
    "and without `save_on_each_node` the trainer state and optimizer too; copy rank 0's checkpoint folders into "
    "every node's `output_dir` before resuming (each node keeping its own rng_state_<rank>.pth), or save to a shared "
    "file system"
)


def _rank_zero_only(problems: list[str]) -> bool:
    return any(p.startswith(_RANK_ZERO_FILES) for p in problems)


def _agreed(problems: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every rank's problems with each folder, merged, so that every rank takes the same checkpoint: a file missing
    on one rank's disk is missing, and a folder that is not on one rank's disk at all (node-local disks) cannot be
    resumed. A rank whose folder lacks what rank 0's holds (the weights, the trainer state) does not share rank 0's
    disk: the problems say what to do (:data:`_NODE_LOCAL`)."""
    gathered = _gathered(problems)
    return problems if len(gathered) == 1 else _merged(gathered)


def _merged(gathered: list[dict[str, list[str]]]) -> dict[str, list[str]]:
    """:func:`_agreed`'s merge of every rank's problems (in rank order), each named after its rank but rank 0's."""
    merged: dict[str, list[str]] = {}
    for name in sorted({name for seen in gathered for name in seen}):
        merged[name] = []
        for rank, seen in enumerate(gathered):
            found = seen.get(name, ["the folder is missing"])
            if rank > 0 and _rank_zero_only(found) and not _rank_zero_only(gathered[0].get(name, found)):
                found = [*found, _NODE_LOCAL]
            for p in found:
                p = p if rank == 0 else f"{p} (rank {rank})"
                if p not in merged[name]:
                    merged[name].append(p)
    return merged


def latest_complete_checkpoint(output_dir: str, *, world_size: int = 1, rank: int | None = None) -> str:
    """The ``checkpoint-N`` folder of ``output_dir`` with the highest N that can be resumed (no
    :func:`checkpoint_problems` on any rank, ``rank`` being this process's; every rank of a distributed run takes the
    same N, also when the ranks' ``output_dir`` are different disks); newer ones are passed over with a warning
    naming the missing or broken file and the rank. Raises :class:`~hf_gradacc.GradAccConfigError` when there is
    none.

    Example:
        ```python
        trainer.train(resume_from_checkpoint=latest_complete_checkpoint(args.output_dir))
        ```
    """
    problems = _agreed(
        {
            name: checkpoint_problems(os.path.join(output_dir, name), world_size=world_size, rank=rank)
            for _, name in _checkpoints(output_dir)
        }
    )
    skipped = []
    for name in sorted(problems, key=lambda n: int(_CHECKPOINT.match(n).group(1)), reverse=True):
        if not problems[name]:
            path = os.path.join(output_dir, name)
            if skipped:
                logger.warning(
                    f"Resuming from {path}: the newer {[n for n, _ in skipped]} cannot be resumed ("
                    + "; ".join(f"{n}: {', '.join(p)}" for n, p in skipped)
                    + "): not saved completely, the run was likely killed while saving."
                )
            return path
        skipped.append((name, problems[name]))
    raise GradAccConfigError(
        f"`resume_from_checkpoint=True` found no complete checkpoint in `output_dir` ({output_dir!r})"
        + (f"; incomplete ones: {'; '.join(f'{n}: {chr(44).join(p)}' for n, p in skipped)}" if skipped else "")
        + ". Pass a checkpoint folder, or start without `resume_from_checkpoint`."
    )


def checkpoint_identity(path: str) -> str | None:
    """What tells the checkpoint in folder ``path`` from any other, whatever folder holds it: its global step and a
    digest of its ``trainer_state.json`` (the step, the epoch, every logged loss and learning rate; without the two
    fields that say which process wrote it), or None when the trainer state is unreadable. Copies of one checkpoint
    (each worker of a Ray Train job resumes from its own download of the reported one) have the same identity; two
    steps of a run, or the same step of two runs, do not. The completion marker alone would not tell them apart: it
    lists file sizes, and every step of a run saves files of the same sizes.

    Example:
        ```python
        assert checkpoint_identity("/tmp/a/checkpoint") == checkpoint_identity("out/checkpoint-2")   # a copy
        ```
    """
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    for who in ("is_local_process_zero", "is_world_process_zero"):  # a node's main process writes its own copy
        state.pop(who, None)
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:12]
    return f"global step {state.get('global_step')}, trainer state {digest}"


def _agreed_folder(path: str, *, world_size: int, rank: int) -> list[str]:
    """Every rank's problems with the folder IT names as the checkpoint to resume, merged, plus one when the ranks'
    folders hold different checkpoints: the ranks agree on the checkpoint by its content
    (:func:`checkpoint_identity`), not by its path, so each rank may resume from its own copy in a folder of its own.
    One collective."""
    own = checkpoint_problems(path, world_size=world_size, rank=rank)
    gathered = _gathered((path, own, checkpoint_identity(path)))
    if len(gathered) == 1:
        return own
    problems = _merged([{"checkpoint": seen} for _, seen, _ in gathered])["checkpoint"]
    held = [(r, where, identity) for r, (where, _, identity) in enumerate(gathered) if identity is not None]
    if len({identity for _, _, identity in held}) > 1:
        problems.append(
            "the ranks' folders hold different checkpoints ("
            + "; ".join(f"rank {r}'s {where!r}: {identity}" for r, where, identity in held)
            + "): every rank must resume the same checkpoint (each its own copy of it is fine)"
        )
    return problems


def resolve_resume(
    value: str | bool | None, *, args: Any, layout: Callable[[], dict[str, Any]], mismatch: str, blocker: str | None
) -> tuple[str | bool | None, ResumePoint | None]:
    """What `Trainer.train` gets for ``resume_from_checkpoint``, and where the resumed run starts in the data when
    the checkpoint's position is carried over in samples (None: the stock resume). ``True`` becomes the newest
    complete checkpoint; a folder is checked and refused with :class:`~hf_gradacc.GradAccConfigError` naming the
    missing or broken file when it cannot be resumed, or naming the setting when it was saved with a data layout
    that cannot be carried over (:func:`check_data_layout`: this run's ``layout()``, ``resume_data_mismatch``, why the
    samples trained are not a prefix of the epoch's order, :func:`prefix_blocker`); anything else passes through."""
    world_size, rank = args.world_size, args.process_index
    if value is True:  # the same name on every rank; on node-local disks, the same checkpoint too (checked below)
        path = latest_complete_checkpoint(args.output_dir, world_size=world_size, rank=rank)
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
    else:
        return value, None
    problems = _agreed_folder(path, world_size=world_size, rank=rank)
    if problems:
        found = " (`resume_from_checkpoint=True` picked it as the newest complete one)" if value is True else ""
        raise GradAccConfigError(
            f"`resume_from_checkpoint` ({path!r}){found} cannot be resumed: {'; '.join(problems)}. Resume from an "
            "older checkpoint (`resume_from_checkpoint=True` picks the newest complete one), or start without it."
        )
    return path, check_data_layout(path, layout(), mismatch=mismatch, blocker=blocker)


# ---------------------------------------------------------------------------------------------- the data position
# What the data position of a checkpoint means. The stock resume skips `global_step` x (the NEW run's samples per step)
# of the epoch's order; hf_gradacc records where the epoch stands in samples instead (`DataPosition`), so a change of
# the first five fields is carried over exactly (`ResumePoint`); a change of any other one cannot be.
_RELAYOUT_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "accumulation_schedule",
    "world_size",
    "data_parallel_size",
)  # the processes, and the ranks among them that hold different samples
_LAYOUT_FIELDS = (
    *_RELAYOUT_FIELDS,
    "num_train_samples",
    "seed",
    "data_seed",
    "dataloader_drop_last",
    "train_sampling_strategy",
    "regroup_micro_batches",
    "max_tokens_per_micro_batch",
    "pack_micro_batches",
)
# Samplers whose epoch order depends on neither the batch size nor the number of ranks (the seed and epoch only).
_PREFIX_SAMPLING = ("random", "sequential")
_UNKNOWN_IF_NONE = ("per_device_train_batch_size", "num_train_samples")  # auto_find_batch_size, an IterableDataset
POSITION_KEY = "position"


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPosition:
    """Where the training data stands after an optimizer step, as recorded in a checkpoint.

    Attributes:
        epoch: the epoch in progress (0-based).
        num_samples: samples of the epoch's order trained, the first ``num_samples`` of it; None when what was
            trained is not a prefix of the order (a dataset without a length, ``group_by_length``).
        num_micro_batches: micro-batches per rank trained in the epoch by the run that saved.
        epoch_done: every micro-batch of the epoch was trained (the next one starts the next epoch).
    """

    epoch: int
    num_samples: int | None
    num_micro_batches: int
    epoch_done: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoint:
    """Where a resumed run starts in the data, taken from the checkpoint's record, not from ``global_step``.

    Attributes:
        epoch: the epoch to resume in.
        num_samples: samples of that epoch's order already trained (skipped by the resumed run).
        global_step: the checkpoint's optimizer steps.
        changed: the layout fields that differ, as ``"name old -> new"``.
    """

    epoch: int
    num_samples: int
    global_step: int
    changed: tuple[str, ...]


def prefix_blocker(args: Any, dataset: Any) -> str | None:
    """Why the samples a run trains are not a prefix of the epoch's order (so a position in samples means nothing),
    or None when they are: a dataset without a length, a sampler whose order depends on the batch size
    (``group_by_length``). Regrouped and packed windows keep each stock window's samples, a prefix of the order."""
    from transformers.trainer_utils import has_length

    if dataset is None or not has_length(dataset):
        return "the training dataset has no length (an IterableDataset): there is no epoch order to count in"
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in _PREFIX_SAMPLING:
        return f"`train_sampling_strategy`={strategy!r} orders the epoch by batches of this run's size"
    return None


def data_layout(args: Any, settings: Any, dataset: Any, *, data_parallel_size: int) -> dict[str, Any]:
    """What decides which samples each optimizer step takes (recorded in every checkpoint): the arguments, the
    settings, the training dataset's length, and the ranks holding different samples (the mesh's
    ``data_parallel_size``: not the processes, whose tensor-, context- and sequence-parallel ranks share a data
    rank's batches)."""
    from transformers.trainer_utils import has_length

    schedule = settings.accumulation_schedule
    layout = {
        "per_device_train_batch_size": None if args.auto_find_batch_size else args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "accumulation_schedule": None if schedule is None else str(schedule),
        "world_size": args.world_size,
        "data_parallel_size": data_parallel_size,  # cp 1 -> 2 on the same processes changes it alone
        "num_train_samples": len(dataset) if dataset is not None and has_length(dataset) else None,
        "seed": args.seed,
        "data_seed": args.data_seed,
        "dataloader_drop_last": args.dataloader_drop_last,
        "train_sampling_strategy": getattr(args, "train_sampling_strategy", "random"),
        "regroup_micro_batches": settings.regroup_micro_batches,
        "max_tokens_per_micro_batch": settings.max_tokens_per_micro_batch,
        "pack_micro_batches": settings.pack_micro_batches,
    }
    return {name: layout[name] for name in _LAYOUT_FIELDS}


def _read_record(path: str) -> tuple[dict[str, Any], int] | None:
    """The checkpoint's data record and its ``global_step``, or None (a checkpoint saved without hf_gradacc)."""
    try:
        with open(os.path.join(path, DATA_NAME)) as f:
            saved = json.load(f)
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            step = int(json.load(f).get("global_step", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return (saved, step) if isinstance(saved, dict) else None


def _rank_zero_record(path: str) -> tuple[dict[str, Any], int] | None:
    """Rank 0's data record and step (:func:`_read_record`), on every rank: one decision everywhere, also when the
    ranks read different disks (node-local). Another rank whose folder holds another step is a
    :class:`~hf_gradacc.GradAccConfigError` (the Trainer would load a different state on each rank); another record
    at the same step, a warning naming what differs."""
    records = _gathered(_read_record(path))
    chosen = records[0]
    for rank, other in enumerate(records[1:], start=1):
        if other == chosen:
            continue
        steps = [None if r is None else r[1] for r in (chosen, other)]
        if None not in steps and steps[0] != steps[1]:
            raise GradAccConfigError(
                f"`resume_from_checkpoint` ({path!r}): rank 0's folder holds step {steps[0]} and rank {rank}'s step "
                f"{steps[1]} (their {TRAINER_STATE_NAME}); the ranks do not read the same checkpoint (node-local "
                "disks holding different runs' folders). Give every rank the same checkpoint, or resume from a folder "
                "every rank holds."
            )
        mine, theirs = ({} if r is None else r[0] for r in (chosen, other))
        differs = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
        logger.warning(
            f"Resuming {path!r}: rank {rank}'s {DATA_NAME} differs from rank 0's in {differs} (rank 0: "
            f"{[mine.get(k) for k in differs]}; rank {rank}: {[theirs.get(k) for k in differs]}); every rank resumes "
            "at rank 0's record."
        )
    return chosen


def _saved_position(saved: dict[str, Any]) -> DataPosition | None:
    try:
        return DataPosition(**saved[POSITION_KEY])
    except (KeyError, TypeError):
        return None  # a record written before positions were (hf_gradacc < 0.x: issue 18)


def check_data_layout(
    path: str, current: dict[str, Any], *, mismatch: str = "error", blocker: str | None = None
) -> ResumePoint | None:
    """Judge the checkpoint at ``path`` against this run's data layout ``current``; return where to resume in the
    data when the checkpoint's position is carried over in samples, or None for the stock resume (skip
    ``global_step`` steps of this run's layout).

    A changed batch size, ``gradient_accumulation_steps``, ``accumulation_schedule``, world or data-parallel size
    (the mesh's ``data_parallel_size``: a changed ``cp_size`` on the same processes) is carried over
    when the checkpoint recorded its position in samples and ``blocker`` (why this run's samples are not a prefix of
    the epoch's order, see :func:`prefix_blocker`) is None. Any other difference (dataset length, seed, data_seed,
    drop_last, sampling strategy, regrouping or packing), or a layout change that cannot be carried over, raises
    :class:`~hf_gradacc.GradAccConfigError` naming it, unless ``mismatch="accept"`` (a warning then, and the stock
    resume). Checkpoints saved without hf_gradacc's ``hf_gradacc_data.json`` are not judged.

    Example:
        ```python
        point = check_data_layout("out/checkpoint-4", data_layout(trainer))
        if point is not None:
            print(f"resuming epoch {point.epoch} after its first {point.num_samples} samples")
        ```
    """
    record = _rank_zero_record(path)  # every rank judges rank 0's record: one decision on every rank
    if record is None:
        return None
    saved, step = record
    differs = [
        name
        for name in _LAYOUT_FIELDS
        if name in saved
        and saved[name] != current.get(name)
        and not (name in _UNKNOWN_IF_NONE and None in (saved[name], current.get(name)))
    ]
    if step == 0:
        return None
    position = _saved_position(saved)
    hard = [name for name in differs if name not in _RELAYOUT_FIELDS]
    why_not = None
    if differs and not hard:
        if blocker is not None:  # this run's own reason (the same as the saved run's when its settings are kept)
            why_not = blocker
        elif position is None or position.num_samples is None:
            why_not = "the checkpoint did not record its position in samples" + (
                " (its samples were not a prefix of the epoch's order: no dataset length, or group_by_length)"
                if position is not None
                else " (saved by an older hf_gradacc)"
            )
    if hard or why_not is not None:
        changes = ", ".join(f"{name}={saved[name]!r} (this run: {current.get(name)!r})" for name in differs)
        reason = (
            f"a changed {', '.join(n for n in differs if n in _RELAYOUT_FIELDS)} cannot be carried over: {why_not}"
            if why_not is not None
            else "these decide which samples each step takes and cannot be carried over"
        )
        if mismatch == "accept":
            logger.warning(
                f"Resuming {path!r} (step {step}) with {changes} (`resume_data_mismatch='accept'`): {reason}. The "
                "resume skips `global_step` times this run's samples per step of the epoch's order; samples may be "
                "lost or trained twice."
            )
            return None
        raise GradAccConfigError(
            f"`resume_from_checkpoint` ({path!r}) was saved at step {step} with {changes}; {reason}. The resume would "
            "skip `global_step` times THIS run's samples per step of the epoch's order, so samples would be lost or "
            "trained twice, silently. Resume with the checkpoint's values, set `resume_data_mismatch='accept'` "
            "(`--resume_data_mismatch accept` on a command line) to "
            "resume anyway, or start a new run from its weights (`from_pretrained` on the folder) without "
            "`resume_from_checkpoint`."
        )
    if position is None or position.num_samples is None or blocker is not None:
        return None  # the same layout, not counted in samples: the stock resume, as before
    epoch, num_samples = position.epoch, position.num_samples
    if position.epoch_done or num_samples >= current["num_train_samples"]:
        epoch, num_samples = epoch + 1, 0
    changed = tuple(f"{name} {saved[name]!r} -> {current.get(name)!r}" for name in differs)
    return ResumePoint(epoch=epoch, num_samples=num_samples, global_step=step, changed=changed)


def stock_position(
    global_step: int,
    *,
    num_update_steps_per_epoch: int,
    gradient_accumulation_steps: int,
    schedule: Any,
    batches_per_epoch: int | None,
) -> tuple[int, int]:
    """Where the stock resume puts a run at ``global_step`` in THIS run's layout: ``(epoch, micro-batches per rank
    trained in it)``."""
    if schedule is not None:
        return schedule.locate(global_step, batches_per_epoch)
    done = global_step % num_update_steps_per_epoch * gradient_accumulation_steps
    return global_step // num_update_steps_per_epoch, done


# ---------------------------------------------------------------------------------------------- saving
def _newest_complete(run_dir: str, *, below: int) -> str | None:
    """The newest checkpoint of ``run_dir`` older than step ``below`` with a completion marker on this rank's disk,
    and readable (no collective: called once the process group is broken)."""
    for step, name in reversed(_checkpoints(run_dir)):
        path = os.path.join(run_dir, name)
        if step < below and os.path.isfile(os.path.join(path, COMPLETE_NAME)) and not checkpoint_problems(path):
            return path
    return None


def _write_marker(folder: str) -> None:
    """``hf_gradacc_complete.json``, atomically (a temporary file renamed), listing every file and its size."""
    files = _listing(folder)
    temporary = os.path.join(folder, f".{COMPLETE_NAME}.tmp")
    with open(temporary, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(folder, COMPLETE_NAME))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, SAVING_NAME))


@contextlib.contextmanager
def checkpoint_save(
    *, run_dir: str, args: Any, state: Any, wait_for_everyone: Callable[[], None], record: Callable[[], dict[str, Any]]
) -> Iterator[None]:
    """Around `Trainer._save_checkpoint`: ``hf_gradacc_saving`` first; after every rank saved (``wait_for_everyone``,
    a barrier) the marker ``hf_gradacc_complete.json`` LAST, with the data ``record()`` beside it; only then older
    checkpoints of ``run_dir`` rotated away (``save_total_limit``), so a kill at any point leaves the old checkpoint or
    a complete new one. A peer that dies or fails while saving (its save's collectives, or the barrier) is a
    :class:`~hf_gradacc.GradAccDistributedError` on every surviving rank, naming the step, the folder left incomplete
    and the checkpoint the next resume takes; ``state``: the Trainer's (its step, its best checkpoint).

    The saving rank's finish (the record, the marker, the rotation) is agreed by every rank in one collective before
    any rank leaves: the Trainer calls ``on_save`` right after, and a callback that copies or uploads the folder on
    every rank (Ray Train's ``RayTrainReportCallback``) must see it complete, never mid-finish. A finish that fails on
    one rank (a full disk) is that error on that rank and a :class:`~hf_gradacc.GradAccDistributedError` naming it
    on every other rank, so no rank trains on alone."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    if args.should_save:
        os.makedirs(folder, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, COMPLETE_NAME))  # saved again: no longer complete until this save ends
        with open(os.path.join(folder, SAVING_NAME), "w") as f:
            f.write("hf_gradacc is saving this checkpoint; it is complete once hf_gradacc_complete.json is here\n")
    limit = args.save_total_limit
    args.save_total_limit = None  # rotate only once the new checkpoint is complete
    try:
        try:
            yield
        finally:
            args.save_total_limit = limit
        wait_for_everyone()  # every rank's files (RNG state, shards) are written
        failure = _finish_save(folder, run_dir, limit, state, record) if args.should_save else None
        failures = _gathered(None if failure is None else f"{type(failure).__name__}: {failure}")  # the finish, agreed
    except RuntimeError as error:  # a peer died or failed while saving: the save's collectives or these two
        if not is_collective_failure(error):
            raise
        step = state.global_step
        raise save_failure(step, folder, _newest_complete(run_dir, below=step), args) from error
    if failure is not None:
        raise failure
    failed = [(rank, why) for rank, why in enumerate(failures) if why is not None]
    if failed:
        rank, why = failed[0]
        raise GradAccDistributedError(
            f"Saving the checkpoint of optimizer step {state.global_step}: rank {rank} failed to finish it ({why}); "
            f"{folder} is left incomplete (no {COMPLETE_NAME}) and the next `resume_from_checkpoint=True` passes it "
            f"over. Every rank stops here (this is rank {args.process_index}); see rank {rank}'s log."
        )


def _finish_save(
    folder: str, run_dir: str, limit: int | None, state: Any, record: Callable[[], dict[str, Any]]
) -> Exception | None:
    """The saving rank's end of a save, once every rank's files are written: the data record, the marker LAST, then
    the rotation of older checkpoints. Returns what failed (to be agreed by every rank first), or None."""
    from transformers.trainer_utils import rotate_checkpoints

    try:
        with open(os.path.join(folder, DATA_NAME), "w") as f:
            json.dump(record(), f, indent=1)
        _write_marker(folder)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )
    except Exception as error:  # noqa: BLE001 - raised after every rank heard of it
        return error
    return None


# ---------------------------------------------------------------------------------------------- the resumed weights
# What `Trainer._load_from_checkpoint` reads as the model's weights, in its order of preference.
_WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
_NAMES_SHOWN = 6


def restore_weights(
    model: torch.nn.Module, folder: str, *, managed_elsewhere: bool = False, field: str = "resume_from_checkpoint"
) -> None:
    """After `Trainer._load_from_checkpoint`: every tensor of the checkpoint's model weights is in ``model``.

    The Trainer loads ``model.safetensors`` with ``load_state_dict``, by name, and only logs the names that do not
    match. transformers 5 saves some models in another layout than they train in: a mixture-of-experts model's
    experts train as one tensor per layer (``mlp.experts.gate_up_proj``) and are saved one per expert, Mixtral's under
    another module name too (``block_sparse_moe.experts.0.w1.weight``); resumed, the router and experts kept the values
    they had before the resume. Here the tensors the load by name missed are converted as `from_pretrained` converts
    them (transformers' conversion mapping of the model) and copied into the model's own. A tensor of the model that
    the checkpoint still does not restore, or a saved one that no tensor of the model takes, is a
    :class:`~hf_gradacc.GradAccConfigError` on every rank, naming them, the transformers version and the way out.

    ``field`` names the setting that loaded ``folder`` in the messages: ``resume_from_checkpoint``, or
    ``load_best_model_at_end`` (the Trainer loads the best checkpoint at the end of training by name as well).

    Not checked (``managed_elsewhere``): FSDP and DeepSpeed checkpoints (their own state dicts, in the model's names);
    nor adapters, nor a model sharded at load time (its checkpoints cannot be resumed; see docs/backends.md).

    Example:
        ```python
        restore_weights(trainer.model, "out/checkpoint-500")   # GradAccMixin calls it on every resume
        ```
    """
    if managed_elsewhere or distributed_config_of(model) is not None:
        return
    saved = _saved_weights(folder)
    problem = None if saved is None else _restore(model, saved, folder, field)
    problems = [(rank, p) for rank, p in enumerate(_gathered(problem)) if p is not None]  # every rank raises alike
    if problems:
        rank, message = problems[0]
        raise GradAccConfigError(message + (f" (found by rank {rank}'s load)" if rank else ""))


def _saved_weights(folder: str) -> dict[str, Callable[[], torch.Tensor]] | None:
    """The checkpoint's model tensors by saved name, each read when called, from the file(s) the Trainer loads;
    None without full model weights (an adapter checkpoint)."""
    path = next((p for n in _WEIGHT_FILES if os.path.isfile(p := os.path.join(folder, n))), None)
    if path is None:
        return None
    if not path.endswith(".index.json"):
        return _readers(path)
    with open(path) as f:
        files = set(json.load(f)["weight_map"].values())
    return {key: read for file in sorted(files) for key, read in _readers(os.path.join(folder, file)).items()}


def _readers(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        handle = safe_open(path, framework="pt", device="cpu")
        return {key: partial(handle.get_tensor, key) for key in handle.keys()}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {key: partial(state.__getitem__, key) for key in state}


def _restore(
    model: torch.nn.Module, saved: dict[str, Callable[[], torch.Tensor]], folder: str, field: str
) -> str | None:
    """Restore what the Trainer's load by name left out; why the checkpoint does not restore the model, or None."""
    import transformers

    state = model.state_dict()
    others = {key: read for key, read in saved.items() if key not in state}  # the load by name restored the rest
    restored, untaken, failure = {key for key in saved if key in state}, [], ""
    if others:
        try:
            converted = _convert_into(model, state, others, untaken)
        except (ImportError, AttributeError, TypeError, ValueError, KeyError, RuntimeError) as error:
            converted, untaken = set(), list(others)
            failure = f" (converting them failed: {type(error).__name__}: {error})"
        restored |= converted
    missing = _not_restored(model, state, restored)
    name = type(model).__name__
    if not missing and not untaken:
        if others:
            logger.warning(
                f"Loading {folder!r} (`{field}`): the Trainer loads the checkpoint's weights by name and left "
                f"{len(converted)} tensors of {name} at their values before the load "
                f"({_names(sorted(converted))}; its 'missing keys' warning): transformers "
                f"{transformers.__version__} saves {name} in another layout than it trains in. hf_gradacc restored "
                "them through transformers' conversion mapping, as `from_pretrained` converts them; every tensor of "
                "the checkpoint is restored."
            )
        return None
    saved_by = _saved_version(folder)
    return (
        f"`{field}` ({folder!r}): the checkpoint's weights do not restore {name}: "
        + (f"{len(missing)} of its tensors are not in it ({_names(missing)})" if missing else "")
        + ("; " if missing and untaken else "")
        + (f"{len(untaken)} saved tensors go to no tensor of the model ({_names(untaken)})" if untaken else "")
        + f"{failure}. The Trainer of transformers {transformers.__version__} (the checkpoint was saved by "
        f"{saved_by}) "
        "loads the weights by name, and the conversion mapping `from_pretrained` converts saved names with does not "
        "turn these into the model's; the tensors left out would keep the values they had before the load, "
        "silently. "
        + (
            f"Resume with a transformers version whose conversion mapping covers "
            f"{getattr(model.config, 'model_type', name)!r} (the one that saved the checkpoint, if another), or start "
            f"a new run from its weights, `{name}.from_pretrained({folder!r})`, without `resume_from_checkpoint` (the "
            "optimizer's moments and the schedule then start afresh)."
            if field == "resume_from_checkpoint"
            else f"Set `{field}=False` and load the best checkpoint after training with "
            f"`{name}.from_pretrained({folder!r})`, which converts it."
        )
    )


def _convert_into(
    model: torch.nn.Module, state: dict[str, torch.Tensor], saved: dict[str, Callable[[], torch.Tensor]], untaken: list
) -> set[str]:
    """Convert the saved tensors ``saved`` to the model's names and layout as `from_pretrained` does (the model's
    conversion mapping: renamings, each layer's experts stacked in index order) and copy each into the model's tensor
    of that name; return the names restored. Saved names no tensor of the model takes go to ``untaken``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, Any] = {}
    for key in sorted(saved, key=dot_natural_key):  # the order from_pretrained stacks the experts in
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if target not in state:
            untaken.append(key)
            continue
        transform = groups.setdefault(
            target, copy.deepcopy(by_pattern[pattern]) if pattern is not None else WeightRenaming(key, target)
        )
        transform.add_tensor(target, key, key if pattern is None else pattern, saved[key])
    restored = set()
    with torch.no_grad():
        for first, transform in groups.items():
            for target, value in transform.convert(first, model=model, config=model.config).items():
                value = value[0] if isinstance(value, list) else value
                if target not in state or state[target].shape != value.shape:
                    untaken.append(target)
                    continue
                state[target].copy_(value)
                restored.add(target)
    return restored


def _not_restored(model: torch.nn.Module, state: dict[str, torch.Tensor], restored: set[str]) -> list[str]:
    """The model's tensors not restored: neither sharing memory with a restored one (tied weights are saved once)
    nor left out of every save (``_keys_to_ignore_on_save``)."""

    def place(tensor: torch.Tensor) -> tuple:
        return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)

    covered = {place(state[name]) for name in restored}
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return [n for n, t in state.items() if n not in restored and n not in ignored and place(t) not in covered]


def _saved_version(folder: str) -> str:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return f"transformers {json.load(f)['transformers_version']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown transformers version"


def _names(names: list[str]) -> str:
    return ", ".join(names[:_NAMES_SHOWN]) + (
        f", ... ({len(names) - _NAMES_SHOWN} more)" if len(names) > _NAMES_SHOWN else ""
    )
