"""What the CLI answers: `effitrain --help`, every command's --help and every flag or config mistake without
torch, transformers, numpy, datasets or accelerate (an import of any of them fails here), and before the
allocator re-executes the command (a mistake costs one light process); and fixes that name only real flags."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "numpy", "datasets", "accelerate")

BLOCKED = textwrap.dedent(f"""
    import sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HEAVY!r}:
                raise ImportError(f"{{name}} imported while answering")

    sys.meta_path.insert(0, Blocked())
""")

MISTAKES = [
    ["train", "--lr", "abc"],
    ["train", "--epochs", "-1"],
    ["train", "--optim", "adamw-16bit"],
    ["train", "--config", "{config}"],
    ["train", "--no-such-flag"],
    ["predict", "--model", "m", "--text", "hi", "--top-p", "2"],
    ["predict", "--model", "m", "--text", "hi", "--max-new-tokens", "0"],
    ["plan", "--memory", "0"],
    ["plan", "--peft", "lora", "--lora-r", "0"],
    ["plan", "--optim", "muon", "--strategy", "fsdp"],
    ["predict", "--model", "", "--text", "hi"],
    ["predict", "--model", "m", "--text", "hi", "--batch-size", "0"],
    ["evaluate", "--model", ""],
    ["train", "--config", ""],
    ["train", "--zero-stage", "3"],
    ["train", "--batch-size", "99999999999999999999"],
    ["bench", "--extra", "'unclosed"],
    ["evaluate"],
    ["evaluate", "--model", "m", "--max-new-tokens", "0"],
    ["evaluate", "--model", "m", "--output", "/no/such/folder/m.json"],
    ["no-such-command"],
]


def answer(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    config = tmp_path / "bad.yaml"
    config.write_text("lr: fast\n")
    argv = [arg.format(config=config) for arg in argv]
    script = BLOCKED + f"from effitrain import cli\nsys.exit(cli.answer_at_once({argv!r}) or 0)\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv", MISTAKES, ids=" ".join)
def test_a_mistake_answers_in_one_line_without_heavy_libraries(argv, tmp_path):
    result = answer(argv, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("effitrain: error: ") and "; fix: " in lines[0], result.stderr


@pytest.mark.parametrize("command", [[], ["train"], ["predict"], ["evaluate"], ["inspect"], ["env"], ["launch"],
                                     ["bench"], ["plan"], ["report"]], ids=lambda c: " ".join(c) or "effitrain")
def test_every_help_answers_without_heavy_libraries(command, tmp_path):
    result = answer([*command, "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: effitrain") and not result.stderr


def test_a_mistake_is_answered_before_the_allocator_reexecutes(monkeypatch, capsys):
    """__main__ re-executes the command under tcmalloc or jemalloc only once its flags are known to be
    right: a mistake never pays for a second start."""
    from effitrain import __main__ as entry
    from effitrain.speedups import allocator

    started = []
    monkeypatch.setattr(allocator, "preloading", lambda: {"LD_PRELOAD": "/lib/libtcmalloc.so"})
    monkeypatch.setattr(allocator, "reexecute", started.append)
    monkeypatch.setattr(sys, "argv", ["effitrain", "train", "--lr", "abc"])
    assert entry.run() == 2 and started == []
    assert "invalid float value: 'abc'" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["effitrain", "env", "--json"])
    monkeypatch.setattr("effitrain.cli.main", lambda: 0)  # what runs after the re-execution: not here
    monkeypatch.setattr("gc.freeze", lambda: None)
    assert entry.run() == 0 and started == [{"LD_PRELOAD": "/lib/libtcmalloc.so"}]


# Flags of other programs that effitrain's messages name (torchrun's and Slurm's), and prefixes of flag families.
OTHER_PROGRAMS = {"--nproc-per-node", "--ntasks-per-node", "--rdzv-conf", "--standalone", "--monitor-interval"}
PREFIXES = {"--lora-", "--no-"}


def test_every_flag_a_message_names_is_a_real_one():
    """A fix that names a flag the user cannot pass (`--messages-column`) is a dead end: every --flag in the
    source's strings is one of effitrain's commands' (or, named as theirs, torchrun's and Slurm's)."""
    import ast
    import re
    from pathlib import Path

    from effitrain import cli

    flags = set()

    def collect(parser):
        for action in parser._actions:
            flags.update(option for option in action.option_strings if option.startswith("--"))
            for sub in (action.choices or {}).values() if isinstance(action.choices, dict) else ():
                collect(sub)

    collect(cli.build_parser())
    unknown = {}
    for path in (Path(__file__).resolve().parents[2] / "src" / "effitrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", node.value):
                    if name not in flags | OTHER_PROGRAMS | PREFIXES:
                        unknown.setdefault(name, path.name)
    assert not unknown, unknown
