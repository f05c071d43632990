"""Adapters are owned by models/: the engine, the outputs, the tasks and the commands save, restore, summarise
and describe a model through its form (models/adapters/model_form.py: plain or adapted, chosen once), and do
not ask whether it is adapted. This counts the branches on adapters left outside the modules whose subject
adapters are (at most LIMIT), and checks that the counter catches each way of writing a new one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "effitrain"

# A word that names adapters: peft (the setting, the library), adapt* (adapters, adapted, is_adapted, adapter,
# adapter_bytes), lora* and qlora (the settings and methods, peft's LoraLayer), in any case.
ADAPTER_WORD = re.compile(r"peft|adapt|lora", re.IGNORECASE)

# Where adapters are the subject, and branches on them belong: models/ (models/adapters/ and the transforms that
# apply them), config.py (the settings' rules), the planner (which plans for the adapters asked for), and
# speedups/adapter_step.py, the training forward of peft's LoRA layers (every line of it is about those layers;
# models/transforms.py switches it on for adapted models only).
OWNERS = ("models/", "planning/", "config.py", "speedups/adapter_step.py")
LIMIT = 4  # issue 42: at most 4 outside the owners


def adapter_words(expression: ast.AST) -> list[str]:
    """The words of an expression that name adapters: names, attributes (so the functions and methods it
    calls: adapters.is_adapted(m), job.adapted), keyword arguments, and string constants (a setting read by
    its key, config["peft"], config.get("peft"), getattr(config, "peft"), or a key compared, key == "peft")."""
    words = []
    for node in ast.walk(expression):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            words.append(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.append(node.value)
    return [word for word in words if ADAPTER_WORD.search(word)]


def decisions(tree: ast.AST) -> list[ast.AST]:
    """What a module branches on: the test of each if and elif, conditional expression, while and assert,
    each comprehension's `if`, a match's subject and a case's guard; and each comparison outside those
    (`on = config.peft != "none"`, branched on later), the outermost only."""
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
        elif isinstance(node, ast.match_case) and node.guard is not None:
            tests.append(node.guard)
    seen = {id(inner) for test in tests for inner in ast.walk(test)}
    comparisons = []
    for node in ast.walk(tree):  # breadth first: an outer comparison before those inside it
        if isinstance(node, ast.Compare) and id(node) not in seen:
            comparisons.append(node)
            seen |= {id(inner) for inner in ast.walk(node)}
    return tests + comparisons


def adapter_branches(sources: dict[str, str]) -> list[str]:
    """`path:line  test` for each decision on adapters in `sources` ({path under src/effitrain: source}) outside
    the owners. An adapter branch: a decision (above) whose expression holds a word that names adapters."""
    found = []
    for path, source in sorted(sources.items()):
        if path.startswith(OWNERS):
            continue
        for test in decisions(ast.parse(source)):
            if adapter_words(test):
                found.append(f"{path}:{test.lineno}  {ast.unparse(test)[:80]}")
    return sorted(found)


def tree_sources() -> dict[str, str]:
    return {path.relative_to(SRC).as_posix(): path.read_text() for path in SRC.rglob("*.py")}


def test_at_most_four_adapter_branches_outside_the_modules_that_own_adapters():
    found = adapter_branches(tree_sources())
    print(f"{len(found)} adapter branch(es) outside {', '.join(OWNERS)}:", *found, sep="\n  ")
    assert len(found) <= LIMIT, (f"{len(found)} branches on adapters outside {OWNERS} (at most {LIMIT}): ask the "
                                 "model's form (models/adapters/model_form.py) instead\n" + "\n".join(found))
    assert not [line for line in found if line.startswith(("engine/run.py", "engine/saving.py", "engine/summary.py",
                                                           "engine/model_card.py"))], found


@pytest.mark.parametrize("code", [
    "if job.adapted:\n    save(job)",
    "if ready:\n    pass\nelif not adapters.is_adapted(model):\n    pass",
    "x = adapter_folder if config.peft != 'none' else None",
    "names = [f for f in folders if is_adapter_dir(f)]",
    "while lora_layers:\n    lora_layers.pop()",
    "assert config['peft'] == 'qlora'",
    "if settings.get('lora_r'):\n    pass",
    "on = getattr(config, 'peft', None) == 'lora'",
    "on = key == 'peft'",
    "match config.peft:\n    case 'lora':\n        pass",
    "match mode:\n    case 'x' if run.form.method == 'qlora':\n        pass",
    "if isinstance(module, LoraLayer):\n    pass",
    "if saved(folder, adapter=True):\n    pass",
])
def test_the_counter_catches_each_way_of_writing_an_adapter_branch(code):
    assert len(adapter_branches({"engine/new.py": code})) == 1, code


@pytest.mark.parametrize("code", [
    "adapters.save_adapter(model, folder)",
    "peft = config.peft",
    "for name in job.form.folders_beside_model:\n    saving.save_trained(job, name)",
    "if job.keeps_best:\n    job.form.write_trained(job, folder)",
    "fix = job.form.non_finite_fix(config, beta)",
    "folder = save(folder, adapter=True) if keeps_best else None",
])
def test_the_counter_leaves_calls_and_values_alone(code):
    assert adapter_branches({"engine/new.py": code}) == [], code


def test_a_branch_added_to_the_engine_is_counted_and_the_owners_are_left_out():
    sources = tree_sources()
    before = adapter_branches(sources)
    added = dict(sources)
    added["engine/run.py"] += "\n\ndef kept(job):\n    if job.adapted:\n        return 'adapter'\n"
    after = adapter_branches(added)
    assert len(after) == len(before) + 1 and [line for line in after if line not in before][0].startswith(
        "engine/run.py:"), after
    # Enough new ones go over the limit; the same code in an owner is not counted.
    crowded = {**sources, "outputs/new.py": "\n".join(f"a{i} = 1 if run.adapted else 0" for i in range(LIMIT + 1))}
    assert len(adapter_branches(crowded)) > LIMIT
    owned = {**sources, **{f"{owner.rstrip('/')}{'/new.py' if owner.endswith('/') else ''}":
                           "a = 1 if run.adapted else 0" for owner in OWNERS[:2]}}
    assert adapter_branches(owned) == before
    # And the tree's owners do branch on adapters: the words are the ones the code uses.
    assert adapter_branches({"elsewhere/" + path: source for path, source in sources.items()
                             if path.startswith("models/adapters/")})
