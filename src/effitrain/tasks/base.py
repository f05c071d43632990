"""What every task has in common: the Auto class, loading the processor and the model, and the loss
as a sum over items (so that the engine can normalise over a whole optimizer step)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from effitrain.errors import UserError
from effitrain.models import loading


class TrainLoss(NamedTuple):
    """What a training micro-batch gives the step runner: its loss summed over items, and the sums the
    step's log line shows beside the loss (train_metric_names' sums, then the count they are divided by;
    None for tasks without them). Returned with the loss, so that no state is kept between the two."""

    loss_sum: torch.Tensor
    sums: torch.Tensor | None = None


class Task:
    """One kind of task. Subclasses set `auto_class_name`, `is_text` and the data-dependent methods."""

    auto_class_name: str = ""
    is_text: bool = False  # tokenised text: tokens/s, a tokenizer, a vocabulary
    has_labels: bool = True  # a label column, a classification head sized for it
    supports_packing: bool = False
    chunked_loss: bool = False  # the loss multiplies the output layer itself (speedups/chunked_lm_loss.py)
    grows_vocabulary: bool = False  # a pretrained model's embeddings grow to its tokenizer's (a chat template's tokens)
    supports_chat: bool = False  # instruction and chat data: --chat-template, --loss-on
    supports_preference: bool = False  # preference pairs: --preference (tasks/preference.py)
    supports_distillation: bool = False  # a teacher's outputs beside the labels: --distill-from (tasks/distillation.py)
    distillation = None  # --distill-from: what with_distillation gave (tasks/distillation.py, lm_distillation.py)
    supports_rl: bool = False  # prompts to generate answers to, learnt from their rewards: --rl (tasks/online_rl.py)
    pipeline_tag: str = ""  # the Hub's name for the task (model cards)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<task {self.name}>"

    # -- models ------------------------------------------------------------------------------------
    @property
    def auto_class(self):
        import transformers

        return getattr(transformers, self.auto_class_name)

    def check_config(self, config) -> None:
        """Settings that make no sense for this task (checked before anything loads)."""
        if getattr(config, "rl", None) is not None and not self.supports_rl:
            raise UserError(f"--rl applies to --task causal-lm, not {self.name}", "drop --rl, or pass --task causal-lm")
        if getattr(config, "tokenizer", None) is not None and not self.is_text:
            raise UserError(f"--tokenizer applies to text tasks, and {self.name} reads no text", "drop --tokenizer")
        if config.packing and not self.supports_packing:
            raise UserError(f"--packing applies to text (--task sequence-classification or causal-lm), not {self.name}",
                            "drop --packing")
        if getattr(config, "distill_from", None) is not None and not self.supports_distillation:
            raise UserError(f"--distill-from applies to the classification tasks and causal-lm, not {self.name}",
                            "drop --distill-from, or pass --task sequence-classification (or image-, audio-, "
                            "causal-lm)")
        if getattr(config, "preference", None) is not None and not self.supports_preference:
            raise UserError(f"--preference applies to --task causal-lm, not {self.name}", "drop --preference")
        if not self.supports_chat:
            from effitrain.config import TrainConfig

            changed = next((flag for flag, name in (("--chat-template", "chat_template"), ("--loss-on", "loss_on"),
                                                        ("--max-new-tokens", "max_new_tokens"))
                            if getattr(config, name) != getattr(TrainConfig, name)), None)
            if changed:
                raise UserError(f"{changed} applies to --task causal-lm, not {self.name}", f"drop {changed}")

    def before_training(self, model, encoded, processor, config, out_dir, autocast=None, resuming=False):
        """What the task makes from the starting model before training (preference tuning: its reference);
        returns the preprocessed splits, with what it added. `autocast`: the run's autocast context (what
        the prepared model's forward runs under); `resuming`: a checkpoint of this run is resumed. By default,
        with --distill-from, the training split with the teacher's stored outputs (its `prepare`)."""
        if self.distillation is None:
            return encoded
        _, collate = self.collators(processor, config)
        return self.distillation.prepare(self, model, encoded, processor, collate, config.eval_batch_size, out_dir,
                                         autocast, resuming)

    def import_model_code(self, model_config) -> None:
        """Import the module of the class this task builds for `model_config` (transformers imports it
        lazily, on first use); nothing if the task has none for it (check_supported says so later)."""
        if self.supports(model_config):
            self.auto_class._model_mapping[type(model_config)]

    def supports(self, model_config) -> bool:
        return type(model_config) in self.auto_class._model_mapping

    def check_supported(self, model_config) -> None:
        """The task has a head for this model type, and the config builds one (sizes that fit together):
        checked on the meta device, so a wrong setting is one line before anything loads."""
        self.check_head(model_config)
        loading.check_sizes(model_config, f"model type `{model_config.model_type}`")
        self.build_on_meta(copy.deepcopy(model_config))

    def check_head(self, model_config) -> None:
        """Only whether the task has a head for this model type (cheap: before the processor loads, so that a
        model of another kind is named as such, not as a missing tokenizer)."""
        if not self.supports(model_config):
            raise UserError(f"model type `{model_config.model_type}` has no {self.name} head in transformers",
                            f"pass a model that {self.auto_class_name} supports, or another --task")
        if getattr(model_config, "is_encoder_decoder", False):
            # Its forward needs decoder inputs (and t5's classifier reads the hidden state at each example's
            # end-of-sequence token) that no task here builds: refused before anything loads or plans,
            # by `train`, `plan` and `inspect` alike, rather than a traceback at the first forward.
            raise UserError(f"model type `{model_config.model_type}` is an encoder-decoder model, which effitrain "
                            f"does not train ({self.name} takes encoder-only or decoder-only models)",
                            "pass an encoder (bert, roberta...) or a decoder (gpt2, llama...) model")

    @staticmethod
    def source_config(source: loading.ModelSource):
        return source.config if source.config is not None else loading.load_config(source.path)

    def build_on_meta(self, model_config):
        """The task's model from a config, without allocating weights (counts, inspect)."""
        from huggingface_hub.errors import StrictDataclassError

        try:
            with torch.device("meta"):
                return self.auto_class.from_config(model_config)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, RuntimeError,
                StrictDataclassError) as err:
            if isinstance(err, UserError):
                raise
            name = self.auto_class._model_mapping[type(model_config)].__name__
            raise UserError(f"model type `{model_config.model_type}` with these settings does not build a {name}: "
                            f"{loading.first_line(err)}", "change the model's settings (e.g. hidden_size a multiple "
                            "of num_attention_heads, sizes > 0)")

    def build_model(self, source: loading.ModelSource, labels: list[str] | None, processor,
                    load_options: dict | None = None):
        """Pretrained weights with a fresh head sized for `labels`, or random initialisation from a config.
        `load_options`: more for from_pretrained (QLoRA's quantization_config and device_map)."""
        if labels is not None and len(labels) < 2:  # evaluating on one class is fine; training on one is not
            raise UserError(f"every training label is `{labels[0]}` (one class): a classifier trained on it learns "
                            "a constant (and one output unit would make transformers treat it as regression)",
                            "add examples of at least one other class to the training data")
        auto = self.auto_class
        head = {} if labels is None else {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                                          "label2id": {label: i for i, label in enumerate(labels)}}
        config = copy.deepcopy(self.source_config(source))
        self.check_supported(config)
        if source.pretrained:
            with loading.loading(source.path):
                # A checkpoint fine-tuned on other labels keeps its body and gets a new head.
                # Safetensors whenever they exist; pickle only where resolve() let it through (--allow-pickle).
                # Mismatched shapes are reported, not raised: check_loaded decides what may differ.
                model, info = auto.from_pretrained(str(source.path), ignore_mismatched_sizes=True,
                                                   use_safetensors=loading.has_safetensors(source.path),
                                                   local_files_only=True, output_loading_info=True, **head,
                                                   **(load_options or {}))
            loading.check_loaded(model, info, source, new_head=bool(head))
        else:
            for key, value in head.items():
                setattr(config, key, value)
            self.adapt_config(config, processor)
            loading.check_fits_in_memory(auto, config, "the model built from its config")
            model = auto.from_config(config)
        self.adapt_model(model, processor)
        return model

    def adapt_config(self, config, processor) -> None:
        """A model built from a config: what it takes from the processor (text: the vocabulary)."""

    def adapt_model(self, model, processor) -> None:
        """After loading or building: what the task needs set on the model."""

    def check_built_model(self, model, encoded, processor, config) -> None:
        """The built model (before its transforms) on a few preprocessed examples, for what only running it
        shows; nothing by default."""

    # -- data --------------------------------------------------------------------------------------
    def columns(self, config) -> dict[str, str]:
        """The task's columns: canonical name -> the user's column name."""
        raise NotImplementedError

    def load_data(self, config):
        """The data of `config` with this task's columns: sources.Loaded (splits, base dir, skipped rows)."""
        from effitrain.data import sources

        self.check_lengths(config)
        return sources.load(config, self.columns(config))

    def drop_untrainable(self, encoded, config) -> tuple[object, int]:
        """(the preprocessed splits, how many examples were left out): examples that would train on nothing
        (a causal LM's answer cut away by --max-length) are refused, or dropped and counted with
        --skip-bad-rows. Every example of most tasks teaches something."""
        return encoded, 0

    def data_description(self, splits, config) -> str:
        """What the run's first line says about the data beyond its sizes (causal-lm: its format)."""
        return ""

    def check_lengths(self, config) -> None:
        """--max-length within the model's positions (read from --model's config; no weights loaded)."""
        if not self.is_text:
            return
        # adapter=True: evaluate reads an adapter folder's config.json here (train refused one earlier).
        source = loading.resolve_source(config.model, config.allow_pickle, adapter=True)
        loading.check_length(self.source_config(source), config.max_length, "--max-length")

    def shortest_input(self, model_config) -> int:
        """The fewest samples (audio) an input must hold for this model; 0: no minimum."""
        return 0

    def loss_positions(self, train) -> int | None:
        """The most positions with a loss in one row of the encoded training split, for the planner; None:
        every position (what the planner assumes without data)."""
        return None

    def sequence_length(self, config, processor) -> int:
        """The longest input a micro-batch can hold (the planner's sequence length)."""
        return config.max_length

    # -- the loss and its counts -------------------------------------------------------------------
    @staticmethod
    def inputs(batch) -> dict:
        return {k: v for k, v in batch.items() if k != "labels"}

    def item_count(self, batch) -> torch.Tensor:
        """The items the loss averages over (labelled examples, or predicted tokens)."""
        return (batch["labels"] != -100).sum()

    def example_count(self, batch) -> torch.Tensor:
        """Examples in a micro-batch, for samples/s."""
        return torch.tensor(len(batch["labels"]), device=batch["labels"].device)

    @staticmethod
    def example_digests(batch) -> list[int]:
        """A 48-bit hash of each example of a micro-batch (its inputs and label without padding), for
        --debug's per-step digest: the same example hashes the same whatever the micro-batch it is in."""
        mask = batch.get("attention_mask")
        examples = []
        for row in range(len(batch["labels"])):
            keep = None if mask is None else mask[row].bool()
            examples.append({key: value[row][keep] if keep is not None and value[row].shape[:1] == keep.shape
                             else value[row] for key, value in batch.items()})
        return [digest(example) for example in examples]

    def token_count(self, batch) -> torch.Tensor | None:
        """Real (non-pad) tokens of a text batch, for tokens/s; None for images and audio."""
        if not self.is_text:
            return None
        if "attention_mask" in batch:
            return batch["attention_mask"].sum()
        return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)  # packed: no padding

    def loss_sum(self, model, batch) -> torch.Tensor:
        """Sum (not mean) of the per-item losses of a micro-batch; labels are kept out of the model so
        that no model-side reduction decides the normalisation."""
        raise NotImplementedError

    def train_loss(self, model, batch) -> TrainLoss:
        """What the step runner calls on each training micro-batch: loss_sum and, for tasks that log sums of
        their own (preference tuning: the rewards and the pairs ranked right), those sums."""
        return TrainLoss(self.loss_sum(model, batch))

    def planned_loss_sum(self, model, batch, loss_positions: int | None) -> torch.Tensor:
        """loss_sum on the planner's fake tensors, which have no labels to select by: `loss_positions`, a
        causal LM's positions with a loss per row (answer-only data); None: every position."""
        return self.loss_sum(model, batch)

    # What a task's training loss computes on the way and the step's log line shows beside the loss:
    # train_loss returns, per micro-batch, one sum per name and last the count they are divided by; the
    # step sums them over its micro-batches and processes, as it does the loss.
    def train_metric_names(self) -> tuple[str, ...]:
        return ()

    def rollout(self, model, group: list, generator: torch.Generator) -> list:
        """The micro-batches an optimizer step trains on, from this process's `group` (called once per step
        by engine/step.py, with the step's RNG): the objective's, for tasks that hold one
        (tasks/objectives/objective.py); as they are for the others."""
        return group

    # -- evaluation --------------------------------------------------------------------------------
    def eval_setting(self, processor, config, split):
        """What eval_outputs needs for one preprocessed split beyond the model and the batch, made once per
        split (causal-lm on answers: how answers are generated); None for most tasks."""
        return None

    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        """Per-example tensors, so that gather_for_metrics can drop the duplicates of uneven shards.
        `setting`: this task's eval_setting for the split."""
        raise NotImplementedError

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        raise NotImplementedError

    def confusion_matrix(self, outputs: tuple, label_names: list[str] | None) -> dict | None:
        """{"labels": [...], "counts": [[...]]} (counts[true][predicted]) from the gathered eval outputs;
        None for tasks without one label per example."""
        return None

    # Metrics whose larger values are better; any other metric (loss, perplexity) is better smaller.
    higher_is_better: tuple[str, ...] = ()

    def is_higher_better(self, metric: str) -> bool:
        return metric in self.higher_is_better

    def metric_names(self, label_names: list[str] | None) -> list[str]:
        raise NotImplementedError

    def example_batch(self, model_config, batch_size: int, seq_len: int) -> dict:
        """Inputs of the shapes a training micro-batch has (values do not matter to memory)."""
        raise NotImplementedError

    def makes(self, model_config) -> bool:
        """Whether a saved model is this task's: its Auto class maps the config to the class that the
        config's `architectures` names."""
        mapping = self.auto_class._model_mapping
        if type(model_config) not in mapping:
            return False
        classes = mapping[type(model_config)]
        names = {c.__name__ for c in (classes if isinstance(classes, (list, tuple)) else [classes])}
        return bool(names & set(getattr(model_config, "architectures", None) or []))

    # -- prediction --------------------------------------------------------------------------------
    def prediction_inputs(self) -> str:
        """The inputs this task's models take, in words, for the refusal of others."""
        raise NotImplementedError

    def prediction_records(self, given: PredictInputs, where: str) -> list[dict]:
        """One JSON-able record per input, in input order: what the output line echoes and what
        prediction_encodings reads. Inputs of a kind the model does not take are refused."""
        raise NotImplementedError

    def refuse_other_inputs(self, given: PredictInputs, accepted: tuple[str, ...], where: str) -> None:
        other = [flag for flag in given.flags() if flag not in accepted]
        if other:
            raise UserError(f"{other[0]} does not fit the model in {where} ({self.name})",
                            f"pass {self.prediction_inputs()}")

    def prediction_encodings(self, records: list[dict], processor, options: PredictOptions) -> list:
        """What each record is before batching, in record order. Texts are tokenised here, all in one
        call (far cheaper than one call per text, and it gives the token counts to batch by); images
        and audio stay records, decoded batch by batch so that a large folder is never all in memory."""
        return records

    def prediction_size(self, encoding) -> int:
        """A cheap size of one input (an item of prediction_encodings), to batch inputs of similar
        sizes together: the less padding, the less computing."""
        return 0

    def prediction_batch(self, encodings: list, processor, options: PredictOptions) -> dict:
        """The model's input tensors for some items of prediction_encodings (decoded, processed, padded
        to the longest of them)."""
        raise NotImplementedError

    def predictions(self, model, batch: dict, processor, options: PredictOptions) -> list[dict]:
        """One JSON-able dict per example of the batch: what the model says about it."""
        raise NotImplementedError


