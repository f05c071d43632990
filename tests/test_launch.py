"""Launch hygiene: stray launcher variables never hang a command, signals stop a launched job cleanly,
and a job's user error is one stderr line with the exit code kept (also under --debug)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from effitrain import cli, devices, launch

HOOKED_CLI = str(Path(__file__).parent / "hooks" / "patched_cli.py")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stray(rank: int, port: int) -> dict:
    """A shell where a torchrun job's variables were left exported, without torchrun's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return {**env, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def effitrain(*args, env=None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "effitrain", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **popen)


def test_env_reports_stray_launcher_variables_without_waiting_for_peers():
    start = time.monotonic()
    text = effitrain("env", env=stray(1, free_port())).communicate(timeout=60)
    data = effitrain("env", "--json", env=stray(0, free_port())).communicate(timeout=60)
    assert time.monotonic() - start < 60
    assert "distributed env   RANK=1 LOCAL_RANK=1 WORLD_SIZE=2" in text[0], text
    assert "unset them to run one process, or start all with `effitrain launch`" in text[0]
    info = json.loads(data[0])
    assert info["distributed_env"]["WORLD_SIZE"] == "2" and info["num_processes"] == 2
    assert info["distributed_type"] == "NOT_JOINED" and info["started_by_torchrun"] is False
    assert text[1] == data[1] == ""


@pytest.mark.slow  # two starts of train and a 10 s wait, about 20 s
def test_train_with_stray_launcher_variables_is_one_line_within_seconds(tiny_model_dir, tmp_path):
    """Rank 1 finds nobody at MASTER_PORT; rank 0 opens it and nobody comes: both stop after
    devices.JOIN_SECONDS (before the fix both waited forever, silently)."""
    flags = ["--model", tiny_model_dir, "--max-steps", 2, "--max-train-samples", 16, "--max-eval-samples", 8]
    start = time.monotonic()
    jobs = {rank: effitrain("train", *flags, "--output-dir", tmp_path / f"rank{rank}", env=stray(rank, free_port()))
            for rank in (0, 1)}
    for rank, job in jobs.items():
        _, stderr = job.communicate(timeout=90)
        assert job.returncode == 2, stderr[-3000:]
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("effitrain: error: launcher variables "), stderr[-3000:]
        assert f"RANK={rank}" in lines[0] and "WORLD_SIZE=2" in lines[0] and f"within {devices.JOIN_SECONDS} s" in lines[0]
        assert "fix: unset them (unset RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT)" in lines[0]
        assert "effitrain launch" in lines[0]
        assert not (tmp_path / f"rank{rank}").exists()  # refused before writing anything
    assert time.monotonic() - start < devices.JOIN_SECONDS + 45  # start-up of two processes on 2 busy cores


def test_incomplete_launcher_variables_are_refused_at_once(monkeypatch):
    from datetime import timedelta

    from effitrain.errors import UserError

    for name in ("TORCHELASTIC_RUN_ID", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(UserError, match=r"ask for 2 processes but are incomplete \(need RANK, MASTER_ADDR\)"):
        devices.init_process_group(timedelta(seconds=5))


def test_a_master_port_taken_by_another_program_is_one_line(monkeypatch, capfd):
    import socket
    from datetime import timedelta

    from effitrain.errors import UserError

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(taken.getsockname()[1])}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(UserError, match=r"port \d+ of 127.0.0.1 is taken by another program.*fix: unset them"):
            devices.init_process_group(timedelta(seconds=5))
    assert capfd.readouterr().err == ""  # c10d's own logs are kept off stderr


def failure(exitcode: int, message: str = "", timestamp: int = 100):
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp,
                           signal_name=lambda: signal.Signals(-exitcode).name)


