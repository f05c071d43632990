"""The shape of the code, read from the tree: layers of whole packages and no import circles (every import
counted, also inside functions; none by name at run time), only the entry points at the top, unique
module names, short engine functions, and each technique decided on in its own modules (task names in
tasks/, strategy names in engine/strategies/, --peft and --compile in models/ and config.py)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "effitrain"


# -- the shape of the code ---------------------------------------------------------------------------

# Lower layers first; a module may import its own layer and those below it, never one above. Entries are
# the packages of src/effitrain and its top-level modules, whole: no package is split between layers. The
# tree is read: a package or top-level module missing here fails the test below.
LAYERS = [
    {"errors", "catalog"},  # catalog: the names users pick from (task names), importing nothing of ours but errors
    {"optimizers"},  # the specs config reads for --optim's choices (no torch at import: builders load it)
    {"config", "runtime", "outputs"},
    {"models", "data", "speedups"},
    {"tasks"},
    {"planning"},
    {"engine"},
    {"report", "commands"},
    {"cli", "__init__", "__main__"},
]


def module_name(path: Path) -> str:
    """`engine.strategies.fsdp` for src/effitrain/engine/strategies/fsdp.py, `engine.strategies` for its
    __init__.py, `__init__` for the package's own."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports_in(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module of `known` (names as module_name gives them) that the source of `module` imports:
    at the top or inside functions (and under TYPE_CHECKING), `import effitrain.x`, `from effitrain.x
    import y` (the module y, else x), `from effitrain import x`, and relative imports (`from . import y`,
    `from ..x import y`). Importing a submodule runs its package's __init__ too: Python has that package
    set up first, so it is no edge here (or every package importing its own modules would be a circle)."""
    here = [] if module == "__init__" else module.split(".")
    package = here if is_package else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("effitrain").lstrip(".") for alias in node.names
                      if alias.name.split(".")[0] == "effitrain"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""])
            elif node.module and node.module.split(".")[0] == "effitrain":
                base = node.module.removeprefix("effitrain")
            else:
                continue
            base = base.strip(".")
            for alias in node.names:
                submodule = f"{base}.{alias.name}".lstrip(".")
                found.add(submodule if submodule in known else base)
    return {name or "__init__" for name in found} & known


def imports_of(path: Path) -> set[str]:
    """Every effitrain module a file of the tree imports (imports_in)."""
    known = {module_name(p) for p in SRC.rglob("*.py")}
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", known)


def layer_of(name: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) if name.split(".")[0] in layer]
    assert found, f"module {name} has no layer in LAYERS: add its package"
    return found[0]


def test_layers_name_whole_packages_each_once():
    entries = [entry for layer in LAYERS for entry in layer]
    assert all("." not in entry and "*" not in entry for entry in entries), entries
    assert len(entries) == len(set(entries)), entries


def test_every_package_and_top_level_module_has_a_layer():
    named = {entry for layer in LAYERS for entry in layer}
    in_tree = {path.stem for path in SRC.glob("*.py")} | {path.parent.name for path in SRC.glob("*/__init__.py")}
    assert in_tree == named, f"in the tree, not in LAYERS: {in_tree - named}; in LAYERS, not in the tree: {named - in_tree}"


def test_only_the_entry_points_stay_at_the_top_and_no_two_modules_share_a_name():
    top = {path.name for path in SRC.glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "cli.py", "config.py", "errors.py"}, top
    stems = [path.stem for path in SRC.rglob("*.py") if path.stem not in ("__init__", "__main__")]
    assert len(stems) == len(set(stems)), sorted({s for s in stems if stems.count(s) > 1})


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in SRC.rglob("*.py")}


def test_the_walk_finds_every_kind_of_import():
    """A synthetic module: each way of importing one of ours is an edge; another package's is none."""
    known = {"__init__", "config", "errors", "tasks", "tasks.base", "tasks.preference", "tasks.reference",
             "engine", "engine.run", "models.loading", "models"}
    source = """
import os
import effitrain.config
from effitrain import errors
from effitrain.models.loading import resolve
from . import base
from .preference import Preference
from ..engine import run
from effitrain import __version__

def later():
    from effitrain.tasks import reference
    import json
"""
    assert imports_in(source, "tasks.causal_lm", False, known) == {
        "config", "errors", "models.loading", "tasks.base", "tasks.preference", "engine.run", "__init__",
        "tasks.reference"}
    assert imports_in("from . import base\nfrom .. import config", "tasks", True, known) == {"tasks.base", "config"}


def test_no_lower_layer_imports_a_higher_one():
    wrong = [f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
             if layer_of(target) > layer_of(module)]
    assert not wrong, wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles of `graph` (module -> the modules it imports), each as the path that closes it."""
    graph = {module: {t for t in targets if t in graph and t != module} for module, targets in graph.items()}
    visiting, done, found = [], set(), []

    def visit(module):
        if module in visiting:
            found.append(visiting[visiting.index(module):] + [module])
            return
        if module in done:
            return
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return found


def test_no_import_circles():
    assert not circles(import_graph()), circles(import_graph())


def test_the_circle_check_finds_a_circle_when_one_is_added():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    graph = import_graph()
    graph["models.adapters"] = graph["models.adapters"] | {"tasks"}  # as config -> tasks did before
    assert circles(graph), "an import of tasks from models.adapters closes a circle (tasks -> tasks.causal_lm)"


def test_no_module_of_ours_is_imported_by_name_at_run_time():
    """importlib.import_module / __import__ of effitrain's modules hides the import from this walk: an
    explicit import (or a table of them) instead. Names given as variables cannot be read here: those
    must stay other packages' (the optional optimizers')."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            name = node.args[0]
            if isinstance(name, ast.JoinedStr) and name.values:
                name = name.values[0]
            ours = isinstance(name, ast.Constant) and isinstance(name.value, str) \
                and (name.value.split(".")[0] == "effitrain" or name.value.startswith("."))
            if called in ("import_module", "__import__") and ours:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, found


