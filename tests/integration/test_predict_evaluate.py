"""`effitrain predict` and `effitrain evaluate` on tiny models of every task, trained here for a few
steps: predictions come back one per input in input order; evaluating the test split gives the run's
metrics.json `test` values again (one process and two); inputs that do not fit are one-line errors."""

from __future__ import annotations

import json

import effitrain
import numpy as np
import pytest
from effitrain.cli import main

from conftest import as_flags

TINY_VIT = "vit:image_size=8,patch_size=4,hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=16"
TINY_WAV2VEC2 = ("wav2vec2:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=16,"
                 "conv_dim=[16,16],conv_stride=[5,4],conv_kernel=[10,8],num_feat_extract_layers=2,"
                 "num_conv_pos_embeddings=16,num_conv_pos_embedding_groups=2")
TINY_GPT2 = "gpt2:n_layer=1,n_embd=16,n_head=2,n_positions=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


def train(folder, **values) -> tuple[dict, dict]:
    """A 2-step run into folder/out; returns (metrics.json, the data flags to evaluate it with)."""
    data = {key: values.pop(key) for key in list(values) if key in ("data", "text_column", "text_pair_column",
                                                                     "label_column", "image_column", "audio_column", "test_split",
                                                                     "eval_batch_size", "max_duration")}
    data.setdefault("test_split", 0.25)
    data.setdefault("eval_batch_size", 2)  # several evaluation batches, an uneven last one
    metrics = effitrain.train({"output_dir": str(folder / "out"), "max_steps": 2, "batch_size": 4, "lr": 1e-3,
                               "log_every": 1, **data, **values})
    return metrics, data


