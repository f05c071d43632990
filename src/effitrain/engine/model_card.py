"""model/README.md: a model card in the Hub's format (YAML metadata through huggingface_hub's
ModelCardData, so that the Hub reads `base_model`, `pipeline_tag`, `datasets` and the `model-index`
results), then how the model was trained and what it scored, so that a saved model explains itself."""

from __future__ import annotations

import html
import re

from pathlib import Path

from effitrain.catalog import rl_names
from effitrain.models import adapters

# metric name in metrics.json -> (model-index metric type, display name)
METRIC_TYPES = {"accuracy": ("accuracy", "Accuracy"), "f1_macro": ("f1", "F1 (macro)"), "loss": ("loss", "Loss"),
                "perplexity": ("perplexity", "Perplexity"), "token_accuracy": ("accuracy", "Token accuracy")}
COUNTS = ("samples", "tokens")  # evaluation counts, not metrics


def base_model(model: str) -> str | None:
    """The Hub id the run started from, when there is one: the default model's, or a --model that names
    a cached Hub id. A local folder or a model built from a config has none."""
    from effitrain.models.loading import DEFAULT_MODEL_HUB_ID

    if model == "default":
        return DEFAULT_MODEL_HUB_ID
    # As loading.resolve tells a Hub id from a path; `type:key=value` and a .json file are configs.
    local = model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model).expanduser().exists()
    return None if local or ":" in model or model.endswith(".json") else model


def dataset_id(data: str) -> str | None:
    from effitrain.data.builtins import HUB_IDS

    return HUB_IDS.get(data)


def text(value) -> str:
    """Words from the data or the user (label names, a run's folder name) as Markdown text: HTML escaped,
    as report.html escapes them, and Markdown's own marks taken literally (a label `a|b` in the table)."""
    return re.sub(r"([\\`*_\[\]|#~])", r"\\\1", html.escape(str(value), quote=False))


def code(value) -> str:
    """A path or setting as a Markdown code span, whatever backticks it holds (CommonMark: a longer run of
    backticks delimits); shown literally, HTML included. Line breaks and other control characters are
    written as Python escapes (a blank line would end the span's paragraph, and what follows it would be
    read as Markdown and HTML)."""
    value = re.sub(r"[\x00-\x1f\x7f\x85\u2028\u2029]", lambda m: repr(m.group())[1:-1], str(value))
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", value)), default=0) + 1)
    padded = f" {value} " if value.startswith("`") or value.endswith("`") else value
    return f"{ticks}{padded}{ticks}"


def metric_label(name: str) -> tuple[str, str]:
    if name in METRIC_TYPES:
        return METRIC_TYPES[name]
    if name.startswith("f1_"):
        return "f1", f"F1 ({name[3:]})"
    return name, name.replace("_", " ").capitalize()


def card_data(config: dict, result: dict, pipeline_tag: str, model_name: str):
    from huggingface_hub import EvalResult, ModelCardData

    data = config["data"]
    dataset = dataset_id(data)
    results = [EvalResult(task_type=pipeline_tag, dataset_type=dataset or Path(data).name, dataset_name=data,
                          dataset_split="test", metric_type=metric_label(name)[0],
                          metric_name=metric_label(name)[1], metric_value=round(float(value), 6))
               for name, value in result["test"].items() if name not in COUNTS]
    return ModelCardData(library_name="transformers", base_model=base_model(config["model"]),
                         pipeline_tag=pipeline_tag, datasets=[dataset] if dataset else None, model_name=model_name,
                         tags=["effitrain"] + adapters.form_of(config).card_tags(),
                         eval_results=results or None)


