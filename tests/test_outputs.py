"""The output folder's promises: --overwrite replaces only an effitrain run and only once the new run
has succeeded (the earlier one is put back when it fails, is signalled or killed), a lock keeps a
second run out, a user mistake leaves nothing behind, and a broken model is never reported as a success."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import read_jsonl
from test_bad_inputs import snapshot
from test_train import small

import effitrain
from effitrain import outputs
from effitrain.engine.step import StepResult, StepRunner
from effitrain.errors import UserError


@pytest.fixture()
def earlier_run(tiny_model_dir, tmp_path):
    """A finished run (1 step) and its files' hashes."""
    out = tmp_path / "out"
    effitrain.train(small(tiny_model_dir, out, max_steps=1))
    return out, snapshot(out)


def fail_at_step(monkeypatch, step: int, error: BaseException) -> None:
    real = StepRunner.run

    def run(self, group, at):
        if at == step:
            raise error
        return real(self, group, at)

    monkeypatch.setattr(StepRunner, "run", run)


def test_overwrite_never_empties_a_folder_that_is_not_a_run(tiny_model_dir, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("precious")
    (notes / "train.csv").write_text("text,label\nhi,ham\n")
    before = snapshot(notes)
    for overwrite, needle in ((False, "already holds files"), (True, "is not an effitrain run")):
        with pytest.raises(UserError, match=needle):
            effitrain.train(small(tiny_model_dir, notes, overwrite=overwrite, data=str(notes / "train.csv")))
    assert snapshot(notes) == before and sorted(p.name for p in notes.iterdir()) == ["ideas.txt", "train.csv"]


def test_overwrite_refuses_a_run_holding_foreign_files_or_the_runs_own_inputs(tiny_model_dir, earlier_run):
    out, before = earlier_run
    with pytest.raises(UserError, match="holds this run's own input"):  # its model/ would be deleted
        effitrain.train(small(tiny_model_dir, out, overwrite=True, model=str(out / "model")))
    assert snapshot(out) == before
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"holds files effitrain did not write \(notes.txt\)"):
        effitrain.train(small(tiny_model_dir, out, overwrite=True))
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / outputs.LOCK).exists()


def test_a_failed_overwrite_puts_the_earlier_run_back(tiny_model_dir, earlier_run, monkeypatch):
    out, before = earlier_run
    fail_at_step(monkeypatch, 2, RuntimeError("the new run crashed"))
    with pytest.raises(RuntimeError, match="crashed"):
        effitrain.train(small(tiny_model_dir, out, overwrite=True, max_steps=3))
    assert snapshot(out) == before
    monkeypatch.undo()
    metrics = effitrain.train(small(tiny_model_dir, out, overwrite=True, max_steps=2))
    assert metrics["steps"] == 2 and json.loads((out / "metrics.json").read_text())["steps"] == 2
    assert not (out / outputs.PREVIOUS).exists() and not (out / outputs.LOCK).exists()


def cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "effitrain", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_step(out, step: int, job: subprocess.Popen) -> None:
    deadline = time.time() + 120
    log = out / "log.jsonl"
    while not (log.exists() and any(r.get("step", 0) >= step for r in read_jsonl(log) if "loss" in r)):
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signalled_overwrite_puts_the_earlier_run_back(tiny_model_dir, earlier_run, sig):
    """SIGTERM unwinds the run and restores at once; after SIGKILL the next run into the folder does."""
    out, before = earlier_run
    job = cli("train", "--model", tiny_model_dir, "--max-train-samples", 64, "--max-eval-samples", 16,
              "--batch-size", 2, "--max-steps", 500, "--log-every", 1, "--output-dir", out, "--overwrite")
    wait_for_step(out, 2, job)
    job.send_signal(sig)
    _, stderr = job.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert job.returncode == 143 and stderr.strip().splitlines() == ["effitrain: stopped by SIGTERM"], stderr
        assert snapshot(out) == before
        return
    assert (out / outputs.PREVIOUS).is_dir()  # killed mid-replacement: the earlier run is set aside
    again = subprocess.run([sys.executable, "-m", "effitrain", "train", "--model", str(tiny_model_dir),
                            "--output-dir", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds an effitrain run" in again.stderr, again.stderr
    assert "put the earlier run back" in again.stdout
    assert snapshot(out) == before


def test_a_second_run_into_the_same_folder_is_refused_at_once(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    flags = ["train", "--model", tiny_model_dir, "--max-train-samples", 16, "--max-eval-samples", 8,
             "--batch-size", 4, "--max-steps", 2, "--output-dir", out]
    first, second = cli(*flags), cli(*flags)
    results = [(job.wait(timeout=300), job.communicate()[1]) for job in (first, second)]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(stderr for code, stderr in results if code == 2).strip().splitlines()
    # Whichever took the lock first trained; the other saw the lock, or the finished run.
    assert len(refused) == 1 and ("another effitrain run" in refused[0] or "already holds" in refused[0]), refused
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2


def test_a_live_lock_refuses_and_a_stale_one_is_taken_over(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (out / outputs.LOCK).write_text(json.dumps({"pid": sleeper.pid, "host": os.uname().nodename,
                                                    "started": "2026-12-03 09:00:00"}))
        with pytest.raises(UserError, match=f"another effitrain run \\(pid {sleeper.pid} on "):
            effitrain.train(small(tiny_model_dir, out, max_steps=1))
        assert (out / outputs.LOCK).exists()  # not ours to remove
    finally:
        sleeper.kill()
        sleeper.wait()
    assert effitrain.train(small(tiny_model_dir, out, max_steps=1))["steps"] == 1  # its process is gone
    assert not (out / outputs.LOCK).exists()


def test_a_user_mistake_during_the_run_leaves_nothing_behind(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "new" / "out"
    fail_at_step(monkeypatch, 1, UserError("a mistake found in the first step", "fix it"))
    with pytest.raises(UserError, match="first step"):
        effitrain.train(small(tiny_model_dir, out))
    assert not (tmp_path / "new").exists()  # the folders it created, gone: the corrected command is not refused


def skip_every_step(monkeypatch) -> None:
    def run(self, group, at):
        zeros = torch.zeros(2, dtype=torch.float64)
        return StepResult(False, None, zeros, zeros)

    monkeypatch.setattr(StepRunner, "run", run)


def test_a_run_whose_every_step_was_skipped_is_not_a_success(tiny_model_dir, tmp_path, monkeypatch):
    skip_every_step(monkeypatch)
    with pytest.raises(UserError, match="all 3 steps had a non-finite loss or gradient"):
        effitrain.train(small(tiny_model_dir, tmp_path / "out", max_steps=3))
    assert not (tmp_path / "out" / "model").exists()


def test_non_finite_weights_are_never_saved_as_a_model(tiny_model_dir, tmp_path, monkeypatch):
    real = StepRunner.run

    def run(self, group, at):
        result = real(self, group, at)
        with torch.no_grad():
            next(self.accelerator.unwrap_model(self.model).parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(StepRunner, "run", run)
    with pytest.raises(UserError, match="weights are not finite"):
        effitrain.train(small(tiny_model_dir, tmp_path / "out", max_steps=2))
    assert not (tmp_path / "out" / "model").exists()


def test_json_outputs_are_strict_and_name_what_was_not_finite(tmp_path):
    outputs.write_json(tmp_path / "m.json", {"test": {"loss": float("nan"), "accuracy": 0.5}, "x": [float("inf")]})
    written = json.loads((tmp_path / "m.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert written == {"test": {"loss": None, "accuracy": 0.5}, "x": [None], "non_finite": ["test.loss (nan)",
                                                                                              "x[0] (inf)"]}
    log = outputs.JsonlLog(tmp_path / "log.jsonl")
    log.write({"step": 1, "loss": float("-inf")})
    log.close()
    assert read_jsonl(tmp_path / "log.jsonl") == [{"step": 1, "loss": None, "non_finite": ["loss (-inf)"]}]


def test_resume_auto_on_a_finished_run_changes_nothing(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    metrics = effitrain.train(small(tiny_model_dir, out, max_steps=4, save_every=2))
    before = snapshot(out)
    assert effitrain.train(small(tiny_model_dir, out, max_steps=4, save_every=2, resume="auto")) == json.loads(
        (out / "metrics.json").read_text())
    assert "has already finished" in capsys.readouterr().out
    with pytest.raises(UserError, match="has finished, with max_steps=4"):
        effitrain.train(small(tiny_model_dir, out, max_steps=6, save_every=2, resume="auto"))
    assert snapshot(out) == before and metrics["steps"] == 4


def test_resume_refuses_another_number_of_steps(tiny_model_dir, tmp_path):
    """The learning rate of each step depends on the total: a changed --max-steps would make it jump."""
    out = tmp_path / "out"
    effitrain.train(small(tiny_model_dir, out, max_steps=4, save_every=2))
    (out / "metrics.json").unlink()  # as if killed after its checkpoint at step 2
    with pytest.raises(UserError, match="made with max_steps=4, this run has 8"):
        effitrain.train(small(tiny_model_dir, out, max_steps=8, save_every=2, resume="auto"))


def test_a_signal_during_a_save_leaves_no_half_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    from effitrain.engine import checkpoint
    from effitrain.errors import Terminated

    def signalled(path):
        raise Terminated()  # as SIGTERM arriving while the checkpoint's files are flushed

    monkeypatch.setattr(checkpoint, "_fsync_tree", signalled)
    out = tmp_path / "out"
    with pytest.raises(Terminated):
        effitrain.train(small(tiny_model_dir, out, max_steps=4, save_every=2))
    assert list((out / "checkpoints").iterdir()) == [] and not (out / outputs.LOCK).exists()
    assert (out / "config.yaml").exists()  # a signalled run is kept (not a user mistake), for --resume


def test_an_unreadable_lock_is_trusted_while_fresh_and_taken_over_once_old(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / outputs.LOCK).write_text("")  # its writer died between creating and filling it, or is writing now
    with pytest.raises(UserError, match="a lock being written now"):
        outputs.RunDir(out).acquire()
    old = time.time() - 60
    os.utime(out / outputs.LOCK, (old, old))
    held = outputs.RunDir(out).acquire()
    assert json.loads((out / outputs.LOCK).read_text())["pid"] == os.getpid()
    held.release(discard=True)
    assert not out.exists() or not any(out.iterdir())
