"""LoRA and QLoRA through peft, owned by models/: which modules get adapters, the 4-bit frozen base, the
tokens the vocabulary gained, and what a trained adapter becomes (merged weights for model/, peft's own
folder for adapter/ and best/). The rest of effitrain calls the names below, and saves, restores and
describes a run's model through its form (`form_of`: plain or adapted), so that it never asks whether a
model is adapted (tests/architecture/test_adapter_branches.py counts where it still does).

peft's classes do the work (LoraConfig, get_peft_model, save_pretrained, PeftModel.from_pretrained);
this package only decides what to pass them. The task's new head (a classifier sized for the labels)
is trained in full through peft's `modules_to_save`: left frozen, a classifier stays random.

    lora_settings.py   what --peft asks for: Peft, method, quantized
    model_parts.py     the head, the linear layers, a tied output layer
    four_bit_base.py   QLoRA's 4-bit base: load options, bitsandbytes' checks, the layout kept
    trained_tokens.py  the rows of tokens the vocabulary gained, trained in full
    wrapping.py        apply (peft's get_peft_model on the chosen targets), is_adapted, switched_off, as_its_base,
                       counts
    merging.py         the merged weights and plain config of model/
    adapter_folder.py  peft's folder of a run (adapter/, best/): saved, put back, its size
    base_record.py     the base an adapter folder belongs to: recorded when saved, checked when loaded
    saved_adapter.py   an adapter folder read back for predict and evaluate
    model_form.py      PlainModel / AdaptedModel: what the engine and the model card call
"""

from effitrain.models.adapters.adapter_folder import adapter_bytes, adapter_state, load_adapter_weights, save_adapter
from effitrain.models.adapters.four_bit_base import (check_4bit, check_4bit_widths, import_libraries, keep_4bit_layout,
                                                     load_options, quantization_config)
from effitrain.models.adapters.lora_settings import ADAPTER, Peft, method, quantized
from effitrain.models.adapters.merging import merged_state_dict, plain_config, save_merged
from effitrain.models.adapters.model_form import AdaptedModel, PlainModel, form_of
from effitrain.models.adapters.model_parts import head_modules, shape
from effitrain.models.adapters.saved_adapter import (absent_targets, apply_saved, base_of, grown_vocabulary,
                                                     is_adapter_dir, load_for_inference)
from effitrain.models.adapters.trained_tokens import (NEW_TOKENS, keep_chunked_loss, mark_new_tokens, new_tokens,
                                                      token_rows)
from effitrain.models.adapters.wrapping import (apply, as_its_base, check_rank, counts, is_adapted, peft_task_type,
                                                switched_off, targets)

__all__ = [
    "ADAPTER", "NEW_TOKENS", "AdaptedModel", "Peft", "PlainModel", "absent_targets", "adapter_bytes", "adapter_state",
    "apply", "apply_saved", "base_of", "check_4bit", "check_4bit_widths", "check_rank", "counts", "form_of",
    "grown_vocabulary", "head_modules", "import_libraries", "is_adapted", "is_adapter_dir", "keep_4bit_layout",
    "keep_chunked_loss", "load_adapter_weights", "load_for_inference", "load_options", "mark_new_tokens",
    "merged_state_dict", "method", "new_tokens", "peft_task_type", "plain_config", "quantization_config",
    "as_its_base", "quantized", "save_adapter", "save_merged", "shape", "switched_off", "targets", "token_rows",
]
