"""What the model learns. Per task: the Auto class, the processor, preprocessing, collators, the loss
(as a sum over items, so the loop can normalise over a whole optimizer step) and the metrics."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from effitrain import models
from effitrain.errors import UserError

TEXT_TASKS = ("sequence-classification", "causal-lm")


def auto_class(task: str):
    import transformers

    return getattr(transformers, {"sequence-classification": "AutoModelForSequenceClassification",
                                  "image-classification": "AutoModelForImageClassification",
                                  "audio-classification": "AutoModelForAudioClassification",
                                  "causal-lm": "AutoModelForCausalLM"}[task])


def load_processor(task: str, source: models.ModelSource):
    """Tokenizer, image processor or feature extractor. A model built from a config has none of its
    own: text models then use the default model's WordPiece tokenizer."""
    from effitrain.data import audio, image

    if task in TEXT_TASKS:
        tokenizer = models.load_tokenizer(source.path or models.default_model_dir())
        if tokenizer.pad_token is None:  # GPT-style tokenizers: pad with EOS, masked out of the loss
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    config = source.config if source.config is not None else _config(source.path)
    if task == "image-classification":
        with models.loading(source.path or "config"):
            return image.image_processor(source.path, config)
    with models.loading(source.path or "config"):
        return audio.feature_extractor(source.path, config.model_type)


def _config(path):
    from transformers import AutoConfig

    with models.loading(path):
        return AutoConfig.from_pretrained(str(path), local_files_only=True)


def build_model(task: str, source: models.ModelSource, labels: list[str] | None, processor):
    """Pretrained weights with a fresh head sized for `labels`, or random initialisation from a config."""
    import copy

    auto = auto_class(task)
    head = {} if labels is None else {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                                      "label2id": {label: i for i, label in enumerate(labels)}}
    config = copy.deepcopy(source.config) if source.config is not None else _config(source.path)
    if type(config) not in auto._model_mapping:
        raise UserError(f"model type `{config.model_type}` has no {task} head in transformers",
                        f"pass a model that {auto.__name__} supports")
    if source.pretrained:
        with models.loading(source.path):
            # A checkpoint fine-tuned on other labels keeps its body and gets a new head.
            # Safetensors whenever they exist; pickle only where resolve() let it through (--allow-pickle).
            model = auto.from_pretrained(str(source.path), ignore_mismatched_sizes=bool(head),
                                         use_safetensors=models.has_safetensors(source.path),
                                         local_files_only=True, **head)
    else:
        for key, value in head.items():
            setattr(config, key, value)
        if task in TEXT_TASKS:
            config.vocab_size = len(processor)
        model = auto.from_config(config)
    if task in TEXT_TASKS and model.config.pad_token_id is None and processor is not None:
        model.config.pad_token_id = processor.pad_token_id  # sequence classification finds the last token by it
    return model


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


def preprocess(task: str, splits, processor, config, base_dir):
    from effitrain.data import audio, image, text

    if task in TEXT_TASKS:
        return text.tokenize(splits, processor, config.max_length, labels=task != "causal-lm")
    if task == "image-classification":
        return image.preprocess(splits, processor, base_dir)
    return audio.preprocess(splits, processor, config.max_duration, base_dir)


def collators(task: str, processor, config):
    """(training collator, evaluation collator)."""
    from effitrain.data import audio, image, text

    if task == "sequence-classification":
        return text.collator(processor), text.collator(processor)
    if task == "causal-lm":
        padded = text.lm_collator(processor)
        return (text.packing_collator() if config.packing else padded), padded
    if task == "image-classification":
        return image.collator(), image.collator()
    return audio.collator(processor), audio.collator(processor)


def _inputs(batch) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def _lm_logits_and_targets(model, batch):
    """Next-token prediction: position t predicts token t+1; -100 targets (padding, and the first token
    of each packed example) are ignored."""
    logits = model(**_inputs(batch), use_cache=False).logits  # no cache: packed masks need cache=None
    return logits[:, :-1].float(), batch["labels"][:, 1:]


def item_count(task: str, batch) -> torch.Tensor:
    """The items the loss averages over: labelled examples, or predicted tokens for causal LM."""
    labels = batch["labels"][:, 1:] if task == "causal-lm" else batch["labels"]
    return (labels != -100).sum()


def example_count(task: str, batch) -> torch.Tensor:
    """Examples in a micro-batch, for samples/s; a packed row holds one example per position id 0."""
    if "position_ids" in batch and task == "causal-lm":
        return (batch["position_ids"] == 0).sum()
    return torch.tensor(len(batch["labels"]), device=batch["labels"].device)


def token_count(task: str, batch) -> torch.Tensor | None:
    """Real (non-pad) tokens of a text batch, for tokens/s; None for images and audio."""
    if task not in TEXT_TASKS:
        return None
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)  # packed: no padding


def loss_sum(task: str, model, batch) -> torch.Tensor:
    """Sum (not mean) of the per-item losses of a micro-batch; labels are kept out of the model so
    that no model-side reduction decides the normalisation."""
    if task == "causal-lm":
        logits, targets = _lm_logits_and_targets(model, batch)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                               ignore_index=-100)
    logits = model(**_inputs(batch)).logits
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum", ignore_index=-100)


def eval_outputs(task: str, model, batch) -> tuple[torch.Tensor, ...]:
    """Per-example tensors, so that gather_for_metrics can drop the duplicates of uneven shards."""
    if task == "causal-lm":
        logits, targets = _lm_logits_and_targets(model, batch)
        mask = targets != -100
        losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
        correct = (logits.argmax(-1) == targets) & mask
        return losses.sum(-1), mask.sum(-1), correct.sum(-1)
    logits = model(**_inputs(batch)).logits.float()
    return logits.argmax(-1), batch["labels"], F.cross_entropy(logits, batch["labels"], reduction="none")


def metrics(task: str, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
    from effitrain.engine.metrics import classification_metrics

    if task == "causal-lm":
        loss_total, tokens, correct = (float(t.double().sum()) for t in outputs)
        loss = loss_total / max(tokens, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "token_accuracy": correct / max(tokens, 1),
                "tokens": int(tokens), "samples": int(len(outputs[0]))}
    predictions, references, losses = outputs
    result = classification_metrics(predictions.numpy(), references.numpy(), label_names)
    result["loss"] = float(losses.mean())
    result["samples"] = int(len(references))
    return result
