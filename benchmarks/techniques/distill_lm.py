"""A 2-layer causal LM distilled from a 4-layer SFT teacher on `sms-spam-chat` (ChatML), against the same student
SFT'd alone for the same steps: test exact match (the task's evaluation: greedy answers to the held-out prompts),
seconds and peak RSS of each run, over seeds. The issue's bar: the distilled students (offline top-k, and
on-policy) reach a higher exact match than SFT alone.

- The data: sms-spam-chat's split at the teacher's seed (42, the default) written once as JSONL files
  (`--data`, `--validation-file`, `--test-file`), so that every run trains and is tested on the same rows
  whatever its `--seed` (the seed also chooses the held-out rows: a student at seed 0 on the built-in name would
  be tested on rows its teacher trained on).
- The teacher: chat_accuracy.py's model and settings (a 4-layer Llama-shaped model from a config, 100 steps,
  batch 32, lr 2e-3, bf16), seed 42, trained once (or `--teacher FOLDER`: its model/ folder's parent, trained so).
- The student, per seed: the teacher's config with 2 layers, random weights drawn at that seed (not the
  teacher's layers 0 and 2: with the teacher's embeddings and head that student answers as the teacher does
  after 5 SFT steps, so nothing could beat SFT alone), then `--start-steps` (40) SFT steps shared by the three
  runs: the answer format first (from random weights the on-policy student samples random tokens, and the
  teacher's scores of them taught it nothing in 40 steps). From that start, three runs of `--steps` (20) steps
  each, where SFT alone is not yet saturated; batch 32, the teacher's lr and precision: (a) SFT alone; (b) offline
  top-k distillation (`--distill-from`, `--distill-top-k`, `--distill-alpha`, `--distill-temperature`); (c)
  on-policy `--rl distill` on the training conversations less their answers (32 prompts a step,
  `--num-generations` completions each, up to 4 new tokens, `--distill-beta`, the divergence at T 1).
- Each run is `effitrain train` in a fresh process (its own peak RSS: metrics.json `peak_memory_bytes`), its
  seconds metrics.json `wall_seconds`; then `effitrain evaluate` scores every student's model/ alike on the
  test split (exact match: an `--rl` run's own evaluation reports the divergence instead).

    .venv/bin/python benchmarks/techniques/distill_lm.py                   # seeds 0 1 2, the teacher trained first
    .venv/bin/python benchmarks/techniques/distill_lm.py --teacher runs/lm-teacher --temperature 2 --beta 0 --seeds 0
    .venv/bin/python benchmarks/techniques/distill_lm.py --dry-run         # 2 steps, a few rows: seconds

The results go to benchmarks/results/distill_lm_<machine>_<date>.md (`--markdown PATH` elsewhere).
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from techniques.chat_accuracy import SETTINGS as TEACHER  # noqa: E402

METHODS = ("sft", "offline", "on-policy")
SPLITS = ("train", "validation", "test")
TEACHER_SEED = 42  # the default seed: it chooses sms-spam-chat's held-out rows, written once for every run


def cli_flags(settings: dict) -> list[str]:
    """{"max_steps": 100, "lr": 0.002} -> ["--max-steps", "100", "--lr", "0.002"]."""
    return [item for key, value in settings.items() for item in (f"--{key.replace('_', '-')}", str(value))]


def write_splits(folder: Path, rows: int | None) -> dict[str, str]:
    """sms-spam-chat's splits at the teacher's seed as JSONL files of `messages` (SFT, the offline distillation and
    the evaluation; `--rl` takes each conversation less its answer as the prompt): {split: path}; `rows`: the first
    N of each split (a dry run)."""
    from effitrain import tasks
    from effitrain.config import TrainConfig

    splits = tasks.get("causal-lm").load_data(TrainConfig(task="causal-lm", data="sms-spam-chat",
                                                          seed=TEACHER_SEED)).splits
    paths = {}
    for name in SPLITS:
        paths[name] = str(folder / f"{name}.jsonl")
        with open(paths[name], "w") as out:
            out.writelines(json.dumps({"messages": row}) + "\n" for row in list(splits[name]["messages"])[:rows])
    return paths


def data_flags(paths: dict[str, str]) -> list[str]:
    return ["--data", paths["train"], "--validation-file", paths["validation"], "--test-file", paths["test"]]


IN_PROCESS = False  # a dry run calls the CLI in this process (the same code, without a fresh process's imports)


def effitrain(argv: list[str]) -> None:
    """`effitrain ARGV` in a fresh process (each run's peak RSS its own), in this one for a dry run."""
    if not IN_PROCESS:
        _common.run_checked([sys.executable, __file__, "--child", *argv])
        return
    from effitrain.cli import main as cli

    code = cli(argv)
    if code:
        raise SystemExit(f"effitrain {' '.join(argv[:3])} ... failed (exit code {code})")


def train(out: Path, flags: list[str]) -> dict:
    """`effitrain train FLAGS --output-dir OUT`; its metrics.json."""
    effitrain(["train", *flags, "--output-dir", str(out)])
    return json.loads((out / "metrics.json").read_text())


def test_exact_match(model: Path, paths: dict[str, str], output: Path) -> float:
    """The task's evaluation of a saved model on the test split (greedy answers, stopped at the end of turn),
    its metrics written to `output` (a new file)."""
    effitrain(["evaluate", "--model", str(model), "--task", "causal-lm", *data_flags(paths), "--split", "test",
               "--output", str(output)])
    return json.loads(output.read_text())["exact_match"]


def random_student(teacher_model: Path, layers: int, seed: int, out: Path) -> Path:
    """The teacher's config with `layers` layers, random weights drawn at `seed`, the teacher's tokenizer (so the
    same vocabulary and ChatML tokens): saved to `out` once, the start every run of this seed shares."""
    from effitrain.runtime.libraries import quiet_import_warnings, quiet_libraries

    quiet_import_warnings()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_libraries(debug=False)
    config = AutoConfig.from_pretrained(str(teacher_model))
    config.num_hidden_layers = layers
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(teacher_model)).save_pretrained(str(out))
    return out


