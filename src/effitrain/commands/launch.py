"""`effitrain launch`: run an effitrain command on N processes per node and M nodes with torchrun's
own launcher and rendezvous (torch.distributed.run), and end the job with one stderr line: the
workers stay silent about user errors and signals (cli.main), the launcher says it once. On a cluster
the node settings come from the scheduler's environment (Slurm, a Kubeflow PyTorchJob), so that the
same command runs on every node; flags win."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import re
import signal
import sys
from collections.abc import Mapping

from effitrain.errors import UserError
from effitrain.runtime import rendezvous
from effitrain.runtime.peers import PeerLost

# What each worker runs (tests put a fault-injecting CLI here, tests/hooks/patched_cli.py).
WORKER_PROGRAM = ["-m", "effitrain"]
# Set in the workers' environment: they leave the one line to this launcher.
LAUNCHED = "EFFITRAIN_LAUNCHED"
# The launcher's process id, in the workers' environment: a worker ends when that process dies.
LAUNCHER_PID = "EFFITRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
DEFAULT_PORT = 29500  # torchrun's, for one node given --master-addr without --master-port
# Commands of one process: N copies would print N times the same answer.
ONE_PROCESS = ("predict", "inspect", "plan")


def standalone(args) -> bool:
    return args.nnodes == 1 and args.master_addr is None


def torchrun_argv(args, command: list[str], join_seconds: float | None = None) -> list[str]:
    """`join_seconds`: how long torch's store waits for the nodes to meet (its default: 600)."""
    argv = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}",
            "--monitor-interval=1"]
    if standalone(args):
        argv.append("--standalone")  # a free port on localhost, nothing to configure
    else:
        argv += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr or '127.0.0.1'}",
                 f"--master-port={args.master_port or DEFAULT_PORT}"]
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


def check_numbers(args) -> None:
    for name in ("nproc", "nnodes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}", f"pass --{name} 1 or more")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}", "pass --max-restarts 0 or more")
    if not getattr(args, "join_timeout", 1) > 0:
        raise UserError(f"--join-timeout must be > 0 seconds, got {args.join_timeout}", "pass e.g. --join-timeout 600")
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


# ---- Cluster environments: what the scheduler says about this node -------------------------------

# Slurm gives no port: one derived from the job id is the same on every node of the job and differs
# between jobs sharing a node (the rule of several tools: 15000 + job id mod 20000).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000
# Set by a launcher in each process it starts, never by a scheduler for a node: next to them, WORLD_SIZE
# and RANK count processes (a shell left with a launched worker's variables, runtime/distributed.py), not nodes.
PROCESS_LEVEL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
NODE_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port")
MAX_HOSTS = 100_000  # a node list expanding to more is garbage, not a cluster


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What a scheduler's environment says about this node; None where it says nothing."""

    source: str  # "Slurm", "PyTorchJob", "WORLD_SIZE/RANK"
    nnodes: int
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: int | None = None


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list in Slurm's order: `node[01-03,07],gpu5` -> node01 node02 node03 node07
    gpu5. A number keeps the width of its range's first bound (`[08-10]`: 08 09 10; `[8-10]`: 8 9 10);
    several bracket groups in one name multiply (`r[1-2]n[1-2]`: r1n1 r1n2 r2n1 r2n2). ValueError otherwise."""
    hosts = []
    for item in _top_level_items(text):
        choices = []
        for part in re.split(r"(\[[^\[\]]*\])", item):  # names and [...] groups alternate
            if part.startswith("["):
                choices.append(_numbers(part[1:-1]))
            elif part and not re.fullmatch(r"[A-Za-z0-9._-]+", part):
                raise ValueError(f"{part!r} is not part of a host name")
            else:
                choices.append([part])
        count = 1
        for choice in choices:
            count *= len(choice)
        if len(hosts) + count > MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} hosts")
        hosts += ["".join(name) for name in itertools.product(*choices)]
    return hosts


def _top_level_items(text: str) -> list[str]:
    """`a[1,2],b` -> ['a[1,2]', 'b']: commas inside brackets are ranges, not host separators."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError("brackets do not pair up")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth or not all(items):
        raise ValueError("brackets do not pair up" if depth else "an empty host name")
    return items


