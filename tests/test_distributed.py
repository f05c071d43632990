"""Two gloo processes under torchrun against one process: same examples per step, same weights."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import read_weights

import effitrain


def torchrun(nproc: int, *args, cwd=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "effitrain", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("train_samples", [14, 18])
def test_two_processes_equal_one_big_batch(tiny_model_dir, tmp_path, train_samples):
    """2 processes x micro-batch 4 x accumulation 2 against 1 process x batch 16, 2 epochs.
    14 examples: micro-batches 4+4 | 4+2, a short one in the step. 18: 4+4 | 4+4 | 2+nothing, so the
    second process runs a zero-weight stand-in in the last step of each epoch."""
    common = dict(model=tiny_model_dir, max_train_samples=train_samples, max_eval_samples=40, epochs=2,
                  lr=1e-3, warmup_ratio=0.0, log_every=1, eval_batch_size=16)
    flags = [arg for key, value in common.items() for arg in (f"--{key.replace('_', '-')}", value)]
    result = torchrun(2, "train", *flags, "--batch-size", 4, "--grad-accum", 2, "--output-dir",
                      tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train({**common, "model": str(tiny_model_dir), "batch_size": 16,
                     "output_dir": str(tmp_path / "single")})

    ddp, single = read_weights(tmp_path / "ddp"), read_weights(tmp_path / "single")
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-5, atol=1e-6)
    m_ddp, m_single = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("ddp", "single"))
    assert m_ddp["world_size"] == 2 and m_single["world_size"] == 1
    assert m_ddp["steps"] == m_single["steps"] == 2 * -(-train_samples // 16)  # 2 epochs
    for split in ("validation", "test"):  # gathered without duplicated samples
        assert m_ddp[split]["samples"] == m_single[split]["samples"] == 40
        assert m_ddp[split]["accuracy"] == m_single[split]["accuracy"]
        assert m_ddp[split]["loss"] == pytest.approx(m_single[split]["loss"], rel=1e-5)
