"""Distillation of a classifier from a teacher's logits computed offline (--distill-from): the loss is
(1 - alpha) x cross-entropy + alpha x T^2 x KL(softmax(teacher / T) || softmax(student / T)), summed per
example, so that the step's normalisation (engine/step.py: the step's sum over its labelled examples) keeps
accumulation and processes exact.

The teacher's logits are computed once, before training, in one pass over the training split (evaluation
mode, no gradients, in batches, the work shared by the processes), stored in the run folder with the
fingerprint of the teacher's folder and of the training split, and the teacher is freed: no teacher is in
memory during the steps. Each training example carries its logits as a column, so the collated batch holds
them beside its labels (whatever the order, the micro-batch or the packing). A resumed run reads the stored
file back; one deleted, altered, or made from another teacher or other data is refused."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from effitrain.errors import UserError
from effitrain.outputs.run_folder import TEACHER_LOGITS as FILE
import effitrain.tasks.reference as reference
import effitrain.tasks.teacher_outputs as teacher_outputs

COLUMN = "teacher_logits"  # the training split's column, and the batch's key: [examples, labels]
FINGERPRINT = teacher_outputs.FINGERPRINT


def loss_sum(student_logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor, alpha: float,
             temperature: float) -> torch.Tensor:
    """The distillation loss summed over the examples whose label is not -100 (each example's own term: the
    step divides by its labelled examples, as it does the cross-entropy)."""
    student = student_logits.float()
    cross_entropy = F.cross_entropy(student, labels, reduction="none", ignore_index=-100)
    teacher_log_probs = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student_log_probs = F.log_softmax(student / temperature, dim=-1)
    kl = (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)
    per_example = (1.0 - alpha) * cross_entropy + alpha * temperature ** 2 * kl
    return torch.where(labels != -100, per_example, per_example.new_zeros(())).sum()


@dataclass(frozen=True)
class Distillation:
    """The run's distillation settings (tasks.for_config makes it from --distill-from, -alpha, -temperature)."""

    teacher: str  # the teacher's folder
    alpha: float = 0.5
    temperature: float = 2.0
    allow_pickle: bool = False

    @classmethod
    def of(cls, config) -> Distillation:
        from effitrain.config import distill_temperature_of

        return cls(config.distill_from, config.distill_alpha, distill_temperature_of(config), config.allow_pickle)

    def describe(self) -> str:
        """The teacher and the loss's weights, as the run's first line names them."""
        return f"{self.teacher} (alpha {self.alpha:g}, T {self.temperature:g})"

    def loss_sum(self, student_logits, batch) -> torch.Tensor:
        return loss_sum(student_logits, batch["labels"], batch[COLUMN], self.alpha, self.temperature)

    # -- the teacher ------------------------------------------------------------------------------
    def teacher_config(self, task, labels: list[str] | None = None):
        """The teacher's source, refused when the folder is no saved model of `task` or its labels are not
        `labels` (the student's, from the data; None: not checked), in their order."""
        where = f"--distill-from {self.teacher}"
        source, config = teacher_outputs.teacher_source(
            self.teacher, self.allow_pickle, task, f"a {task.name} model",
            f"pass a {task.name} model folder (e.g. an effitrain run's model/ on this data)")
        theirs = [str(config.id2label[i]) for i in range(config.num_labels)]
        if labels is not None and theirs != list(labels):
            raise UserError(f"{where} predicts the labels {theirs}, and the data's are {list(labels)} (in this order)",
                            "pass a teacher trained on this data's labels")
        return source

    def check_teacher(self, task, labels: list[str], processor, student_config=None) -> None:
        """The teacher's labels are `labels`; a text teacher reads the student's token ids (its tokenizer's
        vocabulary is the student's), an image or audio teacher the student's inputs (its processor's settings
        and channels are the student's `processor`'s and `student_config`'s): checked once the student is built,
        before the run folder is claimed."""
        from effitrain.models import loading

        source = self.teacher_config(task, labels)
        if processor is None:
            return
        where = f"--distill-from {self.teacher}"
        if task.is_text:
            theirs = loading.load_text_tokenizer(source)
            if theirs.get_vocab() != processor.get_vocab():
                raise UserError(f"{where} has another tokenizer vocabulary than the model trained ({len(theirs)} vs "
                                f"{len(processor)} tokens): it would read other token ids",
                                "pass a teacher with the student's tokenizer")
            return
        # The teacher runs on the pixels or features the student's processor made: made otherwise (another size,
        # mean/std, sampling rate, feature extractor) they are not what the teacher was trained on, silently.
        channels = [getattr(c, "num_channels", 3) for c in (task.source_config(source), student_config)]
        if student_config is not None and channels[0] != channels[1]:
            raise UserError(f"{where} takes {channels[0]}-channel images, the model trained {channels[1]}",
                            "pass a teacher with the student's num_channels")
        differences = processor_differences(task.load_processor(source), processor)
        if differences:
            kind = "image processor" if task.modality == "image" else "feature extractor"
            raise UserError(f"{where} has another {kind} than the model trained ({'; '.join(differences)}: the "
                            "teacher's vs the student's): the teacher would read inputs made otherwise than it "
                            "was trained on", "pass a teacher trained with the student's preprocessing (the same "
                            "preprocessor_config.json settings), or a --model with the teacher's")

    def load_teacher(self, task, source, processor):
        """The teacher model, in evaluation mode."""
        model = task.build_model(source, None, processor)
        return model.eval().requires_grad_(False)

    # -- the stored logits ------------------------------------------------------------------------
    def prepare(self, task, model, encoded, processor, collate, batch_size: int, out_dir: Path | None,
                autocast=None, resuming: bool = False):
        """The splits, the training split with the teacher's logits as a column: read back from the run
        folder on resume, else computed (the teacher loaded, run once, freed) and stored."""
        from datasets import DatasetDict

        labels = [str(model.config.id2label[i]) for i in range(model.config.num_labels)]
        source = self.teacher_config(task, labels)
        train = encoded["train"]
        train = train.remove_columns([c for c in (COLUMN,) if c in train.column_names])
        fingerprint = self.fingerprint(train)
        logits = read(out_dir, fingerprint, len(train), len(labels)) if resuming else None
        if logits is None:
            teacher = self.load_teacher(task, source, processor)
            try:
                with autocast() if autocast is not None else contextlib.nullcontext():
                    logits = compute_logits(teacher, train, collate, batch_size,
                                            lambda m, batch: m(**task.inputs(batch)).logits.float(), len(labels))
            finally:
                del teacher
                gc.collect()  # the teacher's weights go before the student's steps start
            write(out_dir, logits.float(), fingerprint)
        return DatasetDict({**encoded, "train": train.add_column(COLUMN, logits.float().tolist())})

    def fingerprint(self, train) -> str:
        """sha256 over the teacher folder's files (names and bytes) and the training split's rows, in order."""
        return teacher_outputs.fingerprint(self.teacher, train)


