"""Completions sampled inside a training step (GRPO's rollouts): prompts x samples drawn in one batch with
the KV cache (each distinct prompt run once, its cache copied to its samples), at a temperature and top-p,
each row stopping at its first stop id or after max_new_tokens.

What a row draws depends only on its key (online RL passes (the prompt's index in the data, the sample's
index), with the step's seed: engine/step.py's step_generator) and the seed, never on the rows beside it: each row has its own random stream, a CPU
torch.Generator seeded from a hash of (seed, *key), of which new token t uses the t-th uniform u. The token
is drawn by inverse CDF: the temperature-scaled probabilities cut to the top-p nucleus (chosen in sorted
order), and the first token, in vocabulary order, whose cumulative probability exceeds u x the nucleus' mass
is taken (one uniform per token, drawn on the CPU whatever the device, rather than Gumbel
noise over the whole vocabulary per token). No draw is shared between rows and no row's draw depends on how many rows there
are (unlike torch.multinomial on a batch, which reads one stream in row order), so the completions are the
same alone, in any batch, in any order, on any process, and again after a resume, as far as the model's
logits for a row are (the test checks bitwise ids in fp32 on CPU; a kernel whose rounding changes with the
batch's shape can still move a u that falls within rounding of a boundary).

Each sampled token's log-prob is kept from the same forward, in fp32, as TRL 1.16 computes the generating
policy's log-probs (`_get_per_token_logps_and_entropies` with its fused head): log_softmax of the logits
divided by the temperature, before the top-p cut."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from effitrain.tasks.generation import left_padded


@dataclass
class Completions:
    """One row per (prompt, sample), in the order of the prompts given. `ids`: the new tokens, padded on
    the right with pad_id, as wide as the longest row; `mask`: 1 on each row's tokens, its stop token
    included; `stopped`: the row ended with a stop id (False: cut at max_new_tokens); `lengths`: tokens
    per row; `logps`: each token's fp32 log-prob under the sampling model (0 on padding), or None."""

    ids: torch.Tensor
    mask: torch.Tensor
    stopped: torch.Tensor
    lengths: torch.Tensor
    logps: torch.Tensor | None


def row_seed(seed: int, key: tuple[int, ...]) -> int:
    """A 63-bit seed from (seed, *key): a stable hash (Python's hash() changes between processes)."""
    text = ":".join(str(int(part)) for part in (seed, *key))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def uniforms(seed: int, keys: list[tuple[int, ...]], count: int) -> torch.Tensor:
    """(rows, count) fp64 uniforms in [0, 1): row r's are the first `count` draws of its own generator."""
    draws = [torch.rand(count, dtype=torch.float64, generator=torch.Generator().manual_seed(row_seed(seed, key)))
             for key in keys]
    return torch.stack(draws) if draws else torch.zeros((0, count), dtype=torch.float64)


