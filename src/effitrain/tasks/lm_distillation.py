"""Offline distillation of a causal LM from a teacher's top-k log-probs (--distill-from with --task causal-lm,
--distill-top-k K): at each position whose label counts (every token of text data, the answers of chat and
prompt-completion data), the loss is (1 - alpha) x cross-entropy + alpha x T^2 x KL over K + 1 buckets, the
teacher's K likeliest tokens and one for the rest of the mass (teacher: 1 - the sum of its K probabilities,
student: 1 - the sum of its probabilities at those K ids, both at temperature T), summed over the positions, so
that the step's normalisation (the causal LM's: its positions with a label) keeps accumulation and processes
exact.

The teacher runs once, before training, over the training split (evaluation mode, no gradients, in batches,
the rows shared by the processes); the K ids and log-probs of each counted position (positions x K, never the
vocabulary) are stored in the run folder with the fingerprint of the teacher, the rows, K and T
(tasks/teacher_outputs.py), and the teacher is freed. Each training row carries its positions' values as two
columns; the training collator lays them out per position beside the labels ([rows, width, K]), whatever the
padding or the packing, since every layout keeps each example's counted positions in their order."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from effitrain.errors import UserError
from effitrain.outputs.run_folder import TEACHER_TOP_K as FILE
from effitrain.tasks.distillation import Distillation
import effitrain.tasks.reference as reference
import effitrain.tasks.teacher_outputs as teacher_outputs

IDS, LOGPS = "teacher_top_k_ids", "teacher_top_k_logps"  # the columns, and the batch's keys ([rows, width, K])
COLUMNS = (IDS, LOGPS)
WHAT = "the teacher's stored top-k log-probs"  # how a refusal names the file


def loss_sum(student_logits: torch.Tensor, targets: torch.Tensor, teacher_ids: torch.Tensor,
             teacher_logps: torch.Tensor, alpha: float, temperature: float) -> torch.Tensor:
    """The loss summed over positions: `student_logits` [positions, vocabulary], `targets` [positions], the
    teacher's K ids and log-probs at temperature T [positions, K]. In fp32 (fp64 stays fp64)."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    logits, teacher = student_logits.to(dtype), teacher_logps.to(dtype)
    cross_entropy = torch.logsumexp(logits, -1) - logits.gather(-1, targets[:, None])[:, 0]
    scaled = logits / temperature
    student = scaled.gather(-1, teacher_ids.long()) - torch.logsumexp(scaled, -1, keepdim=True)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    tiny = torch.finfo(dtype).tiny  # the rest's mass rounds to <= 0 when K covers (nearly) all of it
    teacher_rest = (-torch.expm1(torch.logsumexp(teacher, -1))).clamp(min=0)
    student_rest = (-torch.expm1(torch.logsumexp(student, -1))).clamp(min=tiny)
    rest = teacher_rest * (teacher_rest.clamp(min=tiny).log() - student_rest.log())
    return ((1.0 - alpha) * cross_entropy + alpha * temperature ** 2 * (kl + rest)).sum()


