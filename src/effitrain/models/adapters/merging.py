"""An adapted model as the plain model that computes what it does: the merged weights and the plain config
of model/, loadable without peft; the training model left untouched."""

from __future__ import annotations

import copy
from pathlib import Path

from effitrain.models.adapters.lora_settings import ADAPTER


def full_tensor(tensor):
    """A whole tensor: FSDP2's sharded DTensors are gathered."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _dense_weight(module):
    """A linear layer's weight in full precision: bitsandbytes' 4-bit weights dequantised."""
    import torch

    weight = module.weight
    if getattr(weight, "quant_state", None) is not None:  # bnb Params4bit: packed values + absmax + quant state
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(weight.data, weight.quant_state).to(torch.float32)
    return full_tensor(weight.detach())


def _plain_layout(module, weight):
    """A weight in the layout of the plain model's layer: transformers quantises GPT-2's Conv1D (weight:
    inputs x outputs) as a 4-bit linear layer (outputs x inputs), recording the class it replaced in
    `source_cls`; its merged weight is transposed back. By that record, not by shape: a square layer
    (GPT-2's attn.c_proj) has the same shape both ways."""
    from transformers.pytorch_utils import Conv1D

    source = getattr(module, "source_cls", None)
    return weight.T if isinstance(source, type) and issubclass(source, Conv1D) else weight


def merged_state_dict(model) -> dict:
    """The weights of the plain model that computes what the adapted one does: each adapted layer's
    base weight (dequantised for QLoRA) plus its low-rank update, the head as trained, the rest as it
    is. The training model is left untouched (peft's merge_and_unload would change it in place, and
    would quantise a QLoRA merge to 4 bits again)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.other import TrainableTokensWrapper

    inner = model.get_base_model()
    merged, done = {}, ()
    for name, module in inner.named_modules():
        if done and name.startswith(done):
            continue
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            weight = _dense_weight(base) + full_tensor(module.get_delta_weight(ADAPTER)).float()
            merged[f"{name}.weight"] = _plain_layout(base, weight)
            if base.bias is not None:
                merged[f"{name}.bias"] = full_tensor(base.bias.detach())
        elif isinstance(module, TrainableTokensWrapper):  # the base's rows with the trained ones in them
            merged[f"{name}.weight"] = full_tensor(module.token_adapter.get_merged_weights([ADAPTER]).detach())
        elif isinstance(module, ModulesToSaveWrapper):
            for key, value in module.modules_to_save[ADAPTER].state_dict().items():
                merged[f"{name}.{key}"] = full_tensor(value)
        elif getattr(getattr(module, "weight", None), "quant_state", None) is not None:  # 4-bit, not adapted
            merged[f"{name}.weight"] = _plain_layout(module, _dense_weight(module))
            if module.bias is not None:
                merged[f"{name}.bias"] = full_tensor(module.bias.detach())
        else:
            continue
        done = (*done, f"{name}.")
    for key, value in inner.state_dict().items():
        if not key.startswith(done) and key not in merged:
            merged[key] = full_tensor(value)
    return merged


def plain_config(model):
    """The adapted model's config as a plain model's: no quantisation settings, the task's class."""
    inner = model.get_base_model()
    config = copy.deepcopy(inner.config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    # The task's class (a base checkpoint's config names its bare model, e.g. BertModel): what predict
    # and evaluate read to know the task of an adapter folder.
    config.architectures = [type(inner).__name__]
    return config


def save_merged(model, task, folder: Path, state: dict) -> None:
    """model/: the merged weights through a plain model's save_pretrained (built on the meta device:
    no second copy of the weights), loadable without peft."""
    import torch

    config = plain_config(model)
    with torch.device("meta"):
        plain = task.auto_class.from_config(config)
    expected = plain.state_dict().keys()
    state = {key: value.contiguous() for key, value in state.items() if key in expected}
    plain.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
