"""Callbacks (engine/callbacks.py) see every step, evaluation and save of a real run, in order; the
console (outputs/console.py) renders the log's records as the lines a person reads."""

import effitrain
import pytest
from effitrain.engine.callbacks import Callbacks
from effitrain.errors import UserError
from effitrain.outputs.console import Console, short

from conftest import read_jsonl, tiny_run


class Recorder:
    def __init__(self):
        self.calls = []

    def on_train_begin(self, job):
        self.calls.append(("begin", job.total_steps))

    def on_step_begin(self, state, group):
        self.calls.append(("step_begin", state.step, len(group)))

    def on_step_end(self, state, result):
        self.calls.append(("step_end", state.step, bool(result.finite)))

    def on_evaluate(self, state):
        self.calls.append(("evaluate", state.step, round(state.validation["loss"], 6)))

    def on_save(self, state, path):
        self.calls.append(("save", state.step, path.name))

    def on_train_end(self, state):
        self.calls.append(("end", state.step))


def test_callbacks_see_each_step_evaluation_and_save_in_order(tiny_model_dir, tmp_path):
    recorder = Recorder()
    out = tmp_path / "out"
    metrics = effitrain.train(tiny_run(tiny_model_dir, out, max_steps=4, eval_every=2, save_every=2,
                                    metric_for_best="accuracy"), callbacks=[recorder])
    step_calls = [c for c in recorder.calls if c[0] in ("step_begin", "step_end")]
    assert step_calls == [c for n in range(1, 5) for c in (("step_begin", n - 1, 1), ("step_end", n, True))]
    evaluations = [c for c in recorder.calls if c[0] == "evaluate"]
    assert [c[1] for c in evaluations] == [2, 4]
    logged = [r for r in read_jsonl(out / "log.jsonl") if r.get("split") == "validation"]
    assert [round(r["loss"], 6) for r in logged] == [c[2] for c in evaluations]  # what the log says
    saves = [c for c in recorder.calls if c[0] == "save"]
    # step 2: the best so far, then its checkpoint; the last step ends in model/, not a checkpoint
    assert saves == [("save", 2, "best"), ("save", 2, "step-2"), ("save", 4, "model")]
    assert recorder.calls[0] == ("begin", 4) and ("end", 4) in recorder.calls
    assert recorder.calls.index(("end", 4)) < recorder.calls.index(("save", 4, "model"))
    assert metrics["steps"] == 4


class Misspelt:
    def on_step_end(self, state, result):
        pass

    def on_evaluation(self, state):
        pass


class CamelCase:
    def onStepEnd(self, state, result):
        pass


class NotAMethod:
    on_step_end = 5

    def on_evaluate(self, state):
        pass


class WrongArguments:
    def on_step_end(self):
        pass


@pytest.mark.parametrize("callbacks, refused", [
    ([object()], r"callback object\(\) has none of the hooks; fix: name its methods"),
    (print, r"callbacks=print is not a list of callback objects; fix: pass a list of objects"),
    (Misspelt(), r"callbacks=Misspelt\(\) is not a list"),
    ("on_step_end", r"callbacks=str\(\) is not a list"),
    ([Misspelt], r"callback Misspelt is a class; fix: pass an instance: Misspelt\(\)"),
    ([Misspelt()], r"has a method on_evaluation, which is no hook; fix: rename it on_evaluate"),
    ([lambda state: None], r"callback <lambda> has none of the hooks"),
    ([CamelCase()], r"has a method onStepEnd, which is no hook; fix: rename it on_step_end"),
    ([NotAMethod()], r"has on_step_end = 5, which is not a method"),
    ([WrongArguments()], r"has on_step_end\(\), which cannot take the hook's arguments; fix: define it as "
                         r"on_step_end\(self, state, result\)"),
    ({Misspelt(): 1}, r"callbacks=dict\(\) is not a list"),
    ((c for c in [Misspelt()]), r"callbacks=<genexpr> is not a list"),
], ids=["no-hooks", "function", "lone-object", "string", "class", "misspelt", "lambda", "camel-case", "not-a-method",
        "wrong-arguments", "mapping", "generator"])
def test_what_is_not_a_list_of_callbacks_is_refused_before_anything_is_written(callbacks, refused, tiny_model_dir,
                                                                                tmp_path):
    with pytest.raises(UserError, match=refused):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "never"), callbacks=callbacks)
    assert not (tmp_path / "never").exists()


def test_no_callbacks_and_a_raising_one_stops_the_run(tiny_model_dir, tmp_path):
    assert Callbacks(None).callbacks == [] and Callbacks(()).callbacks == []

    class Stop:
        def on_step_end(self, state, result):
            if state.step == 2:
                raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "out", max_steps=4, log_every=1), callbacks=[Stop()])
    out = tmp_path / "out"  # an internal error keeps the run's log for a look, and writes no model
    assert len(read_jsonl(out / "log.jsonl")) >= 1 and not (out / "model").exists()


def test_the_console_renders_step_and_validation_records(capsys):
    console = Console(total_steps=10, start=0, shown=True)
    console.write({"step": 2, "epoch": 0.25, "loss": 0.5, "lr": 1e-4, "grad_norm": None, "elapsed_seconds": 1.0,
                   "samples_per_second": 16.0, "tokens_per_second": 160.0, "peak_memory_bytes": 3 * 2**20})
    console.write({"step": 2, "epoch": 0.25, "split": "validation", "accuracy": 0.75, "loss": 0.5, "samples": 8})
    console.write({"step": 3, "skipped": "non-finite loss or gradient", "grad_norm": None})  # said in words instead
    console.say("an event")
    console.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 2/10 epoch 0.25 loss 0.5000 lr 1.00e-04 grad_norm -",
                     "step 2 validation: accuracy 0.7500 loss 0.5000", "an event"]
    assert short({"accuracy": 1, "samples": 3, "tokens": 9}) == "accuracy 1.0000"


def test_a_hidden_console_says_nothing(capsys):
    console = Console(total_steps=3, start=1, shown=False)
    console.say("not shown")
    console.write({"step": 2, "epoch": 1.0, "split": "validation", "loss": 0.1})
    console.close()
    assert capsys.readouterr() == ("", "")