def digest(example: dict) -> int:
    """A 48-bit hash of one example's tensors (keys in sorted order)."""
    import hashlib

    hashed = hashlib.blake2b(digest_size=6)
    for key in sorted(example):
        hashed.update(key.encode() + example[key].detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(hashed.digest(), "little")


@dataclass
class PredictInputs:
    """What `effitrain predict` was given; each task takes the kinds its models understand."""

    texts: list[str] = field(default_factory=list)
    text_pairs: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    input_file: str | None = None

    def flags(self) -> list[str]:
        given = (("--text", self.texts), ("--text-pair", self.text_pairs), ("--prompt", self.prompts),
                 ("--input", self.input_file))
        return [flag for flag, value in given if value]


@dataclass
class PredictOptions:
    max_length: int | None = None  # text: tokens kept per input (None: the tokenizer's model_max_length)
    max_duration: float = 10.0  # audio: seconds kept per clip
    min_samples: int = 0  # audio: shorter clips are refused (predict sets it from the model: task.shortest_input)
    max_new_tokens: int = 32  # causal LM: tokens generated per prompt
    temperature: float | None = None  # causal LM: sampling (instead of greedy) when this or top_p is set
    top_p: float | None = None
    all_scores: bool = False  # classification: every label's probability, not only the best one's
