"""`effitrain launch`: run an effitrain command on N processes per node and M nodes with torchrun's
own launcher and rendezvous (torch.distributed.run), and end the job with one stderr line: the
workers stay silent about user errors and signals (cli.main), the launcher says it once. On a cluster
the node settings come from the scheduler's environment (runtime/cluster.py: Slurm, a Kubeflow
PyTorchJob), so that the same command runs on every node; flags win. The rest lives in runtime/: where
the nodes meet (rendezvous.py), how the job's end is said (job_failures.py), a worker following its
launcher (launcher.py)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from effitrain.errors import UserError
from effitrain.runtime import cluster, devices, job_failures, launcher, rendezvous

# What each worker runs (tests put a fault-injecting CLI here, tests/hooks/patched_cli.py).
WORKER_PROGRAM = ["-m", "effitrain"]
# Commands of one process: N copies would print N times the same answer.
ONE_PROCESS = ("predict", "inspect", "plan")


def torchrun_argv(args, command: list[str], join_seconds: float | None = None) -> list[str]:
    """`join_seconds`: how long torch's store waits for the nodes to meet (its default: 600)."""
    argv = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}",
            "--monitor-interval=1"]
    if rendezvous.standalone(args):
        argv.append("--standalone")  # a free port on localhost, nothing to configure
    else:
        address, port = rendezvous.meeting_point(args)
        argv += [f"--node-rank={args.node_rank}", f"--master-addr={address}", f"--master-port={port}"]
        if join_seconds is not None:
            argv.append(f"--rdzv-conf=timeout={math.ceil(join_seconds)}")
    return argv + [*WORKER_PROGRAM, *command]


def check(args, command: list[str]) -> None:
    check_command(command)
    check_numbers(args)


def check_command(command: list[str]) -> None:
    if not command:
        raise UserError("effitrain launch needs the command to run after `--`",
                        "write e.g. effitrain launch --nproc 2 -- train --max-steps 100")
    if command[0] in ("launch", "--") or command[0].startswith("-"):
        raise UserError(f"effitrain launch runs an effitrain command, not `{command[0]}`",
                        "write e.g. effitrain launch --nproc 2 -- train ...")
    if command[0] in ONE_PROCESS:
        raise UserError(f"effitrain {command[0]} runs on one process (launching it would print its answer once "
                        "per process)", f"run `effitrain {' '.join(command)}` without launch")


MAX_JOIN_TIMEOUT = 7 * 24 * 3600


def check_numbers(args) -> None:
    for name in ("nproc", "nnodes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}", f"pass --{name} 1 or more")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}", "pass --max-restarts 0 or more")
    if not getattr(args, "join_timeout", 1) > 0:
        raise UserError(f"--join-timeout must be > 0 seconds, got {args.join_timeout}", "pass e.g. --join-timeout 600")
    if getattr(args, "join_timeout", 1) > MAX_JOIN_TIMEOUT:  # inf, 1e308: no deadline a clock can say
        raise UserError(f"--join-timeout {args.join_timeout:g} is longer than a week ({MAX_JOIN_TIMEOUT} s)",
                        "pass a wait in seconds up to a week, e.g. --join-timeout 3600")
    if args.master_port is not None:
        rendezvous.check_port(args.master_port)
    if args.master_addr is not None:  # one from the environment was checked under its variable's name
        args.master_addr = rendezvous.check_address(args.master_addr)
    if args.nnodes > 1:
        if args.master_port is None:
            raise UserError("--nnodes > 1 needs --master-port (and --master-addr, the address of node 0)",
                            "pass the same --master-addr and --master-port on every node")
        if not 0 <= args.node_rank < args.nnodes:
            raise UserError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}",
                            "number the nodes 0 to nnodes-1, node 0 being the master")


# CPU workers per core beyond which more processes only wait on each other, each with its own copy of
# the model (1,000 workers on 2 cores were accepted, and stuck in their store connects).
CPU_WORKERS_PER_CORE = 4


def check_nproc(nproc: int) -> None:
    """--nproc within what this node can run: one process per accelerator, or a few per CPU core."""
    devices_here, cores = devices.accelerator_count(), os.cpu_count() or 1
    if devices_here and nproc > devices_here:
        raise UserError(f"--nproc {nproc} is more processes than this node's {devices_here} accelerator(s)",
                        f"pass --nproc {devices_here} or less (one process per device)")
    if not devices_here and nproc > CPU_WORKERS_PER_CORE * cores:
        raise UserError(f"--nproc {nproc} is more than {CPU_WORKERS_PER_CORE} processes per CPU core of this node "
                        f"({cores} cores)", f"pass --nproc {cores} or less (on CPUs, fewer processes with more "
                        "threads each do more)")


def launch(args, command: list[str]) -> int:
    check_command(command)
    args, origin = cluster.resolve(args, os.environ)
    check_numbers(args)
    check_nproc(args.nproc)
    if origin:
        print(origin, file=sys.stderr, flush=True)
    join_seconds = rendezvous.meet(args)

    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ[launcher.LAUNCHED] = "1"
    os.environ[launcher.LAUNCHER_PID] = str(os.getpid())
    if not args.debug:
        job_failures.quiet_torchrun()
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, command, join_seconds)))
    except ChildFailedError as err:
        raise job_failures.LaunchEnded(*job_failures.failure_line(err.failures, args.nproc * args.nnodes)) from err
    except DistError as err:  # torch's store: the nodes did not all meet in time
        raise rendezvous.not_met(args, err) from None
    except SignalException as err:
        # The agent has sent the same signal to the workers and waited for them (SIGKILL after its
        # shutdown timeout): each has unwound its run, kept its latest complete checkpoint and removed
        # a save in progress.
        raise job_failures.LaunchEnded(f"effitrain launch: stopped by {err.sigval.name}: the {args.nproc} worker(s) "
                                       "of this node have ended (a run saving checkpoints resumes with --resume auto)",
                                       128 + err.sigval) from err
    return 0


def add_parser(commands) -> None:
    launch = commands.add_parser("launch", help="run a command on several processes and machines (torchrun)",
                                 description="effitrain launch [options] -- train ... Under Slurm (srun, one task "
                                 "per node) or a Kubeflow PyTorchJob the node flags come from the environment; "
                                 "flags given win.")
    # None: not given, so cluster.resolve may take it from the cluster's environment.
    launch.add_argument("--nproc", type=int, help="processes on this node (one per GPU, or CPU workers; default "
                                                  "PET_NPROC_PER_NODE, else 1)")
    launch.add_argument("--nnodes", type=int, help="number of machines (default from Slurm or PyTorchJob, else 1)")
    launch.add_argument("--node-rank", type=int, help="this machine's number, 0 for the master (default from the "
                                                      "environment, else 0)")
    launch.add_argument("--master-addr", default=None, help="address of node 0 (default from the environment, "
                                                            "else 127.0.0.1)")
    launch.add_argument("--master-port", type=int, default=None, help="a free port on node 0, the same on all nodes "
                                                                      "(default from the environment)")
    launch.add_argument("--join-timeout", type=float, default=600.0,
                        help="seconds the nodes wait for each other at start (default 600, torchrun's)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times on failure")
    launch.add_argument("--debug", action="store_true")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the effitrain command and its flags")


def main(args) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return launch(args, command)
