"""The run's log and its sinks: every record goes to log.jsonl (one JSON object per line) and to
the other sinks the run was given (the trackers, the console)."""

from __future__ import annotations

from pathlib import Path

from effitrain.outputs import files


class RunLog:
    """The run's log: each record goes to every sink (log.jsonl's JsonlLog, tracking.TrackerLog, the console)."""

    def __init__(self, *sinks):
        self.sinks = [sink for sink in sinks if sink is not None]

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def say(self, message: str) -> None:
        """A line for the person watching (outputs/console.py); the files keep records, not sentences."""
        for sink in self.sinks:
            if hasattr(sink, "say"):
                sink.say(message)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class JsonlLog:
    """log.jsonl: one JSON object per line, flushed at once so a crash keeps every line written."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(files.json_text(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
