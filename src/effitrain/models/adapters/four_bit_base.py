"""QLoRA's frozen base: loaded in 4 bits by bitsandbytes, checked where its CPU kernels go wrong, and kept
in the layout it trains in; and the libraries adapters train with, imported before the memory plan counts."""

from __future__ import annotations

import copy

from effitrain.errors import UserError
from effitrain.models.adapters.lora_settings import method, quantized
from effitrain.models.adapters.model_parts import head_modules, in_head, linear_modules


def import_libraries(settings) -> None:
    """Import what these adapters train with (peft; bitsandbytes, which peft imports where installed) now:
    the run's memory plan counts from what the process holds before it (memory_fit.in_use_bytes), and a
    library's code and tables are not training memory."""
    if method(settings) is None:
        return
    import peft  # noqa: F401

    if quantized(settings):
        check_4bit()  # bitsandbytes, or one line saying why it does not load


def load_options(task, source, settings, precision: str, device) -> dict:
    """What the task's from_pretrained needs for these adapters: QLoRA's base quantised as it loads, on
    this process's device, where bitsandbytes quantises it (the head kept in full precision)."""
    if not quantized(settings):
        return {}
    if not source.pretrained:
        raise UserError("--peft qlora quantises pretrained weights as they load, and this model is built from "
                        "a config", "pass a saved model (a folder from save_pretrained), or use --peft lora")
    meta = task.build_on_meta(copy.deepcopy(task.source_config(source)))
    head = head_modules(meta) if task.has_labels else []
    check_4bit_widths(meta, head, device)
    return {"quantization_config": quantization_config(precision, head), "device_map": {"": device}}


def quantization_config(precision: str, head: list[str]):
    """QLoRA's frozen base: 4-bit NormalFloat with double quantisation (the QLoRA paper's choice),
    computing in the training precision; the head stays in full precision (it is trained)."""
    import torch
    from transformers import BitsAndBytesConfig

    check_4bit()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute, llm_int8_skip_modules=head or None)


def check_4bit_widths(model, head: list[str], device) -> None:
    """bitsandbytes (0.50) dequantises 4-bit weights on a CPU row by row, in blocks of 64: a layer whose
    input width is not a multiple of 64 comes back wrong (measured: 37% relative error at width 32, 9%
    at 64), and training would go on over a damaged base. Refused there; CUDA kernels are not affected."""
    if device.type != "cpu":
        return
    for name, module in linear_modules(model).items():
        width = module.weight.shape[-1] if hasattr(module, "in_features") else module.weight.shape[0]
        if not in_head(name, head) and width % 64:
            raise UserError(f"--peft qlora on a CPU: bitsandbytes' CPU 4-bit kernels dequantise wrongly when a "
                            f"layer's input width is not a multiple of 64 ({name}: {width})",
                            "use --peft lora here, or train QLoRA on a GPU")


def check_4bit() -> None:
    """bitsandbytes' 4-bit layers, with a backend for this machine (CUDA, or its CPU kernels)."""
    try:
        import bitsandbytes as bnb
        from bitsandbytes.nn import Linear4bit  # noqa: F401
    except Exception as err:  # ImportError, or a native library that does not load here
        raise UserError(f"--peft qlora needs bitsandbytes' 4-bit layers, which do not load here "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})",
                        "pip install 'bitsandbytes>=0.45', or use --peft lora")
    if not getattr(bnb, "features", None) and not hasattr(bnb.functional, "quantize_4bit"):
        raise UserError(f"--peft qlora: bitsandbytes {bnb.__version__} has no 4-bit quantisation",
                        "pip install 'bitsandbytes>=0.45', or use --peft lora")


def keep_4bit_layout(model) -> None:
    """On CPUs with AVX-512 BF16, bitsandbytes repacks a 4-bit layer's weights in place the first time it
    runs in eval mode without gradients (another layout, bf16 scales): validation would compute something
    else than training and the merged model/, and layers narrower than 128 break; training's forward over
    a repacked layer takes the inference-only kernel and fails (`result += bias`: the traceback QLoRA on
    a causal LM gave, whose chunked-lm-loss start-up check runs the model in eval mode). Kept in the
    layout trained: called as soon as the model is loaded, before anything runs it."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
