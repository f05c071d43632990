"""Evaluation by generation, for prompt-completion and chat data: the model answers each evaluation
example's prompt (everything before its last answer) greedily, stopping at the end of turn; the answer
is scored by exact match of its text with the reference answer's, and by whether it stopped with an
end-of-turn token within max_new_tokens. Each process generates for its own examples; the scores are
per-example tensors, gathered like the other evaluation outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from effitrain.data import answers
from effitrain.data.prompt_batches import left_padded  # one padding for prediction, evaluation and RL prompts


@dataclass
class AnswerGeneration:
    """How one split's answers are generated: the tokenizer (its template installed), the ids that
    stop generation, and how many new tokens an answer may have."""

    tokenizer: object
    stop_ids: list[int]
    max_new_tokens: int


def for_split(tokenizer, split, max_new_tokens: int | None) -> AnswerGeneration:
    """`max_new_tokens` None: the split's longest reference answer, its end of turn included (what a
    right answer needs, so the setting cannot make one wrong; the same for any number of processes)."""
    if max_new_tokens is None:
        spans = [answers.last_answer(labels) for labels in split["labels"]]
        max_new_tokens = max([end - start for start, end in filter(None, spans)], default=1)
    return AnswerGeneration(tokenizer, answers.stop_ids(tokenizer), max_new_tokens)


def prompts_and_references(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt (the ids before its last answer) and reference answer (that answer's ids),
    padding left out."""
    prompts, references = [], []
    for ids, mask, labels in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                 batch["labels"].tolist()):
        size = sum(mask)  # padded on the right (answers.collator)
        start, end = answers.last_answer(labels[:size]) or (size, size)
        prompts.append(ids[:start])
        references.append(ids[start:end])
    return prompts, references


def generate(model, prompts: list[list[int]], setting: AnswerGeneration) -> list[list[int]]:
    """Greedy continuations of `prompts` (new tokens only, at most max_new_tokens, ending at the first
    stop id). A fresh generation config: a pretrained model's saved one (sampling, penalties) must not
    change what is measured. Where the weights are sharded (FSDP), every forward is a collective: the
    processes keep stepping together until all are done (synced_gpus)."""
    from accelerate.utils import extract_model_from_parallel
    from torch.distributed.tensor import DTensor
    from transformers import GenerationConfig

    model = extract_model_from_parallel(model)  # DDP's wrapper has no generate()
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    pad = setting.tokenizer.pad_token_id
    config = GenerationConfig(max_new_tokens=setting.max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=setting.stop_ids, pad_token_id=pad)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None:  # learnt positions (GPT-2) end there: a long prompt keeps its end
        room = max(1, positions - setting.max_new_tokens)
        prompts = [prompt[-room:] for prompt in prompts]
    batch = left_padded(prompts, pad, next(model.parameters()).device)
    out = model.generate(**batch, generation_config=config, synced_gpus=sharded and torch.distributed.is_initialized()
                         and torch.distributed.get_world_size() > 1)
    return [until_stop(row, setting.stop_ids) for row in out[:, batch["input_ids"].shape[1]:].tolist()]


def until_stop(ids: list[int], stop_ids: list[int]) -> list[int]:
    """The tokens through the first stop id (what follows it is the padding of rows done earlier)."""
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[:position + 1]
    return ids


def scores(generated: list[list[int]], references: list[list[int]],
           setting: AnswerGeneration) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: whether the answer's text (decoded without special tokens, stripped) equals the
    reference's, and whether the answer stopped with a stop id."""
    decode = setting.tokenizer.batch_decode
    texts = [text.strip() for text in decode(generated, skip_special_tokens=True)]
    wanted = [text.strip() for text in decode(references, skip_special_tokens=True)]
    exact = torch.tensor([a == b for a, b in zip(texts, wanted)])
    stopped = torch.tensor([bool(row) and row[-1] in setting.stop_ids for row in generated])
    return exact, stopped
