"""The form of a run's model, chosen once from --peft: plain (trained in full) or adapted (LoRA/QLoRA through
peft). The engine saves, restores, summarises and describes its model through the form, and the model card
describes it so, without asking which form it is: what an adapted model's folders hold, and why, is said
here only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import effitrain.models.adapters.adapter_folder as adapter_folder
import effitrain.models.adapters.merging as merging
from effitrain.models.adapters.lora_settings import method, quantized


def form_of(settings) -> PlainModel | AdaptedModel:
    """The form of the model that `settings` ask for (a TrainConfig, a Peft or config.yaml's dict): the one
    place that chooses. A run's model is adapted exactly then (models/transforms.py's `adapters` entry)."""
    chosen = method(settings)
    return PlainModel() if chosen is None else AdaptedModel(chosen)


@dataclass(frozen=True)
class PlainModel:
    """A model trained in full: model/ and best/ hold its whole weights, as save_pretrained writes them.

    `run` in the methods below: the engine's Run (its accelerator, model as prepared, strategy, task)."""

    folders_beside_model: tuple[str, ...] = ()  # what a run's end saves beside model/ (save_trained's)
    # Where the starting model's log-probs come from while it trains (online RL's KL: tasks/reference.py's
    # modes): a frozen copy, the one way to keep a model trained in full as it started.
    reference: str = "copy"

    def write_model(self, run, folder: Path) -> None:
        """model/: the whole model (the strategy gathers it where it is sharded)."""
        run.strategy.save_pretrained(run.model, folder)

    def write_trained(self, run, folder: Path) -> None:
        """best/: the whole model too; load_trained puts it back."""
        self.write_model(run, folder)

    def load_trained(self, run, folder: Path) -> None:
        """write_trained's weights back into the run's model (--keep best)."""
        from safetensors.torch import load_file

        model = run.accelerator.unwrap_model(run.model)
        state, device = {}, run.accelerator.device
        for file in sorted(folder.glob("*.safetensors")):  # safetensors knows `cpu`, not `cpu:0` (gloo processes)
            state.update(load_file(str(file), device="cpu" if device.type == "cpu" else str(device)))
        unexpected = run.strategy.load_full_state_dict(model, state)
        if unexpected:
            raise RuntimeError(f"{folder} holds weights the model does not have: {unexpected[:3]}")

    def adapter_bytes(self, model) -> int | None:
        """metrics.json's adapter_bytes: none."""
        return None

    def non_finite_fix(self, config, beta: str) -> str:
        """What to change when training stopped being finite (`beta`: the preference loss's part)."""
        return f"lower --lr{beta}, use --precision fp32, or check the data for extreme values"

    # -- model/README.md, from config.yaml's dict
    def card_tags(self) -> list[str]:
        return []

    def card_technique(self, config: dict) -> str | None:
        return None

    def card_note(self, config: dict) -> str:
        return ""


@dataclass(frozen=True)
class AdaptedModel:
    """LoRA or QLoRA adapters over a frozen base (peft's PeftModel): model/ holds them merged into the base
    (loadable without peft), adapter/ and best/ peft's own folder, the adapter alone (what --keep best puts
    back, and what peft's PeftModel.from_pretrained applies over the base)."""

    method: str  # lora | qlora
    folders_beside_model: tuple[str, ...] = ("adapter",)
    reference: str = "adapters"  # the starting model is the base: the adapters switched off, no second copy

    def write_model(self, run, folder: Path) -> None:
        model = run.accelerator.unwrap_model(run.model)
        state = merging.merged_state_dict(model)  # on every process: FSDP gathers its shards collectively
        if run.accelerator.is_main_process:
            merging.save_merged(model, run.task, folder, state)

    def write_trained(self, run, folder: Path) -> None:
        """peft's files, the plain config and (saving.py's) the processor."""
        model = run.accelerator.unwrap_model(run.model)
        state = run.strategy.module_state_dict(model)  # a collective where the weights are sharded
        if run.accelerator.is_main_process:
            adapter_folder.save_adapter(model, folder, state)
            merging.plain_config(model).save_pretrained(folder)  # the labels and the task, for predict

    def load_trained(self, run, folder: Path) -> None:
        adapter_folder.load_adapter_weights(run.accelerator.unwrap_model(run.model), folder)

    def adapter_bytes(self, model) -> int:
        """The LoRA matrices and trained head, as adapter/ stores them."""
        return adapter_folder.adapter_bytes(adapter_folder.adapter_state(model))

    def non_finite_fix(self, config, beta: str) -> str:
        """The adapters' settings first: their own default lr is 10x full fine-tuning's, and lora_alpha /
        lora_r scales every update they make."""
        return (f"lower --lr ({config.lr:g} now){beta} or --lora-alpha (alpha/r = {config.lora_alpha:g}/"
                f"{config.lora_r} scales the adapters' updates), use --precision fp32, or check the data for extreme "
                "values")

    # -- model/README.md, from config.yaml's dict
    def card_tags(self) -> list[str]:
        return [self.method]

    def card_technique(self, config: dict) -> str:
        return (f"{config['peft']} (r {config['lora_r']}, alpha {config['lora_alpha']}, "
                f"dropout {config['lora_dropout']}, targets {config['lora_target_modules']})")

    def card_note(self, config: dict) -> str:
        """model/ is not the adapter: what it was merged into, and where the adapter alone is."""
        base = ("the 4-bit NF4 base the adapter was trained over, dequantised to fp32 (so it differs from the original "
                "full-precision base by NF4's rounding)" if quantized(config) else "the base")
        return (f"These weights are the {config['peft']} adapter merged into {base}; the adapter alone is in "
                "../adapter (peft's `PeftModel.from_pretrained` over the base model).\n\n")