# What a processor's to_dict holds that makes no input of its own: names, and what other settings derive
# (Whisper's mel filters and window come from its feature_size, sampling_rate and n_fft).
NOT_SETTINGS = ("processor_class", "_processor_class", "auto_map", "mel_filters", "window")


def processor_differences(theirs, ours) -> list[str]:
    """The settings (resize size, mean/std, rescaling, sampling rate, the processor's type...) on which two image
    processors or feature extractors differ, each as 'name theirs vs ours' (JSON spellings: a tuple and a list,
    an enum and its number, compare equal)."""
    import json

    def settings(processor) -> dict:
        spelled = json.dumps(processor.to_dict(), sort_keys=True, default=lambda o: o.tolist() if hasattr(
            o, "tolist") else str(o))
        return {k: v for k, v in json.loads(spelled).items() if k not in NOT_SETTINGS}

    mine, other = settings(ours), settings(theirs)
    return [f"{key} {json.dumps(other.get(key))} vs {json.dumps(mine.get(key))}"
            for key in sorted(set(mine) | set(other)) if mine.get(key) != other.get(key)]


def compute_logits(teacher, split, collate, batch_size: int, logits_of, labels: int) -> torch.Tensor:
    """The teacher's [examples, labels] logits over the split, in its order (reference.compute_shared: one
    pass in evaluation mode without gradients, each process taking every W-th example)."""
    return reference.compute_shared(teacher, split, collate, batch_size, logits_of, width=labels)


WHAT = "the teacher's stored logits"  # how a refusal names the file


def read(out_dir: Path | None, fingerprint: str, examples: int, labels: int) -> torch.Tensor:
    """The logits an earlier start of this run stored (a resume): refused when the file is gone, altered, or
    made from another teacher or other training data."""
    stored = teacher_outputs.read(Path(out_dir or ".") / FILE, fingerprint, lambda stored: set(stored) == {"logits"}
                                  and tuple(stored["logits"].shape) == (examples, labels), WHAT)
    return stored["logits"]


def write(out_dir: Path | None, logits: torch.Tensor, fingerprint: str) -> None:
    """Written whole by the main process; every process holds the same."""
    teacher_outputs.write(out_dir, FILE, {"logits": logits}, fingerprint)
