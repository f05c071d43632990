"""How long the `effitrain` command takes to answer what needs no training: `--help`, a command's
`--help`, a mistyped value, a config file's mistake; beside an empty Python start (`python -c pass`) and
the same process importing torch (what every answer cost when the CLI imported it while parsing).

Each command runs ROUNDS times in turn with the others, in fresh processes (the median is printed, with
its ratio to the empty start); each answer is also checked to come without torch in the process and
before the allocator's re-execution (the process that answers is the one started).

    .venv/bin/python benchmarks/speedups/cli_start.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

# The answering process: torch imported or not, and whether it is the re-executed one (the allocator's marker
# is set in the process it re-executes: execve keeps the pid).
PROBE = ("import os, sys\nfrom effitrain import __main__ as entry\nfrom effitrain.speedups import allocator\n"
         "code = None\ntry:\n    code = entry.run()\nexcept SystemExit as e:\n    code = e.code\n"
         "same = allocator.PRELOADING not in os.environ\n"
         "sys.stderr.write(f'\\nPROBE torch={\"torch\" in sys.modules} same={same}\\n')\n"
         "sys.exit(code or 0)\n")


def commands(config: Path) -> dict[str, list[str]]:
    effitrain = [sys.executable, "-m", "effitrain"]
    return {"python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "effitrain --help": [*effitrain, "--help"],
            "effitrain train --help": [*effitrain, "train", "--help"],
            "effitrain train --lr abc": [*effitrain, "train", "--lr", "abc"],
            "effitrain train --config bad.yaml": [*effitrain, "train", "--config", str(config)]}


def probed(argv: list[str]) -> tuple[bool, bool]:
    """(torch imported, answered by the process started) for an effitrain command line."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv[3:]], capture_output=True, text=True, timeout=120)
    line = done.stderr.strip().splitlines()[-1]
    return "torch=True" in line, "same=True" in line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="1 round")
    args = parser.parse_args()
    rounds = 1 if args.dry_run else args.rounds
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bad.yaml"
        config.write_text("lr: fast\n")
        lines = commands(config)
        times: dict[str, list[float]] = {name: [] for name in lines}
        for _ in range(rounds):
            for name, argv in lines.items():
                started = time.perf_counter()
                subprocess.run(argv, capture_output=True, timeout=120)
                times[name].append(time.perf_counter() - started)
        checks = {name: probed(argv) for name, argv in lines.items() if name.startswith("effitrain")}
    base = statistics.median(times["python -c pass"])
    print(f"{_common.machine()}; {rounds} rounds, medians")
    _common.print_columns(("command", "seconds", "x python -c pass", "torch imported", "answered before re-exec"),
                          [(name, f"{statistics.median(t):.3f}", f"{statistics.median(t) / base:.1f}",
                            *(("yes" if checks[name][0] else "no", "yes" if checks[name][1] else "no")
                              if name in checks else ("", ""))) for name, t in times.items()])
    if args.dry_run:
        print("dry run: 1 round")
    return 0 if not any(torch for torch, _ in checks.values()) and all(same for _, same in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
