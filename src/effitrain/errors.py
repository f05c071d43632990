"""The one error type a user sees: a problem they can fix, printed as one line, exit code 2."""


class UserError(Exception):
    """Bad input or configuration. `problem` says what is wrong, `fix` what to do about it."""

    exit_code = 2

    def __init__(self, problem: str, fix: str):
        # One line, always: tools grep stderr and people read the last line. Bounded too: a message may
        # quote what the user gave (a path, a flag's value), which may be megabytes.
        self.problem = bounded(" ".join(str(problem).split()))
        self.fix = bounded(" ".join(str(fix).split()))
        super().__init__(f"{self.problem}; fix: {self.fix}")


LONGEST = 1000  # characters of a problem or a fix; the rest is cut


def bounded(text: str) -> str:
    return text if len(text) <= LONGEST else text[:LONGEST - 30] + f" ... ({len(text) - LONGEST + 30:,} more characters)"


class Diverged(UserError):
    """The run's loss or weights stopped being finite: exit 2 like a mistake, but the run's files (its log,
    checkpoints, best/) are kept to look at; model/ is never written."""


class Terminated(BaseException):
    """SIGTERM during a run: unwinds it like Ctrl-C (a BaseException, so no `except Exception` eats it)."""

    exit_code = 143


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a command, raised by the CLI's handler (cli._signals_unwind), which marks itself
    `raises_interrupted`: while it holds SIGINT, any other KeyboardInterrupt was raised by code, not by a key."""


def raised_by_code(error: BaseException) -> bool:
    """Whether `error`, met while running a user's code (a reward file), is that code's failure rather than a
    request from outside to stop: any Exception; SystemExit (exit() or argparse in a script); a KeyboardInterrupt
    that no Ctrl-C caused, known as such only under the CLI's handler (under Python's own, as in a notebook, a
    KeyboardInterrupt may be the user's key, and is left to stop the program). Never SIGTERM's Terminated."""
    import signal

    if isinstance(error, (Exception, SystemExit)):
        return True
    handler_marks_keys = getattr(signal.getsignal(signal.SIGINT), "raises_interrupted", False)
    return isinstance(error, KeyboardInterrupt) and not isinstance(error, Interrupted) and handler_marks_keys
