"""gpu_check.sh's helper (not a benchmark of its own):

    python benchmarks/gpu/_gpu_check.py validate train --precision auto ...   # an effitrain command line
    python benchmarks/gpu/_gpu_check.py validate launch --nproc 2 -- train ... # launch, then the command it runs
    python benchmarks/gpu/_gpu_check.py validate-script benchmarks/planner/memory_plan.py --json x.json
    python benchmarks/gpu/_gpu_check.py report WORK_DIR --out benchmarks/gpu-results.md [--dry-run]
    python benchmarks/gpu/_gpu_check.py --dry-run   # each of the above once, on samples: needs no GPU

`validate` parses a command line with effitrain's own parser (cli.build_parser) and, for train, builds
and validates its TrainConfig exactly as `effitrain train` (commands/train.main) does before it trains (config.build); launch's
options go through launch.check. Nothing runs: checks that need the devices (--strategy fsdp's refusal
on CPUs, NCCL, CUDA memory) happen when a run sets up, and are not made here. `validate-script` runs a
script's own argparse parser on its arguments and stops there (for scripts without a --dry-run).
Exit codes: 0 valid, 2 invalid (one line), 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402
from _common import md_table  # noqa: E402

MiB = 2**20


# -- validation ---------------------------------------------------------------------------------------
def validate_effitrain(argv: list[str]) -> None:
    """Raise effitrain's UserError if `effitrain ARGV` would stop on its flags or its config."""
    from effitrain import cli
    from effitrain import config as cfg

    args = cli.build_parser().parse_args(argv)
    if args.command == "launch":  # what launch.launch checks before it starts torchrun
        import os

        from effitrain.commands import launch
        from effitrain.runtime import cluster

        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv  # as commands/launch.main reads it
        launch.check_command(command)
        launch.check_numbers(cluster.resolve(args, os.environ)[0])  # flags left out: from a cluster's environment
        validate_effitrain(command)
    elif args.command == "train":  # commands/train.main, up to commands/train.train
        values = vars(args).copy()
        values.pop("command")
        config_file = values.pop("config", None)
        cfg.build(cfg.load_yaml(config_file) if config_file else {}, values)


class _Parsed(Exception):
    pass


def validate_script(path: str, argv: list[str]) -> None:
    """Run the script's main() until its argparse parser has parsed `argv`, then stop (SystemExit 2 from
    argparse when a flag is bad). For scripts whose main() parses first, as memory_plan.py's does."""
    import importlib.util

    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    saved_argv, saved_path = sys.argv, list(sys.path)
    spec.loader.exec_module(module)
    sys.argv = [path, *argv]
    argparse.ArgumentParser.parse_args = parse_only
    try:
        module.main()
        raise RuntimeError(f"{path}: main() returned without parsing its arguments")
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path


# -- the results page ---------------------------------------------------------------------------------
def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def env_table(work: Path, step: Path) -> str | None:
    """`effitrain env`'s lines, `name   value`, as rows."""
    try:
        lines = (step / "log").read_text().splitlines()
    except OSError:
        return None
    rows = [re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines if line.strip()]
    rows = [row + [""] * (2 - len(row)) for row in rows]
    return md_table(["", "effitrain env"], rows) if rows else None


def train_table(work: Path, step: Path) -> str | None:
    metrics = read_json(work / "train-default" / "metrics.json")
    if metrics is None:
        return None
    test = metrics.get("test", {})
    peak = metrics.get("peak_memory_bytes")
    row = [metrics.get("precision", "?"), _num(test.get("accuracy"), 4), _num(test.get("f1_macro"), 4),
           _num(metrics.get("train_samples_per_second"), 1), _num(metrics.get("train_tokens_per_second"), 0),
           f"{peak / MiB:.0f} MiB" if peak else "?", metrics.get("steps"), _num(metrics.get("train_seconds"), 1),
           _num(metrics.get("wall_seconds"), 1), metrics.get("world_size")]
    return md_table(["precision", "test accuracy", "test f1_macro", "samples/s", "tokens/s", "peak memory",
                     "steps", "train s", "wall s", "processes"], [row])


