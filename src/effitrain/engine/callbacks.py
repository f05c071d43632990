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

import difflib

HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


def checked(callbacks) -> list:
    """The callbacks as a list (None: none); refuses, before a run starts, what is not a list of callback
    objects: a lone function or object, a class instead of its instance, one with none of the hooks, or
    with a method named like a hook that is not one (a typo would otherwise watch nothing, silently)."""
    from effitrain.errors import UserError

    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes, type)) or callable(callbacks) or not hasattr(callbacks, "__iter__"):
        raise UserError(f"callbacks={_named(callbacks)} is not a list of callback objects",
                        f"pass a list of objects with some of the methods {', '.join(HOOKS)}, e.g. "
                        "callbacks=[MyCallback()]")
    callbacks = list(callbacks)
    for callback in callbacks:
        if isinstance(callback, type):
            raise UserError(f"callback {callback.__name__} is a class", f"pass an instance: {callback.__name__}()")
        misspelt = [name for name in dir(callback) if name.startswith("on_") and name not in HOOKS]
        if misspelt or not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            near = difflib.get_close_matches(misspelt[0], HOOKS, n=1) if misspelt else []
            problem = (f"callback {_named(callback)} has a method {misspelt[0]}, which is no hook" if misspelt
                       else f"callback {_named(callback)} has none of the hooks")
            raise UserError(problem, (f"rename it {near[0]}" if near else "name its methods") +
                            f" (the hooks: {', '.join(HOOKS)})")
    return callbacks


def _named(thing) -> str:
    """A class or function by its name, an object as its class's call: MyCallback()."""
    name = getattr(thing, "__name__", None)
    return name if isinstance(name, str) else f"{type(thing).__name__}()"


class Callbacks:
    def __init__(self, callbacks=()):
        self.callbacks = checked(callbacks)

    def call(self, hook: str, *args) -> None:
        assert hook in HOOKS, hook
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)
