"""Command line: train, predict, inspect, env. Heavy libraries are imported inside the commands,
so that `--help` and bad flags answer at once."""

from __future__ import annotations

import argparse
import contextlib
import errno
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
    add_config_flags(parser, cfg.cli_fields())


def add_config_flags(parser: argparse.ArgumentParser, fields, default_notes: dict[str, str] | None = None) -> None:
    """One flag per config field (bools get --no-...); absent flags stay absent, so that a YAML file
    or train's defaults fill them."""
    types = cfg.field_types()
    for f in fields:
        kind, _ = cfg.base_type(types[f.name])
        default = f" (default: {f.default})" if f.default is not None else ""
        default = (default_notes or {}).get(f.name, default)
        common = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata["help"] + default}
        if kind is bool:
            parser.add_argument(cfg.flag(f.name), action=argparse.BooleanOptionalAction, **common)
        else:
            parser.add_argument(cfg.flag(f.name), type=kind, choices=f.metadata.get("choices"),
                                metavar=f.name.upper(), **common)


def add_predict_flags(predict: argparse.ArgumentParser) -> None:
    predict.add_argument("--model", required=True, help="a model/ directory written by `effitrain train` (or any "
                                                        "save_pretrained classifier or causal LM)")
    predict.add_argument("--text", action="append", help="a text to classify (repeatable)")
    predict.add_argument("--text-pair", action="append", help="the second text of a pair, paired with --text by "
                                                              "position (repeatable)")
    predict.add_argument("--prompt", action="append", help="a prompt for a causal LM to continue (repeatable)")
    predict.add_argument("--input", help="texts or prompts: a JSONL/CSV file with a `text` (and `text_pair`) or "
                                         "`prompt` field; images and audio: a file, a folder of files, or a "
                                         "JSONL/CSV file with a `path` (or `image`/`audio`) column")
    predict.add_argument("--batch-size", type=int, default=64, help="inputs per forward pass (default: 64)")
    predict.add_argument("--max-length", type=int, default=None, help="text: tokens kept per input (default: the "
                                                                      "saved tokenizer's, i.e. train's --max-length)")
    predict.add_argument("--max-duration", type=float, default=10.0, help="audio: seconds kept per clip "
                                                                          "(default: 10.0)")
    predict.add_argument("--max-new-tokens", type=int, default=32, help="causal LM: tokens generated per prompt "
                                                                        "(default: 32)")
    predict.add_argument("--temperature", type=float, default=None, help="causal LM: sample at this temperature "
                                                                         "(default: greedy)")
    predict.add_argument("--top-p", type=float, default=None, help="causal LM: sample from the smallest set of "
                                                                   "tokens holding this probability (default: greedy)")
    predict.add_argument("--seed", type=int, default=42, help="seed for sampling (default: 42)")
    predict.add_argument("--all-scores", action="store_true", help="classification: every label's probability")
    predict.add_argument("--allow-pickle", action="store_true", help="accept pickle-only weights (see train)")
    predict.add_argument("--debug", action="store_true")


def add_evaluate_flags(evaluate: argparse.ArgumentParser) -> None:
    from effitrain.evaluate import DATA_KEYS, SPLITS

    evaluate.add_argument("--model", required=True, help="a model/ directory written by `effitrain train`")
    evaluate.add_argument("--split", default="test", choices=SPLITS, help="the split to evaluate (default: test)")
    evaluate.add_argument("--task", choices=cfg.TASKS, default=None, help="the task the data is for; refused "
                                                                          "unless it is the model's (default: the "
                                                                          "model's, from its config.json)")
    evaluate.add_argument("--output", help="also write the metrics to this JSON file")
    evaluate.add_argument("--allow-pickle", action="store_true", help="accept pickle-only weights (see train)")
    evaluate.add_argument("--debug", action="store_true")
    add_config_flags(evaluate, [f for f in cfg.fields() if f.name in DATA_KEYS],
                     {"max_length": " (default: the saved tokenizer's, i.e. train's --max-length)"})