def _numbers(ranges: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7']."""
    numbers = []
    for piece in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not match or int(match[2] or match[1]) < int(match[1]):
            raise ValueError(f"[{ranges}] is not a list of numbers and ranges like [01-03,7]")
        low, high = int(match[1]), int(match[2] or match[1])
        if len(numbers) + high - low >= MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} hosts")
        numbers += [f"{n:0{len(match[1])}d}" for n in range(low, high + 1)]
    return numbers


def _number(env: Mapping[str, str], name: str, minimum: int, fix: str) -> int:
    value = env[name]
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise UserError(f"{name} is empty" if not value.strip() else f"{name}={value!r} is not a whole number "
                        f">= {minimum}", fix)
    return number


def _port(env: Mapping[str, str], name: str) -> int:
    port = _number(env, name, 1, f"set {name} to a free port (1-65535) or unset it, or pass --master-port")
    if port > 65535:
        raise UserError(f"{name}={port} is not a port (1-65535)", f"set {name} to a free port, or pass --master-port")
    return port


def _address(env: Mapping[str, str], name: str) -> str:
    return rendezvous.check_address(env[name], name)


def _first(env: Mapping[str, str], *names: str) -> str | None:
    """The first of these variables that is set (also when set to an empty string)."""
    return next((name for name in names if name in env), None)


