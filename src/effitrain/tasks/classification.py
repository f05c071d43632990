"""Classification of texts (single or pairs), images and audio clips: one label per example."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

from effitrain.data import packing
from effitrain.errors import UserError
from effitrain.models import loading
import effitrain.tasks.distillation as distillation
import effitrain.tasks.packed as packed
from effitrain.tasks.base import Task, digest

_AUTO = {"text": "AutoModelForSequenceClassification", "image": "AutoModelForImageClassification",
         "audio": "AutoModelForAudioClassification"}


class Classification(Task):
    higher_is_better = ("accuracy", "f1_macro")  # and every f1_<label>
    supports_distillation = True
    distillation = None  # --distill-from: a tasks.distillation.Distillation (with_distillation)

    def __init__(self, name: str, modality: str):
        super().__init__(name)
        self.modality = modality  # text | image | audio
        self.auto_class_name = _AUTO[modality]
        self.is_text = modality == "text"
        self.supports_packing = self.is_text  # padding-free rows: tasks/packed.py
        self.pipeline_tag = f"{modality}-classification"  # the Hub's name for the task (model cards)

    @staticmethod
    def distillation_of(config) -> distillation.Distillation:
        """--distill-from's settings for this task (tasks.for_config)."""
        return distillation.Distillation.of(config)

    def with_distillation(self, distillation) -> Classification:
        """This task learning from a teacher's logits as well as the labels (a copy: tasks.for_config's)."""
        distilled = copy.copy(self)
        distilled.distillation = distillation
        return distilled

    def check_config(self, config) -> None:
        """As every task; --packing also only for the model types whose packed forward is exact."""
        super().check_config(config)
        from effitrain.config import TrainConfig

        if getattr(config, "distill_top_k", TrainConfig.distill_top_k) != TrainConfig.distill_top_k:
            raise UserError(f"--distill-top-k applies to --task causal-lm, not {self.name} (its teacher's logits are "
                            "stored whole)", "drop --distill-top-k")
        if self.distillation is not None:  # a teacher folder that is no model of this task: before the data loads
            self.distillation.teacher_config(self)
        if config.packing:
            packed.check_model(self.source_config(loading.resolve_source(config.model, config.allow_pickle)))

    # -- models ------------------------------------------------------------------------------------
    def load_processor(self, source: loading.ModelSource):
        """Tokenizer, image processor or feature extractor. A model built from a config has none of its
        own: text models then use the default model's WordPiece tokenizer."""
        from effitrain.data import audio, image

        config = self.source_config(source)
        self.check_head(config)
        if self.is_text:
            return loading.load_text_tokenizer(source)
        with loading.loading(source.path or "config"):
            if self.modality == "image":
                image.check_channels(config, f"model {source.path or config.model_type}")
                return image.image_processor(source.path, config)
            return audio.feature_extractor(source.path, config.model_type)

    def check_built_model(self, model, encoded, processor, config) -> None:
        """With --distill-from: the teacher's labels are the data's, its vocabulary or its processor the student's
        (before the output folder is claimed)."""
        if self.distillation is not None:
            labels = [str(model.config.id2label[i]) for i in range(model.config.num_labels)]
            self.distillation.check_teacher(self, labels, processor, model.config)

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

    def load_data(self, config):
        """As every task; with --skip-bad-rows also without the images or clips that do not decode."""
        from effitrain.data import sources

        self.check_lengths(config)
        media = self.modality in ("image", "audio")
        undecodable = functools.partial(self._undecodable, config) if media else None
        return sources.load(config, self.columns(config), undecodable)

    def _undecodable(self, config, data, base_dir) -> list[int]:
        """Rows whose file does not decode, or (audio) is shorter than the model's receptive field: each decoded
        once more, here (the cost of skipping them)."""
        from datasets import Image

        from effitrain.data import audio, image

        shortest, rate = 0, None
        if self.modality == "audio":
            source = loading.resolve_source(config.model, allow_pickle=True)
            shortest = self.shortest_input(self.source_config(source))
            rate = self.load_processor(source).sampling_rate if shortest else None

        def decodes(value) -> bool:
            try:
                if self.modality == "image":
                    image.load_image(value, base_dir)
                elif shortest:  # at the extractor's rate, as preprocessing decodes it
                    audio.decode(audio.located(value, base_dir), rate, config.max_duration, shortest)
                else:
                    audio.check(audio.located(value, base_dir), config.max_duration)
                return True
            except UserError:
                return False

        if isinstance(data.features[self.modality], Image):  # the stored bytes or path, not a decoded image
            data = data.cast_column(self.modality, Image(decode=False))
        return [i for i, value in enumerate(data[self.modality]) if not decodes(value)]

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
        # Its config only (the weights were resolved, and pickle allowed or refused, before the data loaded).
        model_config = self.source_config(loading.resolve_source(config.model, allow_pickle=True))
        return audio.preprocess(splits, processor, config.max_duration, base_dir, self.shortest_input(model_config))

    def shortest_input(self, model_config) -> int:
        """Audio: the fewest samples the model's convolutions make a frame of (shorter clips are refused)."""
        from effitrain.data import audio

        return audio.shortest_clip(model_config) if self.modality == "audio" else 0

    def collators(self, processor, config):
        """(training collator, evaluation collator)."""
        from effitrain.data import audio, image, text

        if self.is_text:
            padded = text.collator(processor, text.pad_multiple(config))
            if config is not None and config.packing:  # training rows packed; evaluation stays padded
                return packing.ClassificationPacker(processor.pad_token_id, config.max_length,
                                                    text.pad_multiple(config) or 1), padded
            return padded, padded
        if self.modality == "image":
            return image.collator(), image.collator()
        return audio.collator(processor), audio.collator(processor)

    # -- the loss, evaluation ----------------------------------------------------------------------
    @staticmethod
    def example_digests(batch) -> list[int]:
        """As every task's; a packed batch's examples hash as they would padded (their own tokens and label)."""
        if packing.is_packed(batch):
            return [digest(example) for example in packing.examples(batch)]
        return Task.example_digests(batch)

    @staticmethod
    def inputs(batch) -> dict:
        return {k: v for k, v in batch.items() if k not in ("labels", distillation.COLUMN)}

    def loss_sum(self, model, batch) -> torch.Tensor:
        logits = packed.logits(model, batch) if packing.is_packed(batch) else model(**self.inputs(batch)).logits
        if distillation.COLUMN in batch:  # the training batches of --distill-from
            return self.distillation.loss_sum(logits, batch)
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum", ignore_index=-100)

    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        logits = model(**self.inputs(batch)).logits.float()
        return logits.argmax(-1), batch["labels"], F.cross_entropy(logits, batch["labels"], reduction="none")

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        from effitrain.tasks.metrics import classification_metrics

        predictions, references, losses = outputs
        result = classification_metrics(predictions.numpy(), references.numpy(), label_names)
        result["loss"] = float(losses.mean())
        result["samples"] = int(len(references))
        return result

    def confusion_matrix(self, outputs: tuple, label_names: list[str] | None) -> dict | None:
        from effitrain.tasks.metrics import confusion_counts

        if not label_names:
            return None
        predictions, references, _ = outputs
        return {"labels": list(label_names),
                "counts": confusion_counts(predictions.numpy(), references.numpy(), len(label_names))}

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

    # -- prediction --------------------------------------------------------------------------------
    def prediction_inputs(self) -> str:
        if self.is_text:
            return ("--text \"...\" (repeatable; --text-pair \"...\" pairs them by position) or --input FILE.jsonl|csv "
                    "with a `text` (and optional `text_pair`) field")
        extensions = ", ".join(_media(self.modality)[0])
        return (f"--input: an {self.modality} file ({extensions}), a folder of them, or a JSONL/CSV file with a "
                f"{' or '.join(f'`{c}`' for c in _media(self.modality)[1])} column of paths")

    def prediction_records(self, given, where: str) -> list[dict]:
        from effitrain.data import inputs

        if not self.is_text:
            self.refuse_other_inputs(given, ("--input",), where)
            extensions, columns = _media(self.modality)
            return [{self.modality: path} for path in inputs.media_files(given.input_file, extensions, columns,
                                                                         self.modality)]
        self.refuse_other_inputs(given, ("--text", "--text-pair", "--input"), where)
        if given.text_pairs and len(given.text_pairs) != len(given.texts):
            raise UserError(f"{len(given.texts)} --text but {len(given.text_pairs)} --text-pair",
                            "give one --text-pair per --text (they pair by position)")
        pairs = given.text_pairs or [None] * len(given.texts)
        records = [_text_record(text, pair) for text, pair in zip(given.texts, pairs)]
        if given.input_file:
            fix = "pass a JSONL file with one {\"text\": ...} per line (or a CSV with a `text` column)"
            path = inputs.existing(given.input_file, fix)
            rows = inputs.read_table(path, fix)
            if any("prompt" in row for row in rows) and not any("text" in row for row in rows):
                raise UserError(f"--input {given.input_file} holds prompts (a `prompt` field), which causal LMs "
                                f"continue; the model in {where} is a {self.name} model",
                                f"pass {self.prediction_inputs()}")
            texts = inputs.string_field(path, rows, ("text",), fix)
            pairs = inputs.string_field(path, rows, ("text_pair",), fix, required=False)
            records += [_text_record(text, pair) for text, pair in zip(texts, pairs)]
        return records

    def prediction_encodings(self, records: list[dict], processor, options) -> list:
        """Texts: token ids, attention mask (and token types), cut at options.max_length as in training;
        texts with and without a pair are tokenised in one call each. Images, audio: the records."""
        if not self.is_text:
            return records
        encodings: list = [None] * len(records)
        for paired in (False, True):
            indices = [i for i, r in enumerate(records) if (r.get("text_pair") is not None) == paired]
            if not indices:
                continue
            pairs = [records[i]["text_pair"] for i in indices] if paired else None
            encoded = processor([records[i]["text"] for i in indices], pairs, truncation=True,
                                max_length=options.max_length)
            for j, i in enumerate(indices):
                encodings[i] = {key: values[j] for key, values in encoded.items()}
        return encodings

    def prediction_size(self, encoding) -> int:
        return len(encoding["input_ids"]) if self.is_text else 0

    def prediction_batch(self, encodings: list, processor, options) -> dict:
        """Texts padded to the longest of the batch (padding to a multiple of 8, as training does, would
        only add work here); images and audio processed as in training, by the evaluation collator."""
        if self.is_text:
            return dict(processor.pad(encodings, return_tensors="pt"))
        features = [dict(feature, labels=0) for feature in self._media_features(encodings, processor, options)]
        batch = self.collators(processor, None)[1](features)
        batch.pop("labels")
        return dict(batch)

    def _media_features(self, records: list[dict], processor, options) -> list[dict]:
        import numpy as np

        from effitrain.data import audio, image

        if self.modality == "image":
            pixels = processor(images=[image.load_image(r["image"], None) for r in records])["pixel_values"]
            return [{"pixel_values": np.asarray(p, dtype=np.float32)} for p in pixels]
        rate = processor.sampling_rate
        clips = [audio.decode(r["audio"], rate, options.max_duration, options.min_samples) for r in records]
        encoded = processor(clips, sampling_rate=rate)
        return [{key: encoded[key][i] for key in encoded} for i in range(len(records))]

    def predictions(self, model, batch: dict, processor, options) -> list[dict]:
        probs = model(**batch).logits.float().softmax(-1).cpu()
        scores, best = probs.max(-1)
        names = [model.config.id2label[i] for i in range(probs.shape[-1])]
        results = [{"label": names[int(i)], "score": round(float(s), 6)} for i, s in zip(best, scores)]
        if options.all_scores:
            for result, row in zip(results, probs.tolist()):
                result["scores"] = {name: round(p, 6) for name, p in zip(names, row)}
        return results


def _media(modality: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(file extensions, table columns) of --input for an image or audio model."""
    from effitrain.data import inputs

    return (inputs.IMAGES, ("path", "image")) if modality == "image" else (inputs.AUDIO, ("path", "audio"))


def _text_record(text: str, pair: str | None) -> dict:
    return {"text": text} if pair is None else {"text": text, "text_pair": pair}