def method_flags(method: str, teacher_model: Path, args) -> list[str]:
    """What a method adds to the common student settings."""
    if method == "sft":
        return []
    if method == "offline":
        return ["--distill-from", str(teacher_model), "--distill-top-k", str(args.top_k), "--distill-alpha",
                str(args.alpha), *(["--distill-temperature", str(args.temperature)] if args.temperature else [])]
    # on-policy: the student samples, the teacher scores every token; the divergence at T 1 (effitrain's default
    # for LMs): the distributions the student samples from
    return ["--rl", "distill", "--distill-from", str(teacher_model), "--num-generations", str(args.num_generations),
            "--max-new-tokens", "4", "--distill-beta", str(args.beta)]


def one_seed(work: Path, seed: int, teacher_model: Path, data: dict, args, common: dict) -> dict[str, dict]:
    """method -> {exact_match, seconds, peak_rss, steps} of the three students of `seed`, from the same start."""
    start = random_student(teacher_model, args.student_layers, seed, work / f"seed{seed}-init")
    if args.start_steps:  # the format first, shared by the three runs
        train(work / f"seed{seed}-start", [*cli_flags({**common, "max_steps": args.start_steps}), "--model",
                                           str(start), *data_flags(data), "--seed", str(seed)])
        start = work / f"seed{seed}-start" / "model"
    results = {}
    for method in args.methods:
        out = work / f"seed{seed}-{method}"
        metrics = train(out, [*cli_flags({**common, "max_steps": args.steps}), "--model", str(start),
                              *data_flags(data), "--seed", str(seed), *method_flags(method, teacher_model, args)])
        exact_match = test_exact_match(out / "model", data, out / "evaluate-test.json")
        results[method] = {"exact_match": exact_match, "test_prompts": metrics["examples"]["test"],
                           "seconds": metrics["wall_seconds"], "train_seconds": metrics["train_seconds"],
                           "peak_rss": metrics["peak_memory_bytes"], "steps": metrics["steps"]}
        print(f"seed {seed} {method}: {json.dumps(results[method])}", flush=True)
    return results


