"""Two gloo processes under torchrun against one process: same examples per step, same weights."""

import json
import subprocess
import sys
from pathlib import Path

import effitrain
import pytest
import torch

from conftest import free_port, read_weights


def torchrun(nproc: int, *args, cwd=None, hooks: list | None = None) -> subprocess.CompletedProcess:
    """effitrain under torchrun; `hooks`: flags of tests/hooks/patched_cli.py (faults injected)."""
    program = ["-m", "effitrain"] if hooks is None else [HOOKED_CLI, *map(str, hooks), "--"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *program, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


HOOKED_CLI = str(Path(__file__).resolve().parents[1] / "hooks" / "patched_cli.py")
TINY_GPT2 = "gpt2:n_layer=2,n_embd=32,n_head=2,n_positions=128,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


def write_chat(folder: Path) -> str:
    """Conversations whose assistant turns differ in length, so that micro-batches hold different numbers
    of answer tokens."""
    path = folder / "chat.jsonl"
    rows = [[{"role": "user", "content": f"message {n} " * (1 + n % 5)},
             {"role": "assistant", "content": " ".join(["ham", "spam"][n % 2] for _ in range(1 + n % 3))}]
            for n in range(400)]
    path.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("task, train_samples, chat, packing", [("sequence-classification", 14, False, False),
                                                                ("sequence-classification", 18, False, False),
                                                                ("causal-lm", 18, False, False),
                                                                ("causal-lm", 18, True, False),
                                                                ("causal-lm", 18, True, True)])
def test_two_processes_and_accumulation_equal_one_big_batch(tiny_model_dir, tmp_path, task, train_samples, chat,
                                                            packing):
    """(2 processes x micro-batch 4 x accumulation 2), (1 x 4 x 4) and (1 x 16), 2 epochs, fp32.
    14 examples: micro-batches 4+4 | 4+2, a short one in the step. 18: 4+4 | 4+4 | 2+nothing, so the
    second process runs a zero-weight stand-in in the last step of each epoch. Causal LM: the loss is
    normalised over the non-pad tokens of the whole step, which differ between micro-batches; on chat
    data over the answer tokens of the whole step (labels -100 elsewhere). With --packing each micro-batch
    is one row of 4 (or 16) examples, whose positions restart at each example."""
    model = str(tiny_model_dir) if task == "sequence-classification" else TINY_GPT2
    common = dict(model=model, task=task, max_train_samples=train_samples, max_eval_samples=40, epochs=2,
                  lr=1e-3, warmup_ratio=0.0, log_every=1, eval_batch_size=16)
    if chat:
        common.update(data=write_chat(tmp_path), chat_template="chatml")
    if packing:
        common.update(packing=True)
    flags = [arg for key, value in common.items()
             for arg in ((f"--{key.replace('_', '-')}",) if value is True else (f"--{key.replace('_', '-')}", value))]
    result = torchrun(2, "train", *flags, "--batch-size", 4, "--grad-accum", 2, "--output-dir",
                      tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train({**common, "batch_size": 4, "grad_accum": 4, "output_dir": str(tmp_path / "accum")})
    effitrain.train({**common, "batch_size": 16, "output_dir": str(tmp_path / "single")})

    single = read_weights(tmp_path / "single")
    for other in ("ddp", "accum"):
        weights = read_weights(tmp_path / other)
        for name in single:
            torch.testing.assert_close(weights[name], single[name], rtol=1e-5, atol=1e-6)
    runs = {d: json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("ddp", "accum", "single")}
    assert [runs[d]["world_size"] for d in ("ddp", "accum", "single")] == [2, 1, 1]
    assert runs["ddp"]["steps"] == runs["single"]["steps"] == 2 * -(-train_samples // 16)  # 2 epochs
    for split in ("validation", "test"):  # gathered without duplicated samples
        assert runs["ddp"][split]["samples"] == runs["single"][split]["samples"] == 40
        assert runs["ddp"][split]["loss"] == pytest.approx(runs["single"][split]["loss"], rel=1e-5)
        key = "accuracy" if task == "sequence-classification" else "token_accuracy"
        assert runs["ddp"][split][key] == runs["single"][split][key]
        if chat:  # each process generated the answers of its share; gathered, the scores of one process
            for key in ("exact_match", "end_of_turn_share"):
                assert runs["ddp"][split][key] == runs["single"][split][key]


def effitrain_launch(*args, cwd=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "effitrain", "launch", *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def test_two_nodes_on_one_machine_equal_one_process(tiny_model_dir, tmp_path):
    """Two launcher invocations, one process each, rendezvous on 127.0.0.1 as two machines would."""
    common = dict(model=tiny_model_dir, max_train_samples=24, max_eval_samples=20, epochs=1, lr=1e-3,
                  warmup_ratio=0.0, eval_batch_size=16)
    flags = [arg for key, value in common.items() for arg in (f"--{key.replace('_', '-')}", value)]
    port = free_port()
    nodes = [effitrain_launch("--nnodes", 2, "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port",
                              port, "--", "train", *flags, "--batch-size", 4, "--output-dir", tmp_path / "nodes")
             for rank in (0, 1)]
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-3000:]
    effitrain.train({**common, "model": str(tiny_model_dir), "batch_size": 8, "output_dir": str(tmp_path / "one")})
    nodes_w, one_w = read_weights(tmp_path / "nodes"), read_weights(tmp_path / "one")
    for name in one_w:
        torch.testing.assert_close(nodes_w[name], one_w[name], rtol=1e-5, atol=1e-6)
    assert json.loads((tmp_path / "nodes" / "metrics.json").read_text())["world_size"] == 2


def children(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def test_a_killed_worker_ends_the_job_within_60_seconds(tiny_model_dir, tmp_path):
    import os
    import signal
    import time

    job = effitrain_launch("--nproc", 2, "--", "train", "--model", tiny_model_dir, "--max-steps", 100000,
                           "--max-train-samples", 64, "--max-eval-samples", 16, "--batch-size", 4, "--log-every", 1,
                           "--output-dir", tmp_path / "out", "--ddp-timeout", 30, "--save-every", 2)
    log = tmp_path / "out" / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text().count("\n") >= 3):  # training is under way
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.5)
    workers = children(job.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    killed_at = time.time()
    _, stderr = job.communicate(timeout=90)
    assert time.time() - killed_at < 60
    assert job.returncode == 1  # the run crashed: not a user mistake (2)
    # One line, no gloo traceback from the survivor: the dead worker, its signal, what the survivor knew.
    import re

    lines = stderr.splitlines()
    match = re.fullmatch(r"effitrain launch: error: worker 1 of 2 was killed by SIGKILL \(signal 9\) during step "
                         r"(\d+); fix: check the memory \(dmesg for the out-of-memory killer\), then rerun with "
                         r"--resume auto \(continues from (.+)\)", lines[0] if len(lines) == 1 else "")
    assert match, stderr[-3000:]
    logged = [r["step"] for r in map(json.loads, log.read_text().splitlines()) if "split" not in r]
    checkpoint = Path(match[2])
    last_saved = (int(match[1]) - 1) // 2 * 2  # --save-every 2; the one before, if that save was cut short
    assert checkpoint.name in (f"step-{last_saved}", f"step-{last_saved - 2}")
    assert (checkpoint / "trainer_state.json").is_file()
    # The step the survivor was in: one after its last logged one, or two when the peer died during the
    # all-reduce that logs a step the survivor had already counted done (engine/run.py: log_window).
    assert int(match[1]) in (logged[-1] + 1, logged[-1] + 2)
    assert not descendants(job.pid)


def test_launch_without_a_command_is_a_user_error(tmp_path):
    from conftest import run_cli

    result = run_cli("launch", "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 2 and "needs the command to run after `--`" in result.stderr
    result = run_cli("launch", "--nnodes", "2", "--", "train", cwd=tmp_path)
    assert result.returncode == 2 and "needs --master-port" in result.stderr


def test_local_sgd_all_reduces_about_one_in_k_and_still_learns(tiny_model_dir, tmp_path):
    common = ["train", "--model", tiny_model_dir, "--max-steps", 16, "--max-train-samples", 256,
              "--max-eval-samples", 16, "--batch-size", 8, "--lr", 3e-3, "--log-every", 4]
    ddp = torchrun(2, *common, "--output-dir", tmp_path / "ddp")
    local = torchrun(2, *common, "--local-sgd-steps", 4, "--output-dir", tmp_path / "local")
    assert ddp.returncode == 0 and local.returncode == 0, (ddp.stderr + local.stderr)[-3000:]
    m_ddp, m_local = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("ddp", "local"))
    assert m_ddp["sync_allreduce_calls"] >= 16  # at least one gradient bucket per step
    # 16 steps / K=4 averagings, plus the final one when the run ends.
    assert m_local["sync_allreduce_calls"] == 16 // 4 + 1
    assert m_local["sync_allreduce_calls"] <= m_ddp["sync_allreduce_calls"] / 4 + 1
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "local" / "log.jsonl").read_text().splitlines())
              if "split" not in r]
    assert losses[-1] < losses[0]
