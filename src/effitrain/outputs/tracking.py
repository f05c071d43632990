"""Experiment trackers (--report-to): TensorBoard, trackio and MLflow, through accelerate's trackers.

A sink of the run's log: every record the engine writes to log.jsonl also goes to the trackers, as
`train/<name>` (loss, lr, grad_norm, samples/s, tokens/s, peak memory, ...) or `<split>/<metric>`
(validation, test) at the record's step; the resolved config and plan are the run's hyperparameters.

Only the main process has trackers (one tracker run per job, not one per process), and they write
into the run's folder, to local files: TensorBoard's event files in tb/, trackio's SQLite store in
trackio/, MLflow's SQLite store in mlruns/mlflow.db (artifact root mlruns/artifacts/); each in a
folder of its own, so that what a killed run leaves (an SQLite journal) is inside it. No server is
started and no connection opened: trackio is told its folder and to stay local, MLflow's telemetry
is off."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import sys
from pathlib import Path
from typing import Any

from effitrain.config import TrainConfig, report_to_names
from effitrain.errors import UserError

PROJECT = "effitrain"  # trackio's project and MLflow's experiment (each run folder has its own store)
# The folders the trackers write in the run folder (outputs.RUN_FOLDERS lists them too).
STORES = {"tensorboard": "tb", "trackio": "trackio", "mlflow": "mlruns"}
MLFLOW_DB = "mlflow.db"  # in mlruns/, beside artifacts/
PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "mlflow": "mlflow"}
# Variables that would send trackio's or MLflow's records elsewhere than the run folder.
REMOTE_VARIABLES = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID",
                    "TRACKIO_WEBHOOK_URL", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME")


def check_installed(config: TrainConfig) -> None:
    """Before anything heavy loads: each tracker asked for has its package."""
    for name in report_to_names(config.report_to):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"--report-to {name} needs the {PACKAGES[name]} package, which is not installed",
                            "pip install 'effitrain[trackers]', or drop it from --report-to")


def trackers(config: TrainConfig, out_dir: Path, resumed_step: int | None) -> list:
    """accelerate's trackers for --report-to, for the main process's Accelerator(log_with=...).
    `resumed_step`: the checkpoint's step when resuming (what was logged after it is logged again)."""
    from accelerate.tracking import TensorBoardTracker

    name = run_name(config, out_dir)
    made = []
    for kind in report_to_names(config.report_to):
        if kind == "tensorboard":
            # purge_step: TensorBoard hides what a killed run logged after its checkpoint, as log.jsonl drops it.
            purge = {} if resumed_step is None else {"purge_step": resumed_step + 1}
            made.append(TensorBoardTracker(STORES[kind], str(out_dir), **purge))  # out_dir/tb
        elif kind == "trackio":
            made.append(_local_trackio()(out_dir / STORES[kind], name))
        else:
            made.append(_local_mlflow()(out_dir / STORES[kind], name))
    return made


def run_name(config: TrainConfig, out_dir: Path) -> str:
    return config.run_name or Path(out_dir).resolve().name


def start(accelerator, config: TrainConfig, out_dir: Path, plan: dict) -> TrackerLog | None:
    """Start the accelerator's trackers with the run's hyperparameters; None when there are none.
    accelerator.end_training() (in the run's clean-up, also on failure) closes them."""
    names = report_to_names(config.report_to)
    if not names or not accelerator.is_main_process:
        return None
    for variable in REMOTE_VARIABLES:
        os.environ.pop(variable, None)
    accelerator.init_trackers(PROJECT, config=hyperparameters(config, out_dir, plan))
    accelerator.print(f"logging to {', '.join(f'{kind} ({out_dir / STORES[kind]})' for kind in names)}")
    return TrackerLog(accelerator)


def hyperparameters(config: TrainConfig, out_dir: Path, plan: dict) -> dict[str, Any]:
    """The resolved config and plan as flat scalars: TensorBoard's hparams take numbers, booleans and
    strings only (None and lists become text)."""
    values = {**config.to_dict(), "output_dir": str(out_dir), "run_name": run_name(config, out_dir)}
    values.pop("plan")  # what was pinned: the plan below is what the run resolved
    values.update({f"plan/{key}": value for key, value in plan.items()})
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value) for key, value in values.items()}