def cpu_model() -> str:
    """lscpu's `Model name` (the CPU the runs shared), or the machine's description where lscpu is missing."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return _common.machine()


def machine_tag() -> str:
    """The results file's machine: `epyc2c`, `xeon2c` (the CPU family and the core count)."""
    name = cpu_model().lower()
    family = next((word for word in ("epyc", "xeon") if word in name), name.split()[0] if name else "cpu")
    return f"{family}{os.cpu_count()}c"


def summary_rows(runs: dict[int, dict[str, dict]], methods) -> list[list]:
    """One row per method: mean test exact match, each seed's, its mean minus SFT's, seeds above SFT, mean
    seconds, mean peak RSS."""
    rows = []
    for method in methods:
        per_seed = [runs[seed][method] for seed in runs]
        em = [r["exact_match"] for r in per_seed]
        sft = [runs[seed]["sft"]["exact_match"] for seed in runs] if "sft" in methods else None
        above = "-" if sft is None or method == "sft" else f"{sum(a > b for a, b in zip(em, sft))} of {len(em)}"
        rows.append([method, f"{statistics.mean(em):.4f}", " / ".join(f"{x:.4f}" for x in em),
                     "-" if sft is None else f"{statistics.mean(em) - statistics.mean(sft):+.4f}", above,
                     f"{statistics.mean(r['seconds'] for r in per_seed):.0f}",
                     _common.mib(statistics.mean(r["peak_rss"] for r in per_seed))])
    return rows


def verdict(runs: dict[int, dict[str, dict]]) -> list[str]:
    """One line per distillation method: is its mean test exact match above SFT alone's, by how many test answers
    over the seeds, against SFT alone's seed-to-seed spread?"""
    if not all("sft" in runs[seed] for seed in runs):
        return ["- no SFT-alone runs (--methods): no verdict"]
    sft = [runs[seed]["sft"]["exact_match"] for seed in runs]
    answers = [runs[seed]["sft"].get("test_prompts") for seed in runs]
    lines = []
    for method in ("offline", "on-policy"):
        if all(method in runs[seed] for seed in runs):
            em = [runs[seed][method]["exact_match"] for seed in runs]
            gained = (f"{sum(round((a - b) * n) for a, b, n in zip(em, sft, answers)):+d} right answers over the "
                      f"seeds, " if None not in answers else "")
            lines.append(f"- {method}: mean test exact match {statistics.mean(em):.4f} against SFT alone's "
                         f"{statistics.mean(sft):.4f} ({gained}SFT alone's spread over the seeds "
                         f"{max(sft) - min(sft):.4f}): bar " + ("met" if statistics.mean(em) > statistics.mean(sft)
                                                             else "missed"))
    return lines


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the students' seeds")
    parser.add_argument("--steps", type=int, default=20, help="each student's optimizer steps (after --start-steps)")
    parser.add_argument("--start-steps", type=int, default=40, help="SFT steps from the random student shared by "
                        "the three runs of a seed (the answer format first)")
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--teacher", type=Path, help="an earlier teacher run's folder (or its model/) instead of "
                        "training one: chat_accuracy.py's settings at seed 42 on sms-spam-chat")
    parser.add_argument("--top-k", type=int, default=20, help="offline: --distill-top-k")
    parser.add_argument("--alpha", type=float, default=0.5, help="offline: --distill-alpha")
    parser.add_argument("--temperature", type=float, help="offline: --distill-temperature (default: effitrain's, "
                        "1 for LMs; on-policy keeps 1)")
    parser.add_argument("--num-generations", type=int, default=2, help="on-policy: completions per prompt")
    parser.add_argument("--beta", type=float, default=1.0, help="on-policy: --distill-beta (1: reverse KL)")
    parser.add_argument("--lr", type=float, default=TEACHER["lr"], help="the students' learning rate")
    parser.add_argument("--work", type=Path, help="keep the runs in this folder (default: a temporary one)")
    parser.add_argument("--markdown", type=Path, help="default: benchmarks/results/distill_lm_<machine>_<date>.md")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--dry-run", action="store_true", help="2 steps, 16 rows per split, one seed; no files")
    return parser.parse_args(argv)


