"""A user's reward file imported from its path (not by a module name: it is not ours) and the function it
names taken out, with one line for each way that fails: the file does not import, has no such name, or the
name is not a function."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType

from effitrain.catalog.reward_names import RewardSpec
from effitrain.errors import UserError, raised_by_code


def function_of(spec: RewardSpec, imported: dict[Path, ModuleType]) -> Callable:
    """The callable `spec.name` of the file `spec.path`; `imported` keeps the files one load has imported, so
    that two functions of one file share its module (its globals, its state)."""
    if spec.path not in imported:
        imported[spec.path] = _imported(spec)
    module = imported[spec.path]
    if not hasattr(module, spec.name):
        defined = sorted(name for name, value in vars(module).items()
                         if callable(value) and getattr(value, "__module__", None) == module.__name__
                         and not name.startswith("_"))
        listed = f"it defines {', '.join(defined)}" if defined else "it defines no function"
        raise UserError(f"reward {spec.text}: {spec.path.name} has no {spec.name!r} ({listed})",
                        f"name a function of the file, or define def {spec.name}(prompts, completions, **kwargs) "
                        "in it")
    function = getattr(module, spec.name)
    if not callable(function):
        kind = type(function).__name__
        kind = f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"
        raise UserError(f"reward {spec.text}: {spec.name} in {spec.path.name} is {kind}, "
                        "not a function", "name a function f(prompts, completions, **kwargs) -> list of floats")
    return function


def _imported(spec: RewardSpec) -> ModuleType:
    """The file run as a module of its own. Its folder joins the end of sys.path (behind every installed
    package, so it shadows none), so that it imports its neighbours as it does when run as a script; it is
    registered in sys.modules under a name of its own while it runs, as dataclasses and pickle expect."""
    path = spec.path
    name = f"_reward_file_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    module = module_from_spec(spec_from_file_location(name, path))
    sys.modules[name] = module
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException as error:  # SystemExit: a script's argparse or exit() at import
        del sys.modules[name]
        if not raised_by_code(error):  # Ctrl-C or SIGTERM while it imported: stop as they stop
            raise
        raise UserError(f"reward {spec.text}: {path.name} fails to import: {first_line(error)}",
                        f"run `python {path}` to see the traceback, and fix the file") from error
    return module


def first_line(error: BaseException) -> str:
    """`error` as `Type: its message's first line` (a SyntaxError's says the file and line)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
