"""A training run seen from outside the engine: the checks that need no heavy library, the output
folder's lock, the run itself, and what is left behind when it fails or is stopped. Nothing here
imports torch or transformers until the engine starts, so that a mistake answers at once."""

from __future__ import annotations

import json
from pathlib import Path

from effitrain import config as cfg
from effitrain.config import TrainConfig
from effitrain.errors import Diverged, UserError
from effitrain.outputs import run_folder


def train(config: TrainConfig, config_file: str | None = None, command: bool = False, callbacks=()) -> dict:
    """Run one training job; returns the metrics written to metrics.json. `command`: run by the
    `effitrain` command, whose process start counts as the run's start-up (imports, arguments).
    `callbacks`: hooks into the loop (engine/callbacks.py)."""
    from effitrain.data import sources
    from effitrain.engine import callbacks as hooks
    from effitrain.engine import checkpoint
    from effitrain.models import loading

    callbacks = hooks.checked(callbacks)  # before anything runs or is written
    loading.check_local(config.model, config.allow_pickle)  # paths first: no library needed to refuse them
    for flag, source in (("--data", config.data), ("--validation-file", config.validation_file),
                         ("--test-file", config.test_file)):
        if source is not None:
            sources.locate(source, flag)
    out = Path(config.output_dir) if config.output_dir else None
    if config.resume == "auto" and out is not None:
        done = finished_run(config, out)
        if done is not None:
            return done
    run_dir = None
    if run_folder.is_main_process():  # the other processes write into the folder process 0 holds
        inputs = (config.data, config.validation_file, config.test_file, config.model, config_file, config.resume)
        run_dir = run_folder.RunDir(out, config.overwrite, inputs=inputs)
        run_dir.acquire(config.resume, lambda: checkpoint.find(run_dir.path, config.resume) if config.resume else None)
    try:  # the CLI turns SIGINT and SIGTERM into exceptions (cli._signals_unwind): they come here too
        from effitrain import tasks
        from effitrain.engine.run import run

        tasks.for_config(config).check_config(config)  # the task's own rules (it imports torch)
        result = run(config, run_dir, command, callbacks)
    except BaseException as err:
        if run_dir is not None:  # a diverged run keeps what it wrote (log, checkpoints, best/): not a mistake to undo
            run_dir.fail(user_mistake=isinstance(err, UserError) and not isinstance(err, Diverged))
        raise
    if run_dir is not None:
        try:
            from effitrain.report import page

            page.write_for_run(run_dir.path)  # report.html: never fails the run
        finally:
            run_dir.succeed()
    return result


def finished_run(config: TrainConfig, out: Path) -> dict | None:
    """--resume auto on a run that already ended: its metrics, untouched (a retried job finds its work
    done); refused if the settings differ from the run's."""
    from effitrain.engine.checkpoint import must_match, same_setting

    if not (run_folder.finished(out) and (out / "config.yaml").is_file()):
        return None
    import yaml

    try:
        earlier = yaml.safe_load((out / "config.yaml").read_text()) or {}
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    now = config.to_dict()
    for key in must_match(earlier):
        if key in earlier and not same_setting(key, earlier[key], now.get(key)):
            if config.overwrite:
                return None  # --overwrite --resume auto with other settings: replace it
            raise UserError(f"--resume auto: the run in {out} has finished, with {key}={earlier[key]!r} (this "
                            f"command has {now.get(key)!r})", "pass its settings to see it finished, --overwrite to "
                            "train it again, or another --output-dir")
    if run_folder.is_main_process():
        print(f"the run in {out} has already finished (metrics.json); nothing to resume")
    return metrics


def add_parser(commands) -> None:
    parser = commands.add_parser("train", help="fine-tune a model (defaults: all-MiniLM-L6-v2 on SMS spam)")
    parser.add_argument("--config", help="YAML file whose keys are these flags' names with underscores; "
                                         "flags given here override it")
    cfg.add_flags(parser, cfg.cli_fields(), grouped=True)


def configured(args) -> tuple[TrainConfig, str | None]:
    """The run's settings from the flags and the --config file, validated; and that file."""
    values = vars(args).copy()
    values.pop("command")
    config_file = values.pop("config", None)
    file_values = cfg.load_yaml(config_file) if config_file is not None else {}
    return cfg.build(file_values, values), config_file


def check_flags(args) -> None:
    configured(args)


def main(args) -> int:
    train(*configured(args), command=True)
    return 0