def cli(capsys, *args) -> tuple[int, list[str], list[str]]:
    """main() in this process: (exit code, stdout lines, non-blank stderr lines)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), [line for line in err.splitlines() if line.strip()]


def predictions(capsys, *args) -> list[dict]:
    code, out, err = cli(capsys, "predict", *args)
    assert code == 0, err
    return [json.loads(line) for line in out]


def assert_reproduces_test_metrics(capsys, run, model_dir, split="test"):
    metrics, data = run
    code, out, err = cli(capsys, "evaluate", "--model", model_dir, *as_flags(data), "--split", split)
    assert code == 0, err
    got, want = json.loads(out[-1]), metrics[split]
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6, rel=0), key


# -- the runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("predict-evaluate")


@pytest.fixture(scope="module")
def text_run(folder, tiny_model_dir):
    rows = [(f"WINNER {i}! claim your free cash prize now", "spam") if i % 2 else (f"see you at {i} for lunch", "ham")
            for i in range(20)]
    (folder / "text").mkdir()
    path = folder / "text" / "sms.csv"
    path.write_text("text,label\n" + "\n".join(f"{t},{label}" for t, label in rows) + "\n")
    return train(folder / "text", model=str(tiny_model_dir), data=str(path))


@pytest.fixture(scope="module")
def pairs_run(folder, tiny_model_dir):
    rows = [("The cat sat on the mat.", "A cat was sitting on the mat.", "1"),
            ("Stocks fell sharply today.", "The weather is sunny.", "0")] * 10
    (folder / "pairs").mkdir()
    path = folder / "pairs" / "mrpc.csv"
    path.write_text("s1,s2,Quality\n" + "\n".join(",".join(r) for r in rows) + "\n")
    return train(folder / "pairs", model=str(tiny_model_dir), data=str(path), text_column="s1",
                 text_pair_column="s2", label_column="Quality")


def write_images(folder, count=20):
    from PIL import Image

    (folder / "imgs").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        label = ["red", "blue"][i % 2]
        pixels = rng.integers(0, 80, (8 + i % 3, 8, 3), dtype=np.uint8)
        pixels[..., 0 if label == "red" else 2] += 170
        Image.fromarray(pixels).save(folder / "imgs" / f"img{i}.png")
        rows.append(f"imgs/img{i}.png,{label}")
    (folder / "images.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return folder / "images.csv"


@pytest.fixture(scope="module")
def image_run(folder):
    path = write_images(folder / "image")
    return train(folder / "image", task="image-classification", model=TINY_VIT, data=str(path), image_column="path")


def write_tones(folder, count=16):
    import soundfile

    (folder / "clips").mkdir(parents=True)
    rows = []
    for i in range(count):
        label = ["low", "high"][i % 2]
        rate = [8000, 16000][i % 2]
        t = np.arange(int(rate * (0.2 + 0.05 * (i % 4)))) / rate
        soundfile.write(folder / "clips" / f"clip{i}.wav", 0.5 * np.sin(2 * np.pi * (250 if i % 2 == 0 else 2000) * t),
                        rate)
        rows.append(f"clips/clip{i}.wav,{label}")
    (folder / "audio.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return folder / "audio.csv"


@pytest.fixture(scope="module")
def audio_run(folder):
    path = write_tones(folder / "audio")
    return train(folder / "audio", task="audio-classification", model=TINY_WAV2VEC2, data=str(path),
                 audio_column="path", max_duration=0.5)


@pytest.fixture(scope="module")
def lm_run(folder):
    (folder / "lm").mkdir()
    path = folder / "lm" / "notes.jsonl"
    lines = [f"note {i}: the meeting moved to room {i % 5} at {i % 12} o'clock" for i in range(20)]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return train(folder / "lm", task="causal-lm", model=TINY_GPT2, data=str(path), max_length=32)


# -- each task: predict, then evaluate the test split ---------------------------------------------------
def test_text_classification(capsys, folder, text_run):
    model = folder / "text" / "out" / "model"
    (folder / "text" / "in.csv").write_text('text\n"free cash, call now"\nhello there\n')
    results = predictions(capsys, "--model", model, "--text", "win a prize", "--input", folder / "text" / "in.csv",
                          "--all-scores", "--batch-size", 2)
    assert [r["text"] for r in results] == ["win a prize", "free cash, call now", "hello there"]
    assert all(r["label"] in ("ham", "spam") and r["score"] == max(r["scores"].values()) for r in results)
    assert all(sum(r["scores"].values()) == pytest.approx(1, abs=1e-5) for r in results)
    assert_reproduces_test_metrics(capsys, text_run, model)
    assert_reproduces_test_metrics(capsys, text_run, model, split="validation")


def test_evaluate_maps_the_data_labels_to_the_model_ids(capsys, folder, text_run):
    """Data holding only `spam` (label id 0 there) is scored against the model's id 1 for spam."""
    model = folder / "text" / "out" / "model"
    texts = [f"claim prize number {i}" for i in range(8)]
    (folder / "text" / "spam.csv").write_text("text,label\n" + "\n".join(f"{t},spam" for t in texts) + "\n")
    code, out, err = cli(capsys, "evaluate", "--model", model, "--data", folder / "text" / "spam.csv", "--split",
                         "train", "--test-split", "0.25")
    assert code == 0, err
    metrics = json.loads(out[-1])
    kept = metrics["samples"]
    labels = [r["label"] for r in predictions(capsys, "--model", model, *[a for t in texts for a in ("--text", t)])]
    assert 0 < kept < len(texts) and 0 <= metrics["accuracy"] <= 1
    if len(set(labels)) == 1:  # a 2-step model says the same about these similar texts: then exactly
        assert metrics["accuracy"] == (1.0 if labels[0] == "spam" else 0.0)


def test_text_pairs(capsys, folder, pairs_run):
    model = folder / "pairs" / "out" / "model"
    (folder / "pairs" / "in.jsonl").write_text(json.dumps({"text": "A dog runs.", "text_pair": "A dog is running."})
                                               + "\n\n" + json.dumps({"text": "Only one text."}) + "\n")
    results = predictions(capsys, "--model", model, "--text", "The cat sat.", "--text-pair", "A cat sat.",
                          "--input", folder / "pairs" / "in.jsonl")
    assert [(r["text"], r.get("text_pair")) for r in results] == [
        ("The cat sat.", "A cat sat."), ("A dog runs.", "A dog is running."), ("Only one text.", None)]
    assert all(r["label"] in ("0", "1") and 0.5 <= r["score"] <= 1 for r in results)
    assert_reproduces_test_metrics(capsys, pairs_run, model)


