"""A training run seen from outside the engine: the checks that need no heavy library, the output
folder's lock, the run itself, and what is left behind when it fails or is stopped. Nothing here
imports torch or transformers until the engine starts, so that a mistake answers at once."""

from __future__ import annotations

import json
from pathlib import Path

from effitrain import outputs
from effitrain.config import TrainConfig
from effitrain.errors import UserError


def train(config: TrainConfig, config_file: str | None = None) -> dict:
    """Run one training job; returns the metrics written to metrics.json."""
    from effitrain.engine import checkpoint

    out = Path(config.output_dir) if config.output_dir else None
    if config.resume == "auto" and out is not None:
        finished = finished_run(config, out)
        if finished is not None:
            return finished
    resume_from = checkpoint.find(out, config.resume) if config.resume else None
    run_dir = None
    if outputs.is_main_process():  # the other processes write into the folder process 0 holds
        inputs = (config.data, config.validation_file, config.test_file, config.model, config_file, config.resume)
        run_dir = outputs.RunDir(out, config.overwrite, resume=resume_from is not None, inputs=inputs).acquire()
    try:  # the CLI turns SIGINT and SIGTERM into exceptions (cli._signals_unwind): they come here too
        from effitrain import tasks
        from effitrain.engine.run import run

        tasks.get(config.task).check_config(config)  # the task's own rules (it imports torch)
        result = run(config, run_dir)
    except BaseException as err:
        if run_dir is not None:
            run_dir.fail(user_mistake=isinstance(err, UserError))
        raise
    if run_dir is not None:
        run_dir.succeed()
    return result


def finished_run(config: TrainConfig, out: Path) -> dict | None:
    """--resume auto on a run that already ended: its metrics, untouched (a retried job finds its work
    done); refused if the settings differ from the run's."""
    from effitrain.engine.checkpoint import MUST_MATCH

    if not ((out / "metrics.json").is_file() and (out / "model").is_dir() and (out / "config.yaml").is_file()):
        return None
    import yaml

    try:
        earlier = yaml.safe_load((out / "config.yaml").read_text()) or {}
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    now = config.to_dict()
    for key in MUST_MATCH:
        if key in earlier and earlier[key] != now.get(key):
            raise UserError(f"--resume auto: the run in {out} has finished, with {key}={earlier[key]!r} (this "
                            f"command has {now.get(key)!r})", "pass its settings to see it finished, --overwrite to "
                            "train it again, or another --output-dir")
    if outputs.is_main_process():
        print(f"the run in {out} has already finished (metrics.json); nothing to resume")
    return metrics
