"""The output folder's promises: --overwrite replaces only an effitrain run and only once the new run
has succeeded (the earlier one is put back when it fails, is signalled or killed), a lock keeps a
second run out, a user mistake leaves nothing behind, and a broken model is never reported as a success."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import effitrain
import pytest
import torch
from effitrain.engine.step import StepResult, StepRunner
from effitrain.errors import UserError
from effitrain.outputs import files as outputs_files
from effitrain.outputs import run_folder, sinks
from test_bad_inputs import snapshot

from conftest import read_jsonl, tiny_run


@pytest.fixture(scope="module")
def one_step_run(tiny_model_dir, tmp_path_factory):
    """A finished run (1 step), trained once for the tests that each get a copy of it."""
    out = tmp_path_factory.mktemp("earlier") / "out"
    effitrain.train(tiny_run(tiny_model_dir, out, max_steps=1))
    return out


@pytest.fixture()
def earlier_run(one_step_run, tmp_path):
    """A finished run (1 step) of this test's own, and its files' hashes."""
    out = tmp_path / "out"
    shutil.copytree(one_step_run, out, symlinks=True)
    return out, snapshot(out)


class FailAtStep:
    """A callback that raises `error` as step `step` begins."""

    def __init__(self, step: int, error: BaseException):
        self.step, self.error = step, error

    def on_step_begin(self, state, group):
        if state.step + 1 == self.step:
            raise self.error


def test_overwrite_never_empties_a_folder_that_is_not_a_run(tiny_model_dir, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("precious")
    (notes / "train.csv").write_text("text,label\nhi,ham\n")
    before = snapshot(notes)
    for overwrite, needle in ((False, "already holds files"), (True, "is not an effitrain run")):
        with pytest.raises(UserError, match=needle):
            effitrain.train(tiny_run(tiny_model_dir, notes, overwrite=overwrite, data=str(notes / "train.csv")))
    assert snapshot(notes) == before and sorted(p.name for p in notes.iterdir()) == ["ideas.txt", "train.csv"]


def test_overwrite_refuses_a_run_holding_foreign_files_or_the_runs_own_inputs(tiny_model_dir, earlier_run):
    out, before = earlier_run
    with pytest.raises(UserError, match="holds this run's own input"):  # its model/ would be deleted
        effitrain.train(tiny_run(tiny_model_dir, out, overwrite=True, model=str(out / "model")))
    assert snapshot(out) == before
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"holds files effitrain did not write \(notes.txt\)"):
        effitrain.train(tiny_run(tiny_model_dir, out, overwrite=True))
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / run_folder.LOCK).exists()


def test_a_failed_overwrite_puts_the_earlier_run_back(tiny_model_dir, earlier_run, monkeypatch):
    out, before = earlier_run
    with pytest.raises(RuntimeError, match="crashed"):
        effitrain.train(tiny_run(tiny_model_dir, out, overwrite=True, max_steps=3),
                        callbacks=[FailAtStep(2, RuntimeError("the new run crashed"))])
    assert snapshot(out) == before
    metrics = effitrain.train(tiny_run(tiny_model_dir, out, overwrite=True, max_steps=2))
    assert metrics["steps"] == 2 and json.loads((out / "metrics.json").read_text())["steps"] == 2
    assert not (out / run_folder.PREVIOUS).exists() and not (out / run_folder.LOCK).exists()


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
def test_a_signalled_overwrite_puts_the_earlier_run_back(tiny_model_dir, earlier_run, sig, cli_here):
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
    assert (out / run_folder.PREVIOUS).is_dir()  # killed mid-replacement: the earlier run is set aside
    again = cli_here("train", "--model", tiny_model_dir, "--output-dir", out)  # the next run, in this process
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


def test_a_held_lock_refuses_and_a_dead_runs_lock_is_taken_over(tiny_model_dir, tmp_path):
    """The lock is an flock: held while its process lives, released by the kernel when it dies."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    lock = out / run_folder.LOCK
    lock.write_text(json.dumps({"pid": 4242, "host": "gpu-node-7", "started": "2026-12-03 09:00:00"}))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the other run's process holds it
        with pytest.raises(UserError, match=r"another effitrain run \(pid 4242 on gpu-node-7, since 2026-12-03"):
            effitrain.train(tiny_run(tiny_model_dir, out, max_steps=1))
        assert lock.exists()  # not ours to remove
    # The same file, no longer held (its process died): taken over, then removed at the end.
    assert effitrain.train(tiny_run(tiny_model_dir, out, max_steps=1))["steps"] == 1
    assert not lock.exists()