def test_images(capsys, folder, image_run):
    model = folder / "image" / "out" / "model"
    by_folder = predictions(capsys, "--model", model, "--input", folder / "image" / "imgs", "--batch-size", 8)
    assert len(by_folder) == 20 and all(r["label"] in ("red", "blue") for r in by_folder)
    assert [r["image"] for r in by_folder] == sorted(str(p) for p in (folder / "image" / "imgs").iterdir())
    by_table = predictions(capsys, "--model", model, "--input", folder / "image" / "images.csv", "--batch-size", 8)
    one = predictions(capsys, "--model", model, "--input", folder / "image" / "imgs" / "img3.png")
    assert by_table[3]["image"] == one[0]["image"] == str(folder / "image" / "imgs" / "img3.png")
    assert by_table[3]["score"] == pytest.approx(one[0]["score"], abs=1e-5)
    assert_reproduces_test_metrics(capsys, image_run, model)


def test_audio(capsys, folder, audio_run):
    model = folder / "audio" / "out" / "model"
    results = predictions(capsys, "--model", model, "--input", folder / "audio" / "clips", "--max-duration", 0.5,
                          "--batch-size", 4)
    assert len(results) == 16 and all(r["label"] in ("low", "high") and r["audio"].endswith(".wav") for r in results)
    assert_reproduces_test_metrics(capsys, audio_run, model)


def test_causal_lm(capsys, folder, lm_run):
    model = folder / "lm" / "out" / "model"
    prompts = ["note 3: the meeting", "note", "note 11: the meeting moved to room"]
    batched = predictions(capsys, "--model", model, *[a for p in prompts for a in ("--prompt", p)],
                          "--max-new-tokens", 5)
    assert [r["prompt"] for r in batched] == prompts and all(isinstance(r["generated"], str) for r in batched)
    # Left padding: a prompt generates the same greedy continuation alone as in a batch of longer ones.
    alone = [predictions(capsys, "--model", model, "--prompt", p, "--max-new-tokens", 5)[0] for p in prompts]
    assert alone == batched
    (folder / "lm" / "prompts.csv").write_text("prompt\nnote 1\nnote 2: the\n")
    sampled = predictions(capsys, "--model", model, "--input", folder / "lm" / "prompts.csv", "--temperature", 1.5,
                          "--max-new-tokens", 4)
    assert [r["prompt"] for r in sampled] == ["note 1", "note 2: the"]
    assert sampled == predictions(capsys, "--model", model, "--input", folder / "lm" / "prompts.csv",
                                  "--temperature", 1.5, "--max-new-tokens", 4)  # same --seed, same draws
    assert_reproduces_test_metrics(capsys, lm_run, model)


