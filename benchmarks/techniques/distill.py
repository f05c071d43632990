"""A 3-layer student of the default model distilled from the fine-tuned 6-layer teacher, against the same
student trained alone and against the teacher (issue 44's classification bar), over seeds.

For one data set (`--data sms-spam`, the default job, or `bbc-news`), each an `effitrain train` run in a fresh
process (`python -m effitrain train`, OMP_NUM_THREADS=1, one run at a time):

    teacher     the default job: all-MiniLM-L6-v2 (6 layers), --seed 42, once (or `--teacher RUN`: a run
                folder of it, with model/ and metrics.json, trained on the same split)
    alone       --student-layers 3 --seed S, for each of --seeds (default 0 1 2)
    distilled   --student-layers 3 --distill-from TEACHER/model --seed S (default --distill-alpha/-temperature)

The students start from the default model's pretrained layers 0, 2, 4, or, with --student-from-teacher, from
the fine-tuned teacher's (`--model TEACHER/model`, DistilBERT's initialisation, the teacher's head included),
alone and distilled alike.

One split for every run: effitrain's split of the data by `--split-seed` (42, the default job's) written to
train/validation/test JSONL files that every run reads (`--data train.jsonl --validation-file ... --test-file
...`), so that the seeds change the students' initial head, dropout and data order but not their test set,
the teacher's test accuracy is measured on the students' test set, and no student is tested on rows its
teacher trained on (`--seed` alone would also move the split: effitrain's seed splits the data). With the
default --split-seed the teacher is the default job's run exactly.

Per run, from its folder: test accuracy and the data's F1 (spam F1 for sms-spam, macro F1 otherwise:
metrics.json `test`), parameters (metrics.json), model/'s bytes on disk, training samples/s (metrics.json
`train_samples_per_second`), and the peak training RSS: the largest `peak_memory_bytes` of log.jsonl's step
records (the process's VmHWM when the last step is logged, before the final evaluation; for a distilled run
it includes the one pass of the teacher over the training split, which frees the teacher before the first
step). metrics.json's `peak_memory_bytes` (after the test evaluation) is shown beside it.

Predict speed: `effitrain.commands.predict.predict(model_dir, texts)` in this process (benchmarks/peers/
predict_speed.py's in-process side: from the model folder to the probabilities, loading included), one torch
thread, on the test split's texts cycled up to --predict-texts, the teacher and the first seed's distilled
student taking turns --predict-repeats times: the best and median wall seconds of each, and the best CPU seconds
of this process (getrusage: on a shared machine the wall clock also counts the time spent waiting for a core;
the bar is read on CPU seconds, the wall ratios printed beside). A student's speed depends on its shape only
(alone and distilled are the same 3-layer model).

    .venv/bin/python benchmarks/techniques/distill.py --data sms-spam --output-dir /tmp/distill-sms \\
        --markdown benchmarks/results/distill_sms-spam_epyc2c_2026-12-06.md
    .venv/bin/python benchmarks/techniques/distill.py --data bbc-news --train-args "--max-length 64"  # every run
    .venv/bin/python benchmarks/techniques/distill.py --teacher /tmp/distill-sms/teacher --distill-args \\
        "--distill-alpha 0.9"   # another setting, the same teacher
    .venv/bin/python benchmarks/techniques/distill.py --teacher /tmp/distill-sms/teacher --student-from-teacher
    .venv/bin/python benchmarks/techniques/distill.py --dry-run   # a tiny model (2 layers -> 1), 2 steps, 1 seed

The bar (issue 44), printed as pass/FAIL, never asserted: the distilled students' mean test accuracy at least
the teacher's minus 0.5 points and at least the alone students' mean; predict at least 1.8x faster than the
teacher's (CPU seconds); the distilled runs' mean peak training RSS within 10% of the alone runs'. Speeds depend on the
machine and on whatever else runs on it: compare ratios, and mind the `other cores` column.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STUDENT_LAYERS = 3
DRY_RUN = ["--max-steps", "2", "--batch-size", "4"]
DRY_RUN_ROWS = {"train": 32, "validation": 8, "test": 8}
BAR_POINTS, BAR_SPEEDUP, BAR_MEMORY = 0.005, 1.8, 1.10


IN_PROCESS = False  # a dry run trains in this process (fresh processes measure each run's own peak RSS)

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=("sms-spam", "bbc-news"), default="sms-spam")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the students' seeds (default 0 1 2)")
    parser.add_argument("--teacher-seed", type=int, default=42, help="the teacher's --seed (default 42)")
    parser.add_argument("--split-seed", type=int, default=42, help="the seed of the one split (default 42)")
    parser.add_argument("--teacher", type=Path, default=None, metavar="RUN",
                        help="reuse this teacher run folder (model/, metrics.json) instead of training one")
    parser.add_argument("--train-args", default="", help="extra `effitrain train` flags for every run, teacher too "
                                                         "(e.g. \"--max-length 64\"), one string")
    parser.add_argument("--student-args", default="", help="extra flags for both students' runs (e.g. \"--lr 2e-4\")")
    parser.add_argument("--distill-args", default="", help="extra flags for the distilled runs only "
                                                           "(e.g. \"--distill-alpha 0.9\")")
    parser.add_argument("--student-from-teacher", action="store_true",
                        help="both students start from the teacher's fine-tuned model/ (`--model TEACHER/model "
                             "--student-layers 3`: DistilBERT's initialisation, its head included) instead of the "
                             "default model's pretrained weights")
    parser.add_argument("--predict-texts", type=int, default=2000, help="texts predicted per timing (the test "
                                                                        "split's, cycled; default 2000)")
    parser.add_argument("--predict-repeats", type=int, default=3, help="timings of each model, in turns (default 3)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where the split and the runs go (default: a temporary folder, deleted at the end)")
    parser.add_argument("--reuse", action="store_true", help="with --output-dir: keep the runs already there "
                                                             "(same flags), run only the missing ones")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                        help="also write the tables to PATH, e.g. "
                             "benchmarks/results/distill_<data>_<machine>_<date>.md")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every figure to PATH")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"a tiny model (2 layers; students of 1), {' '.join(DRY_RUN)}, one seed, a few rows; "
                             "a temporary folder, no files")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.seeds, args.output_dir, args.markdown, args.json, args.reuse = args.seeds[:1], None, None, None, False
        args.predict_texts, args.predict_repeats = 16, 1
    args.student_layers = 1 if args.dry_run else STUDENT_LAYERS  # the dry run's tiny model has 2 layers
    if args.reuse and args.output_dir is None:
        parser.error("--reuse needs --output-dir")
    if min(args.predict_texts, args.predict_repeats) < 1:
        parser.error("--predict-texts and --predict-repeats must be at least 1")
    if args.teacher is not None and not (args.teacher / "model" / "config.json").is_file():
        parser.error(f"--teacher {args.teacher}: no model/config.json there (pass an `effitrain train` run folder)")
    return args


# --- the split ---------------------------------------------------------------------------------------


def write_split(data: str, seed: int, folder: Path, dry_run: bool) -> dict[str, Path]:
    """effitrain's own split of `data` by `seed` (the task's loader, as `effitrain train --data DATA --seed
    SEED` splits it), each split a JSONL file of `text` and the label's name."""
    from effitrain import tasks
    from effitrain.config import TrainConfig

    config = TrainConfig(data=data, seed=seed)
    splits = tasks.for_config(config).load_data(config).splits
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in ("train", "validation", "test"):
        rows = splits[name]
        names = rows.features["label"].names
        count = DRY_RUN_ROWS[name] if dry_run else len(rows)
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"text": text, "label": names[label]}) + "\n"
                                       for text, label in zip(rows["text"][:count], rows["label"][:count])))
    return paths


