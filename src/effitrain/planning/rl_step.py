"""Peak memory per device of an online-RL step (GRPO, RLOO): the step generates, then updates, so its peak is
the larger of two phases on top of what both hold. Every term is what the code allocates, checked tensor by
tensor on effitrain's own runs (benchmarks/planner/rl_step_probe.py; the totals against the runs' resident
peaks: benchmarks/planner/rl_plan_runs.py, benchmarks/results/rl_plan_epyc2c_2026-12-06.md).

Held in both phases: weights (+ a frozen reference copy with --kl-beta and no --peft: `for_rl`), optimizer
states, DDP's gradient buckets, the allocator's overhead (planner.Planner.overhead); not the step's gradients,
which the step runner frees after each optimizer step (engine/step.py: zero_grad(set_to_none=True)).

- generation (tasks/sampling.py's `sample`, the model in eval, no gradients), `generation_bytes`, with
  R = prompts x G rows, P = prompt + max_new_tokens positions, V the vocabulary:
    kv_cache      = 2 x layers x kv_heads x head_dim x P x R bytes (keys, values at KV_BYTES[precision])
    cache_growth  = one layer's keys made anew by torch.cat (R x P x kv_heads x head_dim x 4) + the previous
                    token's logits (R x V x 4)
    sampler       = R x V x (4 + SAMPLER_BYTES_PER_LOGIT [+ TOP_P_BYTES_PER_LOGIT]): the logits and `draw`'s
                    temporaries at its peak
    weight_casts  = 2 x the trained matrices (half precisions: autocast's cached copies)
  total = kv_cache + max(cache_growth, sampler) + weight_casts.
- update: micro-batches of micro_batch x G rows of P positions; `Planner.estimate` simulates on fake tensors
  the --rl objective's own loss (tasks/online_rl.py's planned_loss_sum: the forward, completion_batches.py's
  token log-probs through tasks/lm_head.py, the policy-gradient arithmetic, the backward), as accelerate runs
  it: autocast inside the model's forward only, so the LM head (chunked: speedups/chunked_lm_loss.py's
  _LinearTokenLogProbs, max_new_tokens positions a row) runs in fp32; its backward makes each chunk's logits
  again and holds the previous chunk's gradient while it does: 3 chunks of c x V x 4 bytes live at its peak
  (c = chunk_rows(V), or fewer where the micro-batch has fewer completion positions). As completion_batches.py
  runs it: each prompt once for its G rows (its keys and values copied to each row through a DynamicCache, the
  completions run through that cache; the example batch says its groups, PLANNED_GROUP_ROWS), every row kept:
  the worst case, every group with a spread in its rewards (the update leaves out rows without a gradient,
  grpo.py's `_contributing`, which a run's first steps may not find; with a KL term in the loss it keeps them
  all). A change to that code (the head at other positions, a second forward dropped, padding trimmed)
  changes the simulation with it.

Not counted: the prompt pass's transient activations (one layer of prompts x prompt positions, under the
decode's cache whenever G x (prompt + new tokens) rows-positions outweigh them), the attention masks
(8 bytes a position a row), the reference's no-grad forward with --kl-beta (in the rollout, between the phases:
one micro-batch's forward and two chunks of logits, below the update's peak on the same micro-batch), the
step's micro-batches of ids and masks (R x P x 8 bytes a tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from effitrain.models import adapters
from effitrain.planning.planner import Estimate, Estimator, ModelShapes, Planner, Setting

# Bytes of a cached key and value per element, by the precision the generation's autocast runs in. Under a
# half precision the value projection's output is half, but the key leaves the rotary embedding in fp32
# (Llama, Mistral, Qwen compute cos/sin in the hidden states' fp32 and the half key is promoted by the
# product): measured on a tiny Llama (tests/unit/test_rl_plan.py).
KV_BYTES = {"fp32": (4, 4), "bf16": (4, 2), "fp16": (4, 2)}
# The logits the sampler reads are fp32 in every precision: fp32 runs make them so, and under a half precision
# accelerate's autocast wrapper makes the model's outputs fp32 (convert_outputs_to_fp32; measured: the bf16
# head's output is freed, its fp32 copy kept).
LOGIT_BYTES = 4
# The sampler's (tasks/sampling.py `draw`) bytes per vocabulary entry of a row beyond the logits themselves,
# at its peak: fp32 log-probs, their exp and the cumulative sum (4 each), the positive-probability mask and its
# flip (1 each) and that as int32 (4). Top-p < 1 peaks at its cut instead, beside the log-probs and their exp:
# the sorted probabilities (4), their int64 order (8), the cumulative sum and the mass above each token (4 each)
# and three bool masks (the cut, its zeros, scattered back): 13 more than the draw's own peak.
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 1 + 1 + 4
TOP_P_BYTES_PER_LOGIT = 13
HALF_BYTES = 2

@dataclass(frozen=True)
class AttentionShape:
    """What one cached position of one row costs per layer: kv_heads x head_dim keys and as many values."""

    layers: int
    kv_heads: int
    head_dim: int

    @staticmethod
    def of(config) -> "AttentionShape":
        """From a transformers config: num_key_value_heads (grouped-query attention; all heads when absent),
        head_dim when the config gives one, else hidden_size / num_attention_heads."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return AttentionShape(config.num_hidden_layers, kv_heads, head_dim)