def test_evaluate_on_two_processes_equals_one(folder, text_run, capsys):
    from test_distributed import torchrun

    model = folder / "text" / "out" / "model"
    _, data = text_run
    result = torchrun(2, "evaluate", "--model", model, *as_flags(data), "--output", folder / "text" / "two.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip().splitlines()) == 1  # the main process prints, once
    two = json.loads((folder / "text" / "two.json").read_text())
    one = text_run[0]["test"]
    assert two["samples"] == one["samples"] == 5  # an odd split: the second process's padding is dropped
    assert set(two) == set(one) and all(two[k] == pytest.approx(one[k], abs=1e-6, rel=0) for k in one)


# -- inputs that do not fit: exit 2, one line naming the problem and the fix ----------------------------
@pytest.fixture(scope="module")
def bad(folder, text_run, image_run, lm_run):
    root = folder / "bad"
    (root / "noimg").mkdir(parents=True)
    (root / "noimg" / "notes.txt").write_text("not an image\n")
    (root / "broken").mkdir()
    (root / "broken" / "broken.png").write_bytes(b"this is not a png\n" * 4)
    (root / "empty.jsonl").write_text("")
    (root / "words.txt").write_text("hello\n")
    (root / "nolabel.csv").write_text("text,label\n" + "\n".join(f"text {i},{['ham', 'promo'][i % 2]}"
                                                                  for i in range(12)) + "\n")
    (root / "notjson.jsonl").write_text('{"text": "ok"}\nnot json\n')
    return root


TEXT, IMAGE, LM = "text/out/model", "image/out/model", "lm/out/model"
BAD = [
    (["predict", "--model", TEXT], "nothing to predict"),
    (["predict", "--model", TEXT, "--prompt", "once upon"], "--prompt does not fit"),
    (["predict", "--model", IMAGE, "--text", "a cat"], "--text does not fit"),
    (["predict", "--model", LM, "--text", "hello"], "--text does not fit"),
    (["predict", "--model", TEXT, "--input", "bad/missing.jsonl"], "does not exist"),
    (["predict", "--model", TEXT, "--input", "bad/empty.jsonl"], "is empty"),
    (["predict", "--model", TEXT, "--input", "bad/words.txt"], "unknown file type `.txt`"),
    (["predict", "--model", TEXT, "--input", "bad/notjson.jsonl"], "line 2 is not JSON"),
    (["predict", "--model", IMAGE, "--input", "bad/words.txt"], "unknown file type `.txt`"),
    (["predict", "--model", IMAGE, "--input", "bad/noimg"], "a folder without image files"),
    (["predict", "--model", IMAGE, "--input", "bad/broken"], "broken.png could not be decoded"),
    (["predict", "--model", IMAGE, "--input", "image/images.csv", "--batch-size", "0"], "--batch-size must be > 0"),
    (["predict", "--model", TEXT, "--text", "a", "--text", "b", "--text-pair", "c"], "2 --text but 1 --text-pair"),
    (["predict", "--model", LM, "--prompt", " "], "prompt 1 is empty"),
    (["predict", "--model", LM, "--prompt", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["predict", "--model", "./bad/nowhere", "--text", "hi"], "is not a directory"),
    (["evaluate", "--model", TEXT, "--data", "bad/nolabel.csv"], "label `promo` is not one the model knows"),
    (["evaluate", "--model", TEXT, "--data", "bad/nolabel.csv", "--split", "dev"], "invalid choice"),
    (["evaluate", "--model", IMAGE, "--data", "bad/words.txt"], "unknown file type"),
    (["evaluate", "--model", "default", "--data", "bad/nolabel.csv"], "has no head effitrain predicts or evaluates"),
]


@pytest.mark.parametrize("args, needle", BAD)
def test_bad_input_is_one_line(capsys, monkeypatch, folder, bad, args, needle):
    monkeypatch.chdir(folder)
    code, out, err = cli(capsys, *args)
    assert code == 2 and len(err) == 1 and needle in err[0] and "fix:" in err[0], err
    assert not out and not any("Traceback" in line for line in err)


def test_bad_input_from_a_fresh_process(folder, image_run, bad):
    from conftest import run_cli

    result = run_cli("predict", "--model", IMAGE, "--input", "bad/broken", cwd=folder)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "broken.png could not be decoded" in lines[0], result.stderr
    assert "fix:" in lines[0] and not result.stdout


# -- batching and padding change nothing ----------------------------------------------------------------
def plain_forward(model_dir, text, pair=None) -> list[float]:
    """One text alone through plain transformers (no padding at all): its label probabilities."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    with torch.inference_mode():
        encoded = tokenizer(text, pair, truncation=True, max_length=512, return_tensors="pt")
        return model(**encoded).logits.softmax(-1)[0].tolist()


def test_predict_equals_a_plain_forward_whatever_the_batch(tiny_model_dir):
    """Texts of very different lengths (one token to past the 512-token cut), single and paired, in
    batches of 1, 3 and 64: each text's label and scores are those of the text alone, unpadded."""
    from effitrain.commands.predict import predict
    from effitrain.tasks.base import PredictOptions

    texts = ["hi", "free entry in a weekly competition to win cup final tickets " * 3, "ok " * 700,
             "see you at lunch", "x", "call now " * 40, "urgent! your mobile number has won a prize"]
    pairs = ["a reply", "", "b " * 300, "lunch?", "y", "z", "claim it"]
    names = ["LABEL_0", "LABEL_1"]
    want = [plain_forward(tiny_model_dir, text) for text in texts]
    want_pairs = [plain_forward(tiny_model_dir, text, pair) for text, pair in zip(texts, pairs)]
    assert max(p for row in want for p in row) < 0.999  # a model that says something else for each text
    for batch_size in (1, 3, 64):
        got = predict(str(tiny_model_dir), texts, batch_size, options=PredictOptions(all_scores=True))
        got_pairs = predict(str(tiny_model_dir), texts, batch_size, text_pairs=pairs,
                            options=PredictOptions(all_scores=True))
        for results, expected in ((got, want), (got_pairs, want_pairs)):
            assert [r["text"] for r in results] == texts  # input order
            for result, probs in zip(results, expected):
                assert result["label"] == names[int(np.argmax(probs))]
                assert result["score"] == pytest.approx(max(probs), abs=1e-5, rel=0)
                assert [result["scores"][n] for n in names] == pytest.approx(probs, abs=1e-5, rel=0)


def test_texts_with_and_without_a_pair_in_one_input_file(tmp_path, tiny_model_dir):
    from effitrain.commands.predict import predict

    rows = [{"text": "one", "text_pair": "two"}, {"text": "three " * 50}, {"text": "four", "text_pair": "five six"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    results = predict(str(tiny_model_dir), input_file=str(path), batch_size=8)
    assert [{k: r[k] for k in row} for r, row in zip(results, rows)] == rows
    for result, row in zip(results, rows):
        assert result["score"] == pytest.approx(max(plain_forward(tiny_model_dir, row["text"], row.get("text_pair"))),
                                                abs=1e-5, rel=0)


# -- a model of another task than the inputs or data ask for ---------------------------------------------
@pytest.fixture(scope="module")
def other_models(tmp_path_factory):
    """Causal LMs (GPT-2, Llama) and a masked LM built from configs, saved with save_pretrained, with the
    packaged tokenizer."""
    import torch
    from effitrain.models.loading import default_model_dir
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    root = tmp_path_factory.mktemp("other-tasks")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    vocab = tokenizer.vocab_size
    torch.manual_seed(0)
    built = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_layer=1, n_embd=16, n_head=2, n_positions=64)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=vocab, num_hidden_layers=1, hidden_size=16,
                                              intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                                              max_position_embeddings=64)),
        "mlm": BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32)),
    }
    for name, model in built.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "prompts.jsonl").write_text('{"prompt": "once upon a time"}\n')
    (root / "pairs.jsonl").write_text('{"text": "a", "text_pair": "b"}\n')
    (root / "labelled.csv").write_text("text,label\n" + "".join(f"text {i},{'ab'[i % 2]}\n" for i in range(20)))
    return root


