"""The CLI: exit codes, one-line errors, and the commands' output. In fresh processes, and through
cli.main in this one (conftest's cli_here) where a fresh process would add only its imports' seconds."""

import json
import os
import subprocess
import sys

import pytest
from effitrain.runtime.devices import has_accelerator
from effitrain.speedups import allocator

from conftest import run_cli

CPU_ONLY = pytest.mark.skipif(has_accelerator(), reason="the refusal is for machines without an accelerator")
FRESH = pytest.mark.fresh_process  # a row run as `python -m effitrain`; the others through cli.main here


def assert_user_error(result, needle):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and "fix:" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, needle", [
    pytest.param(["train", "--lr", "abc"], "invalid float value: 'abc'", marks=FRESH),
    (["train", "--batch-size", "0"], "--batch-size must be > 0"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--task", "translation"], "invalid choice"),
    (["train", "--model", "./missing-model-dir"], "is not a directory"),
    (["train", "--model", "nobody/no-such-model"], "nor in the Hugging Face cache"),
    (["train", "--data", "imagenet"], "--data imagenet: no such file, folder or built-in data set"),
    (["train", "--config", "missing.yaml"], "config file missing.yaml does not exist"),
    (["predict", "--model", "./missing-model-dir", "--text", "hi"], "is not a directory"),
    (["predict", "--model", "default"], "nothing to predict"),
    (["inspect", "./missing-model-dir"], "is not a directory"),
    pytest.param([], "required: command", marks=FRESH),
    pytest.param(["train", "--strategy", "deepspeed"], "--strategy deepspeed needs GPUs", marks=CPU_ONLY),
    (["train", "--strategy", "fsdp", "--local-sgd-steps", "4"], "--local-sgd-steps works with --strategy ddp"),
    (["train", "--no-fsdp-reshard-after-forward"], "applies to --strategy fsdp, not ddp"),
    (["train", "--ddp-timeout", "0"], "--ddp-timeout must be > 0"),
    pytest.param(["launch", "--nproc", "0", "--", "train"], "--nproc must be >= 1", marks=FRESH),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, tmp_path, cli_here, request):
    fresh = request.node.get_closest_marker("fresh_process") is not None
    assert_user_error((run_cli if fresh else cli_here)(*args, cwd=tmp_path), needle)


def test_unknown_config_key_names_the_fix(tmp_path):
    (tmp_path / "c.yaml").write_text("learning_rate: 0.1\n")
    assert_user_error(run_cli("train", "--config", "c.yaml", cwd=tmp_path), "unknown key `learning_rate`")


def test_debug_shows_the_traceback(tmp_path, cli_here):
    result = cli_here("train", "--model", "./missing-model-dir", "--debug", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr and "UserError" in result.stderr


def test_existing_output_dir_is_refused_and_untouched(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.json").write_text("{}")
    assert_user_error(run_cli("train", "--output-dir", "old", cwd=tmp_path), "already holds files")
    assert (tmp_path / "old" / "metrics.json").read_text() == "{}"


def test_train_then_predict_through_the_cli(tiny_model_dir, tmp_path):
    result = run_cli("train", "--model", tiny_model_dir, "--max-steps", "2", "--max-train-samples", "32",
                     "--max-eval-samples", "16", "--batch-size", "8", "--output-dir", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "saved to out" in result.stdout
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["steps"] == 2

    (tmp_path / "in.jsonl").write_text('{"text": "free entry win cash"}\n\n{"text": "hello"}\n')
    result = run_cli("predict", "--model", "out/model", "--input", "in.jsonl", "--text", "third", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["text"] for r in lines] == ["third", "free entry win cash", "hello"]
    assert all(r["label"] in ("ham", "spam") and 0.5 <= r["score"] <= 1 for r in lines)


def test_inspect_prints_config_counts_and_device(tiny_model_dir, cli_here):
    result = run_cli("inspect", tiny_model_dir)
    assert result.returncode == 0, result.stderr
    assert '"model_type": "bert"' in result.stdout and "Accelerator would train on: cpu" in result.stdout
    data = json.loads(cli_here("inspect", tiny_model_dir, "--json").stdout)
    assert data["parameters"]["total"] > data["parameters"]["embedding"] > 0
    assert data["config"]["hidden_size"] == 32


def test_env_reports_the_cpu_without_error(cli_here):
    result = run_cli("env")
    assert result.returncode == 0, result.stderr
    assert "gpus              none" in result.stdout or "gpu 0" in result.stdout
    data = json.loads(cli_here("env", "--json").stdout)
    assert data["device_type"] in ("cpu", "cuda", "mps", "xpu")
    assert data["versions"]["torch"] and data["versions"]["accelerate"]
    assert data["precision"]["fp16_supported"] == bool(data["gpus"])
    assert data["allocator"]["kind"] == "glibc"  # in this process: not started by the `effitrain` command
    preloaded = next((kind for kind in allocator.LIBRARIES if allocator.find(kind)), "glibc")
    assert f"allocator         {preloaded}" in result.stdout  # the command's own process: preloaded when installed


def test_an_unknown_allocator_is_one_line_before_anything_runs():
    env = {**os.environ, allocator.ALLOCATOR: "mimalloc"}
    out = subprocess.run([sys.executable, "-m", "effitrain", "env"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"effitrain: error: {allocator.ALLOCATOR}='mimalloc' is not an allocator "
                                       "effitrain knows; fix: set it to one of auto, jemalloc, tcmalloc, system, or "
                                       "unset it (auto)"]


def test_hub_id_is_found_in_the_local_cache_offline(tiny_model_dir, tmp_path):
    """The layout huggingface_hub writes: models--ORG--NAME/refs/main -> snapshots/<commit>/."""
    import os
    import shutil
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-bert"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run([sys.executable, "-m", "effitrain", "inspect", "someorg/tiny-bert", "--json"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"].endswith(commit)


@pytest.mark.parametrize("damage, needle", [
    ("config", "is not a valid JSON file"),
    ("weights", "cannot load the model"),
])
def test_damaged_checkpoint_is_a_user_error(tiny_model_dir, tmp_path, damage, needle, cli_here):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    target = model / ("config.json" if damage == "config" else "model.safetensors")
    target.write_text("{not json or safetensors")
    result = cli_here("train", "--model", model, "--max-steps", "1", "--max-train-samples", "8",
                      "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert_user_error(result, needle)

