"""Launch hygiene: stray launcher variables never hang a command, signals stop a launched job cleanly,
and a job's user error is one stderr line with the exit code kept (also under --debug)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from effitrain import cli
from effitrain.commands import env as env_command
from effitrain.commands import launch
from effitrain.outputs import run_folder
from effitrain.runtime import cluster, devices, distributed, job_failures, launcher, rendezvous
from effitrain.runtime.hostlist import expand_hostlist

from conftest import free_port

HOOKED_CLI = str(Path(__file__).resolve().parents[1] / "hooks" / "patched_cli.py")


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
        assert f"RANK={rank}" in lines[0] and "WORLD_SIZE=2" in lines[0] and f"within {distributed.JOIN_SECONDS} s" in lines[0]
        assert "fix: unset them (unset RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT)" in lines[0]
        assert "effitrain launch" in lines[0]
        assert not (tmp_path / f"rank{rank}").exists()  # refused before writing anything
    assert time.monotonic() - start < distributed.JOIN_SECONDS + 45  # start-up of two processes on 2 busy cores


def test_incomplete_launcher_variables_are_refused_at_once(monkeypatch):
    from datetime import timedelta

    from effitrain.errors import UserError

    for name in ("TORCHELASTIC_RUN_ID", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(UserError, match=r"ask for 2 processes but are incomplete \(need RANK, MASTER_ADDR\)"):
        distributed.init_process_group(timedelta(seconds=5))


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
            distributed.init_process_group(timedelta(seconds=5))
    assert capfd.readouterr().err == ""  # c10d's own logs are kept off stderr


def failure(exitcode: int, message: str = "", timestamp: int = 100):
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp,
                           signal_name=lambda: signal.Signals(-exitcode).name)


def test_a_user_error_of_every_process_is_said_once_and_a_process_own_one_names_it():
    error = "UserError: --data x.csv has no column text; fix: pass --text-column"
    line, code = job_failures.failure_line({0: failure(2, error), 1: failure(2, error, 101)})
    assert (line, code) == ("effitrain: error: --data x.csv has no column text; fix: pass --text-column", 2)
    # The other process was stopped by the launcher before it got there: still the plain line.
    for stopped in (-signal.SIGTERM, 143):
        assert job_failures.failure_line({0: failure(stopped, timestamp=99), 1: failure(2, error)})[0] == line
    # Only process 1 hit it, process 0 failed differently: process 1's own problem, named.
    line, code = job_failures.failure_line({0: failure(1, "RuntimeError: gloo: connection closed", 101),
                                      1: failure(2, error)})
    assert line == "effitrain: error: process 1: --data x.csv has no column text; fix: pass --text-column"
    assert code == 2
    # A worker killed by a signal is the root cause, not its peers' collective errors.
    line, code = job_failures.failure_line({0: failure(1, "RuntimeError: gloo", 99), 1: failure(-signal.SIGKILL)})
    assert (line, code) == ("effitrain launch: error: worker 1 of 2 was killed by SIGKILL (signal 9); fix: check the "
                            "memory (dmesg for the out-of-memory killer), then rerun (with --resume auto if the run "
                            "saved checkpoints)", 1)


def test_a_user_error_under_launch_is_one_line_and_exit_2(tmp_path):
    """Both workers hit it; before, each printed it, then torchrun logged, then the launcher: 4 lines."""
    job = effitrain("launch", "--nproc", 2, "--", "train", "--lr", "fast", cwd=tmp_path,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 2
    assert stderr.splitlines() == ["effitrain: error: argument --lr: invalid float value: 'fast'; fix: see "
                                   "`effitrain train --help`"], stderr[-3000:]


def test_a_signal_while_a_failed_command_reports_does_not_cut_the_report(monkeypatch, capsys):
    """A launched worker that met a user error records it for the launcher (importing torch's error file
    writer: seconds, now that parsing imports nothing heavy), and the launcher SIGTERMs it meanwhile as its
    other worker ended: the report finishes, one line and exit 2, no traceback."""
    def record_slowly(err):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the signal is handled here, in the middle of the report

    monkeypatch.setattr(cli, "_record_for_launcher", record_slowly)
    assert cli.main(["train", "--lr", "fast"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "effitrain: error: argument --lr: invalid float value: 'fast'; fix: see `effitrain train --help`"]


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

    monkeypatch.setattr(env_command, "main", interrupted)
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

    monkeypatch.setattr(env_command, "main", terminated)
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


@pytest.mark.slow  # two workers train until their second save, about 30 s
def test_workers_follow_a_launcher_killed_outright(tiny_model_dir, tmp_path):
    """SIGKILL (kill -9, the out-of-memory killer) leaves the launcher no time to stop its workers, which
    torch's agent starts in sessions of their own: each gets SIGTERM at its launcher's death and unwinds as
    on any SIGTERM, mid-save here: the folder released, the complete checkpoint kept, the partial one gone."""
    from test_distributed import descendants

    out = tmp_path / "out"
    command = [HOOKED_CLI, "--save-pause", 30, "--", "launch", "--nproc", 2, "--", "train", "--model",
               tiny_model_dir, "--max-steps", 1000, "--max-train-samples", 64, "--max-eval-samples", 8,
               "--batch-size", 4, "--save-every", 2, "--output-dir", out]
    job = subprocess.Popen([sys.executable, *map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    checkpoints, deadline = out / "checkpoints", time.monotonic() + 120
    workers = []
    try:
        while not ((checkpoints / "step-2").is_dir() and list(checkpoints.glob(".tmp-step-*"))):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=30)[1][-3000:]
            time.sleep(0.1)
        workers = descendants(job.pid)
        assert len(workers) == 2, workers
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)  # (not communicate: the workers hold its pipes open while they run)
        deadline = time.monotonic() + 60  # well within the hook's 30 s pause had they waited it out
        while any(map(running, workers)):
            assert time.monotonic() < deadline, "a worker kept running after its launcher was killed"
            time.sleep(0.1)
    finally:
        for pid in [job.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.communicate(timeout=30)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    assert not list(out.rglob(".tmp-*"))
    assert not (out / run_folder.LOCK).exists()  # released: a run removes its lock file as it ends


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe never here)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def pdeathsig() -> int:
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    return value.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's PR_SET_PDEATHSIG is Linux's")
def test_a_worker_follows_its_launcher_only(monkeypatch):
    """The launcher is the parent: the death signal is set. A live process of that id that is not the
    parent (variables copied from a worker's environment): nothing. A launcher already gone: SIGTERM now."""
    import ctypes

    sent = []
    monkeypatch.setattr(launcher.os, "kill", lambda pid, sig: sent.append((pid, sig)) if sig else None)
    try:
        monkeypatch.setenv(launcher.LAUNCHER_PID, str(os.getppid()))
        launcher.end_with_launcher()
        assert (pdeathsig(), sent) == (signal.SIGTERM, [])
    finally:
        ctypes.CDLL(None).prctl(launcher.PR_SET_PDEATHSIG, 0, 0, 0, 0)  # this test process follows nobody
    monkeypatch.setenv(launcher.LAUNCHER_PID, str(os.getpid()))  # alive, not the parent
    launcher.end_with_launcher()
    assert (pdeathsig(), sent) == (0, [])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(launcher, "_alive", lambda pid: pid != gone.pid)
    monkeypatch.setenv(launcher.LAUNCHER_PID, str(gone.pid))
    launcher.end_with_launcher()
    assert sent == [(os.getpid(), signal.SIGTERM)]
    monkeypatch.setenv(launcher.LAUNCHER_PID, "not a pid")
    launcher.end_with_launcher()
    assert len(sent) == 1


# ---- Clusters: Slurm and Kubernetes settings from the environment ---------------------------------

SLURM_NODE_1 = {"SLURM_JOB_ID": "4321", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[01-02]"}
PYTORCHJOB_WORKER_1 = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "8",
                       "RANK": "1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


def launch_flags(**given) -> SimpleNamespace:
    """effitrain launch's flags as cli.py parses them: None where not given."""
    flags = dict(nproc=None, nnodes=None, node_rank=None, master_addr=None, master_port=None, max_restarts=0)
    return SimpleNamespace(**{**flags, **given})


def settings(env: dict, **given) -> tuple[tuple, str | None]:
    args, line = cluster.resolve(launch_flags(**given), env)
    return (args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port), line


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),  # width of the first bound: no padding
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-node[09-10]", ["rack1-node09", "rack1-node10", "rack2-node09", "rack2-node10"]),
    ("a[1,3],b[2-3].cluster.org", ["a1", "a3", "b2.cluster.org", "b3.cluster.org"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_slurm_host_lists_expand_in_slurms_order(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("garbage", ["", "node[", "node]01", "a,,b", "n[3-1]", "n[a-b]", "n[]", "n[[1]]",
                                     "n[1-2", "two words", "n[1-9999999]", "n[1;2]", "x,"])
def test_a_garbled_host_list_is_a_value_error(garbage):
    with pytest.raises(ValueError):
        expand_hostlist(garbage)


def test_slurm_gives_node_count_rank_head_and_a_port_from_the_job_id():
    assert settings(SLURM_NODE_1, nproc=8) == (
        (8, 2, 1, "node01", 15000 + 4321), "effitrain launch: 2 nodes from Slurm (node 1, head node01:19321)")
    node_0 = {**SLURM_NODE_1, "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_JOB_ID": "987654"}
    assert settings(node_0, nproc=8)[0] == (8, 2, 0, "node01", 15000 + 987654 % 20000)
    # SLURM_JOB_NUM_NODES when SLURM_NNODES is absent; the step's node list before the job's; MASTER_* win.
    other = {**{k: v for k, v in SLURM_NODE_1.items() if k != "SLURM_NNODES"}, "SLURM_JOB_NUM_NODES": "2",
             "SLURM_STEP_NODELIST": "gpu[7-8]", "MASTER_PORT": "29500"}
    assert settings(other)[0] == (1, 2, 1, "gpu7", 29500)
    assert settings({**other, "MASTER_ADDR": "10.0.0.1"})[0] == (1, 2, 1, "10.0.0.1", 29500)
    # One node: standalone on a free port, as without Slurm.
    one = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "node07"}
    assert settings(one, nproc=2) == ((2, 1, 0, None, None), "effitrain launch: 1 node from Slurm")


def test_flags_win_over_the_environment():
    assert settings(SLURM_NODE_1, nproc=2, master_port=29500) == (
        (2, 2, 1, "node01", 29500),
        "effitrain launch: 2 nodes from Slurm (node 1, head node01:29500); the command line's --master-port won")
    assert settings(PYTORCHJOB_WORKER_1, nproc=1, master_addr="10.0.0.9")[0] == (1, 2, 1, "10.0.0.9", 23456)
    # Flags that settle everything: the environment is not read (not even a broken one).
    broken = {**SLURM_NODE_1, "SLURM_NNODES": "", "SLURM_JOB_NODELIST": "node["}
    assert settings(broken, nproc=1, nnodes=2, node_rank=0, master_addr="h", master_port=1) == (
        (1, 2, 0, "h", 1), None)
    # --nnodes 1: this machine alone, whatever the job spans.
    assert settings(SLURM_NODE_1, nproc=1, nnodes=1) == ((1, 1, 0, None, None), None)


def test_pytorchjob_and_torchrun_style_environments(monkeypatch):
    assert settings(PYTORCHJOB_WORKER_1) == (
        (4, 2, 1, "job-master-0", 23456), "effitrain launch: 2 nodes from PyTorchJob (node 1, head "
        "job-master-0:23456), 4 processes per node from PET_NPROC_PER_NODE")
    # Kubeflow Trainer (TrainJob): PET_MASTER_ADDR/PORT; nprocPerNode "auto": one per accelerator, else 1.
    monkeypatch.setattr(devices, "accelerator_count", lambda: 0)
    trainjob = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "auto",
                "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
    assert settings(trainjob)[0] == (1, 3, 2, "job-node-0-0.job", 29400)
    monkeypatch.setattr(devices, "accelerator_count", lambda: 8)
    assert settings(trainjob)[0][0] == 8
    assert settings({"PET_NPROC_PER_NODE": "2"}) == (
        (2, 1, 0, None, None), "effitrain launch: 1 node from PyTorchJob, 2 processes per node from PET_NPROC_PER_NODE")
    # Older operators set no PET_*: WORLD_SIZE and RANK count the pods.
    old = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert settings(old, nproc=8) == (
        (8, 2, 1, "job-master-0", 23456), "effitrain launch: 2 nodes from WORLD_SIZE/RANK (node 1, head "
        "job-master-0:23456)")


def test_a_launched_workers_stray_variables_are_not_a_cluster():
    """What `stray()` leaves in a shell (LOCAL_RANK next to WORLD_SIZE) counts processes, not nodes: launch
    ignores it as before, and torchrun replaces it in the workers; `train` alone refuses it (runtime/distributed.py)."""
    env = {k: v for k, v in stray(1, 29500).items() if not k.startswith(("SLURM_", "PET_"))}
    assert settings(env, nproc=2) == ((2, 1, 0, None, None), None)
    assert settings(env) == settings({}) == settings({"WORLD_SIZE": "2", "RANK": "1"}) == ((1, 1, 0, None, None), None)


@pytest.mark.parametrize("env, problem", [
    ({**SLURM_NODE_1, "SLURM_NTASKS": "16", "SLURM_PROCID": "9"}, r"Slurm runs 16 tasks on 2 node\(s\).*fix: use "
     r"srun --ntasks-per-node=1"),
    ({**SLURM_NODE_1, "SLURM_PROCID": "3"}, "needs one task per node; fix: use srun --ntasks-per-node=1"),
    ({**SLURM_NODE_1, "SLURM_NNODES": ""}, "SLURM_NNODES is empty; fix: run one launcher per node"),
    ({**SLURM_NODE_1, "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node of the 2 in SLURM_NNODES"),
    ({**SLURM_NODE_1, "SLURM_NODEID": "-1"}, "SLURM_NODEID='-1' is not a whole number >= 0"),
    ({**SLURM_NODE_1, "SLURM_JOB_NODELIST": "node[01-02"}, r"SLURM_JOB_NODELIST='node\[01-02' is not a Slurm "
     r"node list \(brackets do not pair up\); fix: set it as Slurm does"),
    ({**SLURM_NODE_1, "SLURM_JOB_NODELIST": "node 01"}, "is not a Slurm node list"),
    ({**SLURM_NODE_1, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not a whole number"),
    ({**SLURM_NODE_1, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port \(1-65535\)"),
    ({k: v for k, v in SLURM_NODE_1.items() if k != "SLURM_JOB_NODELIST"}, "no SLURM_JOB_NODELIST"),
    ({k: v for k, v in SLURM_NODE_1.items() if k not in ("SLURM_NODEID", "SLURM_PROCID")},
     "a 2-node Slurm allocation but not one of its tasks"),
    ({"SLURM_JOB_ID": "1"}, "neither SLURM_NNODES nor SLURM_JOB_NUM_NODES"),
    ({**PYTORCHJOB_WORKER_1, "PET_NNODES": "1:3"}, r"PET_NNODES=1:3 is a range \(an elasticPolicy\)"),
    ({**PYTORCHJOB_WORKER_1, "PET_NODE_RANK": "5"}, "PET_NODE_RANK=5 is not a node of the 2 in PET_NNODES"),
    ({**PYTORCHJOB_WORKER_1, "PET_NPROC_PER_NODE": "eight"}, "PET_NPROC_PER_NODE='eight' is not a whole number"),
    ({k: v for k, v in PYTORCHJOB_WORKER_1.items() if k != "MASTER_PORT"}, "2 nodes from PyTorchJob, but no "
     r"MASTER_PORT \(nor PET_MASTER_PORT\).*fix: set MASTER_PORT on every node, or pass --master-port"),
])
def test_a_broken_cluster_environment_is_one_user_error(env, problem):
    from effitrain.errors import UserError

    with pytest.raises(UserError, match=problem) as raised:
        cluster.resolve(launch_flags(), env)
    assert "\n" not in str(raised.value) and "; fix: " in str(raised.value)


def test_a_broken_cluster_environment_stops_launch_with_one_line_and_exit_2(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    cases = {"srun --ntasks-per-node=1": {**SLURM_NODE_1, "SLURM_NTASKS": "16", "SLURM_PROCID": "9"},
             "is not a Slurm node list": {**SLURM_NODE_1, "SLURM_JOB_NODELIST": "node[01-02"}}
    for problem, env in cases.items():
        job = effitrain("launch", "--nproc", 2, "--", "train", cwd=tmp_path, env={**base, **env})
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 2 and len(stderr.splitlines()) == 1, stderr[-3000:]
        assert stderr.startswith("effitrain: error: ") and problem in stderr and "; fix: " in stderr
    assert list(tmp_path.iterdir()) == []


def slurm_job_with_a_free_port() -> int:
    """A job id whose derived port nobody listens on, as Slurm's job ids differ between jobs."""
    import random
    import socket

    for _ in range(100):
        job = random.randrange(10**6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", cluster.SLURM_PORT_BASE + job % cluster.SLURM_PORT_SPAN))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in Slurm's range")


@pytest.mark.slow  # two launchers and their workers start on 2 busy cores, then the same run in process
def test_two_slurm_nodes_on_one_machine_equal_one_process(tiny_model_dir, tmp_path):
    """`srun --nodes 2 --ntasks-per-node 1 effitrain launch --nproc 1 -- train ...` as Slurm would start it,
    both "nodes" on 127.0.0.1: no node flag given, 2 x batch 4 reach the weights of 1 x batch 8."""
    import torch
    from effitrain import train

    from conftest import read_weights

    common = dict(model=tiny_model_dir, max_train_samples=16, max_eval_samples=8, epochs=1, lr=1e-3,
                  warmup_ratio=0.0, eval_batch_size=8)
    flags = [arg for key, value in common.items() for arg in (f"--{key.replace('_', '-')}", value)]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "MASTER_"))}
    job = slurm_job_with_a_free_port()
    nodes = [effitrain("launch", "--nproc", 1, "--", "train", *flags, "--batch-size", 4, "--output-dir",
                       tmp_path / "nodes", env={**base, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": str(job),
                                                "SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_NTASKS": "2",
                                                "SLURM_PROCID": str(node), "SLURM_JOB_NODELIST": "127.0.0.1"})
             for node in (0, 1)]
    for node, process in enumerate(nodes):
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        port = cluster.SLURM_PORT_BASE + job % cluster.SLURM_PORT_SPAN
        assert stderr.splitlines()[0] == f"effitrain launch: 2 nodes from Slurm (node {node}, head 127.0.0.1:{port})"
    train({**common, "model": str(tiny_model_dir), "batch_size": 8, "output_dir": str(tmp_path / "one")})
    nodes_w, one_w = read_weights(tmp_path / "nodes"), read_weights(tmp_path / "one")
    for name in one_w:
        torch.testing.assert_close(nodes_w[name], one_w[name], rtol=1e-5, atol=1e-6)
    assert json.loads((tmp_path / "nodes" / "metrics.json").read_text())["world_size"] == 2


# ---- Issue 28, item 4: a dead worker, node 0's address and port, the nodes' wait, no worker left -----

def test_a_worker_killed_by_a_signal_is_one_line_with_the_step_and_checkpoint_its_peers_knew():
    from effitrain.runtime.peers import PeerLost

    knew = f"PeerLost: {PeerLost(5, 'out/checkpoints/step-4')}"
    line, code = job_failures.failure_line({0: failure(1, knew, 101), 1: failure(-signal.SIGKILL, "Signal 9 (SIGKILL) "
                                                                           "received by PID 7")}, world=4)
    assert (line, code) == ("effitrain launch: error: worker 1 of 4 was killed by SIGKILL (signal 9) during step 5; "
                            "fix: check the memory (dmesg for the out-of-memory killer), then rerun with --resume auto "
                            "(continues from out/checkpoints/step-4)", 1)
    # Its peers stopped by the launcher before they knew anything; another signal.
    line, code = job_failures.failure_line({0: failure(-signal.SIGTERM, timestamp=99), 1: failure(-signal.SIGSEGV)})
    assert (line, code) == ("effitrain launch: error: worker 1 of 2 was killed by SIGSEGV (signal 11); fix: find what "
                            "sent it, then rerun (with --resume auto if the run saved checkpoints)", 1)
    # The process that ended ran on another node: this node's workers only lost it.
    line, code = job_failures.failure_line({2: failure(1, f"PeerLost: {PeerLost(3)}"), 3: failure(-signal.SIGTERM)})
    assert (line, code) == ("effitrain launch: error: process 2: another process of the job ended during step 3; no "
                            "checkpoint saved (on another node: its launcher says why); fix: then rerun (no checkpoint "
                            "was saved: --save-every N keeps some)", 1)


GLOO_LOST = ("Got the following error when running the callback: RuntimeError: [../gloo/transport/tcp/pair.cc:553] "
             "Connection closed by peer [127.0.0.1]:12988. This is typically caused by a remote worker crashing.")


@pytest.mark.parametrize("launched", [True, False])
def test_a_collective_broken_by_a_dead_peer_is_one_line_or_left_to_the_launcher(monkeypatch, capsys, tmp_path,
                                                                                launched):
    """A launched worker records it for the launcher and prints nothing; under plain torchrun, one line.
    Never gloo's traceback, and exit 1: the run crashed, it is not the user's mistake."""
    from effitrain.runtime.peers import PeerLost

    def broken(args):
        try:
            raise RuntimeError(GLOO_LOST)
        except RuntimeError as err:
            raise PeerLost(7, "out/checkpoints/step-6") from err

    error_file = tmp_path / "error.json"
    monkeypatch.setattr(env_command, "main", broken)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv(launcher.LAUNCHER_PID, raising=False)
    if launched:
        monkeypatch.setenv(launcher.LAUNCHED, "1")
    else:
        monkeypatch.delenv(launcher.LAUNCHED, raising=False)
    assert cli.main(["env"]) == 1
    recorded = json.loads(error_file.read_text())["message"]["message"]
    assert recorded == "PeerLost: another process of the job ended during step 7; latest checkpoint out/checkpoints/step-6"
    assert vars(PeerLost.parse(recorded)) == vars(PeerLost(7, "out/checkpoints/step-6"))
    # Met outside the training loop (set-up, the final test): nothing said of checkpoints it did not look for.
    unknown = PeerLost.parse(f"PeerLost: {PeerLost(looked=False)}")
    assert (str(unknown), unknown.step, unknown.looked) == ("another process of the job ended", None, False)
    assert job_failures.rerun_fix([unknown]) == "then rerun (with --resume auto if the run saved checkpoints)"
    assert job_failures.rerun_fix([PeerLost(3)]) == "then rerun (no checkpoint was saved: --save-every N keeps some)"
    assert capsys.readouterr().err == ("" if launched else (
        "effitrain: error: another process of the job ended during step 7; latest checkpoint out/checkpoints/step-6; "
        "fix: see why the other process ended (its output; dmesg for the out-of-memory killer) and rerun, with "
        "--resume auto to continue from it\n"))


def clock_of(line: str) -> float:
    """Seconds from now to the HH:MM:SS a line names (today or tomorrow)."""
    import datetime
    import re

    said = datetime.datetime.strptime(re.search(r"until (\d\d:\d\d:\d\d)", line)[1], "%H:%M:%S").time()
    now = datetime.datetime.now()
    then = datetime.datetime.combine(now.date(), said)
    if then < now - datetime.timedelta(hours=12):
        then += datetime.timedelta(days=1)
    return (then - now).total_seconds()


@pytest.mark.parametrize("node", [0, 1])
def test_a_node_says_what_it_waits_for_and_until_when_then_gives_up_in_one_line(tmp_path, node):
    """Node 1 waits for node 0 to listen; node 0 for the other node to join. Neither comes: one line at
    the deadline, exit 2, no worker ever started, nothing written."""
    port = free_port()
    start = time.monotonic()
    job = effitrain("launch", "--nnodes", 2, "--node-rank", node, "--master-addr", "127.0.0.1", "--master-port", port,
                    "--join-timeout", 3, "--", "train", cwd=tmp_path)
    started = time.time()
    first = job.stderr.readline()
    deadline = time.time() + clock_of(first)  # printed to the second, so up to 1 s early
    assert started + 3 - 1 < deadline <= time.time() + 3, first
    _, rest = job.communicate(timeout=90)
    took = time.monotonic() - start
    waits_for = "node 0" if node else "the other 1 node(s)"
    clock = first.split("until ")[-1][:8]
    assert first == f"effitrain launch: node {node} waits for {waits_for} at 127.0.0.1:{port} until {clock} (3 s, --join-timeout)\n"
    fix = ("start effitrain launch on node 0 with the same --nnodes, --master-addr and --master-port (node 0 first, or "
           "within --join-timeout), and check that this node can reach that port") if node else (
           "start effitrain launch on every node with the same --nnodes, --master-addr and --master-port, and check that "
           "they can reach that port of node 0 (a firewall)")
    problem = (f"node 0 never answered at 127.0.0.1:{port} within 3 s" if node else
               f"only 0 of the 1 other node(s) joined node 0 at 127.0.0.1:{port} within 3 s")
    assert rest.splitlines() == [f"effitrain: error: {problem}; fix: {fix}"], rest[-3000:]
    assert job.returncode == 2 and 3 <= took < 60
    assert list(tmp_path.iterdir()) == []


def test_a_master_port_taken_on_node_0_is_one_line_before_torch(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = effitrain("launch", "--nnodes", 2, "--master-addr", "127.0.0.1", "--master-port", port, "--", "train",
                        cwd=tmp_path)
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 2
    assert stderr.splitlines() == [f"effitrain: error: --master-port {port} is taken by another program on node 0; "
                                   "fix: pass a free port, the same on every node (ss -ltn lists the ports in use)"]


@pytest.mark.parametrize("env, problem", [
    ({**PYTORCHJOB_WORKER_1, "MASTER_ADDR": ""}, "MASTER_ADDR is empty; fix: set MASTER_ADDR to node 0's host name"),
    ({**PYTORCHJOB_WORKER_1, "MASTER_ADDR": "job master"}, "MASTER_ADDR='job master' is not a host name or an IP"),
    ({**PYTORCHJOB_WORKER_1, "PET_MASTER_ADDR": "job-master-0:23456"}, "PET_MASTER_ADDR='job-master-0:23456' holds a port"),
    ({**SLURM_NODE_1, "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ({**SLURM_NODE_1, "MASTER_ADDR": "http://node01"}, "MASTER_ADDR='http://node01' is a URL, not a host"),
    ({**SLURM_NODE_1, "MASTER_PORT": "0"}, r"MASTER_PORT='0' is not a whole number >= 1"),
])
def test_a_bad_master_address_from_the_environment_is_one_user_error(env, problem):
    from effitrain.errors import UserError

    with pytest.raises(UserError, match=problem):
        cluster.resolve(launch_flags(), env)


def test_addresses_torch_reads_are_kept_and_normalised():
    for given, kept in [("10.0.0.1", "10.0.0.1"), (" node01 ", "node01"), ("job-master-0.job.svc.", "job-master-0.job.svc."),
                        ("::1", "[::1]"), ("[fe80::1]", "[fe80::1]"), ("gpu_node-3", "gpu_node-3")]:
        assert rendezvous.check_address(given) == kept
    assert launch.torchrun_argv(launch_flags(nproc=1, nnodes=1, node_rank=0, master_addr="[::1]"), ["train"], 7.2)[4:8] == [
        "--node-rank=0", "--master-addr=[::1]", f"--master-port={rendezvous.DEFAULT_PORT}", "--rdzv-conf=timeout=8"]


def test_workers_stuck_in_a_store_connect_follow_a_launcher_killed_outright(tmp_path):
    """Inside torch's C++ connect loop no Python signal handler runs, so the SIGTERM of PR_SET_PDEATHSIG
    waits for the connect's timeout (300 s here): the worker's watch thread ends it within seconds."""
    from test_distributed import descendants

    hung = tmp_path / "hung"
    hung.mkdir()
    job = subprocess.Popen([sys.executable, HOOKED_CLI, "--store-hang", str(hung), "--", "launch", "--nproc", "2", "--",
                            "env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers = []
    try:
        deadline = time.monotonic() + 90
        while len(list(hung.iterdir())) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the workers never reached the store connect"
            time.sleep(0.1)
        time.sleep(1)  # well inside the connect loop
        workers = descendants(job.pid)
        assert sorted(workers) == sorted(int(p.name) for p in hung.iterdir())
        os.kill(job.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait(timeout=30)
        while any(map(running, workers)):
            assert time.monotonic() - killed_at < launcher.START_UNWIND_SECONDS + 10, "a worker outlived its launcher"
            time.sleep(0.1)
    finally:
        for pid in [job.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
