"""An adapter folder read back for predict and evaluate: its base found and checked, the adapter applied
to it (refused where its config and weights disagree) and merged."""

from __future__ import annotations

from pathlib import Path

from effitrain.errors import UserError
import effitrain.models.loading as loading
import effitrain.models.adapters.base_record as base_record
from effitrain.models.adapters.lora_settings import ADAPTER
from effitrain.models.loading import ADAPTER_CONFIG as ADAPTER_MARK  # peft's file: what makes an adapter folder


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_MARK).is_file()


def base_of(path: Path, weights: bool = True) -> Path:
    """The base model an adapter folder was trained on: the one effitrain's record names, found and
    checked (models/adapters/base_record.py; `weights`: its files hashed too, else only what is cheap); for a
    folder saved before that record, peft's base_model_name_or_path as it is, of the adapter's own
    model_type."""
    import json

    content = base_record.read(path)
    if content is not None:
        return base_record.find(path, content, weights)
    from effitrain.outputs.run_folder import MARKER

    if (Path(path).resolve().parent / MARKER).is_file():  # effitrain wrote it with its record: removed since
        raise UserError(f"the adapter in {path} is in an effitrain run but has no {base_record.RECORD} (which base "
                        "it belongs to, with its weights' digest), so its base cannot be checked",
                        f"use the merged model {base_record.merged_model(path)}; or, to apply it to the base peft "
                        "names unchecked, copy the adapter folder out of the run")
    try:
        base = json.loads((Path(path) / ADAPTER_MARK).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"{path / ADAPTER_MARK} is not a valid peft adapter config",
                        "pass the adapter/ folder `effitrain train --peft` wrote, or its model/ folder")
    merged = base_record.merged_model(path)
    if not base:
        raise UserError(f"the adapter in {path} was trained on a model built from a config, which has no "
                        "saved base weights", f"use the merged model: {merged}")
    try:
        found = loading.resolve(base)
    except UserError as err:
        raise UserError(f"the base model of the adapter in {path} ({base}) cannot be loaded: {err.problem}",
                        f"restore it there, or use the merged model {merged}")
    wanted, there = base_record.model_type(Path(path)), base_record.model_type(found)
    if wanted != there:
        raise UserError(f"the base model of the adapter in {path}: {base} is a {there} model, and the adapter "
                        f"was trained on a {wanted} model",
                        f"restore its own base there, or use the merged model {merged}")
    return found


def load_for_inference(path: Path, task):
    """An adapter folder as a plain model: its config (labels) over its base model's weights, the adapter
    applied, then merged (inference needs no separate adapter). The head may be new (the base's, if any,
    is replaced by the adapter's); every other weight of the base must fit, or the base is refused."""
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
                        "use the base the adapter was trained on, or the merged model "
                        f"{base_record.merged_model(path)}")
    if grown:  # as training grew it; every new row is then replaced by the adapter's trained one
        model.resize_token_embeddings(grown[1], mean_resizing=False)
    return apply_saved(model, path).merge_and_unload()


def grown_vocabulary(path: Path, config, base: Path) -> tuple[int, int] | None:
    """(the base's vocabulary, the adapter's) when training grew it (a chat template's tokens), else None.
    The adapter must then hold every new row as trained tokens (what `apply` trains): rows it lacks would
    be made up at load."""
    import json

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
                        f"use the merged model {base_record.merged_model(path)}")
    return before, after


def apply_saved(model, path: Path):
    """peft's PeftModel.from_pretrained, with an adapter_config.json that does not match its weights
    refused: peft raises on another rank or when no target module is found, but says nothing of one
    target among others that the model lacks, and only warns about (or ignores) weights the config
    leaves out or names without weights, which would run as untrained."""
    import warnings

    from peft import PeftConfig, PeftModel, get_peft_model_state_dict
    from safetensors import SafetensorError, safe_open

    fix = ("restore the adapter_config.json that training wrote, or use the merged model "
           f"{base_record.merged_model(path)}")
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
                        f"the merged model {base_record.merged_model(path)}")
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
