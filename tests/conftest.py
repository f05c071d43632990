"""Shared fixtures and builders: a tiny random BERT (saved, or in memory), a tiny run's settings and its CLI
flags, free ports, and helpers to run the CLI and read runs. Tests live in unit/ (pieces alone, no
processes), integration/ (training runs, processes, the CLI) and architecture/ (the code's shape, docs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# --precision auto trains in bf16 on CPUs with native bf16 units (engine/precision.py); the suite's
# equivalence checks compare in fp32 to 1e-5, so auto stays fp32 here (tests of bf16 ask for it).
os.environ.setdefault("EFFITRAIN_CPU_AUTO_PRECISION", "fp32")
OFFLINE_HOOK = Path(__file__).parent / "hooks" / "offline"  # sitecustomize.py: no network
# Inductor's kernel cache does not tell kernels built under ATEN_CPU_CAPABILITY from those built without it:
# a suite run under a restricted instruction set, after one without on the same machine, would load the
# others' kernels and fail inside them ("returned a result with an exception set"). One cache per limit.
_LIMITS = "-".join(os.environ.get(name, "") for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")).strip("-")
if _LIMITS and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                         f"torchinductor-{os.getuid()}-{_LIMITS}")


def pytest_report_header(config):
    """The CPU and the kernels torch picks on it: results differ in their low digits between this project's
    machines (Xeon with AMX, EPYC without), and a failure must name its machine."""
    import platform

    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    limits = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    return (f"cpu: {model or 'unknown'}; torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}" + (f", limited by {limits}" if limits else ""))


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
def tokenizer():
    """The packaged all-MiniLM-L6-v2 tokenizer (read-only: shared by the session)."""
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer, hidden-32 BERT with random weights and the packaged all-MiniLM tokenizer; dropout off so
    that runs which see the same examples compute the same arithmetic."""
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

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


def tiny_bert(**overrides):
    """A 2-layer, hidden-32 BERT classifier with random weights (seed 0), in memory; dropout off unless
    `overrides` say otherwise (any BertConfig field)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    settings = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(**{**settings, **overrides}))


def tiny_run(model_dir, out, **overrides) -> dict:
    """A training run's settings that finish in seconds: 64 examples, micro-batch 8, 6 steps."""
    return {**dict(model=str(model_dir), output_dir=str(out), max_train_samples=64, max_eval_samples=40, batch_size=8,
                   eval_batch_size=16, max_steps=6, log_every=2, lr=1e-3), **overrides}


def as_flags(values: dict) -> list[str]:
    """A run's settings as CLI flags: {"batch_size": 8} -> ["--batch-size", "8"]."""
    return [arg for key, value in values.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed CLI in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "effitrain", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def read_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pytest_configure(config):
    config.addinivalue_line("markers", "fresh_process: a CLI table row run as `python -m effitrain` in a new process "
                                       "rather than through effitrain.cli.main here")


# What a fresh `python -m effitrain` starts with (no -W, no PYTHONWARNINGS): Python's default filters.
PYTHON_DEFAULT_WARNINGS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
                           ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""),
                           ("ignore", ResourceWarning, "")]


@pytest.fixture
def cli_here(monkeypatch, capfd):
    """run_cli's twin that calls effitrain.cli.main(argv) in this process: the same code without the seconds
    of imports a new process pays. So that stderr holds what a fresh process would print there, each call
    starts from a fresh process's state: Python's default warning filters (warnings are printed, not
    collected by pytest), the libraries' loggers at their default levels, transformers' once-only warnings
    and the progress bars back on, handlers bound at import to an earlier stream writing to this one; the
    working folder, environment and all of that are put back afterwards. Output that only importing a
    library prints is not seen here: tables keep some rows in fresh processes for it."""
    import logging
    import traceback
    import warnings

    import datasets  # noqa: F401 (datasets.utils.tqdm)
    import transformers
    from effitrain.cli import main

    def run(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
        argv = list(map(str, args))
        try:
            with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as shown:
                fresh_process_state(patch)
                if cwd is not None:
                    patch.chdir(cwd)
                environ = dict(os.environ)
                capfd.readouterr()
                try:
                    code = main(argv)
                except SystemExit as exit_:  # --help, --version
                    code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
                except Exception:  # an internal error: what the fresh process would print, and its exit code
                    traceback.print_exc()
                    code = 1
                finally:  # what a command set in its environment ends with its process
                    for name in set(os.environ) - set(environ):
                        del os.environ[name]
                    os.environ.update(environ)
                out, err = capfd.readouterr()
        finally:
            logging.root.manager._clear_cache()  # the loggers' levels are back: forget what they enabled
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in shown)
        return subprocess.CompletedProcess(["effitrain", *argv], code, out, err)

    def fresh_process_state(patch: pytest.MonkeyPatch) -> None:
        warnings.resetwarnings()
        for action, category, module in PYTHON_DEFAULT_WARNINGS:
            warnings.filterwarnings(action, category=category, module=module, append=True)
        for name in ("transformers", "datasets", "huggingface_hub"):
            patch.setattr(logging.getLogger(name), "level", logging.WARNING)  # their own default
        for logger in [logging.root, *(lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger))]:
            if logger.name in ("torchao", "torch.utils._pytree", "bitsandbytes", "kernels"):
                patch.setattr(logger, "level", logging.NOTSET)  # runtime/libraries.quiet_import_warnings sets them
            for handler in logger.handlers:
                if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
                    patch.setattr(handler, "stream", sys.stderr)
                    if "flush" in vars(handler):  # transformers' handler flushes the stderr of its import
                        patch.delattr(handler, "flush")
        # pytest's log capture on the root logger would take what a fresh process prints through
        # logging.lastResort (a record no handler takes: torchao's warnings, for one)
        patch.setattr(logging.root, "handlers", [handler for handler in logging.root.handlers
                                                 if not type(handler).__module__.startswith("_pytest")])
        logging.root.manager._clear_cache()
        logging.Logger.warning_once.cache_clear()  # transformers' once-per-process warnings
        patch.setattr(transformers.utils.logging, "_tqdm_active", True)
        patch.setattr(sys.modules["datasets.utils.tqdm"], "_hf_datasets_progress_bars_disabled", False)

    return run