def add_plan_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--model", default="default", help="what `train --model` takes: default, a directory, a "
                                                         "cached hub id, a config.json, or model_type:key=value,...")
    plan.add_argument("--task", default="sequence-classification", choices=cfg.TASKS)
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per example (audio: samples)")
    plan.add_argument("--batch-size", type=int, default=16, help="examples per device per optimizer step; "
                                                                 "split into micro-batches x accumulation")
    plan.add_argument("--memory", default=None, help="the budget per device, e.g. 8GiB (default: what is free "
                                                     "on the device now)")
    plan.add_argument("--world-size", type=int, default=1, help="processes (devices) training together")
    plan.add_argument("--strategy", default="ddp", choices=cfg.STRATEGIES)
    plan.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    plan.add_argument("--device", choices=("cpu", "cuda"), default=None, help="plan for this device "
                                                                              "(default: the one here)")
    plan.add_argument("--precision", action="append", choices=("fp32", "bf16", "fp16"),
                      help="only these precisions (repeatable; default fp32 and bf16)")
    plan.add_argument("--optim", action="append", choices=cfg.OPTIMIZERS,
                      help="only these optimizers (repeatable; default adamw, adamw-8bit, adafactor, sgd)")
    plan.add_argument("--num-labels", type=int, default=2)
    plan.add_argument("--peft", choices=cfg.PEFT_METHODS, default="none", help="plan LoRA or QLoRA adapters as "
                      "`train --peft` applies them: only the adapters and the head have gradients and optimizer "
                      "states; qlora stores the base's linear weights in 4 bits")
    plan.add_argument("--lora-r", type=int, default=cfg.TrainConfig.lora_r)
    plan.add_argument("--lora-dropout", type=float, default=cfg.TrainConfig.lora_dropout)
    plan.add_argument("--lora-target-modules", default=cfg.TrainConfig.lora_target_modules)
    plan.add_argument("--all", action="store_true", help="every micro-batch, not only the largest that fits")
    plan.add_argument("--json", action="store_true", help="print the rows and the recommendation as JSON")
    plan.add_argument("--debug", action="store_true")


def add_launch_parser(commands) -> None:
    launch = commands.add_parser("launch", help="run a command on several processes and machines (torchrun)",
                                 description="effitrain launch [options] -- train ... Under Slurm (srun, one task "
                                 "per node) or a Kubeflow PyTorchJob the node flags come from the environment; "
                                 "flags given win.")
    # None: not given, so launch.resolve may take it from the cluster's environment.
    launch.add_argument("--nproc", type=int, help="processes on this node (one per GPU, or CPU workers; default "
                                                  "PET_NPROC_PER_NODE, else 1)")
    launch.add_argument("--nnodes", type=int, help="number of machines (default from Slurm or PyTorchJob, else 1)")
    launch.add_argument("--node-rank", type=int, help="this machine's number, 0 for the master (default from the "
                                                      "environment, else 0)")
    launch.add_argument("--master-addr", default=None, help="address of node 0 (default from the environment, "
                                                            "else 127.0.0.1)")
    launch.add_argument("--master-port", type=int, default=None, help="a free port on node 0, the same on all nodes "
                                                                      "(default from the environment)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times on failure")
    launch.add_argument("--debug", action="store_true")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the effitrain command and its flags")


