"""`effitrain launch`: run an effitrain command on N processes per node and M nodes with torchrun's
own launcher and rendezvous (torch.distributed.run), and end the job with one stderr line: the
workers stay silent about user errors and signals (cli.main), the launcher says it once."""

from __future__ import annotations

import os
import signal

from effitrain.errors import UserError

# What each worker runs (tests put a fault-injecting CLI here, tests/hooks/patched_cli.py).
WORKER_PROGRAM = ["-m", "effitrain"]
# Set in the workers' environment: they leave the one line to this launcher.
LAUNCHED = "EFFITRAIN_LAUNCHED"
# Commands of one process: N copies would print N times the same answer.
ONE_PROCESS = ("predict", "inspect", "plan")


def torchrun_argv(args, command: list[str]) -> list[str]:
    argv = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}",
            "--monitor-interval=1"]
    if args.nnodes == 1 and args.master_addr is None:
        argv.append("--standalone")  # a free port on localhost, nothing to configure
    else:
        argv += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr or '127.0.0.1'}",
                 f"--master-port={args.master_port}"]
    return argv + [*WORKER_PROGRAM, *command]


def check(args, command: list[str]) -> None:
    if not command:
        raise UserError("effitrain launch needs the command to run after `--`",
                        "write e.g. effitrain launch --nproc 2 -- train --max-steps 100")
    if command[0] in ("launch", "--") or command[0].startswith("-"):
        raise UserError(f"effitrain launch runs an effitrain command, not `{command[0]}`",
                        "write e.g. effitrain launch --nproc 2 -- train ...")
    if command[0] in ONE_PROCESS:
        raise UserError(f"effitrain {command[0]} runs on one process (launching it would print its answer once "
                        "per process)", f"run `effitrain {' '.join(command)}` without launch")
    for name in ("nproc", "nnodes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}", f"pass --{name} 1 or more")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}", "pass --max-restarts 0 or more")
    if args.nnodes > 1:
        if args.master_port is None:
            raise UserError("--nnodes > 1 needs --master-port (and --master-addr, the address of node 0)",
                            "pass the same --master-addr and --master-port on every node")
        if not 0 <= args.node_rank < args.nnodes:
            raise UserError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}",
                            "number the nodes 0 to nnodes-1, node 0 being the master")


def describe(failure) -> str:
    """One line for a worker's failure: its own error message, the signal that killed it, or its exit code."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if isinstance(message, str) and message and "To enable traceback" not in message:
        return message.strip().splitlines()[-1][:400]
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def stopped_by_launcher(failure) -> bool:
    """A worker the launcher stopped (SIGTERM) after another one failed: killed, or unwound by the signal."""
    return failure.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)


def root_cause(failures: dict):
    """The worker that failed first: one killed by a signal other than the launcher's own SIGTERM (its
    peers then fail in their collectives, with a recorded error that looks earlier), else the earliest
    of those the launcher did not stop."""
    killed = [(rank, f) for rank, f in failures.items() if f.exitcode < 0 and not stopped_by_launcher(f)]
    if killed:
        return min(killed, key=lambda item: item[0])
    failed = [(rank, f) for rank, f in failures.items() if not stopped_by_launcher(f)] or list(failures.items())
    return min(failed, key=lambda item: (item[1].timestamp, item[0]))


def failure_line(failures: dict) -> tuple[str, int]:
    """The job's one stderr line and exit code. A user error stays one (exit 2), in the usual
    `effitrain: error: ...; fix: ...` form, said once although every process hit it; it names the
    process when the others failed differently (then it is that process's own problem)."""
    rank, failure = root_cause(failures)
    cause = describe(failure)
    if failure.exitcode == 2 and cause.startswith("UserError: "):
        cause = cause.removeprefix("UserError: ")
        others = [describe(f) for r, f in failures.items() if r != rank and not stopped_by_launcher(f)]
        same = all(other == f"UserError: {cause}" for other in others)
        return f"effitrain: error: {cause if same else f'process {rank}: {cause}'}", 2
    return f"effitrain launch: error: rank {rank} failed: {cause}", 2 if failure.exitcode == 2 else 1


def quiet_torchrun() -> None:
    """torchrun's agent logs each worker's exit and its own shutdown on stderr; effitrain says it in one
    line instead (--debug keeps the logs)."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def launch(args, command: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    check(args, command)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ[LAUNCHED] = "1"
    if not args.debug:
        quiet_torchrun()
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, command)))
    except ChildFailedError as err:
        raise LaunchEnded(*failure_line(err.failures)) from err
    except SignalException as err:
        # The agent has sent the same signal to the workers and waited for them (SIGKILL after its
        # shutdown timeout): each has unwound its run, kept its latest complete checkpoint and removed
        # a save in progress.
        raise LaunchEnded(f"effitrain launch: stopped by {err.sigval.name}: the {args.nproc} worker(s) of this "
                          "node have ended (a run saving checkpoints resumes with --resume auto)",
                          128 + err.sigval) from err
    return 0


class LaunchEnded(Exception):
    """The job ended otherwise than in success (torchrun has stopped every worker): the one line to print."""

    def __init__(self, line: str, exit_code: int):
        self.line, self.exit_code = line, exit_code
        super().__init__(line)
