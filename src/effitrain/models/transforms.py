"""THE ordered model-transform pipeline: what happens to the task's model between loading and training.

Training set-up (engine/setup.py), the memory planner (planning/simulate.py, on the meta device and fake
tensors) and the benchmarks all build through `apply_all`, so that what is planned and measured is the
model that trains. Each entry says when it applies (a condition on `Settings`) and why it sits where it
does: the order is the contract, as in torchtitan's parallelize_llama (checkpointing, then compile,
then FSDP).

Sharding (FSDP) comes later, in the engine's strategy (engine/strategies/fsdp.py), after the optimizer's
parameters are known; what compiling costs is watched by engine/compilation.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from effitrain.config import shards_weights
from effitrain.errors import UserError
from effitrain.models import adapters, loading, student
from effitrain.models.blocks import blocks
from effitrain.speedups import adapter_step, chunked_lm_loss, dropout, first_token_head, onednn_linear


@dataclass(frozen=True)
class Settings:
    """What the conditions read: a run's config and what set-up resolved from it (`of_run`)."""

    task: Any  # tasks.Task: the adapters' head and peft's task type
    device_type: str = "cpu"
    gradient_checkpointing: bool = False  # the resolved plan's, which --memory-budget may turn on
    packing: bool = False
    peft: adapters.Peft | None = None  # None: no adapters
    compile: bool = False
    sharded: bool = False  # --strategy fsdp or deepspeed: weights sharded across processes (never held whole)
    # The CPU speed-ups (fast dropout, first-token head, oneDNN linear). On for the memory planner's model
    # too (they change which tensors a step holds; planning/simulate.settings); off for benchmarks that
    # measure transformers' own layers.
    speed_ups: bool = True
    student_layers: int | None = None  # --student-layers: the loaded model cut to a student of this many layers


def of_run(config, plan, device: torch.device, task) -> Settings:
    """A training run's settings: its TrainConfig and the engine's resolved plan (engine/setup.RunPlan)."""
    return Settings(task, device.type, plan.gradient_checkpointing, config.packing, adapters.Peft.of(config),
                    config.compile, sharded=shards_weights(config.strategy), student_layers=config.student_layers)


@dataclass(frozen=True)
class Transform:
    """One step of the pipeline. `applies` reads the settings only; `apply` returns the model and whether
    it changed it: an entry whose condition holds may leave a model it does not fit as it is (the
    first-token head on a decoder), and metrics.json lists only what changed the model."""

    name: str
    applies: Callable[[Settings], bool]
    apply: Callable[[torch.nn.Module, Settings], tuple[torch.nn.Module, bool]]
    why: str = ""  # why it sits where it does in the order


Applied = tuple[torch.nn.Module, bool]


def _in_place(change: Callable[[torch.nn.Module], object]) -> Callable[[torch.nn.Module, Settings], Applied]:
    """A change made in place as a transform's apply: it changed the model unless it says it did not (a
    count of 0, or False; None: the change always takes)."""
    def apply(model: torch.nn.Module, settings: Settings) -> Applied:
        said = change(model)
        return model, said is None or bool(said)
    return apply


def _fast_dropout(model: torch.nn.Module, settings: Settings) -> Applied:
    """Its dropout layers swapped, or its attention moved to effitrain's SDPA (a model may have either)."""
    swapped = dropout.apply(model)
    moved = any(getattr(getattr(module, "config", None), "_attn_implementation", None) == dropout.ATTENTION
                for module in model.modules())
    return model, bool(swapped) or moved