def data_flags(split: dict[str, Path]) -> list[str]:
    return ["--data", str(split["train"]), "--validation-file", str(split["validation"]),
            "--test-file", str(split["test"])]


def test_texts(split: dict[str, Path]) -> list[str]:
    return [json.loads(line)["text"] for line in split["test"].read_text().splitlines()]


# --- the runs ----------------------------------------------------------------------------------------


def train_argv(kind: str, seed: int, args, split: dict, teacher: Path | None, model: Path | None) -> list[str]:
    """`effitrain train` flags of one run (without --output-dir)."""
    argv = [*data_flags(split), "--seed", str(seed), *shlex.split(args.train_args)]
    if kind != "teacher" and args.student_from_teacher:  # DistilBERT's way: layers of the fine-tuned teacher
        model = teacher / "model"
    if model is not None:  # the dry run's tiny model, or the teacher's fine-tuned one
        argv += ["--model", str(model)]
    if kind != "teacher":
        argv += ["--student-layers", str(args.student_layers), *shlex.split(args.student_args)]
    if kind == "distilled":
        argv += ["--distill-from", str(teacher / "model"), *shlex.split(args.distill_args)]
    return argv + (DRY_RUN if args.dry_run else [])


def run_name(kind: str, seed: int, args) -> str:
    """seedS-alone, seedS-distilled, with the extra flags in the name: another setting's runs sit beside the
    default's in one --output-dir (and --reuse keeps the teacher and the runs whose flags did not change)."""
    extra = ("from teacher " if args.student_from_teacher else "") + args.student_args + \
        (" " + args.distill_args if kind == "distilled" else "")
    if (kind == "distilled" or args.student_from_teacher) and args.teacher is not None:
        extra += f" teacher {args.teacher.name}"  # another teacher's students beside the default's
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", extra).strip("_")
    return f"seed{seed}-{kind}" + (f"-{tag}" if tag else "")


