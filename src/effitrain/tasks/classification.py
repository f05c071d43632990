"""Classification of texts (single or pairs), images and audio clips: one label per example."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from effitrain import models
from effitrain.tasks.base import Task

_AUTO = {"text": "AutoModelForSequenceClassification", "image": "AutoModelForImageClassification",
         "audio": "AutoModelForAudioClassification"}


class Classification(Task):
    higher_is_better = ("accuracy", "f1_macro")  # and every f1_<label>

    def __init__(self, name: str, modality: str):
        super().__init__(name)
        self.modality = modality  # text | image | audio
        self.auto_class_name = _AUTO[modality]
        self.is_text = modality == "text"

    # -- models ------------------------------------------------------------------------------------
    def load_processor(self, source: models.ModelSource):
        """Tokenizer, image processor or feature extractor. A model built from a config has none of its
        own: text models then use the default model's WordPiece tokenizer."""
        from effitrain.data import audio, image

        if self.is_text:
            return models.load_text_tokenizer(source)
        config = source.config if source.config is not None else models.load_config(source.path)
        with models.loading(source.path or "config"):
            if self.modality == "image":
                return image.image_processor(source.path, config)
            return audio.feature_extractor(source.path, config.model_type)

    def adapt_config(self, config, processor) -> None:
        if self.is_text:
            config.vocab_size = len(processor)

    def adapt_model(self, model, processor) -> None:
        if self.is_text and model.config.pad_token_id is None and processor is not None:
            model.config.pad_token_id = processor.pad_token_id  # the head finds the last token by it

    # -- data --------------------------------------------------------------------------------------
    def columns(self, config) -> dict[str, str]:
        column = {"text": config.text_column, "image": config.image_column, "audio": config.audio_column}
        wanted = {self.modality: column[self.modality], "label": config.label_column}
        if self.is_text and config.text_pair_column:
            wanted["text_pair"] = config.text_pair_column
        return wanted

    def sequence_length(self, config, processor) -> int:
        if self.modality == "audio":
            return int(config.max_duration * processor.sampling_rate)
        return config.max_length

    def preprocess(self, splits, processor, config, base_dir):
        from effitrain.data import audio, image, text

        if self.is_text:
            return text.tokenize(splits, processor, config.max_length, labels=True)
        if self.modality == "image":
            return image.preprocess(splits, processor, base_dir)
        return audio.preprocess(splits, processor, config.max_duration, base_dir)

    def collators(self, processor, config):
        """(training collator, evaluation collator)."""
        from effitrain.data import audio, image, text

        if self.is_text:
            return text.collator(processor), text.collator(processor)
        if self.modality == "image":
            return image.collator(), image.collator()
        return audio.collator(processor), audio.collator(processor)

    # -- the loss, evaluation ----------------------------------------------------------------------
    def loss_sum(self, model, batch) -> torch.Tensor:
        logits = model(**self.inputs(batch)).logits
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum", ignore_index=-100)

    def eval_outputs(self, model, batch) -> tuple[torch.Tensor, ...]:
        logits = model(**self.inputs(batch)).logits.float()
        return logits.argmax(-1), batch["labels"], F.cross_entropy(logits, batch["labels"], reduction="none")

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        from effitrain.tasks.metrics import classification_metrics

        predictions, references, losses = outputs
        result = classification_metrics(predictions.numpy(), references.numpy(), label_names)
        result["loss"] = float(losses.mean())
        result["samples"] = int(len(references))
        return result

    def metric_names(self, label_names: list[str] | None) -> list[str]:
        return ["loss", "accuracy", "f1_macro"] + [f"f1_{name}" for name in label_names or []]

    def is_higher_better(self, metric: str) -> bool:
        return metric in self.higher_is_better or metric.startswith("f1_")

    def example_batch(self, model_config, batch_size: int, seq_len: int) -> dict:
        labels = torch.zeros(batch_size, dtype=torch.long)
        if self.is_text:
            ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        if self.modality == "image":
            size = getattr(model_config, "image_size", 224)  # ResNet-style configs have none; processors use 224
            size = size if isinstance(size, int) else size[0]
            return {"pixel_values": torch.zeros(batch_size, getattr(model_config, "num_channels", 3), size, size),
                    "labels": labels}
        return {"input_values": torch.zeros(batch_size, seq_len), "labels": labels}  # seq_len samples
