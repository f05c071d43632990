"""peft's own folder of a run (adapter/, best/): the adapter's weights saved with the record of its base,
put back into the run's model (--keep best), and their size for metrics.json."""

from __future__ import annotations

from pathlib import Path

import effitrain.models.adapters.base_record as base_record
from effitrain.models.adapters.lora_settings import ADAPTER
from effitrain.models.adapters.merging import full_tensor


def adapter_state(model) -> dict:
    """The adapter's weights (LoRA matrices and the head), as peft saves them."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)  # as save_adapter
    return {key: full_tensor(value) for key, value in state.items()}


def save_adapter(model, folder: Path, state: dict | None = None) -> None:
    """peft's save_pretrained: adapter_config.json and adapter_model.safetensors (peft picks the
    adapter's weights out of the model itself, or out of `state`, the whole weights of a sharded
    model), and effitrain's record of the base (models/adapters/base_record.py). Never the embedding layers:
    peft would save the whole output layer when lm_head has an adapter, for vocabularies resized in
    training, which effitrain never does. The base is named by its absolute path in adapter_config.json
    too: peft records the path as given, which may be relative to the folder training ran in."""
    settings = model.peft_config[ADAPTER]
    base = settings.base_model_name_or_path
    if base and Path(base).is_dir():
        settings.base_model_name_or_path = str(Path(base).resolve())
    model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False, state_dict=state)
    base_record.record(folder, base)


def load_adapter_weights(model, folder: Path) -> None:
    """An adapter folder's weights back into the run's model (--keep best)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(p.device for p in model.parameters())
    state = load_file(str(folder / "adapter_model.safetensors"), device=str(device))
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{folder} holds weights the adapter does not have: {result.unexpected_keys[:3]}")


def adapter_bytes(state: dict) -> int:
    return sum(value.numel() * value.element_size() for value in state.values())