def scalars(record: dict) -> dict[str, float]:
    """A log record's numbers under the trackers' names: an evaluation's (`split`) as validation/<metric>
    or test/<metric>, a log step's (it has `loss`) as train/<name>; None, text and non-finite values
    left out, and so are the other records (a skipped step, an out-of-memory retry, the memory plan)."""
    split = record.get("split")
    if not split and "loss" not in record:
        return {}
    prefix, skip = (f"{split}/", {"step", "epoch", "split"}) if split else ("train/", {"step"})
    return {prefix + key: value for key, value in record.items()
            if key not in skip and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class TrackerLog:
    """The trackers as a sink of the run log (outputs/sinks.RunLog): accelerator.log writes on the main
    process only."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def write(self, record: dict) -> None:
        values = scalars(record)
        if values:
            self.accelerator.log(values, step=int(record["step"]))

    def close(self) -> None:
        """Nothing: accelerator.end_training() finishes the trackers, after the last record."""


@contextlib.contextmanager
def _quiet_stdout():
    """trackio prints its progress (`* Trackio project initialized`, `* Run finished. Uploading logs`)
    on stdout: the run's own lines say where the records are."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _point_trackio_at(folder: Path) -> None:
    """trackio reads TRACKIO_DIR once, when imported, into module constants: set it before the import,
    and repoint those constants when an earlier run of this process imported it for another folder."""
    folder = folder.resolve()
    os.environ["TRACKIO_DIR"] = str(folder)
    utils = sys.modules.get("trackio.utils")
    if utils is None or utils.TRACKIO_DIR == folder:
        return
    new = {"TRACKIO_DIR": folder, "MEDIA_DIR": folder / "media", "ARTIFACTS_DIR": folder / "artifacts"}
    old = {name: getattr(utils, name) for name in new}
    for module in [m for name, m in sys.modules.items() if name == "trackio" or name.startswith("trackio.")]:
        for name, value in new.items():
            if getattr(module, name, None) == old[name]:
                setattr(module, name, value)


def _local_trackio():
    from accelerate.tracking import TrackioTracker, on_main_process

    class LocalTrackio(TrackioTracker):
        """trackio's local SQLite store in `folder`: no Space, no dashboard, no system monitor
        threads; resuming the run of the same name when the folder has it (--resume)."""

        main_process_only = True  # accelerate's TrackioTracker runs on every process

        def __init__(self, folder: Path, name: str):
            super().__init__(PROJECT, name=name, resume="allow", embed=False, auto_log_cpu=False,
                             auto_log_gpu=False)
            self.folder = folder

        @on_main_process
        def start(self):
            _point_trackio_at(self.folder)
            with _quiet_stdout():
                super().start()

        @on_main_process
        def finish(self):
            import trackio

            if getattr(self, "run", None) is None:  # another tracker failed to start before this one
                return
            with _quiet_stdout():
                trackio.finish()  # also forgets the run: trackio's exit hook would finish it again

    return LocalTrackio


def _local_mlflow():
    from accelerate.tracking import MLflowTracker, on_main_process

    class LocalMLflow(MLflowTracker):
        """MLflow's SQLite store folder/mlflow.db (MLflow 3.17 refuses its file store), artifacts in
        folder/artifacts, telemetry off; resuming the run of the same name when the store has it."""

        def __init__(self, folder: Path, name: str):
            super().__init__(experiment_name=PROJECT, logging_dir=str((folder / "artifacts").resolve()),
                             run_name=name)
            self.experiment_name, self.run_id = PROJECT, None  # not MLFLOW_* variables: this store is the run's
            self.folder = folder
            self.uri = f"sqlite:///{(folder / MLFLOW_DB).resolve()}"

        @on_main_process
        def start(self):
            import logging

            os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # read when mlflow is imported
            import mlflow

            logging.getLogger("mlflow").setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."
            _forget_store(self.uri)
            self.folder.mkdir(exist_ok=True)
            mlflow.set_tracking_uri(self.uri)
            experiment = mlflow.get_experiment_by_name(PROJECT)
            found = [run for run in mlflow.search_runs([experiment.experiment_id], output_format="list")
                     if run.info.run_name == self.run_name] if experiment else []
            self.run_id = found[0].info.run_id if found else None
            super().start()

        @on_main_process
        def store_init_configuration(self, values: dict):
            """A resumed run keeps the values it started with (MLflow refuses to change a parameter);
            parameters new since then are added."""
            import mlflow

            if self.run_id is not None:
                logged = mlflow.get_run(self.run_id).data.params
                values = {key: value for key, value in values.items() if key not in logged}
            super().store_init_configuration(values)

        @on_main_process
        def finish(self):
            import mlflow

            # Called by the run's clean-up: while an error or Ctrl-C unwinds it, the run did not finish.
            error = sys.exc_info()[1]
            mlflow.end_run("FINISHED" if error is None else "FAILED" if isinstance(error, Exception) else "KILLED")
            _forget_store(self.uri)

    return LocalMLflow


def _forget_store(uri: str) -> None:
    """MLflow keeps a store and a database connection per URI for the life of the process: dropped when
    a run starts and ends, so that a run of this process (the Python API) into a folder whose mlflow.db
    was replaced since (--overwrite) does not use a connection to the replaced file (`readonly
    database`), nor a store that created its tables there (`no such table`)."""
    with contextlib.suppress(ImportError, AttributeError):  # MLflow's internals, as of 3.17
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        engine = SqlAlchemyStore._engine_map.pop(uri, None)
        if engine is not None:
            engine.dispose()
        _tracking_store_registry._get_store_with_resolved_uri.cache_clear()
