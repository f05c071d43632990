"""Online RL end to end (issue 43): `train --rl grpo | rloo` on the built-in addition prompts with a tiny Llama
from a config. 2 processes x 2 prompts x accumulation 2 against one process with 8 prompts (the same
completions, as the reward function saw them, and the same weights within 1e-5 fp32; rewards scaled by each
group's std, and by the step's gathered over the processes: --scale-rewards batch), with a short last step
where one process runs the zero-weight stand-in; a run killed mid-way and resumed against one never stopped
(bitwise); a reward that fails mid-run stops it with one line and leaves the last checkpoint to resume from."""

import json
import os

import effitrain
import pytest
import torch
from test_distributed import torchrun
from test_resume import kill_when, train

from conftest import as_flags, read_jsonl, read_weights

TINY_LLAMA = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=64,max_position_embeddings=64")
# A reward with spread on a random model (the parity of the first token, plus the length), which records what
# it was given, one file per process: the completions each run drew.
REWARD = '''
import json, os
from pathlib import Path

def parity(prompts, completions, completion_ids, **kwargs):
    with open(Path(__file__).parent / f"seen-{os.getpid()}.jsonl", "a") as seen:
        for prompt, ids in zip(prompts, completion_ids):
            seen.write(json.dumps([prompt, ids]) + "\\n")
    return [float(ids[0] % 2) + len(ids) / 10 for ids in completion_ids]
'''


def reward_file(folder, text: str = REWARD) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text(text)
    return f"{folder / 'rewards.py'}:parity"


def seen(folder) -> list[str]:
    """Every [prompt, completion ids] the reward function was given, over the processes, sorted."""
    return sorted(line for path in folder.glob("seen-*.jsonl") for line in path.read_text().splitlines())


def settings(tmp_path, name: str, **more) -> dict:
    return {**dict(model=TINY_LLAMA, task="causal-lm", data="addition", rl="grpo", reward=reward_file(tmp_path / name),
                   num_generations=4, max_new_tokens=4, max_train_samples=18, max_eval_samples=8, epochs=1, lr=2e-3,
                   warmup_ratio=0.0, log_every=1, precision="fp32", eval_batch_size=4), **more}


def step_records(folder) -> list[dict]:
    return [r for r in read_jsonl(folder / "log.jsonl") if "split" not in r and "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("rl, loss_type, scale_rewards", [("grpo", "dapo", "group"), ("grpo", "grpo", "batch"),
                                                          ("rloo", None, "batch")])
