"""Experiment trackers (--report-to): what TensorBoard, trackio and MLflow hold after a run, read back with
their own APIs from the run folder, against log.jsonl; one set for two processes; Ctrl-C, then --resume
and --overwrite; the missing-package error; and no network call (conftest's guard logs every attempt)."""

import importlib.util
import os
import socket
import subprocess
import sys

import effitrain
import pytest
import yaml
from effitrain import config as cfg
from effitrain.errors import UserError
from effitrain.outputs import run_folder, tracking
from test_distributed import torchrun

from conftest import as_flags, read_jsonl

ALL = "tensorboard,trackio,mlflow"
TRAIN = ["loss", "lr", "grad_norm", "samples_per_second", "tokens_per_second", "peak_memory_bytes"]


def settings(model, out, **extra) -> dict:
    return {"model": str(model), "max_train_samples": 48, "max_eval_samples": 16, "batch_size": 8, "max_steps": 6,
            "log_every": 2, "eval_every": 3, "output_dir": str(out), "report_to": ALL, **extra}


def expected(run_dir) -> dict[str, dict[int, float]]:
    """log.jsonl's numbers by tracker name and step: train/<name> for the log steps, <split>/<metric> for
    the evaluations."""
    want: dict[str, dict[int, float]] = {}
    for record in read_jsonl(run_dir / "log.jsonl"):
        split = record.get("split")
        if split is None and "loss" not in record:
            continue  # not a log step (a skipped step, a memory plan)
        names = [key for key in record if key not in ("step", "epoch", "split")] if split else TRAIN
        for name in names:
            if isinstance(record.get(name), (int, float)):
                want.setdefault(f"{split or 'train'}/{name}", {})[record["step"]] = record[name]
    return want


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_runs(run_dir) -> list[tuple]:
    """(run, {metric: [(step, value), ...] in the order logged}) for each run of the store."""
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlruns' / tracking.MLFLOW_DB}")
    experiment = client.get_experiment_by_name(tracking.PROJECT)
    return [(run, {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                            key=lambda m: m.timestamp)]
                   for key in run.data.metrics})
            for run in client.search_runs([experiment.experiment_id])]


def trackio_runs(run_dir) -> list[tuple]:
    """(run, {metric: [(step, value), ...]}) for each run of the store."""
    tracking._point_trackio_at(run_dir / "trackio")  # trackio reads its folder from the environment, once
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    found = []
    for run in trackio.Api().runs(tracking.PROJECT):
        metrics: dict = {}
        for row in SQLiteStorage.get_logs(tracking.PROJECT, run.name):
            for key, value in row.items():
                if key not in ("step", "timestamp"):
                    metrics.setdefault(key, []).append((row["step"], value))
        found.append((run, metrics))
    return found


def assert_holds(got: dict[str, list], want: dict[str, dict[int, float]], rel: float = 1e-9) -> None:
    """One value per log step and per evaluation, that of log.jsonl (the last one logged, after a resume)."""
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for tag, values in want.items():
        assert sorted({step for step, _ in got[tag]}) == sorted(values), tag
        last = dict(got[tag])
        assert last == pytest.approx(values, rel=rel), tag


def test_report_to_names():
    assert cfg.report_to_names("none") == []
    assert cfg.report_to_names("tensorboard") == ["tensorboard"]
    assert cfg.report_to_names(" mlflow , trackio") == ["mlflow", "trackio"]
    for bad, needle in [("wandb", "unknown tracker `wandb`"), ("tensorbord", "did you mean tensorboard?"),
                        ("tensorboard,", "has an empty name"), ("tensorboard,tensorboard", "names tensorboard twice"),
                        ("none,mlflow", "mixes none with trackers"), ("", "--report-to is empty")]:
        with pytest.raises(UserError, match=needle):
            cfg.report_to_names(bad)