def test_a_lock_that_is_not_a_file_is_refused_and_a_race_has_one_winner(tmp_path):
    odd = tmp_path / "odd"
    (odd / run_folder.LOCK).mkdir(parents=True)
    with pytest.raises(UserError, match="the lock file .* cannot be opened"):
        run_folder.RunDir(odd).acquire()
    assert (odd / run_folder.LOCK).is_dir()
    first = run_folder.RunDir(tmp_path / "race").acquire()
    with pytest.raises(UserError, match="another effitrain run"):
        run_folder.RunDir(tmp_path / "race").acquire()
    first.release(discard=True)
    assert not (tmp_path / "race").exists()
    run_folder.RunDir(tmp_path / "race").acquire().release(discard=True)


def test_a_user_mistake_during_the_run_leaves_nothing_behind(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "new" / "out"
    with pytest.raises(UserError, match="first step"):
        effitrain.train(tiny_run(tiny_model_dir, out),
                        callbacks=[FailAtStep(1, UserError("a mistake found in the first step", "fix it"))])
    assert not (tmp_path / "new").exists()  # the folders it created, gone: the corrected command is not refused


def skip_every_step(monkeypatch) -> None:
    def run(self, group, at):
        zeros = torch.zeros(2, dtype=torch.float64)
        return StepResult(False, None, zeros, zeros)

    monkeypatch.setattr(StepRunner, "run", run)


def test_a_run_whose_every_step_was_skipped_is_not_a_success(tiny_model_dir, tmp_path, monkeypatch):
    skip_every_step(monkeypatch)
    with pytest.raises(UserError, match="all 3 steps had a non-finite loss or gradient"):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "out", max_steps=3))
    assert not (tmp_path / "out" / "model").exists()


def test_with_adapters_the_non_finite_message_names_their_settings(tiny_model_dir, tmp_path, monkeypatch):
    skip_every_step(monkeypatch)
    with pytest.raises(UserError, match=r"all 2 steps had a non-finite .* fix: lower --lr \(0.001 now\) or "
                                        r"--lora-alpha \(alpha/r = 16/8 scales the adapters' updates\)"):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "out", max_steps=2, peft="lora"))
    with pytest.raises(UserError, match=r"all 2 steps had a non-finite .* fix: lower --lr, use --precision fp32"):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "out2", max_steps=2))


def test_non_finite_weights_are_never_saved_as_a_model(tiny_model_dir, tmp_path, monkeypatch):
    real = StepRunner.run

    def run(self, group, at):
        result = real(self, group, at)
        with torch.no_grad():
            next(self.accelerator.unwrap_model(self.model).parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(StepRunner, "run", run)
    with pytest.raises(UserError, match="weights are not finite"):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "out", max_steps=2))
    assert not (tmp_path / "out" / "model").exists()


def test_json_outputs_are_strict_and_name_what_was_not_finite(tmp_path):
    outputs_files.write_json(tmp_path / "m.json", {"test": {"loss": float("nan"), "accuracy": 0.5}, "x": [float("inf")]})
    written = json.loads((tmp_path / "m.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert written == {"test": {"loss": None, "accuracy": 0.5}, "x": [None], "non_finite": ["test.loss (nan)",
                                                                                              "x[0] (inf)"]}
    log = sinks.JsonlLog(tmp_path / "log.jsonl")
    log.write({"step": 1, "loss": float("-inf")})
    log.close()
    assert read_jsonl(tmp_path / "log.jsonl") == [{"step": 1, "loss": None, "non_finite": ["loss (-inf)"]}]