def from_slurm(env: Mapping[str, str]) -> Cluster:
    """One launcher per node under srun: node count SLURM_NNODES (or SLURM_JOB_NUM_NODES), node rank
    SLURM_NODEID, head node the first host of the step's node list (SLURM_STEP_NODELIST, else
    SLURM_JOB_NODELIST, SLURM_NODELIST: node 0 of the step is the first of its list), port MASTER_PORT
    or one derived from SLURM_JOB_ID; MASTER_ADDR, if set, replaces the head node."""
    fix = "run one launcher per node: srun --ntasks-per-node=1 effitrain launch --nproc N -- ..., or pass --nnodes"
    nodes_name = _first(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nodes_name is None:
        raise UserError("SLURM_JOB_ID is set but neither SLURM_NNODES nor SLURM_JOB_NUM_NODES", fix)
    nnodes = _number(env, nodes_name, 1, fix)
    if "SLURM_NODEID" not in env and nnodes > 1:
        raise UserError(f"this is a {nnodes}-node Slurm allocation but not one of its tasks (no SLURM_NODEID)", fix)
    node = _number(env, "SLURM_NODEID", 0, fix) if "SLURM_NODEID" in env else 0
    if node >= nnodes:
        raise UserError(f"SLURM_NODEID={node} is not a node of the {nnodes} in {nodes_name}", fix)
    tasks_name = _first(env, "SLURM_NTASKS", "SLURM_NPROCS")
    tasks = _number(env, tasks_name, 1, fix) if tasks_name else nnodes
    task = _number(env, "SLURM_PROCID", 0, fix) if "SLURM_PROCID" in env else node
    if tasks > nnodes or task != node:
        raise UserError(f"Slurm runs {tasks} tasks on {nnodes} node(s) (this is task {task} on node {node}), but "
                        "effitrain launch starts the processes of its node itself and needs one task per node",
                        "use srun --ntasks-per-node=1 (#SBATCH --ntasks-per-node=1) and effitrain launch --nproc "
                        "<GPUs per node>")
    if nnodes == 1:
        return Cluster("Slurm", 1)
    head = _address(env, "MASTER_ADDR") if "MASTER_ADDR" in env else _slurm_head(env)
    return Cluster("Slurm", nnodes, node, head, _slurm_port(env))


def _slurm_head(env: Mapping[str, str]) -> str:
    name = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if name is None:
        raise UserError("no SLURM_JOB_NODELIST (nor SLURM_STEP_NODELIST, SLURM_NODELIST) names the head node",
                        "run under srun, or set MASTER_ADDR or pass --master-addr")
    try:
        return expand_hostlist(env[name].strip())[0]
    except ValueError as err:
        raise UserError(f"{name}={env[name]!r} is not a Slurm node list ({err})", "set it as Slurm does (e.g. "
                        "node[01-04],gpu5), or set MASTER_ADDR or pass --master-addr") from None


def _slurm_port(env: Mapping[str, str]) -> int:
    if "MASTER_PORT" in env:
        return _port(env, "MASTER_PORT")
    name = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
    job = _number(env, name, 0, "run under Slurm (its job id is a number), or set MASTER_PORT or pass --master-port")
    return SLURM_PORT_BASE + job % SLURM_PORT_SPAN


def from_torchrun_env(env: Mapping[str, str], want_nproc: bool = True) -> Cluster | None:
    """A Kubeflow PyTorchJob, or any torchrun-style environment. The training operator sets, in each pod,
    PET_NNODES (the replicas), PET_NODE_RANK (the pod's index, Master 0), PET_NPROC_PER_NODE (nprocPerNode,
    default "auto"), MASTER_ADDR and MASTER_PORT (the Master's service); Kubeflow Trainer's TrainJob sets
    PET_MASTER_ADDR and PET_MASTER_PORT instead. Operators before v1.7 set no PET_*: their WORLD_SIZE
    is the number of pods and RANK the pod's index. So without PET_NNODES, WORLD_SIZE and RANK are read
    as node count and node rank when MASTER_ADDR is set too and no launcher's per-process variable
    (LOCAL_RANK...) says they count processes: a shell left with a launched worker's variables is not a
    cluster (runtime/distributed.py deals with those in `train`). The newer operators' WORLD_SIZE (pods x
    nprocPerNode) is never read."""
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or None
    port_name = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
    nproc = _nproc(env) if want_nproc and "PET_NPROC_PER_NODE" in env else None
    if "PET_NNODES" in env:
        source, nodes_name, rank_name = "PyTorchJob", "PET_NNODES", _first(env, "PET_NODE_RANK", "RANK")
    elif "WORLD_SIZE" in env and addr and not any(env.get(name) for name in PROCESS_LEVEL):
        source, nodes_name, rank_name = "WORLD_SIZE/RANK", "WORLD_SIZE", _first(env, "RANK")
    elif "PET_NPROC_PER_NODE" in env:
        return Cluster("PyTorchJob", 1, nproc=nproc)
    else:
        return None
    fix = "set them as the PyTorchJob does (a fixed number of replicas), or pass --nnodes and --node-rank"
    if re.fullmatch(r"\s*\d+\s*:\s*\d+\s*", env[nodes_name]):
        raise UserError(f"{nodes_name}={env[nodes_name]} is a range (an elasticPolicy): effitrain trains on a fixed "
                        "number of nodes, so that a step equals one big batch", "remove the PyTorchJob's elasticPolicy "
                        "(a fixed number of replicas, nprocPerNode), or pass --nnodes and --node-rank")
    nnodes = _number(env, nodes_name, 1, fix)
    if nnodes == 1:
        return Cluster(source, 1, nproc=nproc)
    if rank_name is None:
        raise UserError(f"{nodes_name}={nnodes} but no PET_NODE_RANK (nor RANK) says which node this is", fix)
    rank = _number(env, rank_name, 0, fix)
    if rank >= nnodes:
        raise UserError(f"{rank_name}={rank} is not a node of the {nnodes} in {nodes_name}", fix)
    addr_name = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    return Cluster(source, nnodes, rank, _address(env, addr_name) if addr_name else None,
                   _port(env, port_name) if port_name else None, nproc)


def _nproc(env: Mapping[str, str]) -> int:
    """PET_NPROC_PER_NODE: a number, or "auto"/"gpu" (the operator's default): one process per accelerator,
    one on a machine without (torchrun's "auto" would start one per CPU core)."""
    value = env["PET_NPROC_PER_NODE"].strip().lower()
    if value in ("auto", "gpu"):
        return max(1, local_accelerators())
    return _number(env, "PET_NPROC_PER_NODE", 1, "set nprocPerNode to a number or \"auto\", or pass --nproc")


def local_accelerators() -> int:
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    return torch.cuda.device_count()


# CPU workers per core beyond which more processes only wait on each other, each with its own copy of
# the model (1,000 workers on 2 cores were accepted, and stuck in their store connects).
CPU_WORKERS_PER_CORE = 4


def check_nproc(nproc: int) -> None:
    """--nproc within what this node can run: one process per accelerator, or a few per CPU core."""
    devices, cores = local_accelerators(), os.cpu_count() or 1
    if devices and nproc > devices:
        raise UserError(f"--nproc {nproc} is more processes than this node's {devices} accelerator(s)",
                        f"pass --nproc {devices} or less (one process per device)")
    if not devices and nproc > CPU_WORKERS_PER_CORE * cores:
        raise UserError(f"--nproc {nproc} is more than {CPU_WORKERS_PER_CORE} processes per CPU core of this node "
                        f"({cores} cores)", f"pass --nproc {cores} or less (on CPUs, fewer processes with more "
                        "threads each do more)")


def from_environment(env: Mapping[str, str], want_nproc: bool = True) -> Cluster | None:
    """Slurm (any SLURM_JOB_ID), else a PyTorchJob or torchrun-style environment, else None."""
    if _first(env, "SLURM_JOB_ID", "SLURM_JOBID"):
        return from_slurm(env)
    return from_torchrun_env(env, want_nproc)


def resolve(args, env: Mapping[str, str]) -> tuple[argparse.Namespace, str | None]:
    """The launch settings: a flag given (not None) wins, then the cluster's environment, then the defaults
    (1 process, 1 node: standalone). One node takes no rank, address or port from the environment (a
    free port on this machine, as without it). The environment is not read when the flags settle
    everything. Also returns the line saying what came from the environment (None: nothing did)."""
    given = {name: getattr(args, name) for name in ("nproc", *NODE_FLAGS)}
    open_nodes = given["nnodes"] != 1 and None in (given[name] for name in NODE_FLAGS)
    cluster = from_environment(env, given["nproc"] is None) if given["nproc"] is None or open_nodes else None
    found = dataclasses.asdict(cluster) if cluster else {}
    pick = {name: found.get(name) if value is None else value for name, value in given.items()}
    if pick["nnodes"] in (None, 1):
        pick.update({name: given[name] for name in NODE_FLAGS}, nnodes=1)
    pick["nproc"] = 1 if pick["nproc"] is None else pick["nproc"]
    pick["node_rank"] = 0 if pick["node_rank"] is None else pick["node_rank"]
    taken = [name for name, value in given.items() if value is None and found.get(name) is not None
             and pick[name] == found[name]]
    if "nnodes" in taken and pick["nnodes"] > 1:
        for name, variables in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
            if pick[name] is None:
                raise UserError(f"{pick['nnodes']} nodes from {cluster.source}, but no {variables} (nor "
                                f"PET_{variables}) says where node 0 waits", f"set {variables} on every node, or "
                                f"pass --{name.replace('_', '-')}")
    resolved = argparse.Namespace(**{**vars(args), **pick})
    overridden = [name for name, value in given.items() if value is not None and found.get(name) is not None]
    return resolved, origin_line(cluster, resolved, taken, overridden) if taken else None


def origin_line(cluster: Cluster, args, taken: list[str], overridden: list[str]) -> str:
    """e.g. `effitrain launch: 2 nodes from Slurm (node 1, head node01:15123)`."""
    line = f"effitrain launch: {args.nnodes} node{'s' * (args.nnodes > 1)} from {cluster.source}"
    if args.nnodes > 1:
        line += f" (node {args.node_rank}, head {args.master_addr}:{args.master_port})"
    if "nproc" in taken:
        line += f", {args.nproc} process{'es' * (args.nproc > 1)} per node from PET_NPROC_PER_NODE"
    if overridden:
        line += "; the command line's " + " ".join(f"--{name.replace('_', '-')}" for name in overridden) + " won"
    return line


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


def failure_line(failures: dict, world: int | None = None) -> tuple[str, int]:
    """The job's one stderr line and exit code. A user error stays one (exit 2), in the usual
    `effitrain: error: ...; fix: ...` form, said once although every process hit it; it names the
    process when the others failed differently (then it is that process's own problem). A worker killed
    by a signal is named with it, and with what its peers knew (the step, the checkpoint): exit 1, the
    run crashed. `world`: the job's processes (default: those that failed here)."""
    rank, failure = root_cause(failures)
    cause = describe(failure)
    lost = [found for r, f in failures.items() if r != rank and (found := PeerLost.parse(describe(f)))]
    if failure.exitcode < 0:
        return killed_line(rank, -failure.exitcode, world or len(failures), lost), 1
    if (own := PeerLost.parse(cause)) is not None:  # the process that ended ran on another node
        return (f"effitrain launch: error: process {rank}: {own} (on another node: its launcher says why); "
                f"fix: {rerun_fix([own])}"), 1
    if failure.exitcode == 2 and cause.startswith("UserError: "):
        cause = cause.removeprefix("UserError: ")
        others = [describe(f) for r, f in failures.items() if r != rank and not stopped_by_launcher(f)]
        same = all(other == f"UserError: {cause}" for other in others)
        return f"effitrain: error: {cause if same else f'process {rank}: {cause}'}", 2
    return f"effitrain launch: error: rank {rank} failed: {cause}", 2 if failure.exitcode == 2 else 1


def killed_line(rank: int, signum: int, world: int, lost: list[PeerLost]) -> str:
    """e.g. `worker 1 of 2 was killed by SIGKILL (signal 9) during step 5; fix: ...`."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    steps = sorted(p.step for p in lost if p.step is not None)
    during = f" during step {steps[-1]}" if steps else ""
    why = ("check the memory (dmesg for the out-of-memory killer), " if signum == signal.SIGKILL else
           "find what sent it, ")
    return (f"effitrain launch: error: worker {rank} of {world} was killed by {name} (signal {signum}){during}; "
            f"fix: {why}{rerun_fix(lost)}")


def rerun_fix(known: list[PeerLost]) -> str:
    """What the surviving processes knew of the checkpoints (nothing, if the launcher stopped them first)."""
    checkpoint = next((p.checkpoint for p in known if p.checkpoint), None)
    if checkpoint:
        return f"then rerun with --resume auto (continues from {checkpoint})"
    if any(p.looked for p in known):
        return "then rerun (no checkpoint was saved: --save-every N keeps some)"
    return "then rerun (with --resume auto if the run saved checkpoints)"


def quiet_torchrun() -> None:
    """torchrun's agent logs each worker's exit and its own shutdown on stderr; effitrain says it in one
    line instead (--debug keeps the logs)."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def launch(args, command: list[str]) -> int:
    check_command(command)
    args, origin = resolve(args, os.environ)
    check_numbers(args)
    check_nproc(args.nproc)
    if origin:
        print(origin, file=sys.stderr, flush=True)
    join_seconds = meet(args)

    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ[LAUNCHED] = "1"
    os.environ[LAUNCHER_PID] = str(os.getpid())
    if not args.debug:
        quiet_torchrun()
    try:
        run(get_args_parser().parse_args(torchrun_argv(args, command, join_seconds)))
    except ChildFailedError as err:
        raise LaunchEnded(*failure_line(err.failures, args.nproc * args.nnodes)) from err
    except DistError as err:  # torch's store: the nodes did not all meet in time
        raise not_met(args, err) from None
    except SignalException as err:
        # The agent has sent the same signal to the workers and waited for them (SIGKILL after its
        # shutdown timeout): each has unwound its run, kept its latest complete checkpoint and removed
        # a save in progress.
        raise LaunchEnded(f"effitrain launch: stopped by {err.sigval.name}: the {args.nproc} worker(s) of this "
                          "node have ended (a run saving checkpoints resumes with --resume auto)",
                          128 + err.sigval) from err
    return 0


# Once node 0 answers, torch's store still needs the nodes' agents to agree on the ranks: never less than this.
MIN_STORE_SECONDS = 60


def meet(args) -> float | None:
    """Before torch's rendezvous: node 0 checks that it can serve the meeting point; with several nodes each
    says what it waits for and until when, and another node waits (bounded) for node 0 to listen. Returns
    the seconds torch's store gets to gather the nodes (None: standalone, nothing to meet)."""
    if standalone(args):
        return None
    address, port = args.master_addr or "127.0.0.1", args.master_port or DEFAULT_PORT
    if args.node_rank == 0:
        rendezvous.ensure_port_free(address, port)
    if args.nnodes == 1:
        return None
    seconds, until = args.join_timeout, rendezvous.deadline_said(args.join_timeout)
    if args.node_rank == 0:
        print(f"effitrain launch: node 0 waits for the other {args.nnodes - 1} node(s) at {address}:{port} {until}",
              file=sys.stderr, flush=True)
        return seconds
    print(f"effitrain launch: node {args.node_rank} waits for node 0 at {address}:{port} {until}", file=sys.stderr,
          flush=True)
    return max(MIN_STORE_SECONDS, rendezvous.wait_for_node_0(address, port, seconds))


def not_met(args, err: BaseException) -> UserError:
    address, port = args.master_addr or "127.0.0.1", args.master_port or DEFAULT_PORT
    if args.node_rank == 0:
        return rendezvous.nodes_missing(err, args.nnodes, address, port, args.join_timeout)
    last = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
    return UserError(f"node {args.node_rank} could not join node 0 at {address}:{port} ({last})",
                     "start effitrain launch on every node with the same --nnodes, --master-addr and --master-port")


# A worker inside a C++ call (a store connect, retried for its whole timeout; a collective) runs no Python
# signal handler until the call returns: after its launcher's death it gets this long to start unwinding
# on its SIGTERM, and that long to finish (torchrun's shutdown timeout), then it ends outright.
START_UNWIND_SECONDS, FINISH_UNWIND_SECONDS = 5.0, 30.0


def end_with_launcher(unwinding: list | None = None) -> None:
    """In a worker of `effitrain launch`: SIGTERM when the launcher dies, however it dies (SIGKILL, the
    out-of-memory killer), so the worker unwinds as on any SIGTERM (its latest complete checkpoint kept, a
    save in progress removed, the output folder released) instead of training on alone and holding the
    folder's lock: torch's agent starts each worker in a session of its own, out of reach of a signal to
    the launcher's process group, and no agent is left to forward one. Linux's PR_SET_PDEATHSIG, which
    fires when the thread that started the worker ends: torch's agent starts them from its main thread.
    A launcher already gone is noticed here; a live process of that id that is not the parent means the
    variables were copied from a worker's environment (nothing to follow). `unwinding`: the signals the
    command's handler has received (cli.py); given, a thread ends the worker if it is stuck in C++."""
    try:
        launcher = int(os.environ.get(LAUNCHER_PID, ""))
    except ValueError:
        return
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    if os.getppid() == launcher:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == launcher:  # still alive after the call: the signal will come when it dies
            if unwinding is not None:
                _watch_launcher(launcher, unwinding)
            return
    elif _alive(launcher):
        return
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before this worker could follow it


def _watch_launcher(launcher: int, unwinding: list) -> None:
    import threading
    import time

    def watch():
        while os.getppid() == launcher:
            time.sleep(0.5)
        deadline = time.monotonic() + START_UNWIND_SECONDS
        while not unwinding and time.monotonic() < deadline:
            time.sleep(0.1)
        if unwinding:  # the handler runs: it unwinds the run (removes a save in progress, releases the folder)
            time.sleep(FINISH_UNWIND_SECONDS)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="effitrain-follows-launcher", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class LaunchEnded(Exception):
    """The job ended otherwise than in success (torchrun has stopped every worker): the one line to print."""

    def __init__(self, line: str, exit_code: int):
        self.line, self.exit_code = line, exit_code
        super().__init__(line)


def add_parser(commands) -> None:
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
    launch.add_argument("--join-timeout", type=float, default=600.0,
                        help="seconds the nodes wait for each other at start (default 600, torchrun's)")
    launch.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times on failure")
    launch.add_argument("--debug", action="store_true")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the effitrain command and its flags")


def main(args) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return launch(args, command)
