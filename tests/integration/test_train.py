"""In-process training runs on the tiny random BERT and a slice of the SMS spam data."""

import json

import effitrain
import pytest
import torch
import yaml
from effitrain.errors import UserError
from safetensors.torch import load_file

from conftest import read_jsonl, read_weights, tiny_run


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    metrics = effitrain.train(tiny_run(tiny_model_dir, out))
    return out, metrics


def test_run_writes_every_output_of_the_contract(finished_run):
    out, metrics = finished_run
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    for split in ("validation", "test"):
        assert set(on_disk[split]) >= {"accuracy", "f1_macro", "f1_ham", "f1_spam", "loss"}
        assert on_disk[split]["samples"] == 40
    assert on_disk["steps"] == 6 and on_disk["world_size"] == 1
    for key in ("train_samples_per_second", "train_tokens_per_second", "peak_memory_bytes", "wall_seconds"):
        assert on_disk[key] > 0
    # 6 steps of 8 examples, and tokens/s counts real (non-pad) tokens only: at most max_length per example.
    assert on_disk["train_samples_per_second"] * on_disk["train_seconds"] == pytest.approx(48)
    assert on_disk["train_tokens_per_second"] / on_disk["train_samples_per_second"] < 128


def test_wall_time_is_split_by_phase(finished_run):
    """set-up + training + evaluation + saving + ... = the process's time to the saved model; a library
    call has no start-up of its own (the command's process age is its start-up)."""
    _, metrics = finished_run
    phases = metrics["wall_seconds_by_phase"]
    assert set(phases) == {"start_up", "set_up", "training", "compiling", "evaluation", "saving", "other", "total"}
    assert phases["start_up"] == 0 and phases["compiling"] == 0
    assert phases["training"] == round(metrics["train_seconds"], 3)
    assert all(phases[key] > 0 for key in ("set_up", "training", "evaluation", "saving"))
    assert phases["total"] == pytest.approx(metrics["wall_seconds"], abs=2e-3)
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"], abs=1e-2)


def test_evaluation_batches_run_longest_first():
    from datasets import Dataset
    from effitrain.data import text

    data = Dataset.from_dict({"input_ids": [[1] * n for n in (3, 9, 1, 9, 5)], "labels": [0] * 5})
    assert text.eval_order(data) == [1, 3, 4, 0, 2]  # ties keep their order
    assert text.eval_order(Dataset.from_dict({"pixel_values": [[0.0]] * 2})) is None


def test_log_has_one_object_per_logged_step_then_evaluations(finished_run):
    out, _ = finished_run
    records = read_jsonl(out / "log.jsonl")
    train_records = [r for r in records if "split" not in r]
    assert [r["step"] for r in train_records] == [2, 4, 6]
    assert all(r["loss"] > 0 and r["lr"] >= 0 and r["grad_norm"] > 0 for r in train_records)
    assert train_records[-1]["lr"] == 0.0  # linear decay ends at zero
    assert [r["split"] for r in records if "split" in r] == ["validation", "test"]


def test_saved_model_loads_with_plain_transformers(finished_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, _ = finished_run
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.id2label == {0: "ham", 1: "spam"}
    assert tokenizer.model_max_length == 128  # predictions truncate where training did
    assert (out / "model" / "model.safetensors").is_file()
    assert not list((out / "model").glob("*.bin"))


def test_predict_agrees_with_plain_transformers(finished_run):
    from effitrain.commands.predict import predict
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, _ = finished_run
    texts = ["WINNER!! Claim your free prize now, call 09061701461", "see you at lunch?", "ok"]
    ours = predict(str(out / "model"), texts, batch_size=2)
    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    with torch.no_grad():
        for text, result in zip(texts, ours):
            probs = model(**tokenizer(text, return_tensors="pt")).logits.softmax(-1)[0]
            assert result["label"] == model.config.id2label[int(probs.argmax())]
            assert result["score"] == pytest.approx(float(probs.max()), abs=1e-5)


def test_config_yaml_reproduces_the_run_bitwise(finished_run, tmp_path):
    out, _ = finished_run
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["output_dir"] == str(out)
    resolved["output_dir"] = str(tmp_path / "again")
    effitrain.train(resolved)
    first, second = read_weights(out), read_weights(tmp_path / "again")
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("group_by_length", [True, False])
def test_accumulation_equals_one_big_batch(tiny_model_dir, tmp_path, group_by_length):
    """14 examples, 2 epochs: steps of [4+4] and [4+2] micro-batches against batches of 8 and 6.
    The short step only matches if the loss is normalised by the step's item count, not per micro-batch."""
    common = dict(max_train_samples=14, max_steps=None, epochs=2, log_every=1, group_by_length=group_by_length,
                  warmup_ratio=0.0)
    effitrain.train(tiny_run(tiny_model_dir, tmp_path / "accum", batch_size=4, grad_accum=2, **common))
    effitrain.train(tiny_run(tiny_model_dir, tmp_path / "big", batch_size=8, grad_accum=1, **common))
    effitrain.train(tiny_run(tiny_model_dir, tmp_path / "small", batch_size=4, grad_accum=1, **common))
    accum, big, small_ = (read_weights(tmp_path / name) for name in ("accum", "big", "small"))
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    for name in big:
        torch.testing.assert_close(accum[name], big[name], rtol=1e-5, atol=1e-6)
    # The comparison is sensitive: training moved the weights, and other batching gives other weights.
    assert not torch.allclose(big["bert.encoder.layer.0.attention.self.query.weight"],
                              initial["bert.encoder.layer.0.attention.self.query.weight"], atol=1e-4)
    assert not torch.allclose(big["classifier.weight"], small_["classifier.weight"], atol=1e-4)
    assert len([r for r in read_jsonl(tmp_path / "accum" / "log.jsonl") if "split" not in r]) == 4


def test_the_garbage_collector_is_left_as_it_was_found(tiny_model_dir, tmp_path):
    """The run pauses the collector while it sets up and freezes what it holds (speedups/process_tuning.py); after
    a run that ends, or one whose set-up fails, the collector is on (or off) as before and nothing stays
    frozen, and cyclic garbage made during the run is collectable again."""
    import gc

    assert gc.isenabled() and gc.get_freeze_count() == 0
    effitrain.train(tiny_run(tiny_model_dir, tmp_path / "ok", max_steps=1))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    from safetensors.torch import load_file

    start, trained = load_file(str(tiny_model_dir / "model.safetensors")), read_weights(tmp_path / "ok")
    assert not torch.equal(start["bert.encoder.layer.0.attention.self.query.weight"],
                           trained["bert.encoder.layer.0.attention.self.query.weight"])  # the one step trained
    with pytest.raises(UserError):
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "bad", max_steps=1, metric_for_best="no-such-metric"))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        effitrain.train(tiny_run(tiny_model_dir, tmp_path / "off", max_steps=1))
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_epochs_run_to_the_end_of_the_data(tiny_model_dir, tmp_path):
    metrics = effitrain.train(tiny_run(tiny_model_dir, tmp_path / "o", max_steps=None, epochs=2, max_train_samples=20,
                                    batch_size=8))
    assert metrics["steps"] == 6 and metrics["epochs"] == 2.0  # ceil(20 / 8) = 3 steps an epoch
    evaluations = [r for r in read_jsonl(tmp_path / "o" / "log.jsonl") if r.get("split") == "validation"]
    assert [r["epoch"] for r in evaluations] == [1.0, 2.0]