def counted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[rows, width - 1]: which positions predict a token whose label counts (position t predicts t + 1)."""
    return labels[:, 1:] != -100


def row_counts(split) -> list[int]:
    """Per training row: its counted positions (text data: every token but the first)."""
    if "labels" in split.column_names:
        return [sum(1 for label in labels[1:] if label != -100) for labels in split["labels"]]
    return [max(len(ids) - 1, 0) for ids in split["input_ids"]]


def with_teacher_columns(collate, top_k: int):
    """The training collator, the rows' top-k values laid out per position beside the labels ([rows, width, K];
    0 where no label counts) after `collate` made the batch without them."""
    def collated(features: list[dict]) -> dict:
        batch = collate([{key: value for key, value in f.items() if key not in COLUMNS} for f in features])
        if IDS not in features[0]:
            return batch
        where = counted_targets(batch["labels"])
        for key, dtype in ((IDS, torch.long), (LOGPS, torch.float32)):
            values = torch.cat([torch.as_tensor(f[key], dtype=dtype).reshape(-1, top_k) for f in features])
            laid = torch.zeros((*batch["labels"].shape, top_k), dtype=dtype)
            laid[:, 1:][where] = values  # row-major: each example's positions in order, examples in order
            batch[key] = laid
        return batch

    return collated


@dataclass(frozen=True)
class LMDistillation(Distillation):
    """The run's settings for a causal LM (tasks.for_config makes it from --distill-from, -alpha, -temperature,
    -top-k)."""

    top_k: int = 20

    @classmethod
    def of(cls, config) -> LMDistillation:
        from effitrain.config import distill_temperature_of

        return cls(config.distill_from, config.distill_alpha, distill_temperature_of(config), config.allow_pickle,
                   config.distill_top_k)

    def describe(self) -> str:
        return f"{self.teacher} (its top {self.top_k} tokens per position, alpha {self.alpha:g}, T {self.temperature:g})"

    def check_teacher(self, task, model, processor) -> None:
        """The teacher is a causal LM reading the student's token ids and predicting over its vocabulary, and K
        fits in that vocabulary: checked once the student is built, before the run folder is claimed."""
        from effitrain.models import loading

        source = self.teacher_config(task)
        theirs = loading.load_text_tokenizer(source)
        if theirs.get_vocab() != processor.get_vocab():
            raise UserError(f"--distill-from {self.teacher} has another tokenizer vocabulary than the model trained "
                            f"({len(theirs)} vs {len(processor)} tokens): its top-k ids would be other tokens",
                            "pass a teacher with the student's tokenizer (its chat template's tokens included)")
        vocabulary = model.get_output_embeddings().weight.shape[0]
        outputs = max(task.source_config(source).vocab_size, len(theirs))  # its embeddings grow to its tokenizer
        if outputs != vocabulary:
            raise UserError(f"--distill-from {self.teacher} predicts over {outputs} tokens and the model trained "
                            f"over {vocabulary}", "pass a teacher with the student's vocabulary")
        if self.top_k > vocabulary:
            raise UserError(f"--distill-top-k {self.top_k} is above the vocabulary ({vocabulary} tokens)",
                            f"pass --distill-top-k at most {vocabulary} (e.g. 20)")

    def loss_sum(self, head, inputs: dict, batch) -> torch.Tensor:
        """The distillation loss of a training micro-batch, through the student's LM head (tasks/lm_head.py):
        logits made for the counted positions only (chunked head: from their hidden states)."""
        where = counted_targets(batch["labels"])
        held = head.held(head.run(inputs, use_cache=False).logits[:, :-1])[where]
        if head.chunked:
            weight, bias = head._weights()
            held = F.linear(held, weight, bias)
        return loss_sum(held, batch["labels"][:, 1:][where], batch[IDS][:, 1:][where], batch[LOGPS][:, 1:][where],
                        self.alpha, self.temperature)

    # -- the stored top-k ---------------------------------------------------------------------------
    def prepare(self, task, model, encoded, processor, collate, batch_size: int, out_dir: Path | None,
                autocast=None, resuming: bool = False):
        """The splits, the training split with the teacher's top-k per counted position as two columns: read
        back from the run folder on resume, else computed (the teacher loaded, run once, freed) and stored."""
        from datasets import DatasetDict

        source = self.teacher_config(task)
        train = encoded["train"]
        train = train.remove_columns([c for c in COLUMNS if c in train.column_names])
        counts = row_counts(train)
        fingerprint = teacher_outputs.fingerprint(self.teacher, train, f"top-k {self.top_k} temperature "
                                                  f"{self.temperature!r}")
        if resuming:
            stored = teacher_outputs.read(Path(out_dir or ".") / FILE, fingerprint,
                                          lambda stored: fits(stored, counts, self.top_k), WHAT)
        else:
            teacher = self.load_teacher(task, source, processor)
            try:
                with autocast() if autocast is not None else contextlib.nullcontext():
                    ids, logps = compute_top_k(teacher, train, collate, batch_size, self.top_k, self.temperature)
            finally:
                del teacher
                gc.collect()  # the teacher's weights go before the student's steps start
            stored = {"ids": ids, "logps": logps, "counts": torch.tensor(counts, dtype=torch.long)}
            teacher_outputs.write(out_dir, FILE, stored, fingerprint)
        ids, logps = (stored[key].split(counts) for key in ("ids", "logps"))
        train = train.add_column(IDS, [row.tolist() for row in ids]).add_column(LOGPS, [row.tolist() for row in logps])
        return DatasetDict({**encoded, "train": train})


def fits(stored: dict, counts: list[int], top_k: int) -> bool:
    """Whether stored tensors hold K values at each of this training split's counted positions."""
    shape = (sum(counts), top_k)
    return (set(stored) == {"ids", "logps", "counts"} and stored["counts"].tolist() == counts
            and tuple(stored["ids"].shape) == shape and tuple(stored["logps"].shape) == shape)


def top_k_of(teacher, batch, top_k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's K likeliest next tokens and their log-probs at temperature T, at each counted position of
    a padded batch, row-major: ([positions, K] ids, [positions, K] log-probs). The output layer is applied at
    the counted positions only, a chunk of them at a time (where compute_top_k could prepare it: a linear head),
    so the whole [rows, length, vocabulary] logits never exist (chat data counts a few answer tokens a row)."""
    from effitrain.speedups import chunked_lm_loss
    from effitrain.tasks.lm_head import LMHead

    inputs = {key: value for key, value in batch.items() if key != "labels"}
    head = LMHead(teacher)
    held = head.run(inputs, use_cache=False).logits[:, :-1][counted_targets(batch["labels"])]
    found = [torch.log_softmax(head.logits_of(chunk).float() / temperature, -1).topk(top_k, -1)
             for chunk in held.split(chunked_lm_loss.chunk_rows(teacher.config.vocab_size))]
    if not found:
        return torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k)
    return torch.cat([ids for _, ids in found]), torch.cat([logps for logps, _ in found])


def compute_top_k(teacher, split, collate, batch_size: int, top_k: int, temperature: float):
    """top_k_of over the split, in its order: ([positions, K] int32 ids, [positions, K] fp32 log-probs), one pass
    in evaluation mode without gradients, each process taking every W-th row (as reference.compute_shared)."""
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    world, rank = (dist.get_world_size(), dist.get_rank()) if shared else (1, 0)
    rows = range(rank, len(split), world)
    device = next(teacher.parameters()).device
    from effitrain.speedups import chunked_lm_loss

    chunked_lm_loss.apply(teacher)  # its forward gives the hidden states, top_k_of applies the head where it counts
    mine = []
    with reference.evaluating(teacher):
        for start in range(0, len(rows), batch_size):
            batch = collate([split[i] for i in rows[start:start + batch_size]])
            ids, logps = top_k_of(teacher, {key: value.to(device) for key, value in batch.items()}, top_k, temperature)
            counts = counted_targets(batch["labels"]).sum(1).tolist()
            mine += zip(ids.int().cpu().split(counts), logps.cpu().split(counts))
    parts: list = [mine]
    if shared:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    ordered = [parts[i % world][i // world] for i in range(len(split))]
    empty = (torch.zeros(0, top_k, dtype=torch.int32), torch.zeros(0, top_k))
    return tuple(torch.cat(values) for values in zip(empty, *ordered))
