"""Shared fixtures: a tiny random BERT built from a config (no downloads), and helpers to read runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
OFFLINE_HOOK = Path(__file__).parent / "hooks" / "offline"  # sitecustomize.py: no network


@pytest.fixture(autouse=True, scope="session")
def offline(tmp_path_factory):
    """No network access at any point: sockets to other machines (and look-ups of their names) fail, in
    this process and, through PYTHONPATH, in every Python subprocess the tests start. Yields the file
    where blocked attempts are written (the `network_attempts` fixture reads it)."""
    from hooks.offline import sitecustomize as guard

    log = tmp_path_factory.mktemp("offline") / "attempts.log"
    log.touch()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EFFITRAIN_TEST_NETWORK_LOG", str(log))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(OFFLINE_HOOK), os.environ.get("PYTHONPATH")])))
        undo = guard.block()
        try:
            yield log
        finally:
            undo()


@pytest.fixture
def network_attempts(offline):
    """A function returning the blocked network attempts made since the test started (any process)."""
    start = offline.stat().st_size
    return lambda: offline.read_bytes()[start:].decode().splitlines()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer, hidden-32 BERT with random weights and the packaged all-MiniLM tokenizer; dropout off so
    that runs which see the same examples compute the same arithmetic."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from effitrain.models import default_model_dir

    path = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    import torch

    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed CLI in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "effitrain", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def read_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
