"""`effitrain plan --rl grpo`: its JSON rows are planning/rl_step.py's figures for the same settings (the step's
peak the larger of generation and update, and which one), in a fresh process as a user runs it."""

import json

from effitrain.planning import planner as plan
from effitrain.planning import rl_step

from conftest import run_cli

# 2 layers, 4 query heads sharing 2 key/value heads, a vocabulary large enough that sampling 8 x 8 rows at once
# outweighs updating one prompt's 8 rows.
TINY_LLAMA = ("llama:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=4000,max_position_embeddings=256")
PROMPTS, PROMPT_LEN, G, NEW_TOKENS, TOP_P = 8, 12, 8, 6, 0.9


def test_plan_rl_json_rows_are_rl_step_figures():
    result = run_cli("plan", "--task", "causal-lm", "--model", TINY_LLAMA, "--rl", "grpo", "--seq-len", PROMPT_LEN,
                     "--batch-size", PROMPTS, "--num-generations", G, "--max-new-tokens", NEW_TOKENS,
                     "--top-p", TOP_P, "--precision", "fp32", "--optim", "adamw", "--memory", "8GiB", "--all",
                     "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert (out["rl"], out["num_generations"], out["max_new_tokens"], out["top_p"]) == ("grpo", G, NEW_TOKENS, TOP_P)
    rows = [row for row in out["rows"] if not row["checkpointing"]]
    assert [row["micro_batch"] for row in rows] == [8, 4, 2, 1]  # --all: every split of the 8 prompts

    shapes = rl_step.for_rl(plan.model_shapes("causal-lm", TINY_LLAMA), G, NEW_TOKENS)
    planner = plan.Planner(shapes, PROMPT_LEN + NEW_TOKENS)
    for row in rows:
        setting = plan.Setting("fp32", "adamw", False, row["micro_batch"], row["accumulation"])
        assert row["micro_batch"] * row["accumulation"] == PROMPTS
        step = rl_step.rl_step(planner, setting, PROMPTS, PROMPT_LEN, NEW_TOKENS, TOP_P)
        expected = step.estimate.to_dict()
        # The overhead depends on the allocator serving the process (the CLI's may differ from pytest's): the
        # tensors' figures must be equal to the byte, and the peak the larger phase's.
        for key in ("weights", "gradients", "optimizer_states", "peak_phase"):
            assert row[key] == expected[key], (key, row, expected)
        held = step.generation_total - step.update.overhead  # generation's bytes beyond the overhead
        assert row["total"] - row["overhead"] == max(held, step.update.total - step.update.overhead)
    # All 8 prompts' 64 rows are generated at once whatever the split; updating 8 prompts' rows at once peaks
    # higher, one prompt's lower, and the update's peak falls with the micro-batch.
    phases = [row["peak_phase"] for row in rows]
    assert phases[0] == "update" and phases[-1] == "generation"
    assert phases == sorted(phases, key=lambda phase: phase == "generation")
