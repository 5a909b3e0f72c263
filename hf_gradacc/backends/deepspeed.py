"""DeepSpeed ZeRO-1/2/3 through accelerate: GradAccTrainer drives the engine itself.

``accelerator.backward`` is not used: it sets the accumulation boundary from accelerate's ``sync_gradients`` on
every call and runs ``engine.step()`` inside every boundary backward, so a second backward pass steps twice and
callbacks see the gradient after the step. Here every backward pass is ``engine.backward(loss,
scale_wrt_gas=False)`` with the boundary set to "final backward pass of the window" just before it, and
``engine.step()`` runs once per window, after the norm and the ``on_pre_optimizer_step`` callbacks.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers.utils import logging

from ..errors import GradAccConfigError, UnsupportedBackendError
from ..grads import RunningGradNorm
from ..schedule import scaled_learning_rate
from .base import Backend, sum_of_squares

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from ..config import GradAccSettings

logger = logging.get_logger(__name__)

SUPPORTED_ZERO_STAGES = (1, 2, 3)


def _is_set(value: Any) -> bool:
    """A DeepSpeed config value the user wrote (not missing, not ``"auto"``)."""
    return value is not None and value != "auto"


def _clip_value(value: Any) -> float:
    """A clipping threshold as DeepSpeed reads it: ``0.0`` means no clipping."""
    if value is None:
        return 0.0
    value = float(value)
    return value if value > 0 and math.isfinite(value) else 0.0


def check_deepspeed_config(
    config: dict[str, Any], args: TrainingArguments, num_processes: int, sequence_parallel_size: int = 1
) -> dict[str, Any]:
    """Check a DeepSpeed config against the TrainingArguments and fill what GradAccTrainer needs, in place.

    GradAccTrainer owns the accumulation (DeepSpeed never divides the loss by its own
    ``gradient_accumulation_steps``) and the clipping threshold comes from ``max_grad_norm`` (DeepSpeed's own
    default ``gradient_clipping`` is 1.0, which would clip silently). Values the user wrote that disagree raise
    :class:`~hf_gradacc.GradAccConfigError` naming both settings; missing and ``"auto"`` values are filled.

    Example:
        ```python
        config = {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}
        check_deepspeed_config(config, args, num_processes=2)
        assert config["gradient_clipping"] == (args.max_grad_norm or 0.0)
        ```
    """
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if not isinstance(stage, int) or stage not in SUPPORTED_ZERO_STAGES:
        raise UnsupportedBackendError(
            f"DeepSpeed ZeRO stage {stage!r} is not supported by GradAccTrainer; supported: {SUPPORTED_ZERO_STAGES}. "
            "Set `zero_stage` in the accelerate config (or `zero_optimization.stage` in the DeepSpeed config)."
        )
    gas = args.gradient_accumulation_steps
    micro = args.per_device_train_batch_size
    pairs = (
        ("gradient_accumulation_steps", gas, "gradient_accumulation_steps"),
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size"),
    )
    for ds_key, wanted, hf_key in pairs:
        value = config.get(ds_key)
        if _is_set(value) and int(value) != wanted:
            raise GradAccConfigError(
                f"DeepSpeed `{ds_key}` ({value}) differs from TrainingArguments `{hf_key}` ({wanted}). Set "
                f"`{ds_key}` to 'auto' in the DeepSpeed config (or drop it from the accelerate config's "
                f"`deepspeed_config`) so it follows `{hf_key}`, or make them equal."
            )
        config[ds_key] = wanted
    total = config.get("train_batch_size")
    # under Ulysses accelerate rewrites it per data rank when it prepares the engine (a backend built again later
    # sees it)
    allowed = {micro * gas * num_processes, micro * gas * (num_processes // max(1, sequence_parallel_size))}
    if _is_set(total) and int(total) not in allowed:
        raise GradAccConfigError(
            f"DeepSpeed `train_batch_size` ({total}) is not `per_device_train_batch_size` x "
            f"`gradient_accumulation_steps` x processes ({micro} x {gas} x {num_processes} = "
            f"{micro * gas * num_processes}). Set `train_batch_size` to 'auto' in the DeepSpeed config. (Without "
            "GPU and with `TrainingArguments(deepspeed=...)`, 'auto' was filled for 1 process: call "
            "hf_gradacc.patches.enable_cpu_distributed() before building the TrainingArguments.)"
        )
    config["train_batch_size"] = int(total) if _is_set(total) else micro * gas * num_processes
    wanted_clip = _clip_value(args.max_grad_norm)
    clip = config.get("gradient_clipping")
    if _is_set(clip) and _clip_value(clip) != wanted_clip:
        raise GradAccConfigError(
            f"DeepSpeed `gradient_clipping` ({clip}) differs from TrainingArguments `max_grad_norm` "
            f"({args.max_grad_norm}). GradAccTrainer clips with `max_grad_norm`: set `gradient_clipping` to 'auto' "
            "in the DeepSpeed config (or drop it from the accelerate config), or set `max_grad_norm` to the same "
            "value."
        )
    config["gradient_clipping"] = wanted_clip
    if config.get("managed_gradient_accumulation", True) is False:
        raise GradAccConfigError(
            "DeepSpeed `managed_gradient_accumulation` is false; GradAccTrainer sets the accumulation boundary on "
            "every backward pass, which needs it true (the default). Remove it from the DeepSpeed config."
        )
    return config


def release_derived_batch(config: dict[str, Any], args: TrainingArguments, num_processes: int) -> None:
    """Under ``total_train_batch_size``: the DeepSpeed config's ``gradient_accumulation_steps`` and
    ``train_batch_size`` that transformers filled from the arguments' ``gradient_accumulation_steps`` as GIVEN
    (``"auto"`` filled before the accumulation was derived) go back to ``"auto"``, so that
    :func:`check_deepspeed_config` fills them with the derived accumulation. Values that differ were written by the
    user and are checked as usual (an error naming both).

    Example:
        ```python
        config = {"gradient_accumulation_steps": 1, "train_batch_size": 4}  # filled with the given GA 1, 2 x 2 ranks
        release_derived_batch(config, args, num_processes=2)               # both "auto" again
        ```
    """
    from ..config import given_accumulation

    given, micro = given_accumulation(args), args.per_device_train_batch_size
    for key, filled in (("gradient_accumulation_steps", given), ("train_batch_size", micro * given * num_processes)):
        if _is_set(config.get(key)) and int(config[key]) == filled:
            config[key] = "auto"


def zero_resume_problem(folder: str, *, data_ranks: int, config: dict[str, Any]) -> str | None:
    """Why the ZeRO checkpoint in ``folder`` (a Trainer checkpoint: ``latest`` names its ``global_stepN``) cannot be
    loaded on ``data_ranks`` ranks with ``config``; None when it can (or holds no ZeRO state).

    Example:
        ```python
        zero_resume_problem("out/checkpoint-1", data_ranks=1, config={"zero_optimization": {"stage": 2}})
        # "Resuming 'out/checkpoint-1' on 1 data rank: its DeepSpeed ZeRO optimizer state is partitioned over 2 ..."
        ```
    """
    import glob
    import os

    if not os.path.isfile(os.path.join(folder, "latest")):
        return None  # no DeepSpeed state (the Trainer's own checks name what is missing)
    with open(os.path.join(folder, "latest")) as f:
        step_dir = os.path.join(folder, f.read().strip())
    saved = len(glob.glob(os.path.join(step_dir, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")))
    if (config.get("checkpoint") or {}).get("load_universal", False):
        if os.path.isfile(os.path.join(folder, "latest_universal")):
            return None  # DeepSpeed's universal checkpoint loads on any number of ranks
        cause = (
            f"the DeepSpeed config sets `checkpoint.load_universal` but {folder!r} holds no universal checkpoint "
            "(no `latest_universal`)"
        )
    elif saved in (0, data_ranks):
        return None
    else:
        held = (  # ZeRO-3 partitions the parameters too
            "ZeRO-3 parameters and optimizer state are"
            if int((config.get("zero_optimization") or {}).get("stage", 0)) == 3
            else "ZeRO optimizer state is"
        )
        cause = f"its DeepSpeed {held} partitioned over {saved} data ranks and DeepSpeed loads it only on {saved}"
    command = (
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {step_dir} --output_folder "
        f"{step_dir}_universal --inject_missing_state"
    )
    ranks = f"{data_ranks} data rank{'s' if data_ranks != 1 else ''}"
    same = f"{saved} data ranks" if saved else "the number of data ranks that saved it"
    return (
        f"Resuming {folder!r} on {ranks}: {cause}. Convert it once into DeepSpeed's universal checkpoint "
        f"(`{command}`; it writes `latest_universal` beside `latest`; Adam-family optimizers only) and add "
        '`"checkpoint": {"load_universal": true}` to the DeepSpeed config (`deepspeed=` in TrainingArguments, or the '
        f"accelerate config's `deepspeed_config_file`), or resume on {same}. See docs/elastic.md."
    )


def unshare_step_counters(optimizer: Any) -> int:
    """Give each parameter of ``optimizer`` (a torch optimizer) its own ``step`` counter where several share one
    tensor; the number of counters copied.

    DeepSpeed 0.19.8's ZeRO-3 universal-checkpoint load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    puts ONE loaded ``step`` tensor into the state of every sub-group's flat partition; torch's Adam family adds 1
    to it in place once per parameter, so with two sub-groups (decay / no decay) the counter runs twice as fast and
    every bias correction after the resume is wrong (measured: 1.9e-02 off the uninterrupted run, relative to its
    update, on 1 and on 2 ranks alike). Can go once DeepSpeed copies the counter per sub-group.

    Example:
        ```python
        step = torch.tensor(1.0)
        optimizer.state[p]["step"] = optimizer.state[q]["step"] = step
        unshare_step_counters(optimizer)  # 1: q's counter is now its own copy
        ```
    """
    seen: set[int] = set()
    copied = 0
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, torch.Tensor):
            continue
        if id(step) in seen:
            state["step"] = step.clone()
            copied += 1
        seen.add(id(state["step"]))
    return copied


def check_client_optimizer(optimizer: Any) -> None:
    """Raise when DeepSpeed cannot step ``optimizer`` the way GradAccTrainer needs (one ``step()`` per window).

    DeepSpeed wraps a torch optimizer into its ZeRO optimizer and calls ``step()`` without a closure; a
    layer-wise optimizer (transformers' ``*_layerwise`` ``optim``) updates inside backward hooks instead.

    Example:
        ```python
        check_client_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))   # fine
        check_client_optimizer(torch.optim.LBFGS(model.parameters()))         # raises GradAccConfigError
        ```
    """
    name = type(optimizer).__name__
    if name == "LayerWiseDummyOptimizer":
        raise GradAccConfigError(
            "A layer-wise optimizer (`optim='*_layerwise'`) updates parameters inside backward hooks; DeepSpeed "
            "cannot take it. Choose an `optim` without '_layerwise' (or drop DeepSpeed)."
        )
    step = getattr(type(optimizer), "step", None)
    if step is None:
        raise GradAccConfigError(f"The optimizer {name} has no step(); DeepSpeed needs a torch.optim.Optimizer.")
    closure = inspect.signature(step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise GradAccConfigError(
            f"The optimizer {name} needs a closure in step(); DeepSpeed calls step() without one. Use an optimizer "
            "whose step() takes no required closure (`optim` in TrainingArguments)."
        )


ZERO_OPTIMIZER_CLASSES = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def _has_coalescing(engine: Any) -> bool:
    """Whether this DeepSpeed can hold a window's gradient reduction (``engine.coalesce_grad_reduction``: in 0.19.8,
    not in 0.18.6)."""
    return callable(getattr(engine, "coalesce_grad_reduction", None))


def check_zero_optimizer(zero_optimizer: Any, stage: int, zero_reduction: str, *, has_coalescing: bool) -> None:
    """The ZeRO optimizer DeepSpeed built is one GradAccTrainer drives, and ``zero_reduction`` is one this DeepSpeed
    can do; otherwise an :class:`~hf_gradacc.UnsupportedBackendError` with the way out."""
    name = type(zero_optimizer).__name__
    if stage not in SUPPORTED_ZERO_STAGES or name not in ZERO_OPTIMIZER_CLASSES:
        raise UnsupportedBackendError(
            f"DeepSpeed built a {name} (ZeRO stage {stage}); GradAccTrainer drives the ZeRO-1/2/3 optimizers "
            f"({', '.join(ZERO_OPTIMIZER_CLASSES)}). With bf16 and ZeRO-1, drop `data_types.grad_accum_dtype: fp32` "
            "from the DeepSpeed config, or use ZeRO-2."
        )
    if zero_reduction == "per_window" and not (has_coalescing and hasattr(zero_optimizer, "_coalesce_grad_reduction")):
        import deepspeed

        raise UnsupportedBackendError(
            f"`zero_reduction='per_window'` holds the window's gradient reduction in DeepSpeed's "
            f"`engine.coalesce_grad_reduction()`, which DeepSpeed {deepspeed.__version__} does not have (0.19.8 "
            "has it). Set `zero_reduction='per_micro_batch'` (the default: the same update, one reduction per "
            "micro-batch), or upgrade DeepSpeed."
        )


class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO-1/2/3: the trainer sets the boundary, runs ``engine.backward`` and ``engine.step`` itself.

    Gradient reduction per ``zero_reduction`` (a :class:`~hf_gradacc.GradAccConfig` field):

    - ``'per_micro_batch'`` (default, upstream behaviour): ZeRO-2/3 reduce-scatter the gradient after every
      micro-batch and keep only this rank's shard, summed over the micro-batches (least memory, one reduction per
      micro-batch). ZeRO-1 keeps full local gradients and reduces once, on the final backward pass.
    - ``'per_window'``: the window runs inside ``engine.coalesce_grad_reduction()``; every rank keeps the full
      local gradient and one reduction runs after the final backward pass (least communication, full gradient
      memory on ZeRO-2/3).

    DeepSpeed averages over the data-parallel ranks, so the trainer's normalisation (sum / global count x world
    size) is exact, and ``scale_wrt_gas=False`` keeps DeepSpeed from dividing by its accumulation steps again.
    ``clip_grad_norm`` returns the exact global norm before the step (one all-reduce of per-parameter sums of
    squares); the clipping itself runs inside ``engine.step()`` with ``gradient_clipping`` = ``max_grad_norm``.
    Between the final backward pass and the step, ``full_grad`` (``deepspeed.utils.safe_get_full_grad``, a
    collective) and ``local_grad`` read the reduced gradient, which ``on_pre_optimizer_step`` callbacks see.

    Example:
        ```python
        # accelerate launch --config_file examples/accelerate_configs/zero2.yaml train.py
        args = GradAccConfig(output_dir="out", gradient_accumulation_steps=8, zero_reduction="per_window")
        trainer = GradAccTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
        trainer.train()
        ```
    """

    name = "deepspeed"

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        settings: GradAccSettings | None = None,
        *,
        multi_backward: bool = False,
        model: torch.nn.Module | None = None,
    ) -> None:
        super().__init__(accelerator, args, settings, multi_backward=multi_backward, model=model)
        self.zero_reduction = self.settings.zero_reduction
        self._check_process_count()
        plugin = accelerator.state.deepspeed_plugin
        if plugin is None:
            raise UnsupportedBackendError("accelerate reports DeepSpeed but holds no DeepSpeed plugin (config).")
        if self.settings.total_train_batch_size is not None:
            release_derived_batch(plugin.deepspeed_config, args, accelerator.num_processes)
        check_deepspeed_config(plugin.deepspeed_config, args, accelerator.num_processes, self.sequence_parallel_size)
        self.zero_stage: int = int(plugin.deepspeed_config["zero_optimization"]["stage"])
        if self.zero_stage == 3 and self.sequence_parallel_size > 1:
            # Measured on 2 CPU ranks (sp 2): the update is 0.50x the float64 full batch; ZeRO-1/2 are exact.
            raise UnsupportedBackendError(
                f"DeepSpeed ZeRO-3 with Ulysses sequence parallelism (`parallelism_config.sp_size` "
                f"{self.sequence_parallel_size}) is not supported by GradAccTrainer: ZeRO-3 scales the sequence "
                "shards' gradients differently from ZeRO-1/2 (measured: half the full-batch gradient with sp 2). Use "
                "`zero_stage: 1` or `2` with `sp_size`, or ZeRO-3 with `parallelism_config_sp_size: 1`."
            )
        self.engine: Any = None
        self._window_reduction: contextlib.ExitStack | None = None

    def check_resume(self, folder: str) -> None:
        """A ZeRO checkpoint partitions the optimizer state per data rank: DeepSpeed loads it only on the number of
        ranks that saved it (it raises ``ZeRORuntimeException`` after the engine is built otherwise). Refused here,
        before anything is loaded, naming DeepSpeed's universal checkpoint (``ds_to_universal`` and the
        ``checkpoint.load_universal`` config), unless the config asks for it and the folder holds it. The verdict is
        summed over every rank (a rank whose disk differs stops every rank, never one alone)."""
        problem = zero_resume_problem(
            folder,
            data_ranks=self.mesh.data_parallel_size,
            config=self.accelerator.state.deepspeed_plugin.deepspeed_config,
        )
        refused = self.sum_over_processes(torch.tensor([float(problem is not None)]))
        if refused.item() > 0:
            raise GradAccConfigError(
                problem
                or f"Resuming {folder!r} with DeepSpeed is refused on another rank (its checkpoint files differ)."
            )

    def after_resume_load(self) -> None:
        """DeepSpeed's ZeRO-3 universal-checkpoint load shares one Adam ``step`` counter between parameter groups
        (:func:`unshare_step_counters`): each group gets its own copy, once, before the first step."""
        basic = getattr(self._bound().optimizer, "optimizer", None)
        if basic is not None and (copied := unshare_step_counters(basic)):
            logger.info(f"DeepSpeed's checkpoint load shared one Adam step counter between groups: {copied} copied.")

    def check_model(self, model: torch.nn.Module) -> None:
        """Under Ulysses sequence parallelism, only token-level causal LMs: DeepSpeed's adapter cuts every batch
        tensor along the sequence, so a sequence-level head's one label per row cannot be sharded (its
        ``get_batch_samples`` fails with a raw IndexError; seen on 2 CPU ranks with a Llama sequence classifier)."""
        super().check_model(model)
        if self.sequence_parallel_size == 1:
            return
        from ..heads import detect_head_type, unwrap_model

        requested = getattr(self.settings, "head_type", "auto")
        head = detect_head_type(model) if requested == "auto" else requested
        if head not in (None, "causal_lm"):
            raise UnsupportedBackendError(
                f"{type(unwrap_model(model)).__name__} (head `{head}`) cannot train under Ulysses sequence "
                "parallelism "
                f"(`parallelism_config.sp_size` {self.sequence_parallel_size}): DeepSpeed's adapter shards every "
                "batch tensor along the sequence, which only a causal LM's per-position labels allow. Set "
                "`parallelism_config_sp_size: 1` for this model, or train a causal LM."
            )

    @property
    def supports_backward_per_term(self) -> bool:  # type: ignore[override]
        # ZeRO-3 fails on a second backward pass through one forward (partitioned gradient sizes no longer match).
        return self.zero_stage != 3

    def kind(self) -> str:
        sp = f", Ulysses sequence parallel {self.sequence_parallel_size}" if self.sequence_parallel_size > 1 else ""
        return f"DeepSpeed ZeRO-{self.zero_stage}{sp}"

    def describe(self) -> str:
        if self.sequence_parallel_size == 1:
            return super().describe()
        return (
            f"{self.kind()}, {self.accelerator.num_processes} processes ({self.mesh.dp_world_size} data x "
            f"{self.sequence_parallel_size} sequence)"
        )

    @property
    def model_parallelism(self) -> str | None:
        sp = self.sequence_parallel_size
        return f"Ulysses sequence parallelism (`sp_size` {sp})" if sp > 1 else None

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks holding positions of the same sequences (accelerate's ``sp_size`` with ``sp_backend="deepspeed"``)."""
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is None or getattr(pc, "sp_backend", None) != "deepspeed":
            return 1
        return int(getattr(pc, "sp_size", None) or 1)

    def _check_process_count(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.accelerator.num_processes:
            raise UnsupportedBackendError(
                f"accelerate reports {self.accelerator.num_processes} process(es) but torch.distributed has "
                f"{dist.get_world_size()} ranks, so counts and data sharding would be wrong. This happens with a "
                "DeepSpeed config on a host without GPU: set HF_GRADACC_CPU_DISTRIBUTED=1 (or call "
                "hf_gradacc.patches.enable_cpu_distributed() before building TrainingArguments)."
            )

    # ------------------------------------------------------------------ setup
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from deepspeed import DeepSpeedEngine

        if not isinstance(model, DeepSpeedEngine):
            raise UnsupportedBackendError(
                f"accelerate reports DeepSpeed but the prepared model is a {type(model).__name__}, not a "
                "DeepSpeedEngine. Let the Trainer prepare the model (do not pass an already-prepared one)."
            )
        super().setup(model, optimizer)
        engine = model
        self.engine = engine
        stage = self.zero_stage = int(engine.zero_optimization_stage())
        zero_optimizer = engine.optimizer
        check_zero_optimizer(zero_optimizer, stage, self.zero_reduction, has_coalescing=_has_coalescing(engine))
        basic = getattr(zero_optimizer, "optimizer", None)
        if basic is not None:
            check_client_optimizer(basic)
        # ZeRO reduces over the sequence-data-parallel group and divides by its size / sp (the data ranks).
        reduced_over = int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size)
        sp = int(getattr(engine, "sequence_parallel_size", None) or 1)
        if reduced_over != self.accelerator.num_processes or sp != self.sequence_parallel_size:
            raise UnsupportedBackendError(
                f"DeepSpeed reduces gradients over {reduced_over} rank(s) with sequence-parallel size {sp}, but there "
                f"are {self.accelerator.num_processes} processes and `parallelism_config.sp_size` is "
                f"{self.sequence_parallel_size}: tensor or pipeline parallelism is not supported by GradAccTrainer "
                "under DeepSpeed. Use data parallelism, with or without Ulysses sequence parallelism (`sp_size`)."
            )
        wanted_clip = _clip_value(self.args.max_grad_norm)
        if _clip_value(engine.gradient_clipping()) != wanted_clip:
            raise GradAccConfigError(
                f"The DeepSpeed engine clips at {engine.gradient_clipping()} but `max_grad_norm` is "
                f"{self.args.max_grad_norm}; the DeepSpeed config was changed after GradAccTrainer checked it. Set "
                "`gradient_clipping` to 'auto'."
            )
        logger.info(
            f"DeepSpeed ZeRO-{stage}: GradAccTrainer drives the engine; gradient reduction {self.zero_reduction!r}, "
            f"clipping at {wanted_clip or 'off'}."
        )

    # ------------------------------------------------------------------ the window
    @contextlib.contextmanager
    def _micro_batch(self, *, is_last: bool) -> Iterator[None]:
        engine = self._bound()
        if self.zero_reduction == "per_window" and self._window_reduction is None:
            stack = contextlib.ExitStack()
            stack.enter_context(engine.coalesce_grad_reduction())
            self._window_reduction = stack
        # DeepSpeed reads the boundary flag before forward and backward; the backward pass sets it again.
        engine.set_gradient_accumulation_boundary(is_last and not self.multi_backward)
        try:
            yield
        except BaseException:
            self._close_window()
            raise
        if is_last:
            self._close_window()

    def _close_window(self) -> None:
        stack, self._window_reduction = self._window_reduction, None
        if stack is not None:
            stack.close()  # leaving coalesce_grad_reduction runs the window's one reduction

    def sync_context(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        return self._micro_batch(is_last=is_last)

    def backward(self, loss: torch.Tensor, *, is_final: bool, retain_graph: bool = False) -> None:
        engine = self._bound()
        if retain_graph and self.zero_stage == 3:
            raise GradAccConfigError(
                "A second backward pass through one forward pass (retain_graph=True) fails inside DeepSpeed ZeRO-3 "
                "(the partitioned gradient sizes no longer match). Set `backward_per_term=False` (the terms are "
                "summed: same gradient), or run one forward per backward pass."
            )
        # A boundary on a non-final backward would reduce (and, on ZeRO-1/2, drop) the gradient accumulated so far.
        engine.set_gradient_accumulation_boundary(is_final)
        engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    # ------------------------------------------------------------------ gradients
    def _loss_scale(self) -> float:
        engine = self.engine
        if engine is None or not engine.fp16_enabled():
            return 1.0
        return float(engine.optimizer.loss_scale)

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self._bound().module.parameters() if p.requires_grad]

    def _local_view(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """This rank's live part of ``param``'s reduced gradient (flat), None when it holds none."""
        from deepspeed.utils import safe_get_local_grad

        if hasattr(param, "ds_id"):  # ZeRO-3
            return safe_get_local_grad(param)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # ZeRO-1/2: the parameter lies in other ranks' partitions
            return None
        return mapping.get_lp_grad_fragment(param._index_in_param_group)

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The full reduced gradient (``safe_get_full_grad``): a collective, call it on every rank in one order."""
        from deepspeed.utils import safe_get_full_grad

        grad = safe_get_full_grad(param)
        if grad is None:
            shape = getattr(param, "ds_shape", param.shape)
            return torch.zeros(shape, dtype=torch.float32, device=param.device)
        scale = self._loss_scale()
        return grad / scale if scale != 1.0 else grad

    def local_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's flat part of the reduced gradient (its ZeRO partition); empty when it holds none."""
        grad = self._local_view(param)
        if grad is None:
            return torch.zeros(0, dtype=torch.float32, device=param.device)
        scale = self._loss_scale()
        if scale != 1.0:
            logger.warning_once("Under fp16 the local gradient is a copy: in-place edits do not reach it.")
            return grad / scale
        return grad

    def write_full_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Store a full gradient back into this rank's partition (``safe_set_full_grad``; no communication)."""
        from deepspeed.utils import safe_set_full_grad

        scale = self._loss_scale()
        safe_set_full_grad(param, grad * scale if scale != 1.0 else grad)

    def grad_sq_norms(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Squared L2 norm of every parameter's reduced gradient: local partition sums, one all-reduce."""
        import torch.distributed as dist

        engine = self.engine
        device = engine.device if engine is not None else torch.device("cpu")
        squares = torch.zeros(len(params), dtype=torch.float64, device=device)
        for i, param in enumerate(params):
            local = self._local_view(param)
            if local is not None and local.numel() > 0:
                squares[i] = local.detach().to(device=device, dtype=torch.float64).pow(2).sum()
        if self.accelerator.num_processes > 1:  # disjoint partitions (data x sequence ranks): their sums add up
            group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
        scale = self._loss_scale()
        return (squares / (scale * scale)).cpu()

    def running_grad_sq_norm(self, params: list[torch.nn.Parameter]) -> RunningGradNorm:
        """The gradient accumulated so far, between two micro-batches (see `Backend.running_grad_sq_norm`).

        - ZeRO-1, and every stage with ``zero_reduction='per_window'``: nothing is reduced before the final backward
          pass; autograd accumulates each rank's own gradient on the parameters (``param.grad``, or ``grad_accum``
          when DeepSpeed keeps a separate accumulation buffer): ``reduced=False``, no communication.
        - ZeRO-3, ``per_micro_batch``: every backward pass reduce-scatters into this rank's fp32 gradient partition,
          summed over the micro-batches (``safe_get_local_grad``): the partitions' squares, one all-reduce.
        - ZeRO-2, ``per_micro_batch``: every backward pass reduces this rank's partition, summed over the
          micro-batches in the ZeRO optimizer's ``all_grad_tensors`` (whole parameter tensors, of which the slice in
          this rank's partition, ``grad_position``, is the reduced one): the slices' squares, one all-reduce.
          DeepSpeed internals, checked here: a clear error where they are absent (CPU offload, bf16 parameters
          with fp32 accumulation, another DeepSpeed version).
        """
        engine = self._bound()
        optimizer = engine.optimizer
        if self.zero_stage == 1 or self.zero_reduction == "per_window":
            if self.zero_stage == 3:
                grads = [p.grad for p in params]
            else:
                getter = getattr(optimizer, "get_gradient_for_reduction", None)
                if getter is None:
                    raise UnsupportedBackendError(self._running_refusal("no `get_gradient_for_reduction`"))
                grads = [getter(p) for p in params]
            squares, reduced = sum_of_squares(grads), False
        elif self.zero_stage == 3:
            from deepspeed.utils import safe_get_local_grad

            squares, reduced = sum_of_squares(safe_get_local_grad(p) for p in params if p.requires_grad), True
        else:
            squares, reduced = sum_of_squares(self._zero2_partition_slices(optimizer)), True
        if reduced and self.accelerator.num_processes > 1:  # disjoint partitions: squares add up (one all-reduce)
            import torch.distributed as dist

            squares = squares.to(engine.device)
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=getattr(optimizer, "dp_process_group", None))
        scale = self._loss_scale()
        return RunningGradNorm(sq_norm=float(squares) / (scale * scale), reduced=reduced)

    def _zero2_partition_slices(self, optimizer: Any) -> Iterator[torch.Tensor]:
        """ZeRO-2 between micro-batches: this rank's reduced partition of each parameter, summed so far. The slices are
        cut as DeepSpeed's ``_get_flat_partition_unpadded`` cuts them at the boundary (the partition starts
        ``first_offset`` elements into its first parameter and holds ``partition_size`` elements)."""
        needed = ("all_grad_tensors", "params_in_partition", "first_offset", "partition_size")
        missing = [name for name in needed if not hasattr(optimizer, name)]
        if missing or getattr(optimizer, "cpu_offload", False):
            raise UnsupportedBackendError(self._running_refusal(f"missing {missing}" if missing else "CPU offload"))
        compact = getattr(optimizer, "_use_compact_grad_partition_buffer", None)
        padding = getattr(optimizer, "round_robin_bit16_padding", None)
        for group, params in enumerate(optimizer.params_in_partition):
            if not params:
                continue
            if compact is not None and compact(group):
                raise UnsupportedBackendError(self._running_refusal("bf16 parameters with fp32 gradient accumulation"))
            if padding is not None and any(padding[group]):
                raise UnsupportedBackendError(self._running_refusal("round-robin gradient partitioning"))
            accumulated = optimizer.all_grad_tensors.get(group)
            if accumulated is None or len(accumulated) != len(params):
                raise UnsupportedBackendError(self._running_refusal("no accumulated partition gradient"))
            size, taken = int(optimizer.partition_size[group]), 0
            for i, grad in enumerate(accumulated):
                start = int(optimizer.first_offset[group]) if i == 0 else 0
                count = min(grad.numel() - start, size - taken)
                yield grad.reshape(-1).narrow(0, start, count)
                taken += count

    def _running_refusal(self, why: str) -> str:
        return (
            f"The gradient between micro-batches cannot be read on DeepSpeed ZeRO-{self.zero_stage} with "
            f"zero_reduction='per_micro_batch' here ({why}). Set `zero_reduction='per_window'` (each rank's local "
            "gradient is then readable), or drop the callback that needs it."
        )

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The exact global norm before the step; DeepSpeed clips inside ``engine.step()`` at ``max_grad_norm``."""
        engine = self._bound()
        wanted = _clip_value(max_norm)
        if _clip_value(engine.gradient_clipping()) != wanted:
            logger.warning_once(
                f"clip_grad_norm(max_norm={max_norm}) differs from the engine's gradient_clipping "
                f"({engine.gradient_clipping()}); DeepSpeed clips at its configured value inside engine.step().",
            )
        squares = self.grad_sq_norms(self._trainable())
        return squares.sum().sqrt().to(torch.float32)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, lr_factor: float = 1.0) -> None:
        engine = self._bound()
        assert self._window_reduction is None, "the window's gradient reduction is still open at the optimizer step"
        # Without the boundary flag engine.step() silently skips the update (coalesce_grad_reduction restores the
        # flag it found on entry, and the first micro-batch set it to False).
        engine.set_gradient_accumulation_boundary(True)
        # The engine steps its LR scheduler inside engine.step(); a scaled rate must be put back BEFORE the
        # scheduler moves (it may compute from the current rate), so the scheduler is held out and stepped here.
        scheduler = engine.lr_scheduler if lr_factor != 1.0 else None
        if scheduler is not None:
            engine.lr_scheduler = None
        try:
            with scaled_learning_rate(optimizer.param_groups, lr_factor):
                engine.step()
        finally:
            if scheduler is not None:
                engine.lr_scheduler = scheduler
        if scheduler is not None and engine.was_step_applied():
            scheduler.step()
        from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

        if isinstance(optimizer, DeepSpeedOptimizerWrapper):
            # A no-op under DeepSpeed (the engine stepped); it keeps the LR scheduler's step bookkeeping, which
            # otherwise warns that lr_scheduler.step() ran before optimizer.step().
            optimizer.step()

    def full_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        module = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        if self.zero_stage != 3:
            return {n: p.detach().cpu() for n, p in module.named_parameters()}
        import deepspeed

        named = list(module.named_parameters())
        # A collective: every rank gathers every partitioned parameter, in the same order.
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().clone().cpu() for n, p in named}

    @property
    def scales_loss(self) -> bool:
        engine = self.engine
        return engine is not None and bool(engine.fp16_enabled())

    def skip_step(self) -> None:
        """Drop the window's gradient as DeepSpeed's own overflow path does: the ZeRO optimizer's gradient buffers are
        cleared, parameters and optimizer state untouched, and ``engine.step()`` is not called."""
        optimizer = self._bound().optimizer
        optimizer.zero_grad(set_to_none=True)
        release = getattr(optimizer, "_release_preflattened_grad_buffers", None)
        if callable(release):
            release()
        if self.zero_stage == 3:
            optimizer.averaged_gradients = {}
        else:
            for buffers in (
                getattr(optimizer, "averaged_gradients", None),
                getattr(optimizer, "all_grad_tensors", None),
            ):
                if isinstance(buffers, dict):
                    for key in list(buffers):
                        buffers[key] = None

    def zero_grad(self) -> None:
        """Nothing to do: ``engine.step()`` already cleared the ZeRO gradient buffers and ``param.grad``."""