def test_records_become_scalars_and_the_config_flat_hyperparameters(tmp_path):
    step = {"step": 4, "epoch": 0.5, "loss": 0.7, "lr": 1e-4, "grad_norm": None, "samples_per_second": 12.5,
            "tokens_per_second": None, "peak_memory_bytes": 2**30, "elapsed_seconds": 1.5}
    assert tracking.scalars(step) == {"train/epoch": 0.5, "train/loss": 0.7, "train/lr": 1e-4,
                                      "train/samples_per_second": 12.5, "train/peak_memory_bytes": 2**30,
                                      "train/elapsed_seconds": 1.5}
    evaluation = {"step": 6, "epoch": 1.0, "split": "validation", "accuracy": 0.9, "loss": float("nan"), "samples": 16}
    assert tracking.scalars(evaluation) == {"validation/accuracy": 0.9, "validation/samples": 16}
    assert tracking.scalars({"step": 3, "skipped": "non-finite loss or gradient", "grad_norm": None}) == {}
    assert tracking.scalars({"step": 0, "memory_plan": "fits", "pieces": 2, "budget_bytes": 2**33}) == {}
    assert tracking.scalars({**step, "loss": None}) == {k: v for k, v in tracking.scalars(step).items()
                                                         if k != "train/loss"}  # every step of it skipped
    values = tracking.hyperparameters(cfg.build({"report_to": "tensorboard"}), tmp_path / "run",
                                      {"grad_accum": 2, "optim": "adamw"})
    assert values["lr"] == 1e-4 and values["max_steps"] == "None" and values["report_to"] == "tensorboard"
    assert values["plan/grad_accum"] == 2 and values["run_name"] == "run" and "plan" not in values
    assert all(isinstance(value, (bool, int, float, str)) for value in values.values())


