"""What `train --peft` asks for: the adapter settings, the method (lora, qlora or none) and peft's name for
the one adapter a run trains. The one place that reads --peft's value to decide."""

from __future__ import annotations

from dataclasses import dataclass

from effitrain.config import TrainConfig


ADAPTER = "default"  # peft's name for the one adapter a run trains


@dataclass(frozen=True)
class Peft:
    """The adapter settings of `train --peft` (config.py's fields, the same names: `apply` takes it)."""

    peft: str = "none"
    lora_r: int = TrainConfig.lora_r
    lora_alpha: float = TrainConfig.lora_alpha
    lora_dropout: float = TrainConfig.lora_dropout
    lora_target_modules: str = TrainConfig.lora_target_modules
    # Rows the vocabulary gains at its end (a chat template's tokens over a pretrained base), trained in full:
    # the planner grows and marks its model so (training reads them off the model: mark_new_tokens).
    new_tokens: int = 0

    @classmethod
    def of(cls, config) -> "Peft | None":
        if method(config) is None:
            return None
        return cls(config.peft, config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_target_modules)


def method(settings) -> str | None:
    """The adapters that settings ask for (lora or qlora; None for none): a TrainConfig, a Peft, or
    config.yaml's dict (the model card). The one place that reads --peft's value to decide."""
    if settings is None:
        return None
    value = settings.get("peft") if isinstance(settings, dict) else getattr(settings, "peft", None)
    return None if value in (None, "none") else value


def quantized(settings) -> bool:
    """QLoRA: the frozen base is loaded in 4 bits."""
    return method(settings) == "qlora"
