"""A process of the job gone: its peers' communication errors recognised, so that a survivor says in a
few words what it knows (the step, the latest checkpoint) instead of gloo's or NCCL's traceback, and
the launcher can name the process that died."""

from __future__ import annotations

import re
import sys

# What gloo and NCCL say when the process at the other end of a connection has ended (gloo: "Connection
# closed by peer", a reset or broken pipe on its socket; NCCL: a communicator aborted by its watchdog).
LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused|remote worker crash|"
                  r"NCCL communicator was aborted|NCCL error.*remote process", re.IGNORECASE)


def lost_peer(err: BaseException) -> bool:
    """The error (or one it was raised from) is a communication error that says a peer went away."""
    dist = sys.modules.get("torch.distributed")
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, PeerLost):
            return True
        if dist is not None and isinstance(err, getattr(dist, "DistBackendError", ())) and LOST.search(str(err)):
            return True
        if isinstance(err, RuntimeError) and LOST.search(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


class PeerLost(RuntimeError):
    """This process's collective failed because another process of the job ended. Its message is what the
    launcher reads back (parse): the step, and the checkpoint a rerun resumes from."""

    def __init__(self, step: int | None = None, checkpoint: str | None = None, looked: bool = True):
        """`looked`: the checkpoints were looked for (False: nothing is said of them)."""
        self.step, self.checkpoint, self.looked = step, checkpoint, looked or checkpoint is not None
        where = f" during step {step}" if step is not None else ""
        latest = f"; latest checkpoint {checkpoint}" if checkpoint else "; no checkpoint saved" if looked else ""
        super().__init__(f"another process of the job ended{where}{latest}")

    @classmethod
    def parse(cls, message: str) -> PeerLost | None:
        """The PeerLost a worker recorded (its message, as the launcher reads it), or None."""
        match = re.search(r"another process of the job ended(?: during step (\d+))?(; latest checkpoint (.+)|; no "
                          r"checkpoint saved)?$", message.strip())
        if not match:
            return None
        return cls(int(match[1]) if match[1] else None, match[3], looked=match[2] is not None)