def draw(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token drawn by inverse CDF over its top-p-cut probabilities in vocabulary order, with its
    uniform in `u` (rows,); and the token's log-prob at the temperature (fp32, before the cut). Row by row:
    nothing here mixes rows.

    Vocabulary order, not sorted order: a token then changes only when u falls within the change of a
    cumulative sum, which float noise in the weights (another process layout's sums after an update) moves by
    next to nothing; in sorted order two nearly equal probabilities that swap places move every u that falls on
    either of them (a random model's near-uniform distribution has thousands of such pairs)."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logps.exp()
    if top_p < 1:  # a token stays while the mass above it is under top_p: the first always does (HF's TopP)
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        inside = (ordered.cumsum(-1) - ordered) < top_p
        probs = probs * torch.zeros_like(inside).scatter(-1, order, inside)
    cumulative = probs.cumsum(-1)
    target = u.to(cumulative.device, cumulative.dtype)[:, None] * cumulative[:, -1:]
    # The first token whose cumulative sum exceeds the target (one of positive probability); rounding that puts
    # the target at the very top stays on the last such token.
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1, keepdim=True)
    tokens = torch.searchsorted(cumulative, target, right=True).clamp(max=last).squeeze(-1)
    return tokens, logps.gather(-1, tokens[:, None]).squeeze(-1)


def cache_keyword() -> str:
    """transformers 5.25 renamed `past_key_values` to `cache` (the old name warns until it goes): the name of a
    model's cache argument and output."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


_cache_keyword = cache_keyword  # its earlier name (tests/unit/test_rl_plan.py)


def sample(model, prompt_ids: list[list[int]], keys: list[tuple[int, ...]], *, max_new_tokens: int,
           temperature: float = 1.0, top_p: float = 1.0, stop_ids: list[int], pad_id: int, seed: int,
           with_logps: bool = True) -> Completions:
    """One completion per row of `prompt_ids` (repeat a prompt once per sample), row i drawn from the
    stream of (seed, *keys[i]). The model runs in evaluation mode (no dropout) under no_grad, and every
    module's training flag is put back after."""
    if not 0 < top_p <= 1 or temperature <= 0 or max_new_tokens < 1 or len(keys) != len(prompt_ids):
        raise ValueError(f"sample: top_p {top_p} in (0, 1], temperature {temperature} > 0, max_new_tokens "
                         f"{max_new_tokens} >= 1 and one key per prompt ({len(keys)} for {len(prompt_ids)})")
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)  # DDP's wrapper: no gradient hooks for forwards without backward
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            tokens, logps = _decode(model, prompt_ids, uniforms(seed, keys, max_new_tokens), max_new_tokens,
                                    temperature, top_p, stop_ids, pad_id)
    finally:
        for module, training in modes.items():
            module.training = training
    return _completions(tokens, logps if with_logps else None, stop_ids, pad_id)


def _decode(model, prompt_ids, u, max_new_tokens, temperature, top_p, stop_ids, pad_id):
    """The sampling loop: each distinct prompt once, left-padded (positions counted from each row's first
    token, so padding moves nothing), its cache then copied to each of its rows (G samples of a prompt
    share one prompt pass, as beam search shares a beam's); then one token per row per forward through
    the cache. Rows that stopped are fed padding until every row has stopped; `_completions` cuts them."""
    distinct = {tuple(prompt): None for prompt in prompt_ids}
    index = {prompt: i for i, prompt in enumerate(distinct)}
    batch = left_padded([list(prompt) for prompt in distinct], pad_id, next(model.parameters()).device)
    rows = torch.tensor([index[tuple(prompt)] for prompt in prompt_ids], device=batch["input_ids"].device)
    keyword = cache_keyword()
    out = model(**batch, position_ids=_positions(batch["attention_mask"]), use_cache=True, logits_to_keep=1)
    cache, logits = getattr(out, keyword), out.logits[:, -1].index_select(0, rows)
    cache.reorder_cache(rows)
    mask = batch["attention_mask"].index_select(0, rows)
    position = _positions(mask)[:, -1:]
    stops = torch.tensor(stop_ids, dtype=torch.long, device=mask.device)
    done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=mask.device)
    u, tokens, logps = u.to(mask.device), [], []  # drawn on the CPU, moved once
    for t in range(max_new_tokens):
        token, logp = draw(logits, u[:, t], temperature, top_p)
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        logps.append(logp)
        done = done | torch.isin(token, stops)
        if t + 1 == max_new_tokens or bool(done.all()):
            break
        mask, position = torch.cat([mask, mask.new_ones((len(mask), 1))], dim=1), position + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, use_cache=True,
                    logits_to_keep=1, **{keyword: cache})
        cache, logits = getattr(out, keyword), out.logits[:, -1]
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first token (left padding at 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _completions(tokens: torch.Tensor, logps: torch.Tensor | None, stop_ids: list[int], pad_id: int) -> Completions:
    """Each row cut after its first stop id: the mask, the lengths, and padding after the cut."""
    hits = torch.isin(tokens, torch.tensor(stop_ids, dtype=torch.long, device=tokens.device))
    stopped = hits.any(dim=1)
    first_stop = hits.int().argmax(dim=1)  # argmax returns the first maximum
    lengths = torch.where(stopped, first_stop + 1, tokens.shape[1])
    mask = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    ids = tokens.masked_fill(~mask, pad_id)
    logps = None if logps is None else logps.masked_fill(~mask, 0.0)
    return Completions(ids, mask.long(), stopped, lengths, logps)