def train(name: str, argv: list[str], root: Path, reuse: bool) -> dict:
    """One `effitrain train` run in a fresh process (one torch thread), or the one already in root/name with
    the same flags (--reuse); its figures."""
    out, flags_file = root / name, root / f"{name}.argv.json"
    kept = reuse and (out / "metrics.json").is_file() and flags_file.is_file() and \
        json.loads(flags_file.read_text()) == argv
    wall, other = None, None
    if kept:
        print(f"reusing {name}: {out}", flush=True)
    else:
        print(f"running {name}: effitrain train {' '.join(argv)}", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        started, before = time.perf_counter(), _common.cpu_snapshot(children=True)
        command = ["train", *argv, "--output-dir", str(out), "--overwrite"]
        if IN_PROCESS:  # a dry run: the same CLI in this process, without a fresh process's imports
            from effitrain.cli import main as cli

            if cli(command):
                raise SystemExit(f"effitrain train ... {name} failed")
        else:
            _common.run_checked([sys.executable, "-m", "effitrain", *command], env)
        wall, other = time.perf_counter() - started, _common.cores(before, _common.cpu_snapshot(children=True))
        flags_file.write_text(json.dumps(argv))
    row = run_figures(out)
    row.update(name=name, argv=argv, wall_seconds=wall, other_cores=other and other["other_cores"])
    print(f"  test accuracy {row['accuracy']:.4f}, {row['f1_key']} {row['f1']:.4f}, {row['samples_per_second']:.1f} "
          f"samples/s, training peak {_common.mib(row['train_peak_bytes'])}", flush=True)
    return row


def run_figures(out: Path) -> dict:
    """What one run folder says: metrics.json, log.jsonl's step records, model/ on disk."""
    metrics = json.loads((out / "metrics.json").read_text())
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [record for record in steps if "split" not in record and "peak_memory_bytes" in record]
    test = metrics["test"]
    f1_key = "f1_spam" if "spam" in (metrics.get("labels") or []) else "f1_macro"
    return {"accuracy": test["accuracy"], "f1": test.get(f1_key), "f1_key": f1_key, "test_samples": test.get("samples"),
            "parameters": metrics["parameters"]["total"], "steps": metrics["steps"],
            "samples_per_second": metrics["train_samples_per_second"], "train_seconds": metrics["train_seconds"],
            "train_peak_bytes": max(record["peak_memory_bytes"] for record in steps) if steps else None,
            "peak_memory_bytes": metrics["peak_memory_bytes"], "precision": metrics.get("precision"),
            "model_bytes": sum(f.stat().st_size for f in (out / "model").rglob("*") if f.is_file())}


# --- predict -----------------------------------------------------------------------------------------


def predict_speed(models: dict[str, Path], texts: list[str], repeats: int) -> dict[str, dict]:
    """name -> its timings of predict() over `texts` (the models taking turns; one torch thread): the best and
    median wall seconds, and the best CPU seconds of this process (wall x its own cores: on a shared machine
    the wall clock also counts the time spent waiting for a core)."""
    import torch

    from effitrain.runtime import libraries
    from peers.predict_speed import effitrain_predict, timed

    torch.set_num_threads(1)
    libraries.quiet_libraries(False)
    figures: dict[str, dict] = {name: {"runs": []} for name in models}
    for _ in range(repeats):
        for name, folder in models.items():
            (results, padded), run = timed(lambda folder=folder: effitrain_predict(folder, texts, 64))
            figures[name]["runs"].append(run)
            figures[name]["padded_tokens"] = padded
            print(f"  predict {name}: {run['seconds']:.2f} s, {run['seconds'] * run['own_cores']:.2f} CPU s (other "
                  f"processes: {_common.fmt(run['other_cores'], '.2f')} cores)", flush=True)
    for entry in figures.values():
        summarise_timings(entry)
    return figures


def summarise_timings(entry: dict) -> dict:
    runs = entry["runs"]
    entry["seconds"] = min(run["seconds"] for run in runs)
    entry["median_seconds"] = statistics.median(run["seconds"] for run in runs)
    entry["cpu_seconds"] = min(run["seconds"] * run["own_cores"] for run in runs)
    entry["other_cores"] = statistics.mean(run["other_cores"] or 0.0 for run in runs)
    return entry


# --- the report --------------------------------------------------------------------------------------


def pct(value) -> str:
    return _common.fmt(None if value is None else 100 * value, ".2f")


def mean_range(values: list) -> str:
    return f"{pct(statistics.mean(values))} ({pct(min(values))}-{pct(max(values))})" if values else "-"


def wrong_rows(row: dict):
    """The test rows the run got wrong (accuracy x rows, rounded): the unit the seeds' spread is read in."""
    return "-" if row.get("test_samples") is None else round((1 - row["accuracy"]) * row["test_samples"])


def runs_table(rows: list[dict]) -> str:
    f1_name = {"f1_spam": "spam F1", "f1_macro": "macro F1"}[rows[0]["f1_key"]]
    header = ["run", "seed", "parameters", "test accuracy %", "wrong test rows", f"{f1_name} %", "training samples/s",
              "peak training RSS", "metrics.json peak", "model/", "other cores"]
    body = [[r["name"], r["seed"], f"{r['parameters']:,}", pct(r["accuracy"]), wrong_rows(r), pct(r["f1"]),
             f"{r['samples_per_second']:.1f}", _common.mib(r["train_peak_bytes"]), _common.mib(r["peak_memory_bytes"]),
             f"{r['model_bytes'] / 1e6:.1f} MB", _common.fmt(r["other_cores"], ".2f")] for r in rows]
    return _common.md_table(header, body)


def summary(rows: list[dict], speed: dict, layers: int) -> tuple[str, list[str]]:
    """The means table and the bar's lines."""
    teacher = rows[0]
    kinds = {kind: [r for r in rows if r["kind"] == kind] for kind in ("alone", "distilled")}
    acc = {kind: statistics.mean(r["accuracy"] for r in group) for kind, group in kinds.items()}
    memory = {kind: statistics.mean(r["train_peak_bytes"] for r in group) for kind, group in kinds.items()}
    teacher_s, student_s = speed["teacher"], speed["student"]
    speedup = {key: teacher_s[key] / student_s[key] for key in ("cpu_seconds", "seconds", "median_seconds")}
    header = ["model", "runs", "test accuracy % mean (min-max)", "F1 % mean", "training samples/s mean",
              "peak training RSS mean", "predict CPU s (best)", "predict wall s best (median)"]
    timing = lambda t: [f"{t['cpu_seconds']:.2f}", f"{t['seconds']:.2f} ({t['median_seconds']:.2f})"]  # noqa: E731
    body = [["teacher (6 layers)", 1, pct(teacher["accuracy"]), pct(teacher["f1"]),
             f"{teacher['samples_per_second']:.1f}", _common.mib(teacher["train_peak_bytes"]), *timing(teacher_s)]]
    for kind, group in kinds.items():
        body.append([f"student, {kind} ({layers} layers)", len(group),
                     mean_range([r["accuracy"] for r in group]), pct(statistics.mean(r["f1"] for r in group)),
                     f"{statistics.mean(r['samples_per_second'] for r in group):.1f}", _common.mib(memory[kind]),
                     *timing(student_s)])
    verdict = lambda ok: "pass" if ok else "FAIL"  # noqa: E731
    lines = [
        f"- distilled mean accuracy {pct(acc['distilled'])}% >= teacher {pct(teacher['accuracy'])}% - 0.5 = "
        f"{pct(teacher['accuracy'] - BAR_POINTS)}%: {verdict(acc['distilled'] >= teacher['accuracy'] - BAR_POINTS)}",
        f"- distilled mean accuracy {pct(acc['distilled'])}% >= alone mean {pct(acc['alone'])}%: "
        f"{verdict(acc['distilled'] >= acc['alone'])}",
        f"- predict: the student {speedup['cpu_seconds']:.2f}x the teacher's speed in CPU seconds (>= {BAR_SPEEDUP}x): "
        f"{verdict(speedup['cpu_seconds'] >= BAR_SPEEDUP)}; in wall seconds {speedup['seconds']:.2f}x best to best, "
        f"{speedup['median_seconds']:.2f}x median to median, other processes using "
        f"{(teacher_s['other_cores'] + student_s['other_cores']) / 2:.2f} cores meanwhile",
        f"- peak training RSS: distilled {_common.mib(memory['distilled'])} / alone {_common.mib(memory['alone'])} = "
        f"{memory['distilled'] / memory['alone']:.3f} (<= {BAR_MEMORY}): "
        f"{verdict(memory['distilled'] <= BAR_MEMORY * memory['alone'])}",
    ]
    return _common.md_table(header, body), lines


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return (done.stdout.strip() or "?") + (" (with uncommitted changes)" if dirty else "")


def report(args, argv: list[str], rows: list[dict], speed: dict, split: dict) -> str:
    means, bar = summary(rows, speed, args.student_layers)
    teacher = rows[0]
    sizes = {name: len(path.read_text().splitlines()) for name, path in split.items()}
    extra = "; ".join(f"{flag} `{value}`" for flag, value in (("--train-args", args.train_args),
                      ("--student-args", args.student_args), ("--distill-args", args.distill_args)) if value)
    start = "the fine-tuned teacher" if args.student_from_teacher else "the default model"
    title = ("made of the fine-tuned teacher's layers, distilled from that teacher" if args.student_from_teacher
             else "of the default model distilled from its fine-tuned teacher")
    return "\n".join([
        f"# distill: a {args.student_layers}-layer student {title}, "
        f"{args.data}", "",
        f"`benchmarks/techniques/distill.py {' '.join(argv)}`", "",
        f"- Machine: {_common.machine(torch_version=True)} (`lscpu` model name), shared; every `effitrain train` "
        "run a fresh process with OMP_NUM_THREADS=1, one at a time; predict timed in the script's process, "
        "one thread.",
        f"- Commit {commit()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"- Data: {args.data}, effitrain's split by seed {args.split_seed} ({sizes['train']} train, "
        f"{sizes['validation']} validation, {sizes['test']} test rows; one test row = "
        f"{100 / sizes['test']:.2f} points), the same files for every run. Teacher: the default job (all-MiniLM-L6-v2, "
        f"{teacher['parameters']:,} parameters, --seed {args.teacher_seed}, {teacher['steps']} steps"
        f"{', reused from ' + str(args.teacher) if args.teacher else ''}); students `--student-layers "
        f"{args.student_layers}`{' (layers 0, 2, 4 of ' if args.student_layers == 3 else ' ('}{start}"
        f"{', `--model teacher/model`' if args.student_from_teacher else ''}), seeds "
        f"{' '.join(map(str, args.seeds))}; the distilled ones "
        f"`--distill-from teacher/model`. effitrain's defaults otherwise ({teacher['precision']}, 1 epoch, batch 16, "
        f"lr 1e-4){'; ' + extra if extra else ''}.", "",
        "Every run:", "", runs_table(rows), "",
        f"Means, and `effitrain predict` on {speed['texts']} texts (the test split's, cycled), the best of "
        f"{args.predict_repeats} timings each (the student timed: seed {args.seeds[0]}'s distilled one):", "",
        means, "",
        "Issue 44's bar:", "", *bar, "",
        "- peak training RSS: the largest `peak_memory_bytes` of the run's log.jsonl step records (the process's "
        "VmHWM at its last step, before the final evaluation); a distilled run's includes the teacher's one pass "
        "over the training split before the first step. metrics.json peak: after the test evaluation.",
        "- predict: one torch thread in this script's process, model folder to probabilities (loading included), "
        "batch 64; CPU s: the process's own CPU time (getrusage), which waiting for a core on a busy machine does "
        "not count, unlike the wall clock.",
        "- other cores: CPU that other processes used during the run (/proc/stat less this script's children); "
        "above ~0.1 the samples/s measure the contention as much as the model. Compare ratios, not absolutes.",
    ]) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    model = None
    if args.dry_run:
        global IN_PROCESS
        IN_PROCESS = True
        model = _common.dry_run_model()
        _common.skipped(f"seeds after the first, students of {STUDENT_LAYERS} layers (the tiny model has 2) and the "
                        "files (--markdown, --json)")
    temporary = args.output_dir is None
    root = Path(tempfile.mkdtemp(prefix="bench-distill-")) if temporary else args.output_dir
    root.mkdir(parents=True, exist_ok=True)
    try:
        split = write_split(args.data, args.split_seed, root / "split", args.dry_run)
        if args.teacher:
            teacher_dir = args.teacher
            teacher = {**run_figures(teacher_dir), "name": "teacher", "argv": None, "wall_seconds": None,
                       "other_cores": None}
        else:
            teacher_dir = root / "teacher"
            teacher = train("teacher", train_argv("teacher", args.teacher_seed, args, split, None, model), root,
                            args.reuse)
        rows = [{**teacher, "kind": "teacher", "seed": args.teacher_seed}]
        for seed in args.seeds:  # alone and distilled take turns: a busy minute hits both
            for kind in ("alone", "distilled"):
                argv_run = train_argv(kind, seed, args, split, teacher_dir, model)
                rows.append({**train(run_name(kind, seed, args), argv_run, root, args.reuse), "kind": kind,
                             "seed": seed})
        texts = test_texts(split)
        texts = [texts[i % len(texts)] for i in range(args.predict_texts)]
        student_dir = root / run_name("distilled", args.seeds[0], args) / "model"
        speed = predict_speed({"teacher": teacher_dir / "model", "student": student_dir}, texts, args.predict_repeats)
        speed["texts"] = len(texts)
        text = report(args, argv, rows, speed, split)
    finally:
        if temporary:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    print("\n" + text)
    if args.markdown is not None:
        args.markdown.write_text(text)
        print(f"written to {args.markdown}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "predict": speed}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
