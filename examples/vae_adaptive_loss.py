"""A VAE with a reconstruction term and an adversarial term weighted VQGAN-style, trained with exact accumulation.

    python examples/vae_adaptive_loss.py --output_dir out --max_steps 20
    accelerate launch --config_file examples/accelerate_configs/ddp_cpu.yaml examples/vae_adaptive_loss.py --output_dir out \
        --use_cpu true
    HF_GRADACC_CPU_DISTRIBUTED=1 accelerate launch --config_file examples/accelerate_configs/zero2_cpu.yaml \
        examples/vae_adaptive_loss.py --output_dir out

Each micro-batch returns two `LossTerm`s, both normalised by the number of samples of the whole optimizer step.
With `backward_per_term` (the default here; `--joint_backward` turns it off) each term gets its own backward pass
through the same forward: GradAccTrainer keeps DDP and DeepSpeed exact (the final pass of the step triggers the
reduction; no optimizer step inside a backward).

The adaptive weight `||grad_last(rec)|| / ||grad_last(adv)||` (VQGAN) is computed INSIDE the model's forward:
`torch.autograd.grad` through a DeepSpeed engine's outputs fails, and under FSDP2 the forward runs on unsharded
parameters, so the gradient must be taken against the tensor the forward actually used (see docs/multi_backward.md).
The discriminator is a frozen random critic here: a real GAN alternates two optimizers, which is beside the point
of this example (accumulating two generator terms exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers import HfArgumentParser, set_seed

from hf_gradacc import GradAccConfig, GradAccTrainer, LossTerm
from hf_gradacc.callbacks import GradNormCallback


class TinyVAEGAN(nn.Module):
    """Encoder, decoder and a frozen critic over flat "images" of ``dim`` values."""

    def __init__(self, dim: int = 64, latent: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.critic = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))
        self.critic.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        mu, logvar = self.encoder(pixel_values).chunk(2, dim=-1)
        z = mu + noise * torch.exp(0.5 * logvar)
        recon = self.decoder(z)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
        rec = (recon - pixel_values).pow(2).sum(-1) + kl  # per sample
        adv = nn.functional.softplus(-self.critic(recon)).squeeze(-1)  # non-saturating generator loss, per sample
        weight = torch.ones((), device=rec.device)
        if self.training and torch.is_grad_enabled():
            last = self.decoder[-1].weight
            g_rec = torch.autograd.grad(rec.mean(), last, retain_graph=True)[0]
            g_adv = torch.autograd.grad(adv.mean(), last, retain_graph=True)[0]
            weight = (g_rec.norm() / (g_adv.norm() + 1e-4)).clamp(0.0, 1e4).detach()
        return {"rec_sum": rec.sum(), "adv_sum": adv.sum(), "adaptive_weight": weight, "recon": recon}


class VAETrainer(GradAccTrainer):
    """Returns the two terms as `LossTerm`s normalised by samples."""

    adversarial_scale = 0.1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        terms = {
            "reconstruction": LossTerm(out["rec_sum"], "samples"),
            "adversarial": LossTerm(self.adversarial_scale * out["adaptive_weight"] * out["adv_sum"], "samples"),
        }
        return (terms, out) if return_outputs else terms


class BlobDataset(torch.utils.data.Dataset):
    """Noisy copies of a few prototypes, with the reparametrisation noise drawn once per sample (deterministic)."""

    def __init__(self, num_samples: int = 256, dim: int = 64, latent: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        prototypes = torch.randn(4, dim, generator=g)
        which = torch.randint(0, 4, (num_samples,), generator=g)
        self.pixels = prototypes[which] + 0.1 * torch.randn(num_samples, dim, generator=g)
        self.noise = torch.randn(num_samples, latent, generator=g)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[i], "noise": self.noise[i]}


@dataclass
class ScriptArguments:
    num_samples: int = field(default=256, metadata={"help": "Samples in the synthetic data set."})
    joint_backward: bool = field(default=False, metadata={"help": "One backward pass on the sum of the terms."})


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((ScriptArguments, GradAccConfig))
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    args.backward_per_term = not script_args.joint_backward
    set_seed(args.seed)  # the model is built before the Trainer seeds: same initial weights on every run
    model = TinyVAEGAN()
    trainer = VAETrainer(
        model=model,
        args=args,
        train_dataset=BlobDataset(script_args.num_samples, seed=args.seed),
        callbacks=[GradNormCallback(depth=1)],
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    logged = [h for h in trainer.state.log_history if "loss/reconstruction" in h]
    summary = {
        "steps": float(result.global_step),
        "train_loss": float(result.training_loss),
        "num_processes": float(trainer.accelerator.num_processes),
    }
    if logged:
        summary.update({k: float(v) for k, v in logged[-1].items() if k.startswith(("loss", "grad_norm"))})
    if trainer.is_world_process_zero():
        print("vae summary:", summary)
    trainer.end()  # destroys the process group; safe at exit on CPU (gloo) ranks
    return summary


if __name__ == "__main__":
    main()