def kv_cache_bytes(config, rows: int, positions: int, key_bytes: int = 4, value_bytes: int | None = None) -> int:
    """A DynamicCache of `rows` rows x `positions` positions: layers x kv_heads x head_dim keys and values per
    position per row (value_bytes: key_bytes when not given)."""
    shape = AttentionShape.of(config)
    per_element = key_bytes + (key_bytes if value_bytes is None else value_bytes)
    return shape.layers * shape.kv_heads * shape.head_dim * positions * rows * per_element


def sampled_logits_bytes(config, rows: int, logit_bytes: int = 4) -> int:
    """The logits the sampler reads: one position per row (logits_to_keep=1), the whole vocabulary."""
    return rows * config.vocab_size * logit_bytes


@dataclass
class Generation:
    """Bytes the generation phase adds to the weights and optimizer states (see the module's doc)."""

    kv_cache: int
    cache_growth: int  # a layer's keys made anew by torch.cat, and the previous token's logits
    sampler: int  # the logits and the sampler's temporaries at its peak
    weight_casts: int  # autocast's half copies of the trained weights (half precisions only)

    @property
    def total(self) -> int:
        return self.kv_cache + max(self.cache_growth, self.sampler) + self.weight_casts


def generation_bytes(shapes: ModelShapes, rows: int, positions: int, precision: str = "fp32",
                     top_p: float = 1.0) -> Generation:
    """The generation of `rows` sequences (prompts x G) of up to `positions` positions (the prompt's + the new
    tokens'), under `precision`'s autocast ("fp32": none)."""
    config = shapes.config
    key_bytes, value_bytes = KV_BYTES[precision]
    logit_bytes = LOGIT_BYTES
    attention = AttentionShape.of(config)
    one_layer = rows * positions * attention.kv_heads * attention.head_dim * max(key_bytes, value_bytes)
    per_logit = logit_bytes + SAMPLER_BYTES_PER_LOGIT + (TOP_P_BYTES_PER_LOGIT if top_p < 1 else 0)
    return Generation(kv_cache_bytes(config, rows, positions, key_bytes, value_bytes),
                      cache_growth=one_layer + sampled_logits_bytes(config, rows, logit_bytes),
                      sampler=sampled_logits_bytes(config, rows, per_logit),
                      weight_casts=0 if precision == "fp32" else HALF_BYTES * _cast_weights(shapes))


def _cast_weights(shapes: ModelShapes) -> int:
    """Elements autocast caches a half copy of: the trained (requires_grad) matrices that reach a linear
    layer; an untied input embedding is looked up, not multiplied, so it is left out. Frozen weights (LoRA's
    bases) are cast anew for each use, not cached."""
    matrices = sum(math.prod(s) for s, trained in shapes.param_shapes if trained and len(s) == 2)
    config, peft = shapes.config, shapes.peft
    if adapters.method(peft) is None and not getattr(config, "tie_word_embeddings", True):
        matrices -= config.vocab_size * config.hidden_size
    return matrices