def build_parser() -> Parser:
    parser = Parser(prog="effitrain", description="Fine-tune pretrained transformers efficiently.")
    parser.add_argument("--version", action="version", version=f"effitrain {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = commands.add_parser("train", help="fine-tune a model (defaults: all-MiniLM-L6-v2 on SMS spam)")
    add_train_flags(train)

    add_predict_flags(commands.add_parser(
        "predict", help="label texts, text pairs, images or audio clips, or continue prompts, with a trained model "
                        "directory (its task comes from its config.json)"))
    add_evaluate_flags(commands.add_parser(
        "evaluate", help="the metrics `train` writes into metrics.json, for a trained model directory on a split "
                         "of the data (same data flags and defaults as train)"))

    inspect = commands.add_parser("inspect", help="show a model's configuration and parameter counts")
    inspect.add_argument("model", nargs="?", default="default", help="default, a directory or a cached hub id")
    inspect.add_argument("--task", default="sequence-classification", choices=cfg.TASKS)
    inspect.add_argument("--json", action="store_true", help="print the counts and device as JSON")
    inspect.add_argument("--debug", action="store_true")

    add_launch_parser(commands)

    bench = commands.add_parser("bench", help="measure each efficiency technique against a baseline")
    from effitrain import bench as bench_module

    bench_module.add_arguments(bench)

    plan = commands.add_parser("plan", help="predict peak memory per device for each combination of techniques, "
                                            "and recommend the fastest that fits",
                               description="Predict the peak memory of training, per device, before loading "
                                           "anything: the model is built on fake tensors.")
    add_plan_flags(plan)

    report = commands.add_parser("report", help="an HTML page of one run or several (curves, evaluations, confusion "
                                               "matrix, memory; several: overlaid and compared), with PNGs")
    report.add_argument("runs", nargs="+", metavar="RUN", help="the --output-dir of a train run (or of a bench: "
                                                               "its variants)")
    report.add_argument("--out", default=None, help="the page (default: RUN/report.html for one run, report.html "
                                                    "here for several); its PNGs go beside it")
    report.add_argument("--debug", action="store_true")

    env = commands.add_parser("env", help="show the devices and precisions Accelerator detects")
    env.add_argument("--json", action="store_true")
    env.add_argument("--debug", action="store_true")
    return parser


def _version() -> str:
    from effitrain import __version__

    return __version__


def cmd_train(args: argparse.Namespace) -> int:
    from effitrain import runs

    values = vars(args).copy()
    values.pop("command")
    config_file = values.pop("config", None)
    file_values = cfg.load_yaml(config_file) if config_file else {}
    runs.train(cfg.build(file_values, values), config_file, command=True)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    for name in ("max_length", "max_duration", "max_new_tokens", "temperature"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):  # NaN fails too
            raise UserError(f"--{name.replace('_', '-')} must be > 0 and finite, got {value}",
                            f"pass a positive --{name.replace('_', '-')}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}", "pass e.g. --top-p 0.9")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise UserError(f"--seed must be in [0, 2**32), got {args.seed}", "pass e.g. --seed 42")
    # Only what prediction needs is imported (torch, transformers): no datasets, no accelerate, no engine.
    from effitrain import models, outputs
    from effitrain.predict import predict
    from effitrain.tasks.base import PredictOptions

    if not args.debug:  # models.quiet_libraries would import datasets, which prediction never uses
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        models.quiet_import_warnings()
    options = PredictOptions(max_length=args.max_length, max_duration=args.max_duration,
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             all_scores=args.all_scores)
    results = predict(args.model, args.text, args.batch_size, text_pairs=args.text_pair, prompts=args.prompt,
                      input_file=args.input, options=options, seed=args.seed, allow_pickle=args.allow_pickle,
                      progress=True)
    try:
        for result in results:
            print(outputs.json_text(result, ensure_ascii=False))
        sys.stdout.flush()
    except BrokenPipeError:  # `predict ... | head`: the reader took what it wanted (the Python docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from effitrain import models, outputs
    from effitrain.evaluate import DATA_KEYS, evaluate

    output = check_output_file(args.output)
    models.quiet_libraries(args.debug)
    values = {key: getattr(args, key) for key in DATA_KEYS if hasattr(args, key)}
    metrics = evaluate(args.model, values, args.split, args.allow_pickle, args.task)
    if int(os.environ.get("RANK", "0")) == 0:  # every process has the gathered metrics; one prints them
        print(outputs.json_text(metrics))
        if output is not None:
            try:
                outputs.write_json(output, metrics)
            except OSError as err:
                raise UserError(f"--output {output} cannot be written ({err.strerror or err})",
                                "pass a file path you can write") from err
    return 0


def check_output_file(given: str | None):
    """--output: a new file in an existing, writable folder; checked before anything runs. An existing
    file is never replaced (it may be a run's own metrics.json or config.json)."""
    from pathlib import Path

    if given is None:
        return None
    output = Path(given)
    if not given or output.is_dir():
        raise UserError(f"--output `{given}` is a folder", "pass a file path, e.g. --output metrics.json")
    if output.exists() or output.is_symlink():
        raise UserError(f"--output {output} already exists", "pass a new file path (effitrain never replaces a "
                        "file it did not write)")
    if not output.parent.is_dir():
        raise UserError(f"--output {output}: no folder {output.parent}", "pass a file path in an existing folder")
    if not os.access(output.parent, os.W_OK):
        raise UserError(f"--output {output}: the folder {output.parent} is not writable",
                        "pass a file path in a folder you can write")
    return output


def cmd_inspect(args: argparse.Namespace) -> int:
    from effitrain import models, tasks
    from effitrain.devices import make_accelerator

    models.quiet_libraries(args.debug)
    task = tasks.get(args.task)
    path = models.resolve(args.model)
    model_config = models.load_config(path)
    task.check_supported(model_config)
    model = task.build_on_meta(model_config)
    counts = models.parameter_counts(model)
    device = str(make_accelerator().device)
    if args.json:
        print(json.dumps({"model": str(path), "config": model.config.to_dict(), "parameters": counts,
                          "device": device}))
        return 0
    print(f"model: {path}")
    print(model.config)
    print(f"parameters: {counts['total']:,} total, {counts['trainable']:,} trainable, "
          f"{counts['embedding']:,} in embeddings ({args.task}"
          + (f" head for {model.config.num_labels} labels)" if task.has_labels else ")"))
    print(f"Accelerator would train on: {device}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from effitrain.planning import sizes

    for name in ("seq_len", "batch_size", "world_size", "num_labels"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}",
                            f"pass a positive --{name.replace('_', '-')}")
    if args.memory is not None:
        sizes.parse_size(args.memory)  # a mistake answers before torch is imported
    import torch

    from effitrain import devices, models
    from effitrain.planning import plan

    models.quiet_libraries(args.debug)
    device = args.device or ("cuda" if devices.has_accelerator() else "cpu")
    if args.memory is None and device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda on a machine without a CUDA GPU: there is no free memory to read",
                        "pass the GPU's memory, e.g. --memory 80GiB")
    budget = sizes.parse_size(args.memory) if args.memory else plan.available_bytes(device)
    # The config as written (its own vocabulary); `train --memory-budget` plans with the tokenizer's,
    # which is what a text model built from a config gets there.
    shapes = plan.model_shapes(args.task, args.model, args.num_labels, peft=_plan_peft(args))
    planner = plan.Planner(shapes, args.seq_len, device, args.world_size, args.strategy, args.zero_stage)
    rows = plan.best_per_technique(planner, args.batch_size, args.precision or ["fp32", "bf16"],
                                   args.optim or ["adamw", "adamw-8bit", "adafactor", "sgd"],
                                   [False, True] if shapes.supports_checkpointing else [False],
                                   budget, args.all)
    best = plan.recommend(rows)
    if args.json:
        print(json.dumps({"model": args.model, "task": args.task, "peft": args.peft, "parameters": shapes.parameters,
                          "trainable": shapes.trainable, "buffer_bytes": shapes.buffer_bytes,
                          "seq_len": args.seq_len, "batch_size": args.batch_size,
                          "world_size": args.world_size, "strategy": args.strategy, "device": device,
                          "budget": budget, "rows": [r.to_dict() for r in rows],
                          "recommended": best.to_dict() if best else None}))
        return 0
    print(f"{args.model} ({args.task}): {shapes.parameters:,} parameters, {shapes.trainable:,} trainable; "
          f"{args.batch_size} x {args.seq_len} per {device} device per step, {args.world_size} process(es) "
          f"({args.strategy}); budget {budget / plan.GiB:.2f} GiB per device. GiB per device:")
    print(plan.format_table(rows, best))
    if best is None:
        print("nothing fits: raise --memory, shorten --seq-len, add processes with --strategy fsdp, "
              "or use a smaller model")
    else:
        s = best.setting
        print(f"recommended: --precision {s.precision} --optim {s.optimizer} --batch-size {s.micro_batch} "
              f"--grad-accum {s.accumulation}" + (" --gradient-checkpointing" if s.checkpointing else "")
              + f" ({best.total / plan.GiB:.2f} GiB, {best.relative_speed:.2f}x the speed of fp32 AdamW)")
    return 0


