"""LoRA and QLoRA through peft: which modules get adapters, the 4-bit frozen base, and what a trained
adapter becomes (merged weights for model/, peft's own folder for adapter/ and best/).

peft's classes do the work (LoraConfig, get_peft_model, save_pretrained, PeftModel.from_pretrained);
this module only decides what to pass them. The task's new head (a classifier sized for the labels)
is trained in full through peft's `modules_to_save`: left frozen, a classifier stays random. Tokens the
vocabulary gained (a chat template's `<|im_start|>`, `<|im_end|>` added to a base without them) are new
rows of the input embeddings and of an untied output layer: their rows alone are trained in full,
through peft's `trainable_token_indices` (left frozen, the model could never learn to end a turn)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from effitrain.config import ALL_LINEAR, TrainConfig, lora_target_names
from effitrain.errors import UserError
from effitrain.models.loading import ADAPTER_CONFIG as ADAPTER_MARK  # peft's file: what makes an adapter folder

ADAPTER = "default"  # peft's name for the one adapter a run trains
NEW_TOKENS = "effitrain_new_tokens"  # on a model: {token id: token} of the rows its vocabulary gained


# -- the settings --------------------------------------------------------------------------------------
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


# -- the model -----------------------------------------------------------------------------------------
def head_modules(model) -> list[str]:
    """The task's head: the top-level modules with weights outside the pretrained body
    (`base_model_prefix`): BERT's `classifier`, GPT-2's `score`, wav2vec2's `projector` and `classifier`."""
    body = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children()
            if name != body and any(True for _ in child.parameters())]


def _linear_modules(model) -> dict[str, object]:
    """Every module a LoRA adapter can wrap (nn.Linear, bitsandbytes' 4-bit Linear, GPT-2's Conv1D)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return {name: module for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))}


def _in_head(name: str, head: list[str]) -> bool:
    return any(name == top or name.startswith(f"{top}.") for top in head)


def targets(model, requested: str, head: list[str]) -> list[str]:
    """The full names of the modules that get adapters: every linear module of the body (`all-linear`,
    as peft and QLoRA define it: not the head, not the output embeddings), or those whose name (or
    last part of it) is in the comma list, the output embeddings (a causal LM's lm_head) included when
    they are not tied to the input embeddings. An unknown name is refused with the names there are."""
    linear = _linear_modules(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    allowed = [name for name in linear if not _in_head(name, head)]
    if requested.strip().lower() == ALL_LINEAR:
        return [name for name in allowed if linear[name] is not output]
    chosen, leaves = [], sorted({name.rsplit(".", 1)[-1] for name in allowed})
    for wanted in lora_target_names(requested):
        found = [name for name in allowed if name == wanted or name.endswith(f".{wanted}")]
        if any(linear[name] is output for name in found) and _tied(model, output):
            raise UserError(f"--lora-target-modules: `{wanted}` shares its weight with the input embeddings "
                            "(tie_word_embeddings), so its adapter could not be merged into model/",
                            "leave it out, or train a model with untied embeddings")
        if not found:
            in_head = any(name == wanted or name.endswith(f".{wanted}") for name in linear)
            raise UserError(f"--lora-target-modules: `{wanted}` is "
                            + ("the task's head, which is trained in full" if in_head else
                               f"not a linear module of {type(model).__name__}"),
                            f"pass some of {', '.join(leaves)} (or all-linear)")
        chosen += [name for name in found if name not in chosen]
    return chosen


def _tied(model, output) -> bool:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embeddings is not None and getattr(output, "weight", None) is getattr(embeddings, "weight", False)


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
    for name, module in _linear_modules(model).items():
        width = module.weight.shape[-1] if hasattr(module, "in_features") else module.weight.shape[0]
        if not _in_head(name, head) and width % 64:
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


def peft_task_type(task) -> str | None:
    """peft's task type where it has one (its model classes know these tasks' heads and generation)."""
    return {"sequence-classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}.get(task.name)


def apply(model, task, config):
    """The model with LoRA adapters on its target modules, the head trained in full, everything else
    frozen: a peft PeftModel."""
    from peft import LoraConfig, get_peft_model

    head = head_modules(model) if task.has_labels else []
    keep_4bit_layout(model)
    names = targets(model, config.lora_target_modules, head)
    check_rank(model, names, config.lora_r)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=names, modules_to_save=head or None, task_type=peft_task_type(task),
                      trainable_token_indices=token_rows(model, names))
    adapted = get_peft_model(model, lora)
    keep_chunked_loss(adapted)
    return adapted


# -- tokens the vocabulary gained ----------------------------------------------------------------------
def mark_new_tokens(model, tokens: dict[int, str]) -> None:
    """Record on the model the rows its vocabulary gained (tasks/causal_lm.py, after resizing for a chat
    template's special tokens; the planner's model too), for `apply` to train them."""
    setattr(model, NEW_TOKENS, dict(tokens))


def new_tokens(model) -> dict[int, str]:
    return dict(getattr(model, NEW_TOKENS, None) or {})


def _module_name(model, module) -> str:
    return next(name for name, found in model.named_modules() if found is module)


def token_rows(model, lora_targets: list[str]) -> dict[str, list[int]] | None:
    """peft's trainable_token_indices: the rows of the new tokens in the input embeddings and, when it is
    not tied to them, the output layer (whose rows make the new tokens' logits: left at their initial
    values, `<|im_end|>` would never be the likeliest token). A tied output layer follows the input
    embeddings' rows (peft ties them). peft cannot train rows of a layer that has a LoRA adapter."""
    ids = sorted(new_tokens(model))
    if not ids:
        return None
    rows = {_module_name(model, model.get_input_embeddings()): ids}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and not _tied(model, output):
        name = _module_name(model, output)
        if name in lora_targets:
            raise UserError(f"--lora-target-modules names `{name.rsplit('.', 1)[-1]}`, the output layer, and the "
                            f"chat template added {len(ids)} token(s) ({', '.join(new_tokens(model).values())}) "
                            "whose output rows must be trained in full, which peft cannot do under a LoRA adapter",
                            f"leave `{name.rsplit('.', 1)[-1]}` out of --lora-target-modules (the new tokens' rows "
                            "of it are trained anyway)")
        rows[name] = ids
    return rows


