"""The shape of the code, read from the tree: layers and no import circles, only the entry points at the
top, unique module names, short engine functions, and each technique decided on in its own modules
(task names in tasks/, strategy names in engine/strategies/, --peft and --compile in models/ and
config.py)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "effitrain"


# -- the shape of the code ---------------------------------------------------------------------------

# Lower layers first; a module may import its own layer and those below it, never one above. Entries are
# the packages of src/effitrain (and the few top-level modules); "pkg.*" is every module of pkg but its
# __init__. The tree is read: a package or top-level module missing here fails the test below.
LAYERS = [
    {"errors", "tasks"},  # tasks: its __init__ only, the registry of names (it imports nothing of ours)
    {"optimizers"},  # the specs config reads for --optim's choices (no torch at import: builders load it)
    {"config", "runtime", "outputs", "planning.sizes"},  # planning.sizes: parsing "8GiB", no imports
    {"models", "data", "speedups", "outputs.model_card"},  # the model card reads the adapters' settings
    {"tasks.*"},
    {"planning"},
    {"engine"},
    {"report", "commands"},
    {"cli", "__init__", "__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports_of(path: Path) -> set[str]:
    """Every effitrain module a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("effitrain"):
            base = node.module.removeprefix("effitrain").lstrip(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}".lstrip(".")
                found.add(candidate if (SRC / Path(*candidate.split("."))).with_suffix(".py").exists()
                          or (SRC / Path(*candidate.split("."))).is_dir() else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("effitrain").lstrip(".") for a in node.names if a.name.startswith("effitrain")}
    return {name for name in found if name}


def layer_of(name: str) -> int:
    parts = name.split(".")
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        below = [i for i, layer in enumerate(LAYERS) if depth < len(parts) and f"{prefix}.*" in layer]
        exact = [i for i, layer in enumerate(LAYERS) if prefix in layer]
        if below or exact:
            return (below or exact)[0]
    raise AssertionError(f"module {name} has no layer in LAYERS: add it")


def test_every_package_and_top_level_module_has_a_layer():
    named = {entry.removesuffix(".*") for layer in LAYERS for entry in layer if "." not in entry.removesuffix(".*")}
    in_tree = {path.stem for path in SRC.glob("*.py")} | {path.parent.name for path in SRC.glob("*/__init__.py")}
    assert in_tree == named, f"in the tree, not in LAYERS: {in_tree - named}; in LAYERS, not in the tree: {named - in_tree}"


def test_only_the_entry_points_stay_at_the_top_and_no_two_modules_share_a_name():
    top = {path.name for path in SRC.glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "cli.py", "config.py", "errors.py"}, top
    stems = [path.stem for path in SRC.rglob("*.py") if path.stem not in ("__init__", "__main__")]
    assert len(stems) == len(set(stems)), sorted({s for s in stems if stems.count(s) > 1})


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in SRC.rglob("*.py")}


def test_no_lower_layer_imports_a_higher_one():
    wrong = [f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
             if layer_of(target) > layer_of(module)]
    assert not wrong, wrong


def test_no_import_circles():
    graph = import_graph()
    graph = {module: {t for t in targets if t in graph and t != module} for module, targets in graph.items()}
    visiting, done, circles = [], set(), []

    def visit(module):
        if module in visiting:
            circles.append(visiting[visiting.index(module):] + [module])
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
    assert not circles, circles


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


def test_no_task_name_is_compared_outside_tasks():
    names = ("sequence-classification", "image-classification", "audio-classification", "causal-lm")
    found = compared(names, lambda relative: "tasks" in relative.parts)
    assert not found, found


# The modules that may decide on the --peft and --compile settings; everything else asks them
# (adapters.method, adapters.quantized, transforms.compiles) or looks at the model (adapters.is_adapted).
TECHNIQUE_SETTINGS = ("peft", "compile")
DECIDES_TECHNIQUES = {"models/transforms.py", "models/adapters.py", "config.py", "engine/compilation.py"}


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
