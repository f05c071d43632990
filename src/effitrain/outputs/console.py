"""The run as a person watches it, on the first process of each machine: tqdm's bar (on a terminal
only) with the last loss, rate and peak memory, and one line per logged step, validation and event.

A sink of the run's log like log.jsonl and the trackers (it renders the records they store), and a
callback of the loop (its bar moves on at the end of each step)."""

from __future__ import annotations

MiB = 2**20
# What every logged step's record holds (engine/run.log_window); a task's own numbers come besides.
STEP_KEYS = ("step", "epoch", "loss", "lr", "grad_norm", "elapsed_seconds", "samples_per_second",
             "tokens_per_second", "peak_memory_bytes")


def short(values: dict) -> str:
    """Metrics on one line: `accuracy 0.9918 f1_macro 0.9818 ... loss 0.0442` (counts left out)."""
    return " ".join(f"{k} {v:.4f}" for k, v in values.items() if k not in ("samples", "tokens"))


class Console:
    def __init__(self, total_steps: int, start: int, shown: bool):
        from tqdm.auto import tqdm

        self.total_steps, self.shown = total_steps, shown
        # disable=None: no bar when stderr is not a terminal (CI logs), and none on other processes.
        self.bar = tqdm(total=total_steps, initial=start, desc="train", unit="step", mininterval=1.0,
                        disable=None if shown else True)

    def write(self, record: dict) -> None:
        """Records with a line of their own: the logged steps and the validations."""
        if record.get("split") == "validation":
            metrics = {k: v for k, v in record.items() if k not in ("step", "epoch", "split")}
            self.say(f"step {record['step']} validation: {short(metrics)}")
        elif "lr" in record and "split" not in record:
            self.step_line(record)

    def step_line(self, record: dict) -> None:
        loss, grad_norm, per_second = record["loss"], record["grad_norm"], record["samples_per_second"]
        shown = "-" if loss is None else f"{loss:.4f}"
        # The live view: tqdm shows step, rate and ETA; these follow them.
        self.bar.set_postfix_str(f"loss {shown}, " + (f"{per_second:.1f} samples/s, " if per_second else "")
                                 + f"peak {record['peak_memory_bytes'] / MiB:.0f} MiB", refresh=False)
        # The task's own numbers (preference: rewards, accuracy) follow the loss, in the record's order.
        own = {k: v for k, v in record.items() if k not in STEP_KEYS and v is not None}
        self.say(f"step {record['step']}/{self.total_steps} epoch {record['epoch']:.2f} loss {shown} "
                 + (short(own) + " " if own else "")
                 + f"lr {record['lr']:.2e} grad_norm " + ("-" if grad_norm is None else f"{grad_norm:.3f}"))

    def say(self, message: str) -> None:
        """A line above the bar (events the log records in its own words, or not at all)."""
        if self.shown:
            self.bar.write(message)

    def on_step_end(self, state, result) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
