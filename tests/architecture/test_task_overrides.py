"""Every task's override of a Task method accepts what the engine passes to Task's: an override that lacks a
parameter the base gained (before_training's `resuming`) fails every run of that task, not a test of its own."""

import importlib
import inspect
import pkgutil

import effitrain.tasks
from effitrain.tasks.base import Task


def all_subclasses(cls) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(all_subclasses(sub) for sub in found))


def test_overrides_take_every_parameter_of_the_base_method():
    for module in pkgutil.walk_packages(effitrain.tasks.__path__, "effitrain.tasks."):
        importlib.import_module(module.name)
    tasks = all_subclasses(Task)
    assert len(tasks) >= 4  # classification, causal-lm, preference, online RL
    missing = []
    for task in tasks:
        for name, method in vars(task).items():
            base = getattr(Task, name, None)
            if not callable(method) or not inspect.isfunction(base):
                continue
            theirs = inspect.signature(method).parameters
            if any(p.kind is p.VAR_KEYWORD for p in theirs.values()):
                continue
            lacking = [p for p in inspect.signature(base).parameters if p not in theirs]
            if lacking:
                missing.append(f"{task.__module__}.{task.__name__}.{name} lacks {', '.join(lacking)}")
    assert not missing, missing