def longest_functions(folder: Path) -> list[tuple[int, str]]:
    lengths = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths.append((node.end_lineno - node.lineno + 1, f"{path.name}:{node.name}"))
    return sorted(lengths, reverse=True)


def test_no_engine_function_is_longer_than_60_lines():
    longest = longest_functions(SRC / "engine")
    print("longest engine functions:", longest[:5])
    assert longest[0][0] <= 60, longest[:3]


def compared(names: tuple[str, ...], allowed) -> list[str]:
    """Where a module that `allowed(relative path)` does not exempt compares something with one of `names`."""
    found = []
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC)
        if allowed(relative):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                found += [f"{relative}:{node.lineno}" for c in constants if c in names]
    return found


def test_the_table_of_task_constructors_holds_the_catalogs_names():
    """config offers catalog/task_names.py's names without importing tasks/: each must be one it makes."""
    from effitrain import tasks
    from effitrain.catalog import task_names

    assert tuple(tasks.CONSTRUCTORS) == task_names.NAMES


def test_no_task_name_is_compared_outside_tasks():
    names = ("sequence-classification", "image-classification", "audio-classification", "causal-lm")
    found = compared(names, lambda relative: "tasks" in relative.parts)
    assert not found, found


# The modules that may decide on the --peft and --compile settings; everything else asks them
# (adapters.method, adapters.quantized, config.compiles) or looks at the model (adapters.is_adapted).
TECHNIQUE_SETTINGS = ("peft", "compile")
DECIDES_TECHNIQUES = {"models/transforms.py", "models/adapters/lora_settings.py", "config.py", "engine/compilation.py"}


def reads_technique_setting(node: ast.AST) -> bool:
    """config.peft, config["compile"], config.get("peft"), getattr(config, "compile", ...)."""
    if isinstance(node, ast.Attribute):
        return node.attr in TECHNIQUE_SETTINGS
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in TECHNIQUE_SETTINGS
    if isinstance(node, ast.Call):
        getter = (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  or isinstance(node.func, ast.Name) and node.func.id == "getattr")
        return getter and any(isinstance(a, ast.Constant) and a.value in TECHNIQUE_SETTINGS for a in node.args[:2])
    return False


def decided_on(tree: ast.AST):
    """The expressions a program branches on: compared, or tested for truth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            yield from (node.left, *node.comparators)
        elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.BoolOp):
            yield from node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node.operand
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def test_no_peft_or_compile_setting_is_decided_on_outside_its_modules():
    found, inside = [], []
    for path in SRC.rglob("*.py"):
        name = path.relative_to(SRC).as_posix()
        hits = {f"{name}:{expr.lineno}" for expr in decided_on(ast.parse(path.read_text()))
                if any(reads_technique_setting(node) for node in ast.walk(expr))}
        (inside if name in DECIDES_TECHNIQUES else found).extend(hits)
    assert inside, "the rule finds no decision even where they are made: it is broken"
    assert not found, sorted(found)


def test_no_strategy_name_is_compared_outside_the_strategies_and_only_fsdp_imports_sharding():
    """The engine calls its Strategy's methods (engine/strategies/); config.py's validation and the memory
    planner, which plans for a strategy by name (planning/, commands/plan.py), may compare names."""
    allowed = {"config.py", "commands/plan.py"}
    found = compared(("ddp", "fsdp", "deepspeed"), lambda relative: relative.parts[0] == "planning"
                     or relative.parts[:2] == ("engine", "strategies") or relative.as_posix() in allowed)
    assert not found, found
    importers = sorted(module for module, targets in import_graph().items() if "engine.sharding" in targets)
    assert importers == ["engine.strategies.fsdp"], importers


def optimizer_name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a registered optimizer name is compared (==, !=, in a tuple) or matched (a case)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            lines += [node.lineno for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
        elif isinstance(node, ast.match_case):
            lines += [c.lineno for c in ast.walk(node.pattern) if isinstance(c, ast.Constant) and c.value in names]
    return lines


def test_no_optimizer_name_is_compared_outside_optimizers():
    """What depends on the optimizer is a field of its spec (optimizers/): config, the engine, the planner,
    plan and bench read it, so that one registered spec is a new optimizer everywhere."""
    from effitrain import optimizers

    names = set(optimizers.NAMES)
    caught = optimizer_name_comparisons(ast.parse(
        'if a == "adamw" or b in ("sgd", "muon"):\n    pass\nmatch c:\n    case "adafactor":\n        pass\n'), names)
    assert sorted(caught) == [1, 1, 1, 4], caught  # the rule sees each form
    found = [f"{path.relative_to(SRC)}:{line}" for path in SRC.rglob("*.py")
             if path.relative_to(SRC).parts[0] != "optimizers"
             for line in optimizer_name_comparisons(ast.parse(path.read_text()), names)]
    assert not found, found
