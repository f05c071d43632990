"""effitrain bench: the matrix, the table, bench.json and bench.png on fake metrics, then one real bench."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
from effitrain.commands import bench
from effitrain.errors import UserError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def fake(name: str, status: str = "ok", **metrics) -> dict:
    return {"name": name, "status": status, "seconds": 1.5, "error": None if status == "ok" else "boom",
            "note": None, "metrics": {key: metrics.get(key) for key in bench.KEPT_METRICS}}


BASE = dict(train_samples_per_second=100.0, train_tokens_per_second=2000.0, peak_memory_bytes=2 * 2**30,
            optimizer_state_bytes_per_param=8.0, optimizer_state_bytes=8 * 2**20, step_seconds=0.16, train_loss=0.5,
            test_accuracy=0.9)


def test_defaults():
    args = parse()
    assert (args.model, args.task, args.data, args.steps, args.batch_size, args.max_length, args.seed) == (
        "default", "sequence-classification", "sms-spam", 20, 16, 128, 42)
    assert args.output_dir is None and args.variants is None and not args.overwrite and not args.debug
    assert parse("--extra", "--max-train-samples 500").extra == "--max-train-samples 500"


def test_variant_selection_keeps_the_matrix_order():
    assert bench.select_variants(None) == list(bench.VARIANTS)
    assert bench.select_variants("recommended, grad-accum,baseline,") == ["baseline", "grad-accum", "recommended"]


@pytest.mark.parametrize("spec", ["baseline,fp8", ","])
def test_unknown_variant_is_a_user_error_listing_the_names(spec):
    with pytest.raises(UserError) as err:
        bench.select_variants(spec)
    assert all(name in err.value.fix for name in bench.VARIANTS)


def test_each_variant_is_the_baseline_with_one_change():
    assert bench.settings_flags(bench.variant_settings("baseline", 16)) == [
        "--batch-size", "16", "--precision", "fp32", "--optim", "adamw"]
    assert bench.variant_settings("grad-accum", 16) == {"batch_size": 8, "grad_accum": 2, "precision": "fp32",
                                                        "optim": "adamw"}
    assert "--gradient-checkpointing" in bench.settings_flags(bench.variant_settings("gradient-checkpointing", 16))
    assert bench.variant_settings("bf16", 16)["precision"] == "bf16"
    assert bench.variant_settings("adamw-8bit", 16)["optim"] == "adamw-8bit"
    assert bench.settings_flags(bench.variant_settings("recommended", 16)) == [
        "--batch-size", "16", "--precision", "auto", "--optim", "adamw"]
    assert bench.settings_flags(bench.variant_settings("recommended", 16, checkpointing=True))[-1] == (
        "--gradient-checkpointing")
    with pytest.raises(UserError, match="even --batch-size"):
        bench.variant_settings("grad-accum", 5)


def test_recommended_checkpoints_only_above_80_percent_of_memory():
    assert bench.needs_checkpointing({"peak_memory_bytes": 85}, 100)[0] is True
    on, note = bench.needs_checkpointing({"peak_memory_bytes": 80}, 100)
    assert on is False and "80%" in note
    assert bench.needs_checkpointing(None, 100)[0] is False
    assert bench.needs_checkpointing({"peak_memory_bytes": None}, 100)[0] is False


def test_train_command_and_extra_flags(tmp_path):
    args = parse("--steps", "7", "--extra", "--max-train-samples 64 --text-column 'the text'")
    extra = bench.parse_extra(args.extra)
    command = bench.train_command(args, bench.variant_settings("baseline", 16), tmp_path / "baseline", extra)
    assert command[:4] == [sys.executable, "-m", "effitrain", "train"]
    assert command[-4:] == ["--max-train-samples", "64", "--text-column", "the text"]
    at = command.index("--max-steps")
    assert command[at:at + 4] == ["--max-steps", "7", "--log-every", "7"]
    assert bench.display(command).startswith("effitrain train --model default ")
    with pytest.raises(UserError, match="--max-steps"):
        bench.parse_extra("--max-steps=5")
    with pytest.raises(UserError, match="close the quotes"):
        bench.parse_extra("--text-column 'oops")


def test_default_matrix_skips_emulated_bf16(monkeypatch):
    from effitrain.runtime import devices

    monkeypatch.setattr(devices, "has_accelerator", lambda: False)
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: False)
    assert list(bench.default_skips(list(bench.VARIANTS))) == ["bf16"]
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    assert bench.default_skips(list(bench.VARIANTS)) == {}


def test_ratios_and_table_from_fake_metrics():
    results = [
        fake("baseline", **BASE),
        fake("adafactor", **{**BASE, "train_samples_per_second": 50.0, "optimizer_state_bytes_per_param": 0.5,
                             "train_tokens_per_second": None, "train_loss": None}),
        fake("adamw-8bit", status="failed"),
    ]
    bench.add_ratios(results)
    assert set(results[0]["ratios"].values()) == {1.0}
    assert results[1]["ratios"]["train_samples_per_second"] == 0.5
    assert results[1]["ratios"]["optimizer_state_bytes_per_param"] == 0.0625
    assert results[1]["ratios"]["train_loss"] is None and set(results[2]["ratios"].values()) == {None}

    table = bench.format_table(results)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["variant", "status", "samples/s"]
    assert "100.0 (1.00x)" in lines[1] and "2048 (1.00x)" in lines[1] and "8.00 (1.00x)" in lines[1]
    assert "50.0 (0.50x)" in lines[2] and "0.50 (0.062x)" in lines[2]
    assert lines[2].split().count("-") == 2  # no tokens/s, no loss
    assert lines[3].split()[:2] == ["adamw-8bit", "failed"] and "adamw-8bit failed: boom" in table
    assert len({len(line) for line in lines[:4]}) == 1  # aligned columns


def test_no_baseline_means_no_ratios():
    results = [fake("bf16", **BASE)]
    bench.add_ratios(results)
    assert "(" not in bench.format_table(results).splitlines()[1]
    assert "no ratios" in bench.format_table(results)


def test_report_is_json_with_every_variant(tmp_path):
    results = [fake("baseline", **BASE), fake("bf16", **BASE)]
    bench.add_ratios(results)
    data = json.loads(json.dumps(bench.report(parse(), ["--x"], results)))
    assert data["steps"] == 20 and data["extra"] == ["--x"]
    assert [v["name"] for v in data["variants"]] == ["baseline", "bf16"]
    assert data["variants"][1]["ratios"]["peak_memory_bytes"] == 1.0


def test_chart_is_a_png(tmp_path):
    results = [fake("baseline", **BASE), fake("bf16", **{**BASE, "peak_memory_bytes": 2**30}),
               fake("adamw-8bit", status="failed")]
    bench.add_ratios(results)
    path = bench.write_chart(tmp_path / "bench.png", results)
    assert path == tmp_path / "bench.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failed_child_gives_its_last_stderr_line(tmp_path):
    command = [sys.executable, "-c", "import sys; print('out'); sys.stderr.write('noise\\nfinal words\\n'); "
                                     "sys.exit(3)"]
    result = bench.run_variant("x", command, tmp_path / "x.log")
    assert (result["status"], result["returncode"], result["error"]) == ("failed", 3, "final words")
    assert "out" in (tmp_path / "x.log").read_text()
    assert bench.outcome_line(result).startswith("FAILED (exit 3) after ")


def test_matrix_decides_recommended_from_the_baseline(tmp_path, monkeypatch, capsys):
    """The orchestration without training: each child is replaced by fake metrics."""
    commands = {}

    def fake_run(name, command, log_path, stream=False):
        commands[name] = command
        if name == "adafactor":
            return {**fake(name, status="failed"), "returncode": 1, "command": command}
        return {**fake(name, **BASE, device="cpu"), "returncode": 0, "command": command}

    monkeypatch.setattr(bench, "run_variant", fake_run)
    monkeypatch.setattr(bench, "machine_memory_bytes", lambda device: int(BASE["peak_memory_bytes"] / 0.9))
    names = ["baseline", "adafactor", "recommended"]
    results = bench.run_matrix(parse(), names, {}, [], tmp_path)
    assert [r["name"] for r in results] == names
    assert "--gradient-checkpointing" in commands["recommended"] and "on" in results[2]["note"]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/3] baseline: effitrain train ") and out[1] == (
        "[1/3] baseline: done in 1.5 s, 100.0 samples/s")
    assert out[3].startswith("[2/3] adafactor: FAILED (exit 1)")


def test_unknown_variant_and_busy_output_dir_are_refused(tmp_path):
    with pytest.raises(UserError, match="unknown variant"):
        bench.main(parse("--variants", "turbo", "--output-dir", str(tmp_path / "b")))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text("{}")
    with pytest.raises(UserError, match="already holds files"):
        bench.main(parse("--variants", "baseline", "--output-dir", str(tmp_path / "b")))
    assert (tmp_path / "b" / "bench.json").read_text() == "{}"


def test_bench_runs_two_variants_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    args = parse("--model", str(tiny_model_dir), "--variants", "baseline,grad-accum", "--steps", "2",
                 "--extra", "--max-train-samples 64 --max-eval-samples 16", "--output-dir", str(out))
    assert bench.main(args) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "[1/2] baseline: effitrain train" in printed and "[2/2] grad-accum: done in" in printed
    data = json.loads((out / "bench.json").read_text())
    baseline, accum = data["variants"]
    assert (baseline["name"], baseline["status"], accum["name"], accum["status"]) == (
        "baseline", "ok", "grad-accum", "ok")
    assert baseline["ratios"]["train_samples_per_second"] == 1.0
    assert baseline["ratios"]["peak_memory_bytes"] == 1.0
    assert accum["ratios"]["train_samples_per_second"] > 0
    assert baseline["metrics"]["steps"] == accum["metrics"]["steps"] == 2
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "grad-accum" / "metrics.json").is_file()
    # report.html compares the variants (report/), with the curves as a PNG beside it; each variant's own too
    page = (out / "report.html").read_text()
    assert "What differs" in page and "grad-accum" in page and "baseline" in page
    assert (out / "report-curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "baseline" / "report.html").is_file()


def test_machine_memory_is_the_ram_on_cpu_and_a_gpu_size_or_none_on_cuda():
    from effitrain.runtime import devices

    assert bench.machine_memory_bytes("cpu") == devices.total_memory_bytes()
    gpu = bench.machine_memory_bytes("cuda")
    assert gpu is None or gpu > 2**30


def test_optimizers_compares_adamw_with_every_other_optimizer(monkeypatch):
    import importlib.util

    from effitrain import config as cfg

    assert bench.OPTIMIZER_VARIANTS == tuple(name for name in cfg.OPTIMIZERS if name != "adamw")
    assert [bench.variant_settings(name, 16)["optim"] for name in bench.OPTIMIZER_VARIANTS] == list(
        bench.OPTIMIZER_VARIANTS)
    assert bench.select_variants("muon,baseline") == ["baseline", "muon"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "schedulefree" else real(name, *a))
    assert bench.missing_packages(["baseline", "muon", "schedule-free-adamw"]) == {
        "schedule-free-adamw": "needs schedulefree: pip install 'effitrain[optimizers]'"}


def test_optimizers_matrix_runs_every_optimizer_and_skips_a_missing_package(tmp_path, monkeypatch, capsys):
    """`bench --optimizers` without training: each child replaced by fake metrics."""
    import importlib.util

    commands = {}

    def fake_run(name, command, log_path, stream=False):
        commands[name] = command
        state = 8 * 2**20 if name == "baseline" else 2**20
        return {**fake(name, **{**BASE, "optimizer_state_bytes": state}, device="cpu"), "returncode": 0,
                "command": command}

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "schedulefree" else real(name, *a))
    monkeypatch.setattr(bench, "run_variant", fake_run)
    with pytest.raises(UserError, match="--optimizers and --variants both choose"):
        bench.main(parse("--optimizers", "--variants", "baseline", "--output-dir", str(tmp_path / "no")))
    assert bench.main(parse("--optimizers", "--output-dir", str(tmp_path / "b"))) == 0
    ran = [name for name in bench.ORDER if name in commands]
    assert ran == ["baseline", *(n for n in bench.OPTIMIZER_VARIANTS if n != "schedule-free-adamw")]
    assert all(commands[n][commands[n].index("--optim") + 1] == (n if n != "baseline" else "adamw") for n in ran)
    data = json.loads((tmp_path / "b" / "bench.json").read_text())
    by_name = {v["name"]: v for v in data["variants"]}
    assert by_name["schedule-free-adamw"]["status"] == "skipped"
    assert by_name["muon"]["ratios"]["optimizer_state_bytes"] == 0.125
    header = capsys.readouterr().out
    assert all(title in header for title in ("optim MiB", "step ms", "test acc"))