def equivalence_table(work: Path, step: Path) -> str | None:
    result = read_json(work / "equivalence.json")
    if result is None:
        return None
    rows = [[r["name"], r["world_size"], r["batch"], r.get("exit_code"), r.get("train_loss"), r.get("test_loss"),
             _sci(r.get("max_abs_diff")), _num(r.get("max_tolerance_ratio"), 3), _sci(r.get("loss_rel_diff")),
             "reference" if r["name"] == "single" else ("PASS" if r.get("close") else "FAIL")] for r in result["runs"]]
    tolerance = f"rtol {result['rtol']}, atol {result['atol']}, fp32, {result['steps']} steps"
    return md_table(["run", "processes", "micro-batch", "exit", "final train loss", "test loss", "max abs weight diff",
                     "max diff / tolerance", "train loss rel diff", f"vs single ({tolerance})"], rows)


def memory_plan_table(work: Path, step: Path) -> str | None:
    rows = read_json(work / "memory_plan.json")
    if not rows:
        return None
    out = []
    for r in rows:
        model, task, micro, length, precision, optimizer, checkpointing, accumulation, peft = r["config"][:9]
        out.append([model.split(":")[0], f"{micro} x {length}", precision, optimizer, "yes" if checkpointing else "no",
                    accumulation, peft, f"{r['predicted'] / MiB:.0f} MiB", f"{r['measured'] / MiB:.0f} MiB",
                    f"{r['error']:+.1%}", r["device"]])
    return md_table(["model", "batch x len", "precision", "optimizer", "checkpointing", "accumulation", "peft",
                     "predicted", "measured", "error", "device"], out)


def mfu_table(work: Path, step: Path) -> str | None:
    result = read_json(work / "mfu.json")
    if result is None:
        return None
    rows = []
    pct = lambda v: f"{v:.1%}" if v is not None else "n/a"  # noqa: E731
    for r in result["rows"]:
        if "error" in r:
            rows.append(["yes" if r["checkpointing"] else "no", r["error"]] + [""] * 8)
            continue
        mem = f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" if r.get("peak_memory_bytes") else "n/a"
        rows.append(["yes" if r["checkpointing"] else "no", f"{r['params'] / 1e9:.3f}B", f"{r['batch']} x {r['seq']}",
                     f"{r['step_seconds']:.3f}", f"{r['tokens_per_second']:.0f}",
                     f"{r['model_flops_per_second'] / 1e12:.1f}",
                     pct(r["mfu"]), pct(r["hfu"]), mem, f"{r['loss']:.3f}"])
    peak = result.get("peak_flops")
    title = f"{result['device']}, peak bf16 {peak / 1e12:.0f} TFLOP/s" if peak else f"{result['device']}, no peak"
    return f"{title}; {result['warmup']} warm-up + {result['steps']} timed steps\n\n" + md_table(
        ["checkpointing", "params", "batch x seq", "s/step", "tokens/s", "model TFLOP/s", "MFU", "HFU (x4/3 "
         "with checkpointing)", "peak memory", "last loss"], rows)


def _sci(value) -> str:
    return "" if value is None else f"{value:.2e}"


