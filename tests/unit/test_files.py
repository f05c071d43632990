"""outputs/files.place: an output that must not replace anything is created whole, under its name, only
if the name is still free (issue 28, item 2); the commands that write such outputs refuse with one line
when a file appeared at their path after their checks."""

import argparse

import pytest

from effitrain.errors import UserError
from effitrain.outputs import files


def test_place_creates_whole_never_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    files.place(target, lambda temporary: temporary.write_text("mine"))
    assert target.read_text() == "mine"
    with pytest.raises(FileExistsError):
        files.place(target, lambda temporary: temporary.write_text("theirs"))
    assert target.read_text() == "mine"
    files.place(target, lambda temporary: temporary.write_text("again"), replace=True)  # its own, checked
    assert target.read_text() == "again" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_evaluate_output_that_appeared_while_evaluating_is_left_alone(tmp_path, monkeypatch, capsys):
    from effitrain.commands import evaluate

    output = tmp_path / "metrics.json"

    def evaluating(*args, **kwargs):  # someone writes the file while the model is evaluated
        output.write_text("someone else's")
        return {"accuracy": 1.0, "loss": 0.1, "samples": 2}

    monkeypatch.setattr(evaluate, "evaluate", evaluating)
    args = argparse.Namespace(model="m", split="test", allow_pickle=False, task=None, reference_model=None, debug=False,
                              output=str(output))
    with pytest.raises(UserError, match="appeared while the model was evaluated"):
        evaluate.main(args)
    assert output.read_text() == "someone else's" and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_a_report_page_that_appeared_while_rendering_is_left_alone(tmp_path, monkeypatch):
    from effitrain.report import page

    out = tmp_path / "compare.html"

    def rendering(runs, pngs_hint=False):
        out.write_text("not a report")
        return "<html></html>"

    monkeypatch.setattr(page, "find_runs", lambda given: [])
    monkeypatch.setattr(page, "render", rendering)
    with pytest.raises(UserError, match="appeared while the report was made"):
        page.write([str(tmp_path / "run")], str(out))
    assert out.read_text() == "not a report" and [p.name for p in tmp_path.iterdir()] == ["compare.html"]
