"""Hooks into the training loop, for code that watches a run (tests, benchmarks, the console) instead
of patching the engine. A callback is any object with some of these methods; each is called in the
order the callbacks were given:

    on_train_begin(job)          set-up done (and a checkpoint restored), before the first step
    on_step_begin(state, group)  before an optimizer step; `group`: this process's micro-batches
    on_step_end(state, result)   after the step and its log line; state.step is the step's number
    on_evaluate(state)           after a validation; state.validation holds its metrics
    on_save(state, path)         after a checkpoint, best/, model/ or adapter/ is written
    on_train_end(state)          after the last step, before the test evaluation

A callback that raises stops the run as a failing step would (the output folder is handled as for
any error)."""

from __future__ import annotations

HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


def checked(callbacks) -> list:
    """The callbacks as a list; refuses, before a run starts, one that has none of the hooks (a typo in
    a method's name would otherwise watch nothing, silently)."""
    callbacks = list(callbacks)
    for callback in callbacks:
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise TypeError(f"{callback!r} has none of the hooks {', '.join(HOOKS)}")
    return callbacks


class Callbacks:
    def __init__(self, callbacks=()):
        self.callbacks = checked(callbacks)

    def call(self, hook: str, *args) -> None:
        assert hook in HOOKS, hook
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)
