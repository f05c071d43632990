"""benchmarks/gpu_check.sh and its scripts, on a machine without GPUs: the dry run validates every step's
command without training and fails on a bad flag; the pieces that do not need a GPU (the validator, the
FLOP formula and peak table, the weight comparison, the results page) work. Nothing here claims anything
about a GPU run: none has happened."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from effitrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def load(name: str):
    """A script of benchmarks/gpu/ as a module; sys.path as it was afterwards (the scripts put benchmarks/ on it
    to import their shared helpers)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    spec.loader.exec_module(module)
    sys.path[:] = saved
    return module


def gpu_check(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_the_dry_run_validates_every_step_and_trains_nothing(tmp_path):
    result = gpu_check("--dry-run", "--work-dir", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("-> dry run: arguments valid, not run") == 5
    assert "every command is valid" in result.stdout
    assert result.stdout.count("  valid (effitrain's parser") == 3  # single, ddp, fsdp
    assert "--strategy fsdp" in result.stdout and "0.953B parameters" in result.stdout  # mfu.py's full model
    assert not (tmp_path / "train-default").exists() and not (tmp_path / "equivalence" / "single").exists()
    page = (tmp_path / "gpu-results.md").read_text()
    assert page.count("\n## ") == 5 and "**Dry run**" in page and "| torch |" in page
    assert "-m effitrain train --precision auto --output-dir" in page


@pytest.mark.parametrize("step, variable, flags, expected", [
    ("train", "GPU_CHECK_TRAIN_ARGS", "--no-such-flag 1", "unrecognized arguments: --no-such-flag 1"),
    ("mfu", "GPU_CHECK_MFU_ARGS", "--hidden 100", "not a multiple of --heads"),
])
def test_a_bad_flag_fails_the_dry_run(tmp_path, step, variable, flags, expected):
    result = gpu_check("--dry-run", "--only", step, "--work-dir", tmp_path, env={variable: flags})
    assert result.returncode == 2, result.stdout[-3000:]
    assert "INVALID" in result.stdout and expected in result.stdout + result.stderr
    assert "a command is invalid" in result.stderr


def test_bad_options_and_a_run_without_gpus_are_refused(tmp_path):
    result = gpu_check("--dry-run", "--bogus")
    assert result.returncode == 2 and "unknown option --bogus" in result.stderr
    result = gpu_check("--dry-run", "--only", "trian")
    assert result.returncode == 2 and "unknown step trian" in result.stderr
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is here: without --dry-run the script would run on the GPUs")
    result = gpu_check("--work-dir", tmp_path)
    assert result.returncode == 2 and "no NVIDIA GPU here" in result.stderr and "--dry-run" in result.stderr
    assert not (tmp_path / "steps").exists()


def test_the_validator_uses_effitrains_parser_and_config_checks():
    check = load("_gpu_check")
    check.validate_effitrain(["launch", "--nproc", "2", "--", "train", "--strategy", "fsdp", "--precision", "fp32"])
    check.validate_effitrain(["train", "--precision", "auto"])
    check.validate_effitrain(["env"])
    for bad in (["launch", "--nproc", "2", "--", "train", "--strategy", "fsdpp"],
                ["launch", "--nproc", "0", "--", "train"],
                ["launch", "--nproc", "2", "--", "predict", "--model", "x"],
                ["train", "--precision", "fp17"],
                ["train", "--batch-size", "0"],
                ["train", "--lr", "-1"],
                ["train", "--effective-batch-size", "32", "--grad-accum", "2"]):
        with pytest.raises(UserError):
            check.validate_effitrain(bad)
    check.validate_script(str(ROOT / "benchmarks" / "planner" / "memory_plan.py"), ["--json", "x.json"])
    with pytest.raises(SystemExit) as exited:
        check.validate_script(str(ROOT / "benchmarks" / "planner" / "memory_plan.py"), ["--only", "bogus"])
    assert exited.value.code == 2


def test_mfu_formula_and_peak_table():
    mfu = load("mfu")
    # PaLM's 6N + 12 L H Q T per token, with H x Q = hidden.
    assert mfu.flops_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3") == mfu.peak_flops("NVIDIA H200") == 989e12
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and mfu.peak_flops("NVIDIA L4") == 121e12
    for unknown in ("NVIDIA H100 PCIe", "NVIDIA L40S", "Tesla T4"):
        assert mfu.peak_flops(unknown) is None  # --peak-flops required: no guess
    assert mfu.main(["--heads", "7"]) == 2  # 2048 is not a multiple of 7: refused before anything is built


def test_equivalence_compares_elementwise():
    import torch

    equivalence = load("gpu_equivalence")
    reference = {"a": torch.randn(4, 4), "b": torch.zeros(3)}
    same = equivalence.differences(reference, {k: v.clone() for k, v in reference.items()}, 1e-5, 1e-5)
    assert same["close"] and same["max_abs_diff"] == same["max_tolerance_ratio"] == 0.0
    within = equivalence.differences(reference, {"a": reference["a"], "b": reference["b"] + 5e-6}, 1e-5, 1e-5)
    assert within["close"] and within["max_tolerance_ratio"] == pytest.approx(0.5, rel=1e-3)  # 5e-6 / 1e-5 at 0
    nudged = {"a": reference["a"] + 1e-3, "b": reference["b"]}
    assert not equivalence.differences(reference, nudged, 1e-5, 1e-5)["close"]
    missing = equivalence.differences(reference, {"a": reference["a"]}, 1e-5, 1e-5)
    assert not missing["close"] and missing["mismatched"] == ["b"]
    flags = equivalence.commands(2, 4, 6, Path("m"), Path("w"))
    assert flags["single"][flags["single"].index("--batch-size") + 1] == "8"
    assert flags["fsdp"][:4] == ["launch", "--nproc", "2", "--"] and "fsdp" in flags["fsdp"]


def test_the_results_page_from_a_runs_outputs(tmp_path):
    """The page a real run would write, from outputs shaped as the scripts and effitrain write them."""
    check = load("_gpu_check")
    steps = tmp_path / "steps"
    for number, name, status in ((1, "env", "ok"), (2, "train", "ok"), (3, "equivalence", "ok"),
                                 (4, "memory_plan", "timed out after 90 s"), (5, "mfu", "ok")):
        folder = steps / f"{number}-{name}"
        folder.mkdir(parents=True)
        (folder / "title").write_text(f"{number}. {name}\n")
        (folder / "status").write_text(status + "\n")
        (folder / "seconds").write_text("12\n")
        (folder / "commands").write_text(f"python {name} --flag\n")
    (steps / "1-env" / "log").write_text("device            cuda (MULTI_GPU, 1 process(es))\n"
                                         "torch             2.13.0\n")
    (steps / "4-memory_plan" / "log").write_text("model    b x len\ndefault    8 x 128  fp32 ...\n")
    (tmp_path / "train-default").mkdir()
    (tmp_path / "train-default" / "metrics.json").write_text(json.dumps(
        {"test": {"accuracy": 0.9918, "f1_macro": 0.982}, "train_samples_per_second": 900.5,
         "train_tokens_per_second": 22000.1, "peak_memory_bytes": 1200 * 2**20, "steps": 243, "world_size": 1,
         "precision": "bf16", "wall_seconds": 30.0, "train_seconds": 10.0}))
    (tmp_path / "equivalence.json").write_text(json.dumps({"rtol": 1e-5, "atol": 1e-5, "steps": 6, "nproc": 2,
        "commands": ["python -m effitrain train ...", "python -m effitrain launch --nproc 2 -- train ..."],
        "runs": [{"name": "single", "world_size": 1, "batch": 8, "train_loss": 0.5, "test_loss": 0.6, "close": True,
                  "exit_code": 0},
                 {"name": "ddp", "world_size": 2, "batch": 4, "train_loss": 0.5, "test_loss": 0.6, "close": True,
                  "max_abs_diff": 1e-7, "max_tolerance_ratio": 0.0123, "loss_rel_diff": 0.0, "exit_code": 0},
                 {"name": "fsdp", "world_size": 2, "batch": 4, "exit_code": 1, "close": False}]}))
    (tmp_path / "mfu.json").write_text(json.dumps({"device": "NVIDIA H200", "peak_flops": 989e12, "warmup": 3,
        "steps": 10, "rows": [{"checkpointing": False, "params": 953e6, "batch": 4, "seq": 2048, "step_seconds": 0.2,
                               "tokens_per_second": 40960, "model_flops_per_second": 2.5e14, "mfu": 0.2528,
                               "hfu": 0.2528, "peak_memory_bytes": 30 * 2**30, "loss": 10.4},
                              {"checkpointing": True, "batch": 4, "seq": 2048, "error": "out of memory at batch 4"}]}))
    out = tmp_path / "gpu-results.md"
    check.report(tmp_path, out, dry_run=False)
    page = out.read_text()
    assert "| device | cuda (MULTI_GPU, 1 process(es)) |" in page
    assert "| bf16 | 0.9918 | 0.9820 | 900.5 | 22000 | 1200 MiB | 243 | 10.0 | 30.0 | 1 |" in page
    assert "| ddp | 2 | 4 | 0 | 0.5 | 0.6 | 1.00e-07 | 0.012 | 0.00e+00 | PASS |" in page
    assert "| fsdp | 2 | 4 | 1 |" in page and "| FAIL |" in page
    assert "25.3%" in page and "out of memory at batch 4" in page and "NVIDIA H200, peak bf16 989 TFLOP/s" in page
    assert "timed out after 90 s" in page and "default    8 x 128" in page  # a failed step shows its last lines
    assert "python -m effitrain launch --nproc 2 -- train ..." in page  # the equivalence's own commands
