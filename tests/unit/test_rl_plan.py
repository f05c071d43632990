"""The RL step's memory plan (planning/rl_step.py): the KV cache against a hand computation and against the
cache transformers really builds, the generation phase against the live bytes of a real `sample`, the peak as
the larger phase, and the reference copy only without --peft and with --kl-beta > 0."""

import contextlib
import dataclasses
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from effitrain.planning import planner as plan
from effitrain.planning import rl_step
from effitrain.tasks import sampling

# 2 layers, 4 query heads sharing 2 key/value heads of 16: 64 cached numbers a position a row per layer (K + V).
TINY_LLAMA = ("llama:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=500,max_position_embeddings=256")


def tiny_llama(spec: str = TINY_LLAMA):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(plan.model_config(spec, "causal-lm")).eval()


def test_kv_cache_bytes_by_hand():
    config = plan.model_config(TINY_LLAMA, "causal-lm")
    # layers 2 x kv_heads 2 x head_dim 64/4 x positions 5 x rows 3 x (key 4 + value 4 bytes)
    assert rl_step.kv_cache_bytes(config, rows=3, positions=5) == 2 * 2 * 16 * 5 * 3 * 8 == 7680
    assert rl_step.kv_cache_bytes(config, 3, 5, key_bytes=4, value_bytes=2) == 2 * 2 * 16 * 5 * 3 * 6
    config.head_dim = 32  # given by the config: wins over hidden_size / heads
    assert rl_step.kv_cache_bytes(config, 3, 5) == 2 * 2 * 32 * 5 * 3 * 8
    no_gqa = types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=None,
                                   hidden_size=32)  # no grouped-query attention: every head cached
    assert rl_step.kv_cache_bytes(no_gqa, rows=2, positions=7, key_bytes=2) == 3 * 4 * 8 * 7 * 2 * 4


