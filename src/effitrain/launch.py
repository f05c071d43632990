"""`effitrain launch`: run an effitrain command on N processes per node and M nodes with torchrun's
own launcher and rendezvous (torch.distributed.run), and turn a failure into one line."""

from __future__ import annotations

import os

from effitrain.errors import UserError


def torchrun_argv(args, command: list[str]) -> list[str]:
    argv = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}",
            "--monitor-interval=1"]
    if args.nnodes == 1 and args.master_addr is None:
        argv.append("--standalone")  # a free port on localhost, nothing to configure
    else:
        argv += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr or '127.0.0.1'}",
                 f"--master-port={args.master_port}"]
    return argv + ["-m", "effitrain", *command]


def check(args, command: list[str]) -> None:
    if not command:
        raise UserError("effitrain launch needs the command to run after `--`",
                        "write e.g. effitrain launch --nproc 2 -- train --max-steps 100")
    if command[0] in ("launch", "--") or command[0].startswith("-"):
        raise UserError(f"effitrain launch runs an effitrain command, not `{command[0]}`",
                        "write e.g. effitrain launch --nproc 2 -- train ...")
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


def root_cause(failures: dict):
    """The worker that failed first: one killed by a signal other than the launcher's own SIGTERM (its
    peers then fail in their collectives, with a recorded error that looks earlier), else the earliest."""
    import signal

    killed = [(rank, f) for rank, f in failures.items() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    if killed:
        return min(killed, key=lambda item: item[0])
    return min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))


def launch(args, command: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    check(args, command)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, command)))
    except ChildFailedError as err:
        rank, failure = root_cause(err.failures)
        raise LaunchFailed(rank, describe(failure), failure.exitcode)
    return 0


class LaunchFailed(Exception):
    """A worker failed: the job has ended (torchrun stopped the others)."""

    def __init__(self, rank: int, cause: str, exitcode: int):
        self.exit_code = 2 if exitcode == 2 else 1  # a worker's user error stays a user error
        super().__init__(f"rank {rank} failed: {cause}")