OTHER_TASK = [
    (["predict", "--model", "M/gpt2", "--text", "hello"], "--text does not fit the model", "fix: pass --prompt"),
    (["predict", "--model", "M/llama", "--text", "hello", "--text", "bye"], "(causal-lm)", "fix: pass --prompt"),
    (["predict", "--model", "M/llama", "--input", "M/pairs.jsonl"], "holds text pairs", "fix: pass --prompt"),
    (["predict", "--model", "TINY", "--prompt", "once upon"], "--prompt does not fit", "fix: pass --text"),
    (["predict", "--model", "TINY", "--input", "M/prompts.jsonl"], "is a sequence-classification model",
     "fix: pass --text"),
    (["evaluate", "--model", "TINY", "--data", "M/labelled.csv", "--task", "causal-lm"],
     "it is a sequence-classification model (BertForSequenceClassification)", "fix: drop --task"),
    (["evaluate", "--model", "M/gpt2", "--data", "M/labelled.csv", "--task", "sequence-classification"],
     "it is a causal-lm model (GPT2LMHeadModel)", "fix: drop --task"),
    (["predict", "--model", "M/mlm", "--text", "hello"], "is a BertForMaskedLM, which has no head", "fix:"),
    (["evaluate", "--model", "M/mlm", "--data", "M/labelled.csv"], "is a BertForMaskedLM, which has no head", "fix:"),
]


@pytest.mark.parametrize("args, problem, fix", OTHER_TASK)
def test_a_model_of_another_task_is_refused(capsys, other_models, tiny_model_dir, args, problem, fix):
    args = [str(a).replace("M/", f"{other_models}/").replace("TINY", str(tiny_model_dir)) for a in args]
    code, out, err = cli(capsys, *args)
    assert code == 2 and len(err) == 1 and problem in err[0] and fix in err[0], err
    assert not out and "Traceback" not in err[0]


def test_a_causal_lm_given_texts_from_a_fresh_process(other_models):
    from conftest import run_cli

    result = run_cli("predict", "--model", other_models / "gpt2", "--text", "hi")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "fix: pass --prompt" in lines[0], result.stderr
    assert not result.stdout  # no labels printed for a model that has none
    prompted = run_cli("predict", "--model", other_models / "gpt2", "--prompt", "hi", "--max-new-tokens", "2")
    assert prompted.returncode == 0, prompted.stderr
    assert set(json.loads(prompted.stdout)) == {"prompt", "generated"}
