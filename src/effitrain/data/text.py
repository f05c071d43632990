"""Text preprocessing with the model's AutoTokenizer, and batches padded to the longest example."""

from __future__ import annotations


def tokenize(splits, tokenizer, max_length: int):
    """input_ids/attention_mask per example, unpadded: padding happens per batch (dynamic padding)."""

    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    encoded = splits.map(encode, batched=True, remove_columns=["text"])
    return encoded.rename_column("label", "labels")


def collator(tokenizer):
    """Pad each batch to its longest example, rounded up to a multiple of 8 (tensor-core friendly shapes)."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)


def train_sampler(dataset, step_batch_size: int, group_by_length: bool, seed: int):
    """A seeded shuffle, or transformers' length-grouped shuffle.

    Lengths are grouped by the global batch of one optimizer step (micro-batch x processes x
    accumulation), so the examples of each step are the same however that batch is split."""
    import torch
    from torch.utils.data import RandomSampler
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(seed)
    if not group_by_length:
        return RandomSampler(dataset, generator=generator)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    return LengthGroupedSampler(step_batch_size, lengths=lengths, generator=generator)