def keep_chunked_loss(model) -> None:
    """peft's trainable tokens wrap the output layer and multiply by its effective weight themselves (the
    wrapped layer's forward never runs): the wrapper, whose `weight` is that effective weight (the trained
    rows in it, differentiably), becomes the layer the chunked loss reads (speedups/chunked_lm_loss.py)."""
    from peft.utils.other import TrainableTokensWrapper

    from effitrain.speedups import chunked_lm_loss

    output = model.get_base_model().get_output_embeddings()
    if isinstance(output, TrainableTokensWrapper) and chunked_lm_loss.prepared(output.token_adapter.get_base_layer()):
        chunked_lm_loss.pass_through(output)


def shape(module) -> tuple[int, int]:
    """(inputs, outputs) of a module an adapter wraps: nn.Linear's and bitsandbytes' (whose 4-bit weight
    is packed) from their attributes, GPT-2's Conv1D (weight: inputs x outputs) from its weight."""
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)


def check_rank(model, names: list[str], rank: int) -> None:
    """A rank above a target's smaller side is refused: its update B @ A would be no lower-rank than the
    matrix itself, with more numbers to train (peft builds it without a word)."""
    modules = dict(model.named_modules())
    name, (inputs, outputs) = min(((name, shape(modules[name])) for name in names), key=lambda item: min(item[1]))
    if rank > min(inputs, outputs):
        raise UserError(f"--lora-r {rank} is above the smaller side of `{name}` ({inputs} inputs x {outputs} "
                        "outputs): its adapter would be no lower-rank than the layer itself",
                        f"pass --lora-r {min(inputs, outputs)} or less (LoRA's ranks are usually 4 to 64)")


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


def is_adapted(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def switched_off(model):
    """peft's disable_adapter context of the PeftModel inside whatever wraps it (DDP, FSDP): inside, the
    model computes as its base did before training (preference tuning's reference, with no second copy)."""
    inner = model
    while not is_adapted(inner) and hasattr(inner, "module"):
        inner = inner.module
    if not is_adapted(inner):
        raise ValueError("the model has no adapters to switch off")
    return inner.disable_adapter()


def counts(model) -> dict[str, int]:
    """Trainable and total parameters (4-bit weights counted as the values they hold, as peft does)."""
    if is_adapted(model):
        trainable, total = model.get_nb_trainable_parameters()
        return {"trainable": trainable, "total": total}
    from effitrain.models import loading

    every = loading.parameter_counts(model)
    return {"trainable": every["trainable"], "total": every["total"]}


# -- saving --------------------------------------------------------------------------------------------
def adapter_state(model) -> dict:
    """The adapter's weights (LoRA matrices and the head), as peft saves them."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)  # as save_adapter
    return {key: _full(value) for key, value in state.items()}


def save_adapter(model, folder: Path, state: dict | None = None) -> None:
    """peft's save_pretrained: adapter_config.json and adapter_model.safetensors (peft picks the
    adapter's weights out of the model itself, or out of `state`, the whole weights of a sharded
    model), and effitrain's record of the base (models/adapter_base.py). Never the embedding layers:
    peft would save the whole output layer when lm_head has an adapter, for vocabularies resized in
    training, which effitrain never does. The base is named by its absolute path in adapter_config.json
    too: peft records the path as given, which may be relative to the folder training ran in."""
    from effitrain.models import adapter_base

    settings = model.peft_config[ADAPTER]
    base = settings.base_model_name_or_path
    if base and Path(base).is_dir():
        settings.base_model_name_or_path = str(Path(base).resolve())
    model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False, state_dict=state)
    adapter_base.record(folder, base)


def load_adapter_weights(model, folder: Path) -> None:
    """An adapter folder's weights back into the run's model (--keep best)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(p.device for p in model.parameters())
    state = load_file(str(folder / "adapter_model.safetensors"), device=str(device))
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{folder} holds weights the adapter does not have: {result.unexpected_keys[:3]}")