def _plan_peft(args: argparse.Namespace):
    """`plan --peft` and the --lora-* flags, checked as `train` checks them."""
    from effitrain.planning import plan

    config = cfg.TrainConfig(peft=args.peft, lora_r=args.lora_r, lora_dropout=args.lora_dropout,
                             lora_target_modules=args.lora_target_modules, strategy=args.strategy)
    cfg.validate(config)
    return plan.Peft.of(config)


def cmd_bench(args: argparse.Namespace) -> int:
    from effitrain import bench

    return bench.run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from effitrain import report

    page, pngs = report.write(args.runs, args.out)
    written = [str(path) for path in (page, *pngs)]
    print("wrote " + (f"{', '.join(written[:-1])} and {written[-1]}" if len(written) > 1 else written[0]))
    return 0


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


def _launcher_speaks() -> bool:
    """A worker of `effitrain launch`: the launcher prints the job's one line (user error, signal)."""
    from effitrain import devices, launch

    return devices.started_by_torchrun() and os.environ.get(launch.LAUNCHED) == "1"


COMMANDS = {"train": cmd_train, "predict": cmd_predict, "evaluate": cmd_evaluate, "inspect": cmd_inspect, "env": cmd_env,
            "launch": cmd_launch, "bench": cmd_bench, "plan": cmd_plan, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    # effitrain never downloads: without this, a hub look-up would wait on network time-outs.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not debug:
        from effitrain.models import quiet_import_warnings

        quiet_import_warnings()
    with _signals_unwind() as received:
        try:
            if _launcher_speaks():  # a launched worker: it ends if its launcher dies
                from effitrain import launch

                launch.end_with_launcher()
            args = build_parser().parse_args(argv)
            return COMMANDS[args.command](args)
        except (SystemExit, GeneratorExit):  # --help, --version
            raise
        except BaseException as err:
            return _ended(err, debug, received)


FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _ended(err: BaseException, debug: bool, received: list[int]) -> int:
    """The exit code of a command that raised, and its one stderr line: 2 for a user mistake, 128 + the
    signal for Ctrl-C (130) or SIGTERM (143), also when the signal surfaced as another error (a peer
    process stopped by the same signal); anything else is an internal error (traceback, 1). --debug
    adds the traceback and keeps the code."""
    import signal

    from effitrain.errors import Terminated
    from effitrain.launch import LaunchEnded

    raised = err
    if isinstance(err, PermissionError):  # always the user's file or folder, wherever it was met
        err = UserError(f"permission denied: {err.filename or err}", "make it readable (and its folder writable, "
                        "for outputs), or run as its owner")
    elif isinstance(err, OSError) and err.errno in FULL_OR_READ_ONLY:  # a save found no room: the disk, not a bug
        where = f" writing {err.filename}" if err.filename else ""
        err = UserError(f"{err.strerror or err}{where} (a half-written save was removed; earlier checkpoints stay)",
                        "free space there, or write to another disk; then rerun (train: --resume auto continues from "
                        "the last checkpoint)")
    if isinstance(err, (UserError, LaunchEnded)):
        code, line = err.exit_code, err.line if isinstance(err, LaunchEnded) else f"effitrain: error: {err}"
        if isinstance(err, UserError):
            _record_for_launcher(err)
    elif isinstance(err, KeyboardInterrupt) or received:
        sig = signal.Signals(received[0] if received else signal.SIGINT)
        code, line = 128 + sig, f"effitrain: stopped by {sig.name}"
    elif isinstance(err, Terminated):  # also raised by a run's own SIGTERM handler (runs.py)
        code, line = err.exit_code, "effitrain: stopped by SIGTERM"
    else:
        _record_for_launcher(err)
        raise err
    if debug:
        import traceback

        traceback.print_exception(raised)
    if not _launcher_speaks():
        print(line, file=sys.stderr)
    return code


@contextlib.contextmanager
def _signals_unwind():
    """SIGINT and SIGTERM unwind the command as exceptions (KeyboardInterrupt, errors.Terminated), so that
    a save in progress is removed and the output folder released; yields the list of signals received.
    Under torchrun a second signal is ignored: the agent forwards Ctrl-C to workers the terminal has
    already interrupted, and a second exception would cut their clean-up short (the agent SIGKILLs a
    worker that has not ended within its shutdown timeout). The previous handlers come back after."""
    import signal
    import threading

    from effitrain import devices
    from effitrain.errors import Terminated

    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def unwind(signum, frame):
        if received and devices.started_by_torchrun():
            return
        received.append(signum)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    previous = {sig: signal.signal(sig, unwind) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