def test_a_distilled_students_teacher_and_layers_are_hyperparameters(tmp_path):
    """The teacher (folder, alpha, T) and --student-layers, as every setting: what a tracker's run table shows."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    config = cfg.build({"report_to": "tensorboard", "distill_from": str(teacher), "distill_alpha": 0.3,
                        "distill_temperature": 4.0, "student_layers": 3})
    values = tracking.hyperparameters(config, tmp_path / "run", {})
    assert (values["distill_from"], values["distill_alpha"], values["distill_temperature"],
            values["student_layers"]) == (str(teacher), 0.3, 4.0, 3)


def test_stores_are_run_folders():
    """--overwrite replaces a run with trackers (and refuses a folder with other files)."""
    assert set(tracking.STORES.values()) <= run_folder.RUN_FOLDERS


def test_every_tracker_holds_the_log_then_overwrite_replaces_them(tiny_model_dir, tmp_path, network_attempts):
    out = tmp_path / "run"
    effitrain.train(settings(tiny_model_dir, out))
    want = expected(out)
    assert {step for step in want["train/loss"]} == {2, 4, 6}
    assert set(want["validation/accuracy"]) == {3, 6} and set(want["test/accuracy"]) == {6}
    assert all(f"train/{name}" in want for name in TRAIN)

    assert_holds(tensorboard_scalars(out), want, rel=1e-6)  # float32 in the event files
    [hparams] = [yaml.safe_load(p.read_text()) for p in (out / "tb").glob("*/hparams.yml")]
    assert hparams["lr"] == 1e-4 and hparams["plan/grad_accum"] == 1 and hparams["run_name"] == "run"

    [(run, metrics)] = mlflow_runs(out)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.0001" and run.data.params["report_to"] == ALL
    assert_holds(metrics, want)

    [(run, metrics)] = trackio_runs(out)
    assert run.name == "run" and run.config["max_steps"] == 6
    assert_holds(metrics, want)

    # A second run into the folder: the earlier run's stores go with it (MLflow's at the same path).
    effitrain.train(settings(tiny_model_dir, out, overwrite=True, report_to="mlflow", max_steps=2,
                             run_name="second"))
    assert sorted(p.name for p in (out / "mlruns").iterdir()) == ["mlflow.db"]  # no artifacts logged
    assert not (out / "tb").exists() and not (out / "trackio").exists()
    [(run, metrics)] = mlflow_runs(out)
    assert run.info.run_name == "second" and [step for step, _ in metrics["train/loss"]] == [2]
    assert network_attempts() == []


def test_two_processes_write_one_set(tiny_model_dir, tmp_path, network_attempts):
    out = tmp_path / "ddp"
    # trackio: accelerate's TrackioTracker would run on every process (main_process_only = False).
    result = torchrun(2, "train", *as_flags(settings(tiny_model_dir, out, batch_size=4,
                                                  report_to="tensorboard,trackio")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stderr.splitlines() if any(
        name in line.lower() for name in ("trackio", "mlflow", "tensorboard", "warn"))], result.stderr[-3000:]
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1  # the scalars, from process 0 only
    assert len(list((out / "tb").glob("*/hparams.yml"))) == 1
    want = expected(out)
    assert set(want["train/loss"]) == {2, 4, 6}
    assert_holds(tensorboard_scalars(out), want, rel=1e-6)
    [(_, metrics)] = trackio_runs(out)
    assert_holds(metrics, want)
    assert network_attempts() == []


def test_ctrl_c_closes_the_trackers_and_resume_continues_them(tiny_model_dir, tmp_path, monkeypatch):
    class InterruptedAfterStep5:
        def on_step_end(self, state, result):  # after the step's line is logged
            if state.step == 5:
                raise KeyboardInterrupt

    values = settings(tiny_model_dir, tmp_path / "run", log_every=1, save_every=3)
    with pytest.raises(KeyboardInterrupt):
        effitrain.train(values, callbacks=[InterruptedAfterStep5()])
    out = tmp_path / "run"
    [(run, _)] = mlflow_runs(out)
    assert run.info.status == "KILLED"  # closed, and not called finished
    assert [step for step, _ in tensorboard_scalars(out)["train/loss"]] == [1, 2, 3, 4, 5]

    effitrain.train({**values, "resume": "auto"})  # from the checkpoint of step 3: steps 4 and 5 run again
    want = expected(out)
    assert set(want["train/loss"]) == {1, 2, 3, 4, 5, 6}
    # TensorBoard hides what the stopped run logged after its checkpoint, as log.jsonl drops it.
    assert [step for step, _ in tensorboard_scalars(out)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert_holds(tensorboard_scalars(out), want, rel=1e-6)
    # MLflow and trackio continue the same run; the stopped run's steps 4 and 5 stay in their history.
    [(run, metrics)] = mlflow_runs(out)
    assert run.info.status == "FINISHED"
    assert_holds(metrics, want)
    [(_, metrics)] = trackio_runs(out)
    assert_holds(metrics, want)


def test_a_missing_tracker_package_is_one_line_before_anything_loads(tmp_path, monkeypatch, capsys):
    from effitrain import cli
    from effitrain.engine import setup

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "trackio" else real(name, *args))
    monkeypatch.setattr(setup, "load_data", lambda *args: pytest.fail("data loaded before the tracker check"))
    assert cli.main(["train", "--report-to", "tensorboard,trackio", "--output-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["effitrain: error: --report-to trackio needs the trackio package, which is not installed; "
                     "fix: pip install 'effitrain[trackers]', or drop it from --report-to"]
    assert not (tmp_path / "run").exists()


def test_the_tests_run_offline(network_attempts):
    """conftest's guard, here and in a subprocess: other machines are neither reached nor looked up."""
    with pytest.raises(OSError, match="the tests run offline"):
        socket.create_connection(("192.0.2.1", 80), timeout=1)  # TEST-NET-1
    with pytest.raises(OSError, match="not looked up"):
        socket.getaddrinfo("huggingface.co", 443)
    child = subprocess.run([sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 80), 1)"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 1 and "the tests run offline" in child.stderr
    with socket.create_server(("127.0.0.1", 0)) as server:  # this machine stays reachable
        socket.create_connection(server.getsockname(), timeout=5).close()
    assert [line.split(": ", 1)[1] for line in network_attempts()] == [
        "connection to ('192.0.2.1', 80)", "look-up of 'huggingface.co'", "connection to ('192.0.2.1', 80)"]
