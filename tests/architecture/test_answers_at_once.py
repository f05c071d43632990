"""`effitrain --help`, every command's --help and every flag or config mistake answer without torch,
transformers, numpy, datasets or accelerate (an import of any of them fails here), and before the
allocator re-executes the command: a mistake costs one light process."""

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