def teacher_run(work: Path, args, data: dict, dry: dict) -> tuple[Path, float]:
    """(the teacher's model/ folder, its test exact match): trained here, or --teacher's."""
    if args.teacher is None:
        settings = {key: value for key, value in TEACHER.items() if key != "data"}
        metrics = train(work / "teacher", [*cli_flags({**settings, **dry}), *data_flags(data),
                                           "--seed", str(TEACHER_SEED)])
        return work / "teacher" / "model", metrics["test"]["exact_match"]
    model = args.teacher / "model" if (args.teacher / "model").is_dir() else args.teacher
    return model, test_exact_match(model, data, work / "teacher-evaluate-test.json")


def report(args, argv, teacher_em: float, runs: dict, seconds: float) -> str:
    header = ["student", "mean test exact match", "each seed", "mean - SFT's", "seeds above SFT", "mean seconds",
              "mean peak RSS"]
    each = [[seed, method, f"{r['exact_match']:.4f}", f"{r['seconds']:.0f}", f"{r['train_seconds']:.0f}",
             _common.mib(r["peak_rss"])] for seed in runs for method, r in runs[seed].items()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=_common.BENCHMARKS).stdout.strip()
    return "\n".join([
        f"# A 2-layer LM student distilled from its 4-layer SFT teacher, sms-spam-chat ({datetime.date.today()})",
        "", f"CPU: {cpu_model()} ({_common.machine(torch_version=True)}); commit {commit}; "
        f"`{' '.join(['benchmarks/techniques/distill_lm.py', *argv])}`; {seconds / 60:.0f} min in all, one "
        "training at a time.", "",
        f"Teacher: test exact match {teacher_em:.4f} (the majority answer, `ham`, gives 0.860). Students: "
        f"{args.student_layers} layers, random weights per seed, {args.start_steps} common SFT steps, then "
        f"{args.steps} steps each; offline top-k {args.top_k}, alpha {args.alpha}; offline temperature "
        f"{args.temperature or 'effitrain default (1)'}; on-policy {args.num_generations} completions per prompt, "
        f"beta {args.beta}, temperature 1; lr {args.lr}.", "",
        _common.md_table(header, summary_rows(runs, args.methods)), "", "Verdict (the bar: higher mean test exact "
        "match than SFT alone):", "", *verdict(runs), "", "Each run (seconds: the `effitrain train` run's "
        "wall_seconds with its own evaluation; train: its training loop):", "",
        _common.md_table(["seed", "student", "test exact match", "seconds", "train seconds", "peak RSS"], each), ""])


def wrapped(text: str) -> str:
    """The report's prose lines wrapped at 120 characters (list items indented), its tables as they are."""
    import textwrap

    return "\n".join(line if len(line) <= 120 or line.startswith("|") else
                     textwrap.fill(line, 120, subsequent_indent="  " if line.startswith("- ") else "",
                                   break_on_hyphens=False, break_long_words=False) for line in text.split("\n"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # `effitrain ...` in a fresh process (a dry run's settings applied by _common)
        from effitrain.cli import main as cli

        return cli(argv[1:])
    args = parse(argv)
    dry, rows = {}, None
    if args.dry_run:
        global IN_PROCESS
        IN_PROCESS = True
        _common.dry_run_model()
        dry, rows, args.seeds, args.steps = {"max_steps": 2, "batch_size": 4}, 16, args.seeds[:1], 2
        args.start_steps = min(args.start_steps, 1)
        _common.skipped("the other seeds and the results file")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-distill-lm-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        data = write_splits(work, rows)
        teacher_model, teacher_em = teacher_run(work, args, data, dry)
        print(f"teacher {teacher_model}: test exact match {teacher_em:.4f}", flush=True)
        common = {key: TEACHER[key] for key in ("task", "chat_template", "max_length", "batch_size", "precision")}
        common.update(lr=args.lr, **{key: value for key, value in dry.items() if key != "max_steps"})
        runs = {seed: one_seed(work, seed, teacher_model, data, args, common) for seed in args.seeds}
    text = wrapped(report(args, argv, teacher_em, runs, time.perf_counter() - started))
    print(text)
    if args.dry_run:
        return 0
    markdown = args.markdown or (_common.BENCHMARKS / "results"
                                 / f"distill_lm_{machine_tag()}_{datetime.date.today()}.md")
    markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"teacher_exact_match": teacher_em, "runs": runs}, indent=1))
    print(f"written: {markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
