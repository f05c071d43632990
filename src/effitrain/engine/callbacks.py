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
import re

HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


# Each hook's arguments after self, for the check that a callback's methods can take them.
ARGUMENTS = {"on_train_begin": ("job",), "on_step_begin": ("state", "group"), "on_step_end": ("state", "result"),
             "on_evaluate": ("state",), "on_save": ("state", "path"), "on_train_end": ("state",)}


def checked(callbacks) -> list:
    """The callbacks as a list (None: none); refuses, before a run starts, what is not a list (or tuple) of
    callback objects: a lone function or object, a mapping, a class instead of its instance, one with none of
    the hooks, a hook that is not a method or cannot take the hook's arguments, or a method named like a hook
    that is not one (a typo would otherwise watch nothing, silently)."""
    from effitrain.errors import UserError

    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise UserError(f"callbacks={_named(callbacks)} is not a list of callback objects",
                        f"pass a list of objects with some of the methods {', '.join(HOOKS)}, e.g. "
                        "callbacks=[MyCallback()]")
    for callback in callbacks:
        if isinstance(callback, type):
            raise UserError(f"callback {callback.__name__} is a class", f"pass an instance: {callback.__name__}()")
        problem = _hook_problem(callback)
        if problem is not None:
            raise UserError(f"callback {_named(callback)} {problem[0]}",
                            f"{problem[1]} (the hooks: {', '.join(HOOKS)})")
    return list(callbacks)


def _hook_problem(callback) -> tuple[str, str] | None:
    import inspect

    for hook in HOOKS:
        method = getattr(callback, hook, None)
        if method is None:
            continue
        if not callable(method):
            return f"has {hook} = {method!r}, which is not a method", f"make {hook} a method"
        try:
            inspect.signature(method).bind(*ARGUMENTS[hook])
        except TypeError:
            return (f"has {hook}{inspect.signature(method)}, which cannot take the hook's arguments",
                    f"define it as {hook}({', '.join(['self', *ARGUMENTS[hook]])})")
        except ValueError:  # a builtin without a signature: taken as it is
            pass
    misspelt = [name for name in dir(callback) if name not in HOOKS and not name.startswith("_")
                and callable(getattr(callback, name, None))
                and re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower().lstrip("_").startswith("on_")]
    if misspelt:
        near = difflib.get_close_matches(re.sub(r"(?<!^)(?=[A-Z])", "_", misspelt[0]).lower(), HOOKS, n=1)
        return f"has a method {misspelt[0]}, which is no hook", f"rename it {near[0]}" if near else "rename it"
    if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
        return "has none of the hooks", "name its methods"
    return None


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