def test_resume_auto_on_a_finished_run_changes_nothing(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    metrics = effitrain.train(tiny_run(tiny_model_dir, out, max_steps=4, save_every=2))
    before = snapshot(out)
    assert effitrain.train(tiny_run(tiny_model_dir, out, max_steps=4, save_every=2, resume="auto")) == json.loads(
        (out / "metrics.json").read_text())
    assert "has already finished" in capsys.readouterr().out
    with pytest.raises(UserError, match="has finished, with max_steps=4"):
        effitrain.train(tiny_run(tiny_model_dir, out, max_steps=6, save_every=2, resume="auto"))
    assert snapshot(out) == before and metrics["steps"] == 4


def test_resume_refuses_another_number_of_steps(tiny_model_dir, tmp_path):
    """The learning rate of each step depends on the total: a changed --max-steps would make it jump."""
    out = tmp_path / "out"
    effitrain.train(tiny_run(tiny_model_dir, out, max_steps=4, save_every=2))
    (out / "metrics.json").unlink()  # as if killed after its checkpoint at step 2
    with pytest.raises(UserError, match="made with max_steps=4, this run has 8"):
        effitrain.train(tiny_run(tiny_model_dir, out, max_steps=8, save_every=2, resume="auto"))


def test_a_signal_during_a_save_leaves_no_half_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    from effitrain.engine import checkpoint
    from effitrain.errors import Terminated

    def signalled(path):
        raise Terminated()  # as SIGTERM arriving while the checkpoint's files are flushed

    monkeypatch.setattr(checkpoint, "_fsync_tree", signalled)
    out = tmp_path / "out"
    with pytest.raises(Terminated):
        effitrain.train(tiny_run(tiny_model_dir, out, max_steps=4, save_every=2))
    assert list((out / "checkpoints").iterdir()) == [] and not (out / run_folder.LOCK).exists()
    assert (out / "config.yaml").exists()  # a signalled run is kept (not a user mistake), for --resume


class Killed(BaseException):
    """Stands for SIGKILL: the run stops where it is, and nothing of its own clean-up runs."""


def kill_at_step(monkeypatch, step: int) -> FailAtStep:
    """A callback that kills the run as step `step` begins."""

    def die(self, user_mistake):
        os.close(self.fd)  # what the kernel does for a dead process: the lock is free, nothing else changes
        self.fd = None

    monkeypatch.setattr(run_folder.RunDir, "fail", die)
    return FailAtStep(step, Killed())


def test_resume_auto_restarts_a_run_killed_before_its_first_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    killed = kill_at_step(monkeypatch, 2)
    with pytest.raises(Killed):
        effitrain.train(tiny_run(tiny_model_dir, out, save_every=3, resume="auto"), callbacks=[killed])
    assert (out / "log.jsonl").exists() and not (out / "checkpoints").exists()
    monkeypatch.undo()
    assert effitrain.train(tiny_run(tiny_model_dir, out, save_every=3, resume="auto"))["steps"] == 6  # the same command


def test_overwrite_with_resume_auto_continues_the_replacing_run_after_a_kill(tiny_model_dir, earlier_run,
                                                                             monkeypatch):
    """A restart loop (`launch --max-restarts`) with --overwrite --resume auto: the first start replaces the
    earlier run, the restarts continue the new one; the earlier run stays aside until it succeeds."""
    out, before = earlier_run
    killed = kill_at_step(monkeypatch, 4)
    settings = dict(overwrite=True, resume="auto", save_every=3, max_steps=6)
    with pytest.raises(Killed):
        effitrain.train(tiny_run(tiny_model_dir, out, **settings), callbacks=[killed])
    assert (out / run_folder.PREVIOUS / "metrics.json").exists() and (out / "checkpoints" / "step-3").is_dir()
    monkeypatch.undo()
    metrics = effitrain.train(tiny_run(tiny_model_dir, out, **settings))
    assert metrics["steps"] == 6 and not (out / run_folder.PREVIOUS).exists()
    # Continued from its step-3 checkpoint: the log goes on from there, no step twice.
    assert [r["step"] for r in read_jsonl(out / "log.jsonl") if "loss" in r and "split" not in r] == [2, 4, 6]


def test_a_checkpoint_of_another_folder_does_not_open_this_one(tiny_model_dir, earlier_run, tmp_path):
    """--resume PATH continues a checkpoint from elsewhere: the output folder is checked as for a new run."""
    out, before = earlier_run
    other = tmp_path / "other"
    effitrain.train(tiny_run(tiny_model_dir, other, max_steps=4, save_every=2))
    with pytest.raises(UserError, match="already holds an effitrain run"):
        effitrain.train(tiny_run(tiny_model_dir, out, max_steps=4, save_every=2,
                              resume=str(other / "checkpoints" / "step-2")))
    assert snapshot(out) == before


def test_config_yaml_does_not_carry_how_its_folder_was_treated(tiny_model_dir, earlier_run):
    out, _ = earlier_run
    effitrain.train(tiny_run(tiny_model_dir, out, max_steps=1, overwrite=True))
    written = (out / "config.yaml").read_text()
    assert "overwrite: false" in written and "resume: null" in written


def fake_run(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / run_folder.MARKER).write_text('{"kind": "train"}')
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_what_counts_as_written_by_effitrain(tmp_path):
    run = fake_run(tmp_path / "run", **{"metrics.json": "{}", ".tmp-mynotes": "mine"})
    (run / "model").mkdir()
    fake_run(run / "sub", **{"thesis.txt": "mine"})  # a folder with a marker, and the user's file in it
    (run / "link").symlink_to(tmp_path)
    assert run_folder.foreign_entries(run) == [".tmp-mynotes", "link", "sub/thesis.txt"]
    with pytest.raises(UserError, match="holds files effitrain did not write"):
        run_folder.RunDir(run, overwrite=True).acquire()
    assert (run / "sub" / "thesis.txt").exists() and not (run / run_folder.LOCK).exists()


def test_a_leftover_previous_folder_never_costs_the_run_in_place(tmp_path):
    finished_ = fake_run(tmp_path / "a", **{"metrics.json": "{}", "config.yaml": "x: 1\n"})
    (finished_ / "model").mkdir()
    (finished_ / run_folder.PREVIOUS / "checkpoints").mkdir(parents=True)  # killed while deleting the replaced run
    with pytest.raises(UserError, match="already holds an effitrain run"):
        run_folder.RunDir(finished_).acquire()
    assert (finished_ / "metrics.json").exists() and (finished_ / "model").is_dir()
    assert not (finished_ / run_folder.PREVIOUS).exists()
    linked = fake_run(tmp_path / "b", **{"config.yaml": "x: 1\n"})
    notes = tmp_path / "notes"
    fake_run(notes, **{"notes.txt": "mine"})
    (linked / run_folder.PREVIOUS).symlink_to(notes)
    with pytest.raises(UserError, match="is not a folder effitrain wrote"):
        run_folder.RunDir(linked, overwrite=True).acquire()
    assert (notes / "notes.txt").read_text() == "mine" and (linked / "config.yaml").exists()


def test_too_many_bad_steps_keep_the_log_and_best_but_write_no_model(tiny_model_dir, tmp_path, monkeypatch):
    real = StepRunner.run

    def run(self, group, at):
        if at <= 2:
            return real(self, group, at)
        zeros = torch.zeros(2, dtype=torch.float64)
        return StepResult(False, None, zeros, zeros)

    monkeypatch.setattr(StepRunner, "run", run)
    out = tmp_path / "out"
    with pytest.raises(UserError, match="2 steps in a row had a non-finite loss or gradient .* no model was saved"):
        effitrain.train(tiny_run(tiny_model_dir, out, max_bad_steps=2, eval_every=2, metric_for_best="accuracy"))
    assert (out / "best").is_dir() and (out / "log.jsonl").exists() and not (out / "model").exists()


def test_a_rank_without_a_world_is_the_main_process(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_folder.is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not run_folder.is_main_process()


def test_a_full_disk_during_the_save_is_one_line_and_leaves_no_half_model(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    import errno

    from effitrain import cli
    from effitrain.engine import saving

    def full(run, folder):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "tokenizer.json"))

    monkeypatch.setattr(saving, "save_processor", full)
    out = tmp_path / "out"
    code = cli.main(["train", "--model", str(tiny_model_dir), "--max-train-samples", "16", "--max-eval-samples",
                     "8", "--batch-size", "8", "--max-steps", "2", "--save-every", "1", "--output-dir", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "No space left on device writing" in lines[0] and "fix:" in lines[0]
    assert not (out / "model").exists() and not (out / ".tmp-model").exists()
    assert (out / "checkpoints" / "step-1").is_dir()  # what was saved before stays, for --resume auto


def on_a_small_disk(folder, size: str, *command) -> subprocess.CompletedProcess:
    """`command` run with `folder` a tmpfs of `size` in a mount namespace of its own (gone with it): a real
    file system that fills up, as root on this project's machines."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root (unshare --mount) to mount a small file system")
    folder.mkdir(exist_ok=True)
    mount = 'mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(folder), size,
                           *map(str, command)], capture_output=True, text=True, timeout=300)


def test_torch_and_safetensors_full_disk_errors_are_said_as_one(tmp_path):
    """torch.save raises a RuntimeError with no errno ("unexpected pos"), safetensors its SafetensorError
    ("os error 28"): outputs.files.writing says both as the OSError the CLI turns into one line."""
    script = ("import sys, torch; from pathlib import Path; from effitrain.outputs import files; "
              "from safetensors.torch import save_file\n"
              "for name, save in (('a.pt', torch.save), ('b.safetensors', lambda t, p: save_file({'t': t}, p))):\n"
              "    try:\n"
              "        with files.writing(Path(sys.argv[1]) / name):\n"
              "            save(torch.zeros(2**20), str(Path(sys.argv[1]) / name))\n"
              "    except OSError as err:\n"
              "        print(err.errno, type(err.__cause__).__name__)\n")
    result = on_a_small_disk(tmp_path / "disk", "1m", sys.executable, "-c", script, tmp_path / "disk")
    assert result.stdout.split("\n")[:2] == ["28 RuntimeError", "28 SafetensorError"], result.stderr[-2000:]


def test_a_full_disk_during_a_checkpoint_keeps_the_earlier_one_and_says_so(tiny_model_dir, tmp_path):
    """A real full disk (20 MiB: one checkpoint of the tiny model fits, not two): one line, exit 2, the
    half-written checkpoint removed, the earlier one complete for --resume auto."""
    disk = tmp_path / "disk"
    result = on_a_small_disk(disk, "20m", sys.executable, "-c", "import sys; from effitrain.__main__ import run; "
                             "code = run(); print(sorted(p.name for p in (sys.modules['pathlib'].Path(sys.argv[-1]) / "
                             "'checkpoints').iterdir())); sys.exit(code)", "train", "--model", tiny_model_dir,
                             "--max-train-samples", 16, "--max-eval-samples", 8, "--batch-size", 8, "--max-steps", 3,
                             "--save-every", 1, "--output-dir", disk / "out")
    lines = [line for line in result.stderr.splitlines() if line.startswith("effitrain")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "No space left on device writing" in lines[0] and "earlier checkpoints stay" in lines[0]
    assert result.stdout.strip().splitlines()[-1] == "['step-1']"


def test_a_bench_whose_variants_failed_at_start_can_be_replaced(tmp_path):
    """A variant refused at its start leaves its NAME.log but no folder; --overwrite still replaces the
    bench (the corrected command runs), and a .log that bench did not write still stops it."""
    bench = fake_run(tmp_path / "bench", **{"bench.json": '{"variants": []}'})
    (bench / run_folder.MARKER).write_text('{"kind": "bench"}')
    (bench / "baseline.log").write_text("$ effitrain train --output-dir bench/baseline\n--- stdout\n")
    assert run_folder.foreign_entries(bench) == []
    (bench / "mine.log").write_text("my notes\n")
    assert run_folder.foreign_entries(bench) == ["mine.log"]
    (bench / "mine.log").unlink()
    held = run_folder.RunDir(bench, overwrite=True, kind="bench").acquire()
    held.start()
    assert sorted(p.name for p in bench.iterdir()) == sorted([run_folder.LOCK, run_folder.MARKER, run_folder.PREVIOUS])
    held.succeed()
    assert sorted(p.name for p in bench.iterdir()) == [run_folder.MARKER]
    train = fake_run(tmp_path / "train")  # in a train run's folder, the same log is not effitrain's
    (train / "baseline.log").write_text("$ effitrain train\n")
    assert run_folder.foreign_entries(train) == ["baseline.log"]