def _full(tensor):
    """A whole tensor: FSDP2's sharded DTensors are gathered."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _dense_weight(module):
    """A linear layer's weight in full precision: bitsandbytes' 4-bit weights dequantised."""
    import torch

    weight = module.weight
    if getattr(weight, "quant_state", None) is not None:  # bnb Params4bit: packed values + absmax + quant state
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(weight.data, weight.quant_state).to(torch.float32)
    return _full(weight.detach())


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
            weight = _dense_weight(base) + _full(module.get_delta_weight(ADAPTER)).float()
            merged[f"{name}.weight"] = _plain_layout(base, weight)
            if base.bias is not None:
                merged[f"{name}.bias"] = _full(base.bias.detach())
        elif isinstance(module, TrainableTokensWrapper):  # the base's rows with the trained ones in them
            merged[f"{name}.weight"] = _full(module.token_adapter.get_merged_weights([ADAPTER]).detach())
        elif isinstance(module, ModulesToSaveWrapper):
            for key, value in module.modules_to_save[ADAPTER].state_dict().items():
                merged[f"{name}.{key}"] = _full(value)
        elif getattr(getattr(module, "weight", None), "quant_state", None) is not None:  # 4-bit, not adapted
            merged[f"{name}.weight"] = _plain_layout(module, _dense_weight(module))
            if module.bias is not None:
                merged[f"{name}.bias"] = _full(module.bias.detach())
        else:
            continue
        done = (*done, f"{name}.")
    for key, value in inner.state_dict().items():
        if not key.startswith(done) and key not in merged:
            merged[key] = _full(value)
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


def adapter_bytes(state: dict) -> int:
    return sum(value.numel() * value.element_size() for value in state.values())


# -- loading an adapter folder (predict, evaluate) -----------------------------------------------------
def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_MARK).is_file()


def base_of(path: Path, weights: bool = True) -> Path:
    """The base model an adapter folder was trained on: the one effitrain's record names, found and
    checked (models/adapter_base.py; `weights`: its files hashed too, else only what is cheap); for a
    folder saved before that record, peft's base_model_name_or_path as it is, of the adapter's own
    model_type."""
    import json

    from effitrain.models import adapter_base, loading

    content = adapter_base.read(path)
    if content is not None:
        return adapter_base.find(path, content, weights)
    from effitrain.outputs.run_folder import MARKER

    if (Path(path).resolve().parent / MARKER).is_file():  # effitrain wrote it with its record: removed since
        raise UserError(f"the adapter in {path} is in an effitrain run but has no {adapter_base.RECORD} (which base "
                        "it belongs to, with its weights' digest), so its base cannot be checked",
                        f"use the merged model {adapter_base.merged_model(path)}; or, to apply it to the base peft "
                        "names unchecked, copy the adapter folder out of the run")
    try:
        base = json.loads((Path(path) / ADAPTER_MARK).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"{path / ADAPTER_MARK} is not a valid peft adapter config",
                        "pass the adapter/ folder `effitrain train --peft` wrote, or its model/ folder")
    merged = adapter_base.merged_model(path)
    if not base:
        raise UserError(f"the adapter in {path} was trained on a model built from a config, which has no "
                        "saved base weights", f"use the merged model: {merged}")
    try:
        found = loading.resolve(base)
    except UserError as err:
        raise UserError(f"the base model of the adapter in {path} ({base}) cannot be loaded: {err.problem}",
                        f"restore it there, or use the merged model {merged}")
    wanted, there = adapter_base.model_type(Path(path)), adapter_base.model_type(found)
    if wanted != there:
        raise UserError(f"the base model of the adapter in {path}: {base} is a {there} model, and the adapter "
                        f"was trained on a {wanted} model", f"restore its own base there, or use the merged model {merged}")
    return found


def load_for_inference(path: Path, task):
    """An adapter folder as a plain model: its config (labels) over its base model's weights, the adapter
    applied, then merged (inference needs no separate adapter). The head may be new (the base's, if any,
    is replaced by the adapter's); every other weight of the base must fit, or the base is refused."""
    from effitrain.models import adapter_base, loading

    base = base_of(path)
    config = loading.load_config(path)
    grown = grown_vocabulary(path, config, base)
    if grown:
        config.vocab_size = grown[0]  # the base's rows load as they are; the new ones are the adapter's
    with loading.loading(base):
        model, info = task.auto_class.from_pretrained(str(base), config=config, local_files_only=True,
                                                      ignore_mismatched_sizes=True, output_loading_info=True,
                                                      use_safetensors=loading.has_safetensors(base))
    unfit = loading.unfit_weights(model, info, new_head=True)
    if unfit:
        raise UserError(f"the base model {base} does not fit the adapter in {path}: {unfit}",
                        f"use the base the adapter was trained on, or the merged model {adapter_base.merged_model(path)}")
    if grown:  # as training grew it; every new row is then replaced by the adapter's trained one
        model.resize_token_embeddings(grown[1], mean_resizing=False)
    return apply_saved(model, path).merge_and_unload()


def grown_vocabulary(path: Path, config, base: Path) -> tuple[int, int] | None:
    """(the base's vocabulary, the adapter's) when training grew it (a chat template's tokens), else None.
    The adapter must then hold every new row as trained tokens (what `apply` trains): rows it lacks would
    be made up at load."""
    import json

    from effitrain.models import adapter_base, loading

    before, after = getattr(loading.load_config(base), "vocab_size", None), getattr(config, "vocab_size", None)
    if not isinstance(before, int) or not isinstance(after, int) or after <= before:
        return None
    try:
        rows = json.loads((Path(path) / ADAPTER_MARK).read_text()).get("trainable_token_indices")
    except (OSError, ValueError, AttributeError):
        rows = None  # apply_saved says what is wrong with the file
    lists = rows.values() if isinstance(rows, dict) else [rows] if isinstance(rows, list) else []
    if not lists or any(not set(range(before, after)) <= set(ids or []) for ids in lists):
        raise UserError(f"the adapter in {path} has a vocabulary of {after} tokens and its base {base} has {before}, "
                        "and the adapter does not hold the rows of the tokens between",
                        f"use the merged model {adapter_base.merged_model(path)}")
    return before, after


def apply_saved(model, path: Path):
    """peft's PeftModel.from_pretrained, with an adapter_config.json that does not match its weights
    refused: peft raises on another rank or when no target module is found, but says nothing of one
    target among others that the model lacks, and only warns about (or ignores) weights the config
    leaves out or names without weights, which would run as untrained."""
    import warnings

    from peft import PeftConfig, PeftModel, get_peft_model_state_dict
    from safetensors import SafetensorError, safe_open

    from effitrain.models import adapter_base, loading

    fix = f"restore the adapter_config.json that training wrote, or use the merged model {adapter_base.merged_model(path)}"
    try:
        settings = PeftConfig.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise UserError(f"{path / ADAPTER_MARK} is not a valid peft adapter config ({loading.first_line(err)})", fix)
    problem = f"{path / ADAPTER_MARK} does not match the weights in adapter_model.safetensors"
    absent = absent_targets(model, getattr(settings, "target_modules", None))
    if absent:
        raise UserError(f"{problem}: its target_modules name {', '.join(absent[:3])}, which "
                        f"{type(model).__name__} does not have", fix)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # missing keys: compared below, as one line
            adapted = PeftModel.from_pretrained(model, str(path), adapter_name=ADAPTER, config=settings)
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as weights:
            saved = set(weights.keys())
    except SafetensorError as err:  # truncated or overwritten: no config could match it
        raise UserError(f"{path / 'adapter_model.safetensors'} is not a whole safetensors file "
                        f"({loading.first_line(err)[:200]})", "copy the adapter folder again from its run, or use "
                        f"the merged model {adapter_base.merged_model(path)}")
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError, OSError) as err:
        lines = [line.strip() for line in str(err).splitlines() if "size mismatch" in line] or [loading.first_line(err)]
        raise UserError(f"{problem}: {lines[0][:300]}", fix)
    expected = set(get_peft_model_state_dict(adapted, adapter_name=ADAPTER, save_embedding_layers=False))
    if saved != expected:
        missing, extra = sorted(expected - saved), sorted(saved - expected)
        found = [f"{len(keys)} {what} ({keys[0]}{', ...' if len(keys) > 1 else ''})"
                 for keys, what in ((missing, "named without weights"), (extra, "weights it does not name")) if keys]
        raise UserError(f"{problem}: {'; '.join(found)}", fix)
    return adapted


def absent_targets(model, target_modules) -> list[str]:
    """The names of a target_modules list that match no module of `model` (peft's rule: the whole name,
    or its last parts after a dot); a regular expression (a string) is left to peft."""
    if not isinstance(target_modules, (list, set, tuple)):
        return []
    names = [name for name, _ in model.named_modules()]
    return sorted(target for target in target_modules
                  if not any(name == target or name.endswith(f".{target}") for name in names))
