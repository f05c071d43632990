"""A run killed with SIGKILL and resumed with --resume auto ends with exactly the weights of the run
that was never stopped (fp32, CPU, fixed seed). The killed runs are processes of their own; the runs never
stopped and the resumed ones go through cli.main in the test process (a process without the killed run's
memory, as a new one; none of its own imports to pay)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_distributed import HOOKED_CLI

from conftest import read_jsonl, read_weights


@pytest.fixture(scope="module")
def dropout_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny BERT with dropout on, so that resuming must also restore the RNG."""
    path = tmp_path_factory.mktemp("tiny-dropout")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    (path / "config.json").write_text(json.dumps(config))
    return path


def train(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "effitrain", "train", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when(job: subprocess.Popen, ready, seconds: float = 120, poll: float = 0.05) -> None:
    """SIGKILL the job as soon as `ready()` holds (failing with its stderr if it ends first or takes too long)."""
    deadline = time.time() + seconds
    while not ready():
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(poll)
    job.send_signal(signal.SIGKILL)
    job.wait()


def finished(job: subprocess.Popen) -> str:
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    return stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that is never stopped, once per setting (kill points of the same setting share it)."""
    from effitrain.cli import main

    runs = {}

    def run(common: list):
        key = tuple(map(str, common))
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("straight")
            assert main(["train", *key, "--output-dir", str(runs[key])]) == 0
        return runs[key]
    return run


def resumed_here(cli_here, *args) -> str:
    """`effitrain train ARGS --resume auto` through cli.main in this process; its stdout."""
    result = cli_here("train", *args, "--resume", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("kill_after, accum", [(4, 1), (11, 1), (7, 2)])
def test_killed_then_resumed_equals_uninterrupted(dropout_model_dir, tmp_path, uninterrupted, kill_after, accum,
                                                  cli_here):
    common = ["--model", dropout_model_dir, "--max-train-samples", 40, "--max-eval-samples", 16,
              "--batch-size", 4 // accum, "--grad-accum", accum, "--epochs", 2, "--lr", 1e-3, "--log-every", 1,
              "--save-every", 3, "--seed", 7]
    straight_dir = uninterrupted(common)

    out = tmp_path / "killed"
    job = train(*common, "--output-dir", out)  # a process of its own, to be killed
    kill_when(job, lambda: any(r.get("step", 0) >= kill_after for r in read_log(out)))
    assert not (out / "metrics.json").exists()
    (out / "checkpoints" / ".tmp-step-99").mkdir(parents=True, exist_ok=True)  # as a kill during a save leaves it
    assert "resumed from" in resumed_here(cli_here, *common, "--output-dir", out)

    straight, resumed = read_weights(straight_dir), read_weights(out)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    steps = [r["step"] for r in read_jsonl(out / "log.jsonl") if "split" not in r and "skipped" not in r]
    assert steps == sorted(set(steps)) == list(range(1, 21))  # logs continue, no step twice
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-15", "step-18"]  # --keep-last 2
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 20
    # Counted over both invocations, up to the checkpoint: training time is part of the wall time.
    assert 0 < metrics["train_seconds"] <= metrics["wall_seconds"]
    phases = metrics["wall_seconds_by_phase"]  # both invocations' start-ups (commands) and set-ups
    assert phases["start_up"] > 0
    assert phases["total"] == pytest.approx(phases["start_up"] + metrics["wall_seconds"], abs=2e-3)
    # The resumed run read its data from the cache: its saved tokenizer is still the same, byte for byte.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "model" / name).read_bytes() == (straight_dir / "model" / name).read_bytes()


def read_log(out):
    path = out / "log.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return records


def test_resume_refuses_a_checkpoint_of_other_settings(dropout_model_dir, tmp_path, cli_here):
    """Both commands through cli.main in this process: nothing here needs a process of its own."""
    common = ["--model", dropout_model_dir, "--max-train-samples", 16, "--max-eval-samples", 8, "--batch-size", 4,
              "--max-steps", 4, "--save-every", 2, "--output-dir", tmp_path / "o"]
    first = cli_here("train", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "o" / "metrics.json").unlink()  # as if killed after its step-2 checkpoint
    before = (tmp_path / "o" / "config.yaml").read_text()
    result = cli_here("train", *common, "--resume", "auto", "--lr", "0.5")
    assert result.returncode == 2 and "was made with lr=0.0001" in result.stderr, result.stderr
    assert (tmp_path / "o" / "config.yaml").read_text() == before  # nothing written before the refusal


def test_a_checkpoint_whose_optimizer_state_is_not_its_recorded_optims_is_refused(dropout_model_dir, tmp_path,
                                                                                  cli_here):
    """optimizer.bin swapped for an SGD run's (one state a weight, not AdamW's two): one line, exit 2."""
    common = ["--model", dropout_model_dir, "--max-train-samples", 16, "--max-eval-samples", 8, "--batch-size", 4,
              "--max-steps", 4, "--save-every", 2]
    for name in ("adamw", "sgd"):
        done = cli_here("train", *common, "--optim", name, "--output-dir", tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "adamw" / "metrics.json").unlink()  # as if killed after its step-2 checkpoint
    checkpoint = tmp_path / "adamw" / "checkpoints" / "step-2"
    shutil.copy(tmp_path / "sgd" / "checkpoints" / "step-2" / "optimizer.bin", checkpoint / "optimizer.bin")
    result = cli_here("train", *common, "--optim", "adamw", "--output-dir", tmp_path / "adamw", "--resume", "auto")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"checkpoint {checkpoint} does not fit the model and --optim adamw" in lines[0] and "fix:" in lines[0]


def test_launch_restarts_a_killed_worker_and_resumes_bitwise(dropout_model_dir, tmp_path):
    """2 processes; one worker is killed once; --max-restarts 1 restarts both, they resume from the latest
    checkpoint, and the run ends with the weights of a 2-process run that was never stopped."""
    from test_distributed import children

    common = ["train", "--model", dropout_model_dir, "--max-train-samples", 48, "--max-eval-samples", 16,
              "--batch-size", 4, "--epochs", 2, "--lr", 1e-3, "--log-every", 1, "--save-every", 2, "--seed", 3,
              "--resume", "auto"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(out, *extra):
        return subprocess.Popen([sys.executable, "-m", "effitrain", "launch", "--nproc", "2", *extra, "--",
                                 *map(str, common), "--output-dir", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    finished(launch(tmp_path / "straight"))
    out = tmp_path / "restarted"
    # One restart is enough: the restarted workers join through keys of their own attempt
    # (devices.init_process_group), not a dead peer's address left in the launcher's store.
    job = launch(out, "--max-restarts", "1")
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 5 for r in read_log(out)):
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(children(job.pid)[1], signal.SIGKILL)
    assert "resumed from" in finished(job)  # the restarted workers continued from a checkpoint

    straight, restarted = read_weights(tmp_path / "straight"), read_weights(out)
    assert all(torch.equal(straight[name], restarted[name]) for name in straight)
    steps = [r["step"] for r in read_jsonl(out / "log.jsonl") if "split" not in r and "skipped" not in r]
    assert steps == list(range(1, 13))


def test_a_kill_during_a_save_keeps_the_last_good_checkpoint(dropout_model_dir, tmp_path, cli_here):
    common = ["--model", dropout_model_dir, "--max-train-samples", 40, "--max-eval-samples", 16, "--batch-size", 4,
              "--epochs", 1, "--lr", 1e-3, "--log-every", 1, "--save-every", 3, "--seed", 5]
    straight = cli_here("train", *common, "--output-dir", tmp_path / "straight")  # in this process
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "killed"
    job = subprocess.Popen([sys.executable, HOOKED_CLI, "--save-pause", "3", "--", "train", *map(str, common),
                            "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = out / "checkpoints" / ".tmp-step-6"
    kill_when(job, (partial / "trainer_state.json").exists)  # the second save is under way
    assert (out / "checkpoints" / "step-3" / "trainer_state.json").is_file()
    assert not (out / "checkpoints" / "step-6").exists()

    assert "resumed from" in resumed_here(cli_here, *common, "--output-dir", out)
    assert not partial.exists()
    straight, resumed = read_weights(tmp_path / "straight"), read_weights(out)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