def teacher_bytes(task_name: str, folder: str | None, allow_pickle: bool = False) -> int:
    """The bytes of a teacher's weights and buffers (--rl distill's, held on every device through the steps), from
    its folder's config built on the meta device, at the dtype transformers builds it in (fp32)."""
    from effitrain import tasks
    from effitrain.models import loading

    if folder is None:
        return 0
    task = tasks.get(task_name)
    model = task.build_on_meta(task.source_config(loading.resolve_source(folder, allow_pickle)))
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def for_rl(shapes: ModelShapes, generations: int, max_new_tokens: int, kl_beta: float = 0.0, rl: str = "grpo",
           temperature: float = 1.0, teacher: int | None = None) -> ModelShapes:
    """The update's shapes: G sequences per prompt (`--batch-size` counts prompts), each micro-step the --rl
    objective's own loss (tasks/online_rl.py on the planner's fake tensors: its LM head at the completions'
    positions, the policy-gradient arithmetic; --rl distill: the teacher's logits of the micro-batch's completion
    tokens x the vocabulary, made before the student's forward as the loss makes them); with kl_beta > 0 (KL to a
    reference) a frozen reference copy of the weights (and buffers), except with --peft, where the reference is
    the same weights with the adapters switched off. `teacher`: the bytes of a teacher held through the steps
    (teacher_bytes; None for an objective that learns from one: a teacher of the model's own size)."""
    from types import SimpleNamespace

    from effitrain.catalog import rl_names
    from effitrain.tasks import objectives, online_rl

    peft = shapes.peft
    copied = kl_beta > 0 and adapters.method(peft) is None
    reference = shapes.weight_bytes + shapes.buffer_bytes if copied else 0
    if rl_names.get(rl).teacher:  # never sharded, never trained: whole on every device, as a frozen reference
        reference += shapes.weight_bytes + shapes.buffer_bytes if teacher is None else teacher
    kind = objectives.RL_REGISTRY[rl]
    objective = kind(generations=generations, max_new_tokens=max_new_tokens, beta=kl_beta, temperature=temperature,
                     loss_type=kind.loss_of(SimpleNamespace(loss_type="dapo")))  # the loss's type: tiny tensors
    return replace(shapes, rows_per_example=generations, loss_positions=max_new_tokens, reference_bytes=reference,
                   step_task=online_rl.OnlineRL(shapes.task, objective))


@dataclass
class RlStepEstimate:
    """The step's two phases and its peak; `estimate`: the peak as a planner row (its activations the larger
    of the update's and what generation holds beyond the weights and states), for `format_table`."""

    update: Estimate
    generation: Generation
    generation_total: int  # the generation phase's peak: what it holds, weights and overhead included
    estimate: Estimate

    @property
    def total(self) -> int:
        return self.estimate.total

    @property
    def peak_phase(self) -> str:
        return self.estimate.peak_phase


def rl_step(planner: Planner, setting: Setting, prompts: int, prompt_len: int, max_new_tokens: int,
            top_p: float = 1.0) -> RlStepEstimate:
    """The peak of one RL step on one device: `planner` built on `for_rl`'s shapes with seq_len = prompt_len +
    max_new_tokens; `setting.micro_batch` prompts (x G sequences) per micro-batch; `prompts` this device's
    prompts per step (generated in one batch of prompts x G rows)."""
    shapes = planner.shapes
    update = planner.estimate(setting)
    weights, gradients, states = planner.model_states(setting.optimizer)
    buckets = gradients - planner.step_gradient_bytes()  # DDP's buckets stay; the step's gradients are freed
    generation = generation_bytes(shapes, prompts * shapes.rows_per_example, prompt_len + max_new_tokens,
                                  setting.precision, top_p)
    generation_total = weights + states + buckets + generation.total + update.overhead
    # As a planner row: weights, gradients, states and overhead as the update's; the rest is activations.
    activations = max(update.activations, generation_total - (weights + gradients + states + update.overhead))
    phase = "generation" if generation_total > update.total else "update"
    return RlStepEstimate(update, generation, generation_total,
                          replace(update, activations=activations, peak_phase=phase))


def estimator(planner: Planner, prompt_len: int, max_new_tokens: int, top_p: float = 1.0) -> Estimator:
    """The step's peak as `plan` and `train --memory-budget` ask for it per setting (planner.best_per_technique,
    planner.fit): the setting's micro_batch x accumulation are the device's prompts per step, all generated at
    once; `planner` built on `for_rl`'s shapes with seq_len = prompt_len + max_new_tokens."""
    def estimate(setting: Setting) -> Estimate:
        prompts = setting.micro_batch * setting.accumulation
        return rl_step(planner, setting, prompts, prompt_len, max_new_tokens, top_p).estimate

    return estimate
