"""Processes training together: launcher variables, joining the process group (bounded, with one
line when a peer never comes), and the Accelerator."""

from __future__ import annotations

import contextlib
import os
import sys

from effitrain.runtime import devices

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


# Processes not started by torchrun (no agent waits for their peers) must all meet within this time:
# stray launcher variables in a shell would otherwise make a plain `train` wait for peers that never come.
JOIN_SECONDS = 10


def make_accelerator(ddp_timeout: float | None = None, plugins: dict | None = None, mixed_precision: str = "no",
                     broadcast_buffers: bool = True, log_with: list | None = None):
    """Accelerator, told it is on a CPU when no accelerator exists: otherwise accelerate does not enter
    multi-CPU mode and every process of `torchrun --nproc-per-node N` trains alone, silently.
    `ddp_timeout` bounds how long a collective waits for a dead or stuck peer; `plugins`: the strategy's
    (engine/strategies: DeepSpeed's); `log_with`: experiment trackers (outputs/tracking.py)."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    init_process_group(timedelta(seconds=ddp_timeout or 600))  # before accelerate, which would wait unbounded
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))] if ddp_timeout else []
    if not broadcast_buffers:
        from accelerate.utils import DistributedDataParallelKwargs

        # DDP broadcasts buffers in every forward, a collective: a process that skipped a forward
        # (out of memory) would leave the others waiting in it.
        handlers.append(DistributedDataParallelKwargs(broadcast_buffers=False))
    fresh_accelerator_state()
    return Accelerator(cpu=not devices.has_accelerator(), kwargs_handlers=handlers, mixed_precision=mixed_precision,
                       log_with=log_with or None, **(plugins or {}))


@contextlib.contextmanager
def _c10d_logs_off():
    """c10d's C++ side logs each failed connection, with a stack, straight to file descriptor 2; the
    failure becomes one line of effitrain's instead."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def launcher_variables() -> dict[str, str]:
    """The torchrun variables set in this process's environment."""
    return {name: os.environ[name] for name in DIST_VARS if os.environ.get(name)}


def launcher_world_size() -> int:
    """How many processes the launcher variables announce (1 without them). accelerate joins a process
    group, and waits for the others, as soon as this is over 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def started_by_torchrun() -> bool:
    """torchrun's agent (so also `effitrain launch`) sets this in its workers' environment only."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def init_process_group(timeout) -> None:
    """Join the process group before accelerate does. Outside torchrun, the peers must meet within
    JOIN_SECONDS (join_started_by_hand). Under torchrun, join through the launcher's store with keys of
    this restart attempt only. torch's launcher keeps one store for all attempts (the shared rendezvous
    store; the static one for --master-addr) although torch.distributed assumes a new store per attempt,
    so a restarted worker can read a dead peer's gloo address (or NCCL id) from the previous attempt:
    "Gloo connectFullMesh failed ... Connection refused" about every other restart here. accelerate
    then uses this process group as it is."""
    import torch.distributed as dist

    env = os.environ
    if dist.is_initialized() or launcher_world_size() < 2:
        return
    if not started_by_torchrun():
        join_started_by_hand(timeout)
        return
    # One node only: restart counts are per node agent, so nodes could disagree on the attempt.
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE"):
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    store = dist.PrefixStore(f"/effitrain/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    _join(store, timeout)


def _join(store, timeout) -> None:
    import torch
    import torch.distributed as dist

    env = os.environ
    backend = "gloo"
    if torch.cuda.is_available():  # CPU tensors (accelerate launch --cpu) over gloo, CUDA ones over NCCL
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=timeout)


def join_started_by_hand(timeout) -> None:
    """WORLD_SIZE > 1 without torchrun: stray variables in a shell, or processes started one by one.
    No agent has checked that the peers exist, so they must meet within JOIN_SECONDS, or this one stops
    with one line naming the variables. Once all are there, the store and the process group get the
    run's own timeout."""
    from effitrain.errors import UserError

    variables = " ".join(f"{k}={v}" for k, v in launcher_variables().items())
    fix = ("unset them (unset " + " ".join(launcher_variables()) + ") to run one process, or start every "
           "process with `effitrain launch --nproc N -- ...`")
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    try:
        rank, port = int(os.environ.get("RANK", "0")), int(os.environ.get("MASTER_PORT", "0"))
    except ValueError:
        missing, rank, port = missing or ["a number in RANK and MASTER_PORT"], 0, 0
    world, address = launcher_world_size(), os.environ.get("MASTER_ADDR", "")
    if missing or not 0 <= rank < world:
        raise UserError(f"launcher variables {variables} ask for {world} processes but are incomplete (need "
                        f"{', '.join(missing) or f'RANK in [0, {world})'}), and no launcher started this one", fix)
    try:
        store = _open_store(address, port, rank, world)
    except (RuntimeError, TimeoutError, OSError) as err:  # DistNetworkError, DistStoreError: RuntimeErrors
        what = (f"the other processes did not connect within {JOIN_SECONDS} s" if rank == 0 else
                f"process 0 did not answer at {address}:{port} within {JOIN_SECONDS} s")
        if "address already in use" in str(err).lower():
            what = f"port {port} of {address} is taken by another program"
        raise UserError(f"launcher variables {variables} are set, so this process waits for {world - 1} other(s), "
                        f"but {what} (no launcher started this process)", fix) from err
    store.set_timeout(timeout)
    _join(store, timeout)


def _open_store(address: str, port: int, rank: int, world: int):
    """The rendezvous store, within JOIN_SECONDS: process 0 serves it and waits for the others to connect;
    the others wait for it to listen (a plain socket probe: c10d's client would log each failed try)."""
    import socket
    import time
    from datetime import timedelta

    import torch.distributed as dist

    wait = timedelta(seconds=JOIN_SECONDS)
    if rank == 0:
        with _c10d_logs_off():
            return dist.TCPStore(address, port, world, is_master=True, timeout=wait, wait_for_workers=True)
    deadline = time.monotonic() + JOIN_SECONDS
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {address}:{port}") from None
            time.sleep(0.2)
    with _c10d_logs_off():
        return dist.TCPStore(address, port, world, is_master=False, timeout=wait)


def fresh_accelerator_state() -> None:
    """accelerate keeps one process-wide state (precision, plugins, accumulation), so a second training
    run in the same Python process could not change precision. Each run starts from a clean one; the
    process group and device (PartialState) are kept. This is what accelerate's own tests do."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):  # set by a previous run's plugin
        os.environ.pop(name, None)
