"""`python -m effitrain`, `torchrun -m effitrain` and the `effitrain` command: the CLI."""

import sys


def run() -> int:
    try:
        from effitrain.cli import main
    except KeyboardInterrupt:  # Ctrl-C while the CLI is still importing: the same one line as later
        print("effitrain: stopped by SIGINT", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