def procedure(config: dict, result: dict, facts: dict) -> list[str]:
    """The settings that matter for reproducing the run, as Markdown list items."""
    from effitrain.config import compiles

    grad_accum, world = result["grad_accum"], result["world_size"]
    examples, pieces = result["examples"], result["pieces_per_micro_batch"]
    base = base_model(config["model"])
    adapters_said = adapters.form_of(config).card_technique(config)  # None for a model trained in full
    techniques = [name for name, on in (
        ("gradient checkpointing", result["gradient_checkpointing"]),
        ("torch.compile per transformer block", compiles(config)),
        (f"local SGD every {config['local_sgd_steps']} steps", config.get("local_sgd_steps")),
        (facts.get("sharding"), facts.get("sharding")),  # "fsdp sharding" over processes, or None
        (adapters_said, adapters_said),
        ("packing", config.get("packing")),
        (f"micro-batches run in {pieces} pieces (--memory-budget)", pieces > 1),
    ) if on]
    return [
        f"- base model: {code(config['model'])}" + (f" ({base})" if base not in (None, config["model"]) else "")
        + (f"; trained as a student of {student_said(config, result)}" if config.get("student_layers") else ""),
        f"- task: {config['task']}" + (f", preference tuning: {preference_said(config)}" if config.get("preference")
                                       else "") + (f", online RL: {rl_said(config, code)}" if config.get("rl") else ""),
        *([f"- distilled from {distillation_said(config, code, top_k=not result.get('labels'))}"]
          if config.get("distill_from") and not config.get("rl") else []),  # --rl distill: rl_said names it
        f"- data: {code(config['data'])}: {examples.get('train', 0)} train / {examples.get('validation', 0)} "
        f"validation / {examples.get('test', 0)} test examples" + (f", labels {', '.join(map(text, result['labels']))}"
                                                      if result.get("labels") else ""),
        f"- steps: {result['steps']} ({result['epochs']} epochs) of {config['batch_size']} x {grad_accum} x "
        f"{world} process(es) = {config['batch_size'] * grad_accum * world} examples per step",
        f"- learning rate {config['lr']} (warm-up {config['warmup_ratio']} of the steps, then linear decay), "
        f"weight decay {config['weight_decay']}, gradient clipping {config['max_grad_norm']}",
        f"- optimizer: {result['optimizer']}; precision: {result['precision']}"
        + (f"; max length {config['max_length']}" if facts["is_text"] else ""),
        f"- techniques: {', '.join(techniques) if techniques else 'none'}",
        f"- parameters: {result['parameters']['trainable']:,} trained of {result['parameters']['total']:,} "
        f"({100 * result['trainable_share']:.2f}%)",
        f"- hardware: {world} x {facts['hardware']} ({result['device']})",
        f"- time: {result['wall_seconds']:.1f} s in all, {result['train_seconds']:.1f} s training, "
        f"{result['train_samples_per_second']:.1f} samples/s, "
        f"peak memory {result['peak_memory_bytes'] / 2**20:.0f} MiB",
        f"- seed {config['seed']}",
    ]


def student_said(config: dict, result: dict) -> str:
    """--student-layers in words: how many layers of how many (metrics.json's `student`), which ones."""
    made = result.get("student") or {}
    of = f" of its {made['of']} layers (layers {', '.join(map(str, made['kept']))})" if made.get("of") else \
        " of its layers"
    return f"{config['student_layers']}{of}, evenly spaced, DistilBERT's way (--student-layers)"


def distillation_said(config: dict, shown=str, top_k: bool = False) -> str:
    """--distill-from in words (docs/distillation.md); the report's summary says the same. `shown`: how the
    teacher's folder is written (the card shows it as code); `top_k`: a causal LM's (no labels), which learns its
    teacher's top-k log-probs at each labelled position rather than its logits."""
    over = (f"KL over the teacher's top {config['distill_top_k']} tokens and the rest of its mass at each labelled "
            "position" if top_k else "KL(teacher || student)")
    stored = "top-k log-probs" if top_k else "logits"
    return (f"the teacher {shown(config['distill_from'])} (--distill-from): loss (1 - alpha) x cross-entropy + "
            f"alpha x T^2 x {over} at temperature T, alpha {config['distill_alpha']:g}, "
            f"T {config['distill_temperature']:g}; the teacher's {stored} computed once before training and stored")


