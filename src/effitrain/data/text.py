"""Text preprocessing with the model's AutoTokenizer, and batches padded to the longest example or packed."""

from __future__ import annotations

from effitrain.data import cache


def tokenize(splits, tokenizer, max_length: int, labels: bool = True, end: int | None = None):
    """input_ids/attention_mask per example, unpadded: padding happens per batch (dynamic padding).
    A `text_pair` column makes sentence pairs, truncated together (longest first), as in GLUE MRPC.
    `end` (language modelling): the end-of-text token appended to every text that does not end with it and
    that --max-length did not cut (as TRL's SFTTrainer appends EOS), so that the model learns to stop."""
    pairs = "text_pair" in splits["train"].column_names

    def encode(batch):
        encoded = tokenizer(batch["text"], batch["text_pair"] if pairs else None, truncation=True,
                            max_length=max_length)
        if end is not None:
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"]):
                if len(ids) < max_length and (not ids or ids[-1] != end):
                    ids.append(end)
                    mask.append(1)
        return encoded

    removed = [c for c in splits["train"].column_names if c != "label"]
    key = [cache.tokenizer_key(tokenizer), max_length, pairs, labels] + ([end] if end is not None else [])
    encoded = cache.map_splits(splits, encode, key, batched=True, remove_columns=removed)
    return encoded.rename_column("label", "labels") if labels else encoded


def pad_multiple(config=None) -> int | None:
    """What batches round their padded length up to: 8 on accelerators (tensor cores take multiples of
    8) and with --compile (fewer shapes, fewer graphs); nothing on CPUs, whose matmuls gain nothing from
    it (the default model's step measured proportional to the length: 25, 27, 32 tokens -> 17.0, 17.9,
    18.0 ms a token) while length-grouped SMS batches carried ~10% more tokens rounded to 8."""
    from effitrain.config import compiles
    from effitrain.runtime.devices import has_accelerator

    return 8 if compiles(config) or has_accelerator() else None


def collator(tokenizer, multiple: int | None = 8):
    """Pad each batch to its longest example, rounded up to a multiple of `multiple` (pad_multiple())."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)


def lm_collator(tokenizer, multiple: int | None = 8):
    """Causal LM, padded: labels are the inputs, -100 on the padding positions (the loss shifts them).
    Padding is found by the attention mask, not by token: where the pad token is the EOS (GPT-2, Llama
    without one of their own), transformers' DataCollatorForLanguageModeling also hides every real EOS
    from the loss, so a padded run never learnt to end a text where a packed run of the same data did."""
    from transformers import DataCollatorWithPadding

    pad = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)

    def collate(features):
        batch = pad([{key: f[key] for key in ("input_ids", "attention_mask") if key in f} for f in features])
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    return collate


def packing_collator():
    """Causal LM, packed: the micro-batch's examples end to end in one row, no padding. Position ids
    restart at each example, which makes transformers build a block-diagonal causal mask (attention
    stays inside each example); the first label of each example is -100, so no token learns to
    predict the start of the next example."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)


def lengths(dataset) -> list[int] | None:
    """Example lengths for length grouping: tokens, or audio samples (a preference pair: its longer
    answer's sequence); None where all are one size."""
    if "chosen_input_ids" in dataset.column_names:
        return [max(len(a), len(b)) for a, b in zip(dataset["chosen_input_ids"], dataset["rejected_input_ids"])]
    for column in ("input_ids", "input_values"):
        if column in dataset.column_names and dataset.features[column].__class__.__name__ in ("List",
                                                                                               "Sequence",
                                                                                               "LargeList"):
            return [len(x) for x in dataset[column]]
    return None


# What one more forward costs on a CPU besides its tokens, in padded tokens. The default model's evaluation
# of the SMS splits (batch 128) measured fastest at 64 of 64 / 256 / 1024 / 4096, in fp32 and in bf16.
PIECE_COST = 64


def trimmed_pieces(batch: dict, cost: int = PIECE_COST):
    """An evaluation batch padded to its longest example, as pieces of rows each padded only to its own
    longest row: (pieces, order), where the pieces hold the batch's rows longest first and `order` gives
    their place in the batch (None: already in order). Per example the outputs are those of the whole
    batch (padding is masked out), for less work: even sorted longest first, the SMS splits' batches of
    128 carry 48% padding (a few long messages widen the first one), 5.5% in pieces. The batch comes
    back alone unless it is text (2-d input_ids and attention_mask, one entry per row in every tensor),
    and only padding on the right is trimmed (left padding's positions would move).

    Training batches stay whole: length-grouped ones carry little padding (the default job's first 60
    steps: 3% fewer tokens in pieces), and the extra forward-backward passes measured no faster."""
    import torch

    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == 2
            and mask.shape == ids.shape and len(ids) > 0):
        return [batch], None
    rows, width = ids.shape
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 and len(v) == rows for v in batch.values()):
        return [batch], None  # not one entry per row (packed rows' labels are per example)
    columns = torch.arange(1, width + 1, device=mask.device)
    extents = ((mask != 0) * columns).amax(1).clamp_(min=1)  # each row's last attended column, 1-based
    order = torch.argsort(extents, descending=True, stable=True)
    sorted_extents = extents[order].tolist()
    cuts = piece_cuts(sorted_extents, cost)
    if len(cuts) == 2 and sorted_extents[0] == width:
        return [batch], None
    in_order = bool((order == torch.arange(rows, device=order.device)).all())

    def piece(start: int, stop: int) -> dict:
        picked = slice(start, stop) if in_order else order[start:stop]
        out = {}
        for key, value in batch.items():
            value = value[picked]
            out[key] = value[:, : sorted_extents[start]] if value.dim() >= 2 and value.shape[1] == width else value
        return out

    return [piece(a, b) for a, b in zip(cuts, cuts[1:])], None if in_order else order


def piece_cuts(extents: list[int], cost: int) -> list[int]:
    """Where to cut rows sorted longest first so that the padded tokens plus `cost` per piece are least
    (dynamic programming over the cut before each row): [0, ..., len(extents)]."""
    import numpy as np

    widths = np.asarray(extents, dtype=np.float64)
    best, before = np.zeros(len(extents) + 1), np.zeros(len(extents) + 1, dtype=np.int64)
    for stop in range(1, len(extents) + 1):
        starts = np.arange(stop)
        totals = best[:stop] + widths[:stop] * (stop - starts) + cost  # the last piece: rows starts..stop-1
        before[stop] = int(totals.argmin())
        best[stop] = totals[before[stop]]
    cuts = [len(extents)]
    while cuts[-1] > 0:
        cuts.append(int(before[cuts[-1]]))
    return cuts[::-1]


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
