"""--compile: each transformer block compiled in place trains as the eager model does, and a run reports
the graphs and seconds compiling cost apart from its training time."""

import copy
import json

import pytest
import torch
from effitrain.engine import compilation
from effitrain.models import transforms

from conftest import tiny_bert


def batches(lengths, size: int = 4) -> list[dict]:
    """Padded batches of other lengths (padding in the first row), as the collator makes them."""
    generator = torch.Generator().manual_seed(1)
    made = []
    for length in lengths:
        mask = torch.ones(size, length, dtype=torch.long)
        mask[0, length // 2:] = 0
        made.append({"input_ids": torch.randint(1, 100, (size, length), generator=generator), "attention_mask": mask,
                     "labels": torch.randint(0, 2, (size,), generator=generator)})
    return made


def train_losses(model, steps: list[dict]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in steps:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_compiled_blocks_train_as_the_eager_model(checkpointing):
    eager = tiny_bert().train()
    if checkpointing:  # non-reentrant, as effitrain turns it on: the compiled blocks run inside the checkpoints
        eager.gradient_checkpointing_enable({"use_reentrant": False})
    compiled = copy.deepcopy(eager)
    assert transforms.compile_blocks(compiled) == 2
    steps = batches([16, 24, 16, 40])  # new lengths after the first: dynamic graphs, not one per length
    with compilation.no_silent_fallback():
        expected, got = train_losses(eager, steps), train_losses(compiled, steps)
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
        with torch.inference_mode():  # evaluation: the same logits through the compiled blocks
            eager.eval(), compiled.eval()
            batch = {k: v for k, v in steps[1].items() if k != "labels"}
            torch.testing.assert_close(compiled(**batch).logits, eager(**batch).logits, rtol=1e-5, atol=1e-5)


def test_a_model_without_blocks_is_refused():
    from effitrain.errors import UserError

    with pytest.raises(UserError, match="--compile compiles a model by its transformer blocks"):
        transforms.compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_compiled_run_reports_compile_time_apart_from_training_time(tiny_model_dir, tmp_path, cli_here):
    from conftest import read_jsonl

    out = tmp_path / "run"
    result = cli_here("train", "--model", tiny_model_dir, "--compile", "--max-steps", "4", "--log-every", "2",
                      "--max-train-samples", "64", "--max-eval-samples", "32", "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    compiled = metrics["compile"]
    assert compiled["blocks"] == 2 and compiled["graphs"] >= 1 and compiled["seconds"] > 0
    compiling_steps = [r for r in read_jsonl(out / "log.jsonl") if "compile_seconds" in r]
    assert compiling_steps and compiling_steps[0]["step"] == 1  # the first step compiles
    # Training time leaves compiling out: what the steps that compiled spent compiling is not in it.
    assert metrics["train_seconds"] < metrics["wall_seconds"] - sum(r["compile_seconds"] for r in compiling_steps)
    assert "compiled for" in result.stdout + result.stderr
    # Evaluation (validation, test) runs eagerly: no graph was compiled after the steps.
    assert compiled["graphs"] == compiling_steps[-1]["compile_graphs_so_far"]


def test_reaching_the_recompile_limit_stops_instead_of_running_eagerly(monkeypatch):
    from effitrain.errors import UserError

    monkeypatch.setattr(compilation, "RECOMPILE_LIMIT", 1)
    model = tiny_bert(num_hidden_layers=1).train()
    transforms.compile_blocks(model)
    batch = {k: v for k, v in batches([16])[0].items() if k != "labels"}
    with pytest.raises(UserError, match="would otherwise run uncompiled"), compilation.no_silent_fallback():
        model(**batch)
        model.eval()  # another mode: a second graph, over the limit of one
        model(**batch)
