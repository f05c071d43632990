"""The `effitrain` command: a parser made of each command's own (commands/<name>.py: add_parser, main, and
an optional `check_flags(args)`), the dispatch, exit codes and signals. Parsing and checking import
neither torch nor transformers (commands import them inside main), so that `--help` and every flag or
config mistake answer at once, before the allocator re-executes the command (`answer_at_once`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys

from effitrain.errors import UserError

COMMANDS = ("train", "predict", "evaluate", "inspect", "env", "launch", "bench", "plan", "report")


class Parser(argparse.ArgumentParser):
    """argparse prints usage plus a message over two lines; effitrain's contract is one line, exit 2."""

    def error(self, message: str):
        # argparse quotes the value it refused: a huge one is cut, so that the line stays readable
        message = re.sub(r"'([^']{80})[^']{20,}'", lambda m: f"'{m.group(1)}...' ({len(m.group(0)) - 2} characters)",
                         message)
        raise UserError(message, f"see `{self.prog} --help`")


def command_module(name: str):
    """A command's module, imported when the parser is built (not when __main__ imports this module)."""
    from effitrain.commands import train, predict, evaluate, inspect, env, launch, bench, plan, report  # as COMMANDS

    return {"train": train, "predict": predict, "evaluate": evaluate, "inspect": inspect, "env": env,
            "launch": launch, "bench": bench, "plan": plan, "report": report}[name]


def build_parser() -> Parser:
    from effitrain import __version__

    parser = Parser(prog="effitrain", description="Fine-tune pretrained transformers efficiently.")
    parser.add_argument("--version", action="version", version=f"effitrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        command_module(name).add_parser(commands)
    return parser


def parsed(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, and checked by the command's own `check_flags(args)` where it has one (rules that need
    no heavy library: values, the config file's keys)."""
    args = build_parser().parse_args(argv)
    check_flags = getattr(command_module(args.command), "check_flags", None)
    if check_flags is not None:
        check_flags(args)
    return args


def answer_at_once(argv: list[str]) -> int | None:
    """Run by `__main__` before it re-executes the command under another allocator: --help and --version
    (SystemExit), and a flag or config mistake (its one line, exit 2), answered in this light process;
    None where the command is to run (anything else this meets, the command meets again and says)."""
    try:
        parsed(argv)
    except UserError as err:
        if not _launcher_speaks():
            print(f"effitrain: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception:  # noqa: BLE001 - not a mistake in the flags: the command's own run reports it
        return None
    return None


def _record_for_launcher(err: BaseException) -> None:
    """Under torchrun, leave the cause where the launcher reads it, so its one line can name it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)


def _launcher_speaks() -> bool:
    """A worker of `effitrain launch`: the launcher prints the job's one line (user error, signal)."""
    from effitrain.runtime import launcher

    return launcher.is_launched_worker()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    # effitrain never downloads: without this, a hub look-up would wait on network time-outs.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not debug:
        from effitrain.runtime.libraries import quiet_import_warnings

        quiet_import_warnings()
    with _signals_unwind() as received:
        try:
            if _launcher_speaks():  # a launched worker: it ends if its launcher dies
                from effitrain.runtime import launcher

                launcher.end_with_launcher(received)
            args = parsed(argv)
            return command_module(args.command).main(args)
        except (SystemExit, GeneratorExit):  # --help, --version
            raise
        except BaseException as err:
            received.ending = True  # a signal now (the launcher's, as its other worker ended) waits for the report
            return _ended(err, debug, received)


class _Received(list):
    """The signals received; `ending` once the command has failed and its report is being made."""

    ending = False


FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _ended(err: BaseException, debug: bool, received: list[int]) -> int:
    """The exit code of a command that raised, and its one stderr line: 2 for a user mistake, 128 + the
    signal for Ctrl-C (130) or SIGTERM (143), also when the signal surfaced as another error (a peer
    process stopped by the same signal); 1 with one line for a collective broken by another process's end;
    anything else is an internal error (traceback, 1). --debug
    adds the traceback and keeps the code."""
    import signal

    from effitrain.errors import Terminated
    from effitrain.runtime import distributed, peers
    from effitrain.runtime.job_failures import LaunchEnded

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
    elif isinstance(err, Terminated):  # also raised by a run's own SIGTERM handler (commands/train.py)
        code, line = err.exit_code, "effitrain: stopped by SIGTERM"
    elif distributed.launcher_world_size() > 1 and peers.lost_peer(err):  # another process of the job ended: it
        # (or its launcher) says why, this one what it knows
        lost = err if isinstance(err, peers.PeerLost) else peers.PeerLost(looked=False)
        _record_for_launcher(lost)
        resume = ", with --resume auto to continue from it" if lost.checkpoint else ""
        code, line = 1, (f"effitrain: error: {lost}; fix: see why the other process ended (its output; dmesg for "
                         f"the out-of-memory killer) and rerun{resume}")
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
    """SIGINT and SIGTERM unwind the command as exceptions (errors.Interrupted, a KeyboardInterrupt, and
    errors.Terminated), so that
    a save in progress is removed and the output folder released; yields the list of signals received.
    Under torchrun a second signal is ignored: the agent forwards Ctrl-C to workers the terminal has
    already interrupted, and a second exception would cut their clean-up short (the agent SIGKILLs a
    worker that has not ended within its shutdown timeout). The previous handlers come back after."""
    import signal
    import threading

    from effitrain.errors import Interrupted, Terminated
    from effitrain.runtime import distributed

    received = _Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def unwind(signum, frame):
        if received and distributed.started_by_torchrun():
            return
        received.append(signum)
        if received.ending:  # the command failed and is saying why (a worker importing torch's error file
            return  # writer, say): the report is not cut short; the signal is counted
        raise Terminated() if signum == signal.SIGTERM else Interrupted()

    unwind.raises_interrupted = True  # errors.raised_by_code: a KeyboardInterrupt not Interrupted is code's
    previous = {sig: signal.signal(sig, unwind) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
