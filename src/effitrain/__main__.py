"""`python -m effitrain`, `torchrun -m effitrain` and the `effitrain` command: the CLI."""

import sys


def run() -> int:
    try:
        from effitrain.errors import UserError
        from effitrain.speedups import allocator, process_tuning

        from effitrain.cli import answer_at_once, main

        try:  # before torch is loaded: this process may be replaced by itself with jemalloc or tcmalloc
            environment = allocator.preloading()
        except UserError as err:
            print(f"effitrain: error: {err}", file=sys.stderr)
            return err.exit_code
        if environment is not None:
            code = answer_at_once(sys.argv[1:])  # --help and mistakes: no second start for them
            if code is not None:
                return code
            allocator.reexecute(environment)
    except KeyboardInterrupt:  # Ctrl-C while the CLI is still importing: the same one line as later
        print("effitrain: stopped by SIGINT", file=sys.stderr)
        return 130
    code = main()
    process_tuning.ending_process(code)  # no teardown collections over the imports' objects
    return code


if __name__ == "__main__":
    raise SystemExit(run())