def rl_said(config: dict, shown=str) -> str:
    """--rl and its settings in words (docs/rl.md); the report's summary says the same. `shown`: how a reward's
    name (a user's path.py:name) is written (the card shows it as code)."""
    rewards = [shown(name) for name in config.get("reward") or ["exact-match"]]
    weights = config.get("reward_weights")
    rewards_said = ", ".join(f"{name} x {weight:g}" for name, weight in zip(rewards, weights)) if weights \
        else ", ".join(rewards)
    high = config.get("clip_epsilon_high")
    clip = f"clip {config['clip_epsilon']:g}" + (f" (high {high:g})" if high is not None else "")
    entry = rl_names.get(config["rl"])
    if entry.teacher:  # on-policy distillation: no rewards, the teacher's divergence
        beta = config.get("distill_beta", 1.0)
        kind = {1.0: "the reverse KL(student || teacher)", 0.0: "the forward KL(teacher || student)"}.get(
            float(beta), f"the generalised JSD (beta {beta:g})")
        return (f"{config['rl']}, {config['num_generations']} completions per prompt of at most "
                f"{config['max_new_tokens']} tokens at temperature {config['temperature']:g}; loss {kind} to the "
                f"teacher {shown(config['distill_from'])} (--distill-from) at temperature "
                f"{config['distill_temperature']:g} per completion token")
    loss = f"{config['loss_type']} loss, " if "loss_type" in entry.settings else ""  # rloo's loss is its own
    kl = f"KL beta {config['kl_beta']:g}" if config["kl_beta"] else "no KL"
    return (f"{config['rl']}, {config['num_generations']} completions per prompt of at most "
            f"{config['max_new_tokens']} tokens at temperature {config['temperature']:g}"
            + (f", top-p {config['top_p']:g}" if config.get("top_p", 1.0) != 1.0 else "")
            + f", {loss}rewards scaled by {config.get('scale_rewards') or entry.scale_rewards}, "
            f"{clip}, {kl}"
            + (", truncated completions masked" if config.get("mask_truncated") else "")
            + f"; rewards {rewards_said}")


def rl_results(result: dict) -> str:
    """Online RL: the final reward, of the last logged step's sampled completions and of greedy completions of
    the held-out prompts."""
    trained = (result.get("train_metrics") or {}).get("reward")
    said = [f"{trained:.4f} on the last logged window's sampled completions" if trained is not None else None,
            *(f"{result[split]['reward']:.4f} greedy on the {split} prompts" for split in ("validation", "test")
              if "reward" in (result.get(split) or {}))]
    said = [part for part in said if part]
    return f"Final reward (weighted): {', '.join(said)}.\n\n" if said else ""


def preference_said(config: dict) -> str:
    """--preference and its settings in words (docs/preference.md)."""
    said = f"{config['preference']} beta {config['beta']}"
    if config.get("reference"):
        said += f" ({config.get('dpo_loss', 'sigmoid')} loss, reference {config['reference']})"
    return said


def results_table(result: dict) -> list[str]:
    splits = [name for name in ("validation", "test") if result.get(name)]
    names = [name for name in result["test"] if name not in COUNTS]
    lines = ["| metric | " + " | ".join(splits) + " |", "| --- |" + " --- |" * len(splits)]
    for name in names:
        cells = [f"{result[split][name]:.4f}" if name in result[split] else "" for split in splits]
        lines.append(f"| {text(metric_label(name)[1])} | " + " | ".join(cells) + " |")
    return lines


def render(config: dict, result: dict, facts: dict) -> str:
    """The card's text. `facts`: what metrics.json does not say (pipeline_tag, hardware, is_text)."""
    from effitrain.runtime.libraries import versions

    name = Path(config["output_dir"]).name
    best = result.get("best") or {}
    kept = (f"The weights are those of the best validation {best['metric']} ({best['value']:.4f}, step "
            f"{best['step']}).\n\n" if best.get("kept_in_model") and best.get("step") else "")
    body = "\n".join([
        f"# {text(name)}", "",
        f"A {config['task']} model fine-tuned with effitrain {versions()['effitrain']}.", "",
        "```python",
        "from transformers import pipeline",
        f"pipe = pipeline(\"{facts['pipeline_tag']}\", model=\"path/to/this/folder\")",
        "```", "",
        "## Training procedure", "", *procedure(config, result, facts), "",
        "## Results", "", kept + (rl_results(result) if config.get("rl") else "") + adapters.form_of(config).card_note(
            config) + "\n".join(results_table(result)), "",
        "Made by `effitrain train`; the run's own files (config.yaml, log.jsonl, metrics.json) are in the folder "
        "above this one.", ""])
    return f"---\n{card_data(config, result, facts['pipeline_tag'], name).to_yaml()}\n---\n{body}"


def write(folder: Path, config: dict, result: dict, facts: dict) -> None:
    (folder / "README.md").write_text(render(config, result, facts), encoding="utf-8")
