"""What a cluster's environment says about this node, and the launch settings it gives: Slurm (one
`effitrain launch` per node under srun), a Kubeflow PyTorchJob or any torchrun-style environment. A flag
given wins over the environment, so that the same command runs on every node and a person can still
override one setting."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping

from effitrain.errors import UserError
from effitrain.runtime import devices, rendezvous
from effitrain.runtime.hostlist import expand_hostlist

# Slurm gives no port: one derived from the job id is the same on every node of the job and differs
# between jobs sharing a node (the rule of several tools: 15000 + job id mod 20000).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000
# Set by a launcher in each process it starts, never by a scheduler for a node: next to them, WORLD_SIZE
# and RANK count processes (a shell left with a launched worker's variables, runtime/distributed.py), not nodes.
PROCESS_LEVEL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
NODE_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What a scheduler's environment says about this node; None where it says nothing."""

    source: str  # "Slurm", "PyTorchJob", "WORLD_SIZE/RANK"
    nnodes: int
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: int | None = None


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
        return max(1, devices.accelerator_count())
    return _number(env, "PET_NPROC_PER_NODE", 1, "set nprocPerNode to a number or \"auto\", or pass --nproc")


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
