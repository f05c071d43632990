"""Text preprocessing with the model's AutoTokenizer, and batches padded to the longest example or packed."""

from __future__ import annotations

from effitrain.data import cache


def tokenize(splits, tokenizer, max_length: int, labels: bool = True):
    """input_ids/attention_mask per example, unpadded: padding happens per batch (dynamic padding).
    A `text_pair` column makes sentence pairs, truncated together (longest first), as in GLUE MRPC."""
    pairs = "text_pair" in splits["train"].column_names

    def encode(batch):
        return tokenizer(batch["text"], batch["text_pair"] if pairs else None, truncation=True,
                         max_length=max_length)

    removed = [c for c in splits["train"].column_names if c != "label"]
    key = [tokenizer.name_or_path, len(tokenizer), max_length, pairs, labels]
    encoded = cache.map_splits(splits, encode, key, batched=True, remove_columns=removed)
    return encoded.rename_column("label", "labels") if labels else encoded


def pad_multiple(config=None) -> int | None:
    """What batches round their padded length up to: 8 on accelerators (tensor cores take multiples of
    8) and with --compile (fewer shapes, fewer graphs); nothing on CPUs, whose matmuls gain nothing from
    it (the default model's step measured proportional to the length: 25, 27, 32 tokens -> 17.0, 17.9,
    18.0 ms a token) while length-grouped SMS batches carried ~10% more tokens rounded to 8."""
    from effitrain.devices import has_accelerator

    return 8 if getattr(config, "compile", False) or has_accelerator() else None


def collator(tokenizer, multiple: int | None = 8):
    """Pad each batch to its longest example, rounded up to a multiple of `multiple` (pad_multiple())."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)


def lm_collator(tokenizer, multiple: int | None = 8):
    """Causal LM, padded: labels are the inputs with padding set to -100 (the model shifts nothing:
    the loss shifts them)."""
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=multiple)


def packing_collator():
    """Causal LM, packed: the micro-batch's examples end to end in one row, no padding. Position ids
    restart at each example, which makes transformers build a block-diagonal causal mask (attention
    stays inside each example); the first label of each example is -100, so no token learns to
    predict the start of the next example."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)


def lengths(dataset) -> list[int] | None:
    """Example lengths for length grouping: tokens, or audio samples; None where all are one size."""
    for column in ("input_ids", "input_values"):
        if column in dataset.column_names and dataset.features[column].__class__.__name__ in ("List",
                                                                                               "Sequence",
                                                                                               "LargeList"):
            return [len(x) for x in dataset[column]]
    return None


class EpochSeeded:
    """A sampler whose order is a function of (seed, epoch) alone: resuming at epoch e replays exactly
    the order the uninterrupted run had. accelerate's prepared loader calls set_epoch each epoch."""

    def __init__(self, make, seed: int):
        import torch

        self.generator = torch.Generator()
        self.seed = seed
        self.sampler = make(self.generator)
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(self.seed + epoch)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def eval_order(dataset) -> list[int] | None:
    """Evaluation order: longest first (metrics do not depend on the order). Each batch then pads to
    lengths close to its own: a shuffled batch of 128 SMS pads every message to the longest of 128
    (80% padding); and the largest batch comes first, so a shortage of memory shows at once. None
    where all examples have one size."""
    sizes = lengths(dataset)
    return None if sizes is None else sorted(range(len(sizes)), key=lambda i: -sizes[i])


def train_sampler(dataset, step_batch_size: int, group_by_length: bool, seed: int):
    """A seeded shuffle, or transformers' length-grouped shuffle.

    Lengths are grouped by the global batch of one optimizer step (micro-batch x processes x
    accumulation), so the examples of each step are the same however that batch is split."""
    from torch.utils.data import RandomSampler

    sizes = lengths(dataset) if group_by_length else None
    if sizes is None:
        return EpochSeeded(lambda generator: RandomSampler(dataset, generator=generator), seed)
    return EpochSeeded(lambda generator: LengthGroupedSampler(step_batch_size, sizes, generator), seed)


class LengthGroupedSampler:
    """transformers.trainer_pt_utils.LengthGroupedSampler's order, index for index (tested against it):
    a seeded permutation cut into mega-batches of min(50, n // (4 x batch)) batches, each sorted longest
    first, the longest example of all moved to the front. Written here because importing
    trainer_pt_utils imports transformers' Trainer utilities, peft and bitsandbytes: ~1.1 s a run."""

    def __init__(self, batch_size: int, sizes: list[int], generator):
        self.batch_size, self.sizes, self.generator = batch_size, sizes, generator

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        import torch

        sizes, count = self.sizes, len(self.sizes)
        mega_batch = max(min(count // (self.batch_size * 4), 50), 1) * self.batch_size
        order = torch.randperm(count, generator=self.generator)
        groups = [sorted(order[i:i + mega_batch].tolist(), key=lambda j: sizes[j], reverse=True)
                  for i in range(0, count, mega_batch)]
        longest = int(torch.argmax(torch.tensor([sizes[group[0]] for group in groups])))  # the first of ties
        groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
        return iter([i for group in groups for i in group])