def test_logged_steps_carry_throughput_and_memory(finished_run):
    out, _ = finished_run
    train_records = [r for r in read_jsonl(out / "log.jsonl") if "split" not in r]
    for record in train_records:
        assert record["samples_per_second"] > 0 and record["peak_memory_bytes"] > 0
        # tokens counts real (non-pad) tokens: at most max_length per example
        assert 0 < record["tokens_per_second"] < 128 * record["samples_per_second"]
    peaks = [r["peak_memory_bytes"] for r in train_records]
    assert peaks == sorted(peaks)


def test_throughput_windows_add_up_to_the_totals():
    from effitrain.engine.state import TrainState

    state = TrainState()
    state.totals += torch.tensor([16.0, 400.0])
    state.train_seconds = 2.0
    assert state.take_throughput() == (16.0, 400.0, 2.0)
    state.totals += torch.tensor([8.0, 100.0])
    state.train_seconds = 3.0
    assert state.take_throughput(lambda t: t * 2) == (32.0, 600.0, 1.0)  # 2 processes: sums (48, 1000)


def test_model_card_holds_the_metrics_and_the_procedure(finished_run):
    from huggingface_hub import ModelCard

    out, metrics = finished_run
    card = ModelCard.load(out / "model" / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert card.data.datasets == ["ucirvine/sms_spam"] and card.data.base_model is None  # a local folder
    scores = {result.metric_name: result.metric_value for result in card.data.eval_results}
    assert scores["Accuracy"] == pytest.approx(metrics["test"]["accuracy"], abs=1e-6)
    assert scores["F1 (spam)"] == pytest.approx(metrics["test"]["f1_spam"], abs=1e-6)
    assert all(result.dataset_split == "test" for result in card.data.eval_results)
    assert "- steps: 6 (" in card.text and "of 8 x 1 x 1 process(es) = 8 examples per step" in card.text
    assert "64 train / 40 validation / 40 test examples, labels ham, spam" in card.text


def test_the_live_view_on_a_terminal_shows_loss_speed_and_memory(tiny_model_dir, tmp_path):
    """On a terminal the bar carries step, rate, ETA, loss, samples/s and peak memory, and closes before the
    summary; off a terminal (every other test) there is no bar, only the log lines."""
    import fcntl
    import os
    import struct
    import subprocess
    import sys
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a pty has no size of its own
    process = subprocess.Popen([sys.executable, "-m", "effitrain", "train", "--model", str(tiny_model_dir),
                                "--max-steps", "4", "--log-every", "2", "--max-train-samples", "64",
                                "--max-eval-samples", "16", "--output-dir", str(tmp_path / "o")],
                               stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    screen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    assert process.wait(timeout=300) == 0
    lines = screen.decode(errors="replace").replace("\r", "\n").splitlines()
    bar = [line for line in lines if line.startswith("train: 100%")][-1]
    assert "4/4 [" in bar and "step/s, loss " in bar and " samples/s, peak " in bar and bar.endswith(" MiB]")
    assert any(line.startswith("test: accuracy") for line in lines)  # on a line of its own
