"""Mixture-of-experts fine-tuning with the router load-balancing loss formed over the whole optimizer step
(`router_balance="global_batch"`, docs/moe.md): the expert fractions and router probabilities of every routed token
of the step, on every micro-batch and rank, enter the model's own balance formula ONCE, so the update does not
depend on how the step is split into micro-batches and ranks.

    python examples/moe_global_balance.py --output_dir out --max_steps 4 --report_to none
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/moe_global_balance.py \
        --output_dir out --use_cpu true --max_steps 4 --report_to none

It trains a tiny Mixtral built from its config (4 experts, top-2, no download) on a run_clm-style synthetic dataset;
swap in your MoE checkpoint, dataset and tokenizer. Before training it runs ONE SGD(lr=1) step of the first window
with each rule at the given batch size and GA, and at one sample per micro-batch, and prints the router weights'
relative error against the float64 reference of the global-batch loss (hf_gradacc/testing/moe_reference.py):
`global_batch` is ~1e-6 at both splits; `micro_batch` is 5e-2 off at 2 x 4 and 1.3e-1 at 1 x 8 (it changes with
the split). During training
`moe/load_max_over_mean` (the most loaded expert over the mean, 1.0 = balanced) is logged.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_gradacc import GradAccConfig, GradAccTrainer
from hf_gradacc.testing.moe_reference import global_balance_gradients
from hf_gradacc.testing.one_step import one_step_args, one_step_update
from hf_gradacc.testing.reference import compare
from hf_gradacc.testing.tiny import PaddingCollator, build_tiny_moe, synthetic_clm_dataset


@dataclass
class ScriptArguments:
    num_samples: int = field(default=64, metadata={"help": "Synthetic documents in the training set."})
    router_aux_loss_coef: float = field(default=0.1, metadata={"help": "The model's balance-loss coefficient."})


def router_error(config: GradAccConfig, samples: list[dict], coef: float, rule: str, batch: int, ga: int) -> float:
    """One SGD(lr=1) step of ``rule`` over ``samples`` at ``batch`` x ``ga``: the router weights' relative error
    against the float64 reference of the global-batch loss."""
    model = build_tiny_moe("mixtral", seed=config.seed, router_aux_loss_coef=coef)
    args = one_step_args(tempfile.mkdtemp(prefix="moe_check_"), args_class=GradAccConfig, router_balance=rule,
                         per_device_train_batch_size=batch, gradient_accumulation_steps=ga, use_cpu=config.use_cpu)  # fmt: skip
    update, _ = one_step_update(GradAccTrainer, model, samples, args)
    reference = global_balance_gradients(model, samples, PaddingCollator())
    router = [n for n in reference if n.endswith("gate.weight")]
    return compare({n: update[n] for n in router}, {n: reference[n] for n in router}).relative_error


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script, config = parser.parse_args_into_dataclasses(args=argv)
    config.router_balance = "global_batch"
    dataset = synthetic_clm_dataset(script.num_samples, seed=config.seed)
    result: dict[str, float] = {}
    if config.world_size == 1:
        bs, ga = config.per_device_train_batch_size, config.gradient_accumulation_steps
        window = [dict(row) for row in dataset.select(range(bs * ga))]
        for rule in ("global_batch", "micro_batch"):
            for split, (b, g) in {f"{bs}x{ga}": (bs, ga), f"1x{bs * ga}": (1, bs * ga)}.items():
                result[f"{rule}_{split}"] = error = router_error(config, window, script.router_aux_loss_coef, rule, b, g)
                print(f"router_balance={rule!r} at {split}: router weights {error:.1e} from the global-batch loss")
    model = build_tiny_moe("mixtral", seed=config.seed, router_aux_loss_coef=script.router_aux_loss_coef)
    trainer = GradAccTrainer(model=model, args=config, train_dataset=dataset, data_collator=PaddingCollator())
    trained = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    load = [log["moe/load_max_over_mean"] for log in trainer.state.log_history if "moe/load_max_over_mean" in log]
    last = load[-1] if load else float("nan")  # logged every `logging_steps`
    print(f"trained {trainer.state.global_step} steps, train loss {trained.training_loss:.4f}, "
          f"expert load max/mean {last:.3f}")  # fmt: skip
    result.update(steps=trainer.state.global_step, load=last)
    return result


if __name__ == "__main__":
    main()
