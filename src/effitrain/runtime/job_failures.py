"""How a launched job ended, said in one stderr line with its exit code: the worker that failed first
(its own error, the signal that killed it, or its exit code), with what its peers knew of the step and the
checkpoints. torchrun's agent logs every worker's end; the workers stay silent (cli.py), the launcher
says it once."""

from __future__ import annotations

import signal

from effitrain.runtime.peers import PeerLost


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


class LaunchEnded(Exception):
    """The job ended otherwise than in success (torchrun has stopped every worker): the one line to print."""

    def __init__(self, line: str, exit_code: int):
        self.line, self.exit_code = line, exit_code
        super().__init__(line)
