"""TrainState: everything a run counts, and what a checkpoint keeps of it.

The running sums (`window`: loss and items since the last log line; `totals`: examples and tokens)
are per process. A checkpoint stores them summed over the processes; on resume each process takes
1/W of the sums, so that the sums over processes, the only thing ever reported, come out the same.
That scaling is done here and nowhere else."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


@dataclass
class TrainState:
    device: torch.device | str = "cpu"
    step: int = 0
    train_seconds: float = 0.0
    last_loss: float | None = None  # mean over the last logged window
    last_task_metrics: dict = field(default_factory=dict)  # the task's own means over it (online RL: its reward)
    skipped_steps: int = 0  # steps with a non-finite loss or gradient
    bad_in_a_row: int = 0
    # Evaluation during training: the best value of the metric for best, its step, and the patience count.
    best_value: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    validation: dict = field(default_factory=dict)  # the latest validation metrics
    window: torch.Tensor = None  # loss sum, items (then the task's sums) since the last log line (this process)
    totals: torch.Tensor = None  # examples, tokens (this process)
    started: float = field(default_factory=time.perf_counter)  # this invocation's start (perf_counter)
    earlier_wall_seconds: float = 0.0  # what the invocations before a resume ran, up to its checkpoint
    # Throughput windows: totals over processes and train_seconds at the last log line (not checkpointed:
    # the first window after a resume spans the whole run so far, still a true average).
    logged_totals: torch.Tensor = None
    logged_seconds: float = 0.0
    # Wall seconds outside the training steps, by phase (see `timed`), over the invocations.
    phase_seconds: dict = field(default_factory=dict)
    # The window's length: 2, or more where the task logs sums of its own (engine/step.window_size).
    window_size: int = 2

    SCALARS = ("step", "train_seconds", "last_loss", "last_task_metrics", "skipped_steps", "bad_in_a_row", "best_value",
               "best_step", "evals_without_improvement", "validation", "phase_seconds")

    def __post_init__(self):
        if self.window is None:
            self.window = torch.zeros(self.window_size, dtype=torch.float64, device=self.device)
        if self.totals is None:
            self.totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.logged_totals is None:
            self.logged_totals = torch.zeros(2, dtype=torch.float64, device=self.device)

    def state_dict(self, reduce=None) -> dict:
        """Plain values for trainer_state.json; `reduce` sums a tensor over the processes (a collective:
        every process calls this)."""
        reduce = reduce or (lambda tensor: tensor)
        return {**{name: getattr(self, name) for name in self.SCALARS}, "wall_seconds": self.wall_seconds(),
                "window": reduce(self.window.clone()).tolist(), "totals": reduce(self.totals.clone()).tolist()}

    def load_state_dict(self, state: dict, world: int) -> None:
        for name in self.SCALARS:
            if name in state:  # checkpoints from before evaluation-during-training lack the best fields
                setattr(self, name, state[name])
        self.earlier_wall_seconds = state.get("wall_seconds", state["train_seconds"])
        saved = torch.tensor(state["window"], dtype=torch.float64, device=self.device) / world
        self.window = torch.zeros(self.window_size, dtype=torch.float64, device=self.device)
        self.window[:len(saved)] = saved[:self.window_size]  # a checkpoint from before the task's sums: none yet
        self.totals = torch.tensor(state["totals"], dtype=torch.float64, device=self.device) / world

    def wall_seconds(self) -> float:
        """Seconds the run has taken, over its invocations (a resumed run counts the earlier ones up to
        the checkpoint, as train_seconds does)."""
        return self.earlier_wall_seconds + time.perf_counter() - self.started

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Adds the wall time of the block to `phase` (start_up, set_up, evaluation or saving)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_phase(phase, time.perf_counter() - start)

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    def seconds_by_phase(self, compiling: float = 0.0) -> dict:
        """wall_seconds split: start-up (the process before the run: imports, arguments, the output
        folder), set-up (data, tokenisation, model, loaders), training (the steps), compiling
        (--compile), evaluation (validation and test), saving (checkpoints, best/, model/, adapter/,
        metrics.json), and what is left (logging, the checks between them). `total`: start-up + wall_seconds,
        the process's time to the saved model."""
        timed = self.phase_seconds
        split = {"start_up": timed.get("start_up", 0.0), "set_up": timed.get("set_up", 0.0),
                 "training": self.train_seconds, "compiling": compiling,
                 "evaluation": timed.get("evaluation", 0.0), "saving": timed.get("saving", 0.0)}
        total = split["start_up"] + self.wall_seconds()
        split["other"] = max(0.0, total - sum(split.values()))
        return {**{phase: round(seconds, 3) for phase, seconds in split.items()}, "total": round(total, 3)}

    def take_window(self, reduce=None) -> list[float]:
        """[loss sum, items, then the task's sums and their count] since the last call, over all processes;
        the window starts again."""
        window = (reduce(self.window) if reduce else self.window).tolist()
        self.window.zero_()
        return window

    def take_throughput(self, reduce=None) -> tuple[float, float, float]:
        """(examples, tokens, training seconds) since the last call, over all processes (a collective
        when `reduce` is given)."""
        totals = reduce(self.totals.clone()) if reduce else self.totals.clone()
        examples, tokens = (totals - self.logged_totals).tolist()
        seconds = self.train_seconds - self.logged_seconds
        self.logged_totals, self.logged_seconds = totals, self.train_seconds
        return examples, tokens, seconds


def process_age_seconds() -> float:
    """Seconds since this process started (Linux: /proc; 0 elsewhere): the start-up before run()."""
    import os

    try:
        with open("/proc/self/stat") as stat:
            started = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