def test_two_processes_and_accumulation_equal_one_big_batch(tmp_path, rl, loss_type, scale_rewards):
    """18 prompts: steps of 8, 8 and 2 (the last: one micro-batch of 2, so the second process runs the
    stand-in). The completions are keyed by (row, sample) under the step's seed: the same in both layouts.
    `--scale-rewards batch` divides by the std of the whole step's rewards, which the processes gather first."""
    extra = {"rl": rl, "scale_rewards": scale_rewards, **({"loss_type": loss_type} if loss_type else {})}
    ddp = settings(tmp_path, "ddp", **extra)
    result = torchrun(2, "train", *as_flags(ddp), "--batch-size", 2, "--grad-accum", 2,
                      "--output-dir", tmp_path / "ddp-run")
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train({**settings(tmp_path, "one", **extra), "batch_size": 8, "output_dir": str(tmp_path / "one-run")})
    assert seen(tmp_path / "ddp") == seen(tmp_path / "one")
    assert len(seen(tmp_path / "one")) == 18 * 4 + 2 * 8  # each prompt's 4 samples, then 8 + 8 greedy answers
    single, weights = read_weights(tmp_path / "one-run"), read_weights(tmp_path / "ddp-run")
    for name in single:
        torch.testing.assert_close(weights[name], single[name], rtol=1e-5, atol=1e-5)
    got, wanted = step_records(tmp_path / "ddp-run"), step_records(tmp_path / "one-run")
    assert len(got) == len(wanted) == 3
    for mine, theirs in zip(got, wanted):
        for key in ("loss", "reward", "reward_parity", "zero_spread_share", "completion_length", "truncated_share"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
        assert mine["reward_parity"] > 0 and mine["zero_spread_share"] < 1  # there is something to learn from


@pytest.mark.slow
def test_killed_after_step_3_and_resumed_equals_uninterrupted(tmp_path, cli_here):
    common = as_flags(settings(tmp_path, "rewards", max_steps=6, save_every=3, seed=3, batch_size=2))
    straight = cli_here("train", *common, "--output-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    job = train(*common, "--output-dir", out)
    kill_when(job, (out / "checkpoints" / "step-3" / "trainer_state.json").is_file, seconds=240)
    resumed = cli_here("train", *common, "--output-dir", out, "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    wanted, got = read_weights(tmp_path / "straight"), read_weights(out)
    assert all(torch.equal(wanted[name], got[name]) for name in wanted)
    assert [r["reward"] for r in step_records(out)][-3:] == [r["reward"] for r in step_records(tmp_path / "straight")][-3:]


FAILING = REWARD.replace("    return [", '''    calls = Path(__file__).parent / "calls"
    calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
    if int(calls.read_text()) >= 3:
        raise ValueError("the grader is down")
    return [''')


def test_a_reward_that_fails_mid_run_stops_it_with_one_line_and_the_checkpoint_resumes(tmp_path, cli_here):
    common = as_flags({**settings(tmp_path, "rewards", max_steps=4, save_every=2, batch_size=2),
                       "reward": reward_file(tmp_path / "rewards", FAILING)})
    failed = cli_here("train", *common, "--output-dir", tmp_path / "run")
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode == 2 and len(lines) == 1, failed.stderr[-3000:]
    assert "reward parity" in lines[0] and "raised ValueError: the grader is down on row" in lines[0] \
        and "fix:" in lines[0], lines[0]
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "trainer_state.json").is_file()
    reward_file(tmp_path / "rewards")  # fixed in place
    resumed = cli_here("train", *common, "--output-dir", tmp_path / "run", "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 4


# A reward with spread on a random model that records, in evaluation only (once `record` exists), the greedy
# completions it scores: the test computes the metrics from them by hand.
RECORDING = '''
import json
import os
from pathlib import Path

def parity(prompts, completions, completion_ids, answer, **kwargs):
    record = Path(__file__).parent / "record"
    if record.exists():
        with open(record, "a") as seen:
            for prompt, text, ids, truth in zip(prompts, completions, completion_ids, answer):
                seen.write(json.dumps([prompt, text, ids, truth]) + "\\n")
    return [float(ids[0] % 2) + len(ids) / 10 if ids else None for ids in completion_ids]
'''


def test_evaluate_with_rewards_gives_the_runs_test_metrics(tmp_path, cli_here):
    """`evaluate --reward ...` on a GRPO run's model/ and test split gives metrics.json's `test` values (the same
    names, the same numbers), and those are the means of what the rewards scored, computed here by hand."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(5)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    rewards = reward_file(tmp_path / "rewards", RECORDING)
    split = as_flags(dict(data=tmp_path / "sums.jsonl", test_split=0.25, max_eval_samples=7, eval_batch_size=3,
                          max_new_tokens=5, precision="fp32"))
    data = [*split, "--reward", f"{rewards},exact-match", "--reward-weights", "0.5", "2"]
    trained = cli_here("train", *as_flags(dict(model=TINY_LLAMA, task="causal-lm", rl="grpo", num_generations=2,
                                               max_steps=1, batch_size=2, output_dir=tmp_path / "run")), *data)
    assert trained.returncode == 0, trained.stderr[-3000:]
    wanted = json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]
    (tmp_path / "rewards" / "record").write_text("")  # from now on the reward records what it scores
    result = cli_here("evaluate", "--model", tmp_path / "run" / "model", *data, "--output", tmp_path / "m.json")
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout)
    assert got == json.loads((tmp_path / "m.json").read_text())
    assert set(got) == set(wanted) == {"loss", "reward", "reward_parity", "reward_exact-match", "exact_match",
                                       "completion_length", "end_of_turn_share", "samples"}
    for key in wanted:
        assert got[key] == pytest.approx(wanted[key], abs=1e-9), key
    seen = [json.loads(line) for line in (tmp_path / "rewards" / "record").read_text().splitlines()]
    assert len(seen) == got["samples"] == 7 and {prompt for prompt, *_ in seen} <= {row["prompt"] for row in rows}
    parity = [ids[0] % 2 + len(ids) / 10 if ids else None for _, _, ids, _ in seen]
    exact = [float(text.strip() == truth.strip()) for _, text, _, truth in seen]
    scored = [p for p in parity if p is not None]
    assert got["reward_parity"] == pytest.approx(sum(scored) / len(scored)) and got["reward_parity"] > 0
    assert got["exact_match"] == got["reward_exact-match"] == pytest.approx(sum(exact) / 7)
    assert got["reward"] == pytest.approx(sum(0.5 * (p or 0) + 2 * e for p, e in zip(parity, exact)) / 7)
    assert got["loss"] == -got["reward"]
    assert got["completion_length"] == pytest.approx(sum(len(ids) for _, _, ids, _ in seen) / 7)
    # The same prompts, three of the test split's answers now what the model answers (spaced: both sides are
    # stripped): exact match 3/7, with --rl and no --reward the default reward.
    answered = {prompt: f" {text} " for prompt, text, _, _ in seen[:3]}
    rows = [{**row, "answer": answered.get(row["prompt"], row["answer"])} for row in rows]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    again = cli_here("evaluate", "--model", tmp_path / "run" / "model", *split, "--rl", "rloo")
    assert again.returncode == 0, again.stderr[-3000:]
    same = {key: got[key] for key in ("completion_length", "end_of_turn_share", "samples")}
    assert json.loads(again.stdout) == {"loss": -3 / 7, "reward": 3 / 7, "reward_exact-match": 3 / 7,
                                        "exact_match": 3 / 7, **same}


# A reward file that notes each import of it (the process's id), as a file with side effects at import would.
NOTING = '''
import os
from pathlib import Path

with open(Path(__file__).parent / "imports", "a") as imports:
    imports.write(f"{os.getpid()}\\n")


def parity(completions, completion_ids, **kwargs):
    return [float(ids[0] % 2) if ids else None for ids in completion_ids]


def length(completions, completion_ids, **kwargs):
    return [len(ids) / 4 for ids in completion_ids]
'''


def test_a_reward_file_is_imported_once_per_command(tmp_path, cli_here):
    """Two functions of one file, a run that checks its settings, plans its memory, evaluates during training and
    on the test split, and saves: the file runs once; `evaluate` with it, once more."""
    rewards = reward_file(tmp_path / "rewards", NOTING)
    named = ["--reward", f"{rewards},{rewards.replace(':parity', ':length')}"]
    flags = as_flags(dict(model=TINY_LLAMA, task="causal-lm", data="addition", rl="grpo", num_generations=2,
                          max_new_tokens=2, max_train_samples=4, max_eval_samples=2, batch_size=2, max_steps=2,
                          eval_every=1, save_every=1, memory_budget="64GiB", precision="fp32"))
    trained = cli_here("train", *flags, *named, "--output-dir", tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    imports = tmp_path / "rewards" / "imports"
    assert imports.read_text().splitlines() == [str(os.getpid())]
    assert {"reward_parity", "reward_length"} <= set(step_records(tmp_path / "run")[-1])
    evaluated = cli_here("evaluate", "--model", tmp_path / "run" / "model", "--data", "addition",
                         "--max-eval-samples", "2", "--max-new-tokens", "2", *named)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert imports.read_text().splitlines() == [str(os.getpid())] * 2