def test_a_user_error_of_every_process_is_said_once_and_a_process_own_one_names_it():
    error = "UserError: --data x.csv has no column text; fix: pass --text-column"
    line, code = launch.failure_line({0: failure(2, error), 1: failure(2, error, 101)})
    assert (line, code) == ("effitrain: error: --data x.csv has no column text; fix: pass --text-column", 2)
    # The other process was stopped by the launcher before it got there: still the plain line.
    for stopped in (-signal.SIGTERM, 143):
        assert launch.failure_line({0: failure(stopped, timestamp=99), 1: failure(2, error)})[0] == line
    # Only process 1 hit it, process 0 failed differently: process 1's own problem, named.
    line, code = launch.failure_line({0: failure(1, "RuntimeError: gloo: connection closed", 101),
                                      1: failure(2, error)})
    assert line == "effitrain: error: process 1: --data x.csv has no column text; fix: pass --text-column"
    assert code == 2
    # A worker killed by a signal is the root cause, not its peers' collective errors.
    line, code = launch.failure_line({0: failure(1, "RuntimeError: gloo", 99), 1: failure(-signal.SIGKILL)})
    assert (line, code) == ("effitrain launch: error: rank 1 failed: killed by signal SIGKILL", 1)


def test_a_user_error_under_launch_is_one_line_and_exit_2(tmp_path):
    """Both workers hit it; before, each printed it, then torchrun logged, then the launcher: 4 lines."""
    job = effitrain("launch", "--nproc", 2, "--", "train", "--lr", "fast", cwd=tmp_path,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 2
    assert stderr.splitlines() == ["effitrain: error: argument --lr: invalid float value: 'fast'; fix: see "
                                   "`effitrain train --help`"], stderr[-3000:]


def test_one_process_commands_are_refused_by_launch():
    args = SimpleNamespace(nproc=2, nnodes=1, max_restarts=0, node_rank=0, master_port=None)
    for command in (["predict", "--text", "hi"], ["inspect"], ["plan"]):
        with pytest.raises(Exception, match=f"effitrain {command[0]} runs on one process.*without launch"):
            launch.check(args, command)


def test_debug_shows_the_traceback_and_keeps_the_exit_code(monkeypatch, capsys):
    assert cli.main(["train", "--lr", "fast", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "UserError: argument --lr" in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "env", interrupted)
    assert cli.main(["env", "--debug"]) == 130
    assert "KeyboardInterrupt" in capsys.readouterr().err
    assert cli.main(["env"]) == 130
    assert capsys.readouterr().err == "effitrain: stopped by SIGINT\n"


def test_sigterm_unwinds_a_command_with_exit_143_and_the_handlers_come_back(monkeypatch, capsys):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    unwound = []

    def terminated(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
        finally:
            unwound.append(True)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "env", terminated)
    start = time.monotonic()
    assert cli.main(["env"]) == 143
    assert time.monotonic() - start < 4 and unwound == [True]
    assert capsys.readouterr().err == "effitrain: stopped by SIGTERM\n"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.slow  # two workers train until their second save, about 30 s
@pytest.mark.parametrize("sig, whom", [(signal.SIGINT, "group"), (signal.SIGTERM, "launcher")])
def test_a_signal_stops_a_launched_job_cleanly(tiny_model_dir, tmp_path, sig, whom):
    """Ctrl-C reaches the launcher and both workers (the terminal signals the whole group); SIGTERM (kill,
    a scheduler) reaches the launcher only, which passes it on. Sent while the second checkpoint is being
    saved (held open by the test hook): the first one stays, the partial one goes, one line, 128 + signal."""
    out = tmp_path / "out"
    command = [HOOKED_CLI, "--save-pause", 4, "--", "launch", "--nproc", 2, "--", "train", "--model", tiny_model_dir,
               "--max-steps", 1000, "--max-train-samples", 64, "--max-eval-samples", 8, "--batch-size", 4,
               "--save-every", 2, "--output-dir", out]
    job = subprocess.Popen(
        [sys.executable, *map(str, command)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    checkpoints, deadline = out / "checkpoints", time.monotonic() + 120
    try:
        while not ((checkpoints / "step-2").is_dir() and list(checkpoints.glob(".tmp-step-*"))):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=30)[1][-3000:]
            time.sleep(0.1)
        (os.killpg if whom == "group" else os.kill)(job.pid, sig)
        stopped_at = time.monotonic()
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert time.monotonic() - stopped_at < 40
    assert job.returncode == 128 + sig
    assert stderr.splitlines() == [f"effitrain launch: stopped by {sig.name}: the 2 worker(s) of this node have "
                                   "ended (a run saving checkpoints resumes with --resume auto)"], stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    assert (checkpoints / "step-2" / "trainer_state.json").is_file()
    assert not list(out.rglob(".tmp-*"))