def _num(value, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


TABLES = {"env": env_table, "train": train_table, "equivalence": equivalence_table, "memory_plan": memory_plan_table,
          "mfu": mfu_table}


def header(work: Path, dry_run: bool) -> str:
    import torch

    from effitrain import __version__

    gpus = (work / "nvidia-smi.csv").read_text().strip() if (work / "nvidia-smi.csv").is_file() else ""
    names = sorted({line.split(",")[1].strip() for line in gpus.splitlines() if line.count(",") >= 2})
    commit = (work / "git.txt").read_text().strip() if (work / "git.txt").is_file() else "?"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = [["date", when], ["GPUs", f"{len(gpus.splitlines())} x {', '.join(names)}" if names else "none"],
            ["torch", torch.__version__], ["CUDA (torch build)", torch.version.cuda or "none (CPU build)"],
            ["effitrain", f"{__version__}, commit {commit}"]]
    if gpus:
        rows.append(["nvidia-smi (index, name, driver, memory)", gpus.replace("\n", "; ")])
    title = "# effitrain on GPUs: `benchmarks/gpu_check.sh`"
    note = ("**Dry run**: every command below was printed and its arguments validated; nothing was trained and "
            "no GPU was used." if dry_run else "Written by `bash benchmarks/gpu_check.sh`; each step's exact "
                                               "commands follow its table.")
    return f"{title}\n\n{note}\n\n{md_table(['', ''], rows)}\n"


def step_section(work: Path, step: Path) -> str:
    read = lambda name: (step / name).read_text().strip() if (step / name).is_file() else ""  # noqa: E731
    name = step.name.split("-", 1)[1]
    status, seconds = read("status") or "not reached", read("seconds")
    parts = [f"## {read('title') or name}", "", f"Status: **{status}**" + (f" ({seconds} s)" if seconds else "")]
    table = None if status.startswith("dry run") else TABLES[name](work, step)
    if table:
        parts += ["", table]
    elif not status.startswith(("ok", "dry run", "skipped")) and (step / "log").is_file():
        tail = (step / "log").read_text().splitlines()[-25:]
        parts += ["", "Last lines of its output:", "", "```", *tail, "```"]
    commands = read("commands")
    inner = read_json(work / "equivalence.json") if name == "equivalence" else None
    if inner and not status.startswith("dry run"):
        commands += "\n" + "\n".join(inner.get("commands", []))
    if commands:
        parts += ["", "```", commands, "```"]
    return "\n".join(parts) + "\n"


def report(work: Path, out: Path, dry_run: bool) -> None:
    steps = sorted(p for p in (work / "steps").iterdir() if p.is_dir()) if (work / "steps").is_dir() else []
    text = header(work, dry_run) + "\n" + "\n".join(step_section(work, step) for step in steps)
    if str(out) == "-":
        print(text)
        return
    out.write_text(text)
    print(f"results written to {out}")


# -- command line -------------------------------------------------------------------------------------
def dry_run() -> int:
    """`--dry-run`: validate a train command line and memory_plan.py's arguments, and print the results
    page of an empty work folder, as gpu_check.sh's dry run does; no GPU step runs."""
    argv = ["train", "--precision", "auto", "--max-steps", "1"]
    validate_effitrain(argv)
    print(f"valid: effitrain {' '.join(argv)} (effitrain's parser and config validation; not run)")
    script = Path(__file__).parent.parent / "planner" / "memory_plan.py"
    validate_script(str(script), ["--json", "memory.json"])
    print(f"valid: {script.name}'s own parser accepts --json memory.json (not run)")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        report(Path(work), Path("-"), dry_run=True)
    _common.skipped("the GPU steps (bash benchmarks/gpu_check.sh runs them; its --dry-run validates each command)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--dry-run"]:
        return dry_run()
    if argv[:1] == ["validate"]:
        from effitrain.errors import UserError

        try:
            validate_effitrain(argv[1:])
        except UserError as err:
            print(f"invalid: effitrain {' '.join(argv[1:])}\n  effitrain: error: {err}", file=sys.stderr)
            return 2
        print(f"valid: effitrain {' '.join(argv[1:][:2])} ... (effitrain's parser and config validation; "
              "not run, so device checks were not made)")
        return 0
    if argv[:1] == ["validate-script"] and len(argv) >= 2:
        try:
            validate_script(argv[1], argv[2:])
        except SystemExit as err:  # argparse's own error message is printed above
            return 2 if err.code else 0
        print(f"valid: {argv[1]}'s own parser accepts {' '.join(argv[2:]) or 'no arguments'} (not run)")
        return 0
    parser = argparse.ArgumentParser(prog="_gpu_check.py report")
    parser.add_argument("command", choices=("report",))
    parser.add_argument("work", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the markdown file, or - for stdout")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    report(args.work, args.out, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