def cache_bytes(cache) -> int:
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kv_cache_bytes_equal_the_dynamic_cache_transformers_builds(precision):
    """R rows, a prompt pass of 5 positions then 3 one-token steps through the cache (8 positions): the cache
    tensors' bytes equal the formula's, to the byte; under bf16 autocast the keys stay fp32 (the rotary
    embedding promotes them), the values are bf16."""
    model, rows, keyword = tiny_llama(), 3, sampling._cache_keyword()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    with torch.no_grad(), autocast:
        out = model(input_ids=torch.arange(1, 16).view(rows, 5), use_cache=True)
        for step in range(3):
            out = model(input_ids=torch.full((rows, 1), 7 + step), use_cache=True, **{keyword: getattr(out, keyword)})
    cache = getattr(out, keyword)
    assert cache.get_seq_length() == 8
    key_bytes, value_bytes = rl_step.KV_BYTES[precision]
    assert {layer.keys.element_size() for layer in cache.layers} == {key_bytes}
    assert {layer.values.element_size() for layer in cache.layers} == {value_bytes}
    assert cache_bytes(cache) == rl_step.kv_cache_bytes(model.config, rows, 8, key_bytes, value_bytes)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages created inside the mode and still alive (not the weights)."""

    def __init__(self, model):
        super().__init__()
        self.held = self.peak = 0
        self.sizes = WeakIdKeyDictionary()
        for tensor in [*model.parameters(), *model.buffers()]:  # views of the weights are not new memory
            self.sizes[tensor.untyped_storage()] = 0

    def _freed(self, size):
        self.held -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage() not in self.sizes:
                size = tensor.untyped_storage().nbytes()
                self.sizes[tensor.untyped_storage()] = size
                weakref.finalize(tensor.untyped_storage(), self._freed, size)
                self.held += size
        self.peak = max(self.peak, self.held)
        return out


@pytest.mark.parametrize("precision, top_p, prompt_len, new_tokens, vocab", [
    ("fp32", 1.0, 24, 8, 500),  # the cache and its growth dominate
    ("fp32", 0.9, 6, 6, 4000),  # the sampler's vocabulary-wide temporaries dominate, top-p's cut included
    ("bf16", 1.0, 24, 8, 500),  # fp32 keys, bf16 values, autocast's cached bf16 weights
])
def test_generation_phase_against_the_live_bytes_of_sample(precision, top_p, prompt_len, new_tokens, vocab):
    """`sample` on 3 prompts x G 4, no stop: the planned generation bytes are within -3% / +5% of the peak of
    the tensors it really holds (what is not counted: the one-token steps' activations, the masks)."""
    spec = TINY_LLAMA.replace("vocab_size=500", f"vocab_size={vocab}")
    model, prompts, generations = tiny_llama(spec), 3, 4
    ids = [[(11 * p + j) % (vocab - 2) + 2 for j in range(prompt_len)] for p in range(prompts)]
    rows = [prompt for prompt in ids for _ in range(generations)]
    keys = [(0, i // generations, i % generations) for i in range(len(rows))]
    live = LiveBytes(model)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    with autocast, live:
        out = sampling.sample(model, rows, keys, max_new_tokens=new_tokens, top_p=top_p, stop_ids=[-1], pad_id=0,
                              seed=0)
    assert out.ids.shape == (len(rows), new_tokens)
    planned = rl_step.generation_bytes(plan.model_shapes("causal-lm", spec), len(rows), prompt_len + new_tokens,
                                       precision, top_p)
    print(f"planned {planned.total:,} measured {live.peak:,}: {planned.total / live.peak - 1:+.2%}")
    assert -0.03 <= planned.total / live.peak - 1 <= 0.05, (planned, live.peak)


@pytest.fixture(scope="module")
def tiny_shapes():
    return plan.model_shapes("causal-lm", TINY_LLAMA)


def test_the_peak_is_the_larger_phase_over_what_both_hold(tiny_shapes):
    """Generation holds weights, states and its own bytes (no gradients: freed after each optimizer step);
    the update is the planner's micro-step of micro_batch x G rows; the step's peak is the larger of the two."""
    shapes = rl_step.for_rl(tiny_shapes, generations=8, max_new_tokens=64)
    planner = plan.Planner(shapes, 16 + 64)
    # 64 prompts x 8 = 512 rows of 80 positions generated, updated one prompt (8 rows) at a time: generation.
    gen_heavy = rl_step.rl_step(planner, plan.Setting("fp32", "adamw", False, 1, 64), 64, 16, 64)
    weights, gradients, states = planner.model_states("adamw")
    update = gen_heavy.update
    assert gen_heavy.generation_total == weights + states + gen_heavy.generation.total + update.overhead
    assert gen_heavy.peak_phase == "generation" and gen_heavy.total == gen_heavy.generation_total > update.total
    assert (gen_heavy.estimate.weights, gen_heavy.estimate.gradients) == (weights, gradients)
    # One prompt generated and updated at once: the update (all activations held for the backward) is larger.
    update_heavy = rl_step.rl_step(planner, plan.Setting("fp32", "adamw", False, 1, 1), 1, 16, 64)
    assert update_heavy.peak_phase == "update"
    assert update_heavy.total == update_heavy.update.total > update_heavy.generation_total
    assert dataclasses.replace(update_heavy.estimate, peak_phase=None) == update_heavy.update
    assert update_heavy.generation.kv_cache == rl_step.kv_cache_bytes(shapes.config, 8, 80)


def test_ddp_buckets_are_held_through_generation(tiny_shapes):
    """Two DDP processes: the gradient buckets (a second copy) persist between steps; the step's gradients do not."""
    shapes = rl_step.for_rl(tiny_shapes, 8, 64)
    setting = plan.Setting("fp32", "adamw", False, 1, 16)
    one = rl_step.rl_step(plan.Planner(shapes, 80), setting, 16, 16, 64)
    two = rl_step.rl_step(plan.Planner(shapes, 80, world_size=2), setting, 16, 16, 64)
    assert two.generation_total - one.generation_total == 4 * shapes.trainable


def test_update_shapes_and_the_reference_copy(tiny_shapes):
    """G rows per prompt, the loss on the new tokens only; a reference copy (weights and buffers) only with
    --kl-beta > 0 and without --peft (with --peft the reference is the adapters switched off)."""
    plain = rl_step.for_rl(tiny_shapes, generations=8, max_new_tokens=4)
    assert (plain.rows_per_example, plain.loss_positions, plain.reference_bytes) == (8, 4, 0)
    kl = rl_step.for_rl(tiny_shapes, 8, 4, kl_beta=0.04)
    assert kl.reference_bytes == tiny_shapes.weight_bytes + tiny_shapes.buffer_bytes > 0
    lora = plan.model_shapes("causal-lm", TINY_LLAMA, peft=plan.Peft("lora", lora_dropout=0.0))
    assert rl_step.for_rl(lora, 8, 4, kl_beta=0.04).reference_bytes == 0
    # The copy is held in both phases: the plan grows by exactly its bytes.
    setting = plan.Setting("fp32", "adamw", False, 2, 1)
    without, with_copy = (rl_step.rl_step(plan.Planner(shapes, 16), setting, 2, 12, 4) for shapes in (plain, kl))
    # (the KL's few tensors change glibc's churn-based overhead by bytes: compared without it)
    assert (with_copy.total - with_copy.estimate.overhead) - (without.total - without.estimate.overhead) == \
        kl.reference_bytes
    assert (with_copy.generation_total - with_copy.update.overhead) - \
        (without.generation_total - without.update.overhead) == kl.reference_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_update_simulation_against_the_live_bytes_of_the_objective_loss(precision):
    """One micro-batch of 2 prompts x G 4 (80 completion positions of a 3,000-token vocabulary: the LM head's
    chunks dominate) through the GRPO objective's real loss and backward, autocast inside the model's forward
    only as accelerate runs it, every row kept (the example batch: each group's rewards differ, so every
    advantage is non-zero) and each prompt run once for its 4 rows (completion_batches.shared_prompts): the
    planner's simulated peak of the same micro-step is at least the live bytes the real one holds, and over it
    by at most the weights (the simulation counts views of the weights its operators make, as it does for
    every task: planning/simulate.py's timeline); and within 1% of that timeline's own count on the real
    tensors, which the whole-row forward (the plan before the prompt pass was shared) is 7% over."""
    from torch.utils.flop_counter import flop_registry

    from effitrain.planning import simulate
    from effitrain.speedups import chunked_lm_loss
    from effitrain.tasks.objectives import completion_batches

    spec = TINY_LLAMA.replace("vocab_size=500", "vocab_size=3000")
    generations, new_tokens, prompt_len = 4, 10, 6
    shapes = rl_step.for_rl(plan.model_shapes("causal-lm", spec), generations, new_tokens)
    planner = plan.Planner(shapes, prompt_len + new_tokens)
    phases = planner.phases(precision, False, 2)
    simulated = max(phases.forward_held, phases.first_with_grads, phases.last_with_grads)

    model = tiny_llama(spec).train()
    assert chunked_lm_loss.apply(model)
    task = shapes.step_task
    batch = task.example_batch(model.config, 2 * generations, prompt_len + new_tokens)
    firsts, sizes = completion_batches.shared_prompts(batch, model)  # the real loss shares each prompt's pass
    assert (firsts.tolist(), sizes.tolist()) == ([0, 4], [4, 4])
    assert bool(task.objective._contributing(batch)["advantages"].ne(0).all())  # and keeps every row
    assert len(task.objective._contributing(batch)["advantages"]) == 2 * generations

    def micro_step(counter):
        model.zero_grad(set_to_none=True)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
        with counter, autocast:  # planned_loss_sum narrows autocast to the model's forward, as accelerate does
            (task.planned_loss_sum(model, batch, None) / 2).backward()

    live = LiveBytes(model)
    micro_step(live)
    timeline = simulate._Timeline(flop_registry)
    micro_step(timeline)
    counted = max(held + grads for held, grads in timeline.points)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"simulated {simulated:,} real {live.peak:,} (the timeline's count {counted:,}) weights {weights:,}")
    assert live.peak <= simulated <= live.peak + weights
    assert abs(simulated / counted - 1) <= 0.01

