"""Speed-ups of the training step on CPUs (src/effitrain/speedups/) and of the command's start, each measured
against what it replaced."""
