"""Command line: train, predict, inspect, env. Heavy libraries are imported inside the commands,
so that `--help` and bad flags answer at once."""

from __future__ import annotations

import argparse
import json
import os
import sys

from effitrain import config as cfg
from effitrain.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse prints usage plus a message over two lines; effitrain's contract is one line, exit 2."""

    def error(self, message: str):
        raise UserError(message, f"see `{self.prog} --help`")


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file whose keys are these flags' names with underscores; "
                                         "flags given here override it")
    types = cfg.field_types()
    for f in cfg.fields():
        kind, _ = cfg.base_type(types[f.name])
        default = f" (default: {f.default})" if f.default is not None else ""
        common = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata["help"] + default}
        if kind is bool:
            parser.add_argument(cfg.flag(f.name), action=argparse.BooleanOptionalAction, **common)
        else:
            parser.add_argument(cfg.flag(f.name), type=kind, choices=f.metadata.get("choices"),
                                metavar=f.name.upper(), **common)


def build_parser() -> Parser:
    parser = Parser(prog="effitrain", description="Fine-tune pretrained transformers efficiently.")
    parser.add_argument("--version", action="version", version=f"effitrain {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = commands.add_parser("train", help="fine-tune a model (defaults: all-MiniLM-L6-v2 on SMS spam)")
    add_train_flags(train)

    predict = commands.add_parser("predict", help="label texts with a trained model directory")
    predict.add_argument("--model", required=True, help="a model/ directory written by `effitrain train`")
    predict.add_argument("--text", action="append", help="a text to label (repeatable)")
    predict.add_argument("--input", help="a JSONL file with one {\"text\": ...} per line")
    predict.add_argument("--batch-size", type=int, default=64)
    predict.add_argument("--debug", action="store_true")

    inspect = commands.add_parser("inspect", help="show a model's configuration and parameter counts")
    inspect.add_argument("model", nargs="?", default="default", help="default, a directory or a cached hub id")
    inspect.add_argument("--task", default="sequence-classification", choices=cfg.TASKS)
    inspect.add_argument("--json", action="store_true", help="print the counts and device as JSON")
    inspect.add_argument("--debug", action="store_true")

    launch = commands.add_parser("launch", help="run a command on several processes and machines (torchrun)",
                                 description="effitrain launch [options] -- train ...")
    launch.add_argument("--nproc", type=int, default=1, help="processes on this node (one per GPU, or CPU workers)")
    launch.add_argument("--nnodes", type=int, default=1, help="number of machines")
    launch.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0 for the master")
    launch.add_argument("--master-addr", default=None, help="address of node 0 (default 127.0.0.1)")
    launch.add_argument("--master-port", type=int, default=None, help="a free port on node 0, the same on all nodes")
    launch.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times on failure")
    launch.add_argument("--debug", action="store_true")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the effitrain command and its flags")

    bench = commands.add_parser("bench", help="measure each efficiency technique against a baseline")
    from effitrain import bench as bench_module

    bench_module.add_arguments(bench)

    env = commands.add_parser("env", help="show the devices and precisions Accelerator detects")
    env.add_argument("--json", action="store_true")
    env.add_argument("--debug", action="store_true")
    return parser


def _version() -> str:
    from effitrain import __version__

    return __version__


def cmd_train(args: argparse.Namespace) -> int:
    from effitrain.engine.loop import run

    values = vars(args).copy()
    values.pop("command")
    file_values = cfg.load_yaml(values.pop("config")) if values.get("config") else {}
    values.pop("config", None)
    run(cfg.build(file_values, values))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from effitrain import models
    from effitrain.predict import predict, read_inputs

    if args.batch_size <= 0:
        raise UserError(f"--batch-size must be > 0, got {args.batch_size}", "pass e.g. --batch-size 64")
    texts = read_inputs(args.text, args.input)
    models.quiet_libraries(args.debug)
    for result in predict(args.model, texts, args.batch_size):
        print(json.dumps(result, ensure_ascii=False))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from effitrain import models
    from effitrain.devices import make_accelerator

    models.quiet_libraries(args.debug)
    path = models.resolve(args.model)
    model = models.build_on_meta(path, args.task)
    counts = models.parameter_counts(model)
    device = str(make_accelerator().device)
    if args.json:
        print(json.dumps({"model": str(path), "config": model.config.to_dict(), "parameters": counts,
                          "device": device}))
        return 0
    print(f"model: {path}")
    print(model.config)
    print(f"parameters: {counts['total']:,} total, {counts['trainable']:,} trainable, "
          f"{counts['embedding']:,} in embeddings ({args.task} head for {model.config.num_labels} labels)")
    print(f"Accelerator would train on: {device}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from effitrain import bench

    return bench.run(args)


def cmd_env(args: argparse.Namespace) -> int:
    from effitrain import devices

    info = devices.report()
    print(json.dumps(info, indent=2) if args.json else devices.format_report(info))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from effitrain.launch import launch

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return launch(args, command)


def _record_for_launcher(err: BaseException) -> None:
    """Under torchrun, leave the cause where the launcher reads it, so its one line can name it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)


COMMANDS = {"train": cmd_train, "predict": cmd_predict, "inspect": cmd_inspect, "env": cmd_env,
            "launch": cmd_launch, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    # effitrain never downloads: without this, a hub look-up would wait on network time-outs.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not debug:
        from effitrain.models import quiet_import_warnings

        quiet_import_warnings()
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UserError as err:
        if debug:
            raise
        _record_for_launcher(err)
        print(f"effitrain: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        if type(err).__name__ != "LaunchFailed":
            _record_for_launcher(err)
            raise
        print(f"effitrain launch: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("effitrain: interrupted", file=sys.stderr)
        return 130