def _adapters(model: torch.nn.Module, settings: Settings) -> Applied:
    return adapters.apply(model, settings.task, settings.peft), True


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each transformer block in place; the number of blocks."""
    found = blocks(model)
    if not found:
        raise UserError(f"--compile compiles a model by its transformer blocks, and {type(model).__name__} has none "
                        "(no repeated layers, none named in transformers' _no_split_modules)", "drop --compile")
    for block in found:
        block.compile()
    return len(found)


def _adapter_step(model: torch.nn.Module, settings: Settings) -> Applied:
    """The adapters' training forward; their half-precision casts kept across steps where that leaves the
    peak memory as it is (speedups/adapter_step.py: not when checkpointing or sharded)."""
    keep = adapter_step.keeps_half_casts(settings.sharded, settings.gradient_checkpointing)
    return model, bool(adapter_step.apply(model, keep_half_casts=keep))


def _compile(model: torch.nn.Module, settings: Settings) -> Applied:
    compile_blocks(model)  # a model without blocks is refused
    return model, True


def _student(model: torch.nn.Module, settings: Settings) -> Applied:
    return student.make_student(model, settings.student_layers), True


PIPELINE = (
    Transform("student", lambda s: s.student_layers is not None, _student,
              why="first, right after loading: every entry below (the adapters, checkpointing, compile) and the "
                  "sharding after them must see only the layers that train; the teacher's others are freed"),
    Transform("fast-dropout", lambda s: s.speed_ups, _fast_dropout,
              why="on the plain model, before the adapters: its nn.Dropout layers and attention function, not the "
                  "dropout peft adds (speedups/adapter_step.py draws those, with the adapters)"),
    Transform("first-token-head", lambda s: s.speed_ups and not s.packing, _in_place(first_token_head.apply),
              why="before the adapters, which wrap the classifier it recognises by class; not with packing, "
                  "whose rows hold many examples, each read at its own first token"),
    Transform("onednn-linear", lambda s: s.speed_ups and s.device_type == "cpu" and onednn_linear.preferred(),
              _in_place(onednn_linear.apply),
              why="before the adapters: it routes the body's nn.Linear layers, not LoRA's small matrices, which "
                  "peft adds later"),
    Transform("gradient-checkpointing", lambda s: s.gradient_checkpointing,
              _in_place(loading.enable_gradient_checkpointing),
              why="on the transformers model, whose switch it is, before peft wraps it; non-reentrant, so that "
                  "under a frozen body (LoRA) the recomputed inputs still require gradients (peft #137)"),
    Transform("chunked-lm-loss", lambda s: s.task.chunked_loss, _in_place(chunked_lm_loss.apply),
              why="after onednn-linear, whose forward the output layer keeps outside the loss; before the adapters, "
                  "on the plain model's output layer (which they leave as it is); in the planner's model too: "
                  "it changes what a step holds (no whole logits)"),
    Transform("adapters", lambda s: s.peft is not None, _adapters,
              why="after every change to the plain model: peft wraps it, freezes the body and adds layers that "
                  "the entries above must not touch; before compile, whose graphs must hold them"),
    Transform("adapter-step", lambda s: s.speed_ups and s.peft is not None, _adapter_step,
              why="right after the adapters, whose layers it gives a training forward without wasted passes (their "
                  "dropout masks drawn as fast-dropout's); before compile, whose graphs must hold it"),
    Transform("compile", lambda s: s.compile, _compile,
              why="last: the compiled graphs must hold every transform before it (checkpointing's recomputation, "
                  "the adapters' layers, the fast dropout); in place, so the parameter names stay the plain model's"),
)


def chosen(settings: Settings, skip=(), pipeline=PIPELINE) -> list[Transform]:
    """The entries that apply with these settings, in order, less `skip` (names; an unknown one is an error)."""
    unknown = set(skip) - {transform.name for transform in pipeline}
    if unknown:
        raise ValueError(f"no transform named {sorted(unknown)} in {[t.name for t in pipeline]}")
    return [transform for transform in pipeline if transform.name not in skip and transform.applies(settings)]


def apply_all(model: torch.nn.Module, settings: Settings, skip=(), pipeline=PIPELINE
              ) -> tuple[torch.nn.Module, list[str]]:
    """The model through every entry that applies, in order; and the names of those that changed it
    (metrics.json's `transforms`)."""
    applied = []
    for transform in chosen(settings, skip, pipeline):
        model, changed = transform.apply(model, settings)
        if changed:
            applied.append(transform.name)
    return model, applied
