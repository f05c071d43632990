"""The built-in optimizers, one spec each, in `--optim`'s order. Their builders are imported when one
is built (torch, and the packages of the `optimizers` extra, only then).

cpu_speed: a training step's speed vs fused AdamW on CPUs: `effitrain bench` (20 steps of the default
model, epyc2c) for adafactor and 8-bit; benchmarks/optimizers.py (60 steps of the default job) for the
package optimizers: benchmarks/results/optimizers_xeon2c_2026-12-05.md."""

from __future__ import annotations

import effitrain.optimizers.state_sizes as state_sizes
from effitrain.optimizers.spec import OptimizerSpec


def _classic():
    import effitrain.optimizers.classic as classic

    return classic


def _packaged():
    import effitrain.optimizers.packaged as packaged

    return packaged


EIGHT_BIT_LIBRARIES = ("bitsandbytes.optim", "torchao.optim")  # bitsandbytes, else torchao

BUILT_IN = [
    OptimizerSpec(
        "adamw", "adamw (fused; 8 bytes/param)",
        build=lambda model, lr, decay, betas, blocks: _classic().adamw(model, lr, decay, betas),
        state_bytes=state_sizes.adamw, lighter=("adamw-8bit", "adafactor"), plan_rank=0),
    OptimizerSpec(
        "adafactor", "adafactor",
        build=lambda model, lr, decay, betas, blocks: _classic().adafactor(model, lr, decay),
        state_bytes=state_sizes.adafactor, step_temporary_bytes=state_sizes.adafactor_temporaries,
        libraries=("transformers.optimization",), plain_tensor_states=True, cpu_speed=0.82, plan_rank=2),
    OptimizerSpec(
        "adamw-8bit", "adamw-8bit",
        build=lambda model, lr, decay, betas, blocks: _classic().eight_bit("adamw-8bit", "AdamW8bit", model, lr,
                                                                           decay, betas),
        state_bytes=state_sizes.eight_bit, libraries=EIGHT_BIT_LIBRARIES, plain_tensor_states=True,
        cpu_speed=0.59, lighter=("adafactor",), plan_rank=1),
    OptimizerSpec(
        "adam-8bit", "adam-8bit (bitsandbytes, else torchao; about 2 bytes/param)",
        build=lambda model, lr, decay, betas, blocks: _classic().eight_bit("adam-8bit", "Adam8bit", model, lr,
                                                                           decay, betas),
        state_bytes=state_sizes.eight_bit, libraries=EIGHT_BIT_LIBRARIES, plain_tensor_states=True,
        cpu_speed=0.59, lighter=("adafactor",)),
    OptimizerSpec(
        "sgd", "sgd (momentum = --beta1; 4 bytes/param)",
        build=lambda model, lr, decay, betas, blocks: _classic().sgd(model, lr, decay, betas),
        state_bytes=state_sizes.sgd, step_temporary_bytes=state_sizes.sgd_temporaries, plan_rank=3),
    OptimizerSpec(
        "galore-adamw", "galore-adamw (GaLore: Adam's two moments kept in a rank-8 projection of every weight "
        "matrix wider than 8, embeddings included, renewed from the gradient's SVD every 500 steps, scale 4, as "
        "its GLUE fine-tuning recipe; other tensors AdamW)",
        build=lambda model, lr, decay, betas, blocks: _packaged().galore(model, lr, decay, betas),
        state_bytes=state_sizes.galore, package=("galore_torch", "galore-torch"), whole_weights=True,
        low_rank=True, cpu_speed=0.68),
    OptimizerSpec(
        "apollo-adamw", "apollo-adamw (APOLLO: the same rank-8 moments over a random projection renewed every 200 "
        "steps, used only to scale the raw gradient channel by channel; scale = matrix width / rank, as its "
        "fine-tuning recipe)",
        build=lambda model, lr, decay, betas, blocks: _packaged().apollo(model, lr, decay, betas),
        state_bytes=state_sizes.apollo, package=("apollo_torch", "apollo-torch"), whole_weights=True,
        low_rank=True, cpu_speed=0.78),
    OptimizerSpec(
        "muon", "muon (torch.optim.Muon: momentum only, 4 bytes/param, for the 2-D weights inside the transformer "
        "blocks, lr matched to AdamW's; AdamW for embeddings, head and 1-D tensors)",
        build=lambda model, lr, decay, betas, blocks: _packaged().muon(model, lr, decay, betas, blocks),
        state_bytes=state_sizes.muon, whole_weights=True, cpu_speed=0.53),
    OptimizerSpec(
        "schedule-free-adamw", "schedule-free-adamw (no lr decay, warm-up kept; 8 bytes/param: the averaged point "
        "and the second moment; evaluation and model/ use the averaged weights)",
        build=lambda model, lr, decay, betas, blocks: _packaged().schedule_free(model, lr, decay, betas),
        state_bytes=state_sizes.schedule_free, package=("schedulefree", "schedulefree"), whole_weights=True,
        decays=False, averaged_weights=True, cpu_speed=0.69),
]
