"""What one online-RL step really holds, phase by phase: a `--rl grpo` run (rl_plan_runs.py's rows) inside this
process, under the allocator the `effitrain` command preloads, with each phase of each step measured apart:

- generation (tasks/sampling.py's `sample`), the rest of the rollout (rewards, the micro-batches, the
  reference's log-probs with --kl-beta), the update (every micro-batch's forward and backward) and the
  optimizer step;
- per phase: the peak of the live tensor bytes the run made (a dispatch mode sees every storage created,
  weakrefs see it freed; the weights, made before, are counted apart) and what made the largest ones live at
  that peak (operator, shape, dtype); the resident peak (VmHWM, reset at the phase's start through
  /proc/self/clear_refs) less the resident set before the model (memory_fit's `in_use_bytes`), and RssFile.

It is how planning/rl_step.py's terms were checked against the code (benchmarks/results/rl_plan_*.md).

    python benchmarks/planner/rl_step_probe.py gen-fp32 [--steps 4] [--top 12] [--kl-beta 0.04] [--peft lora]
    python benchmarks/planner/rl_step_probe.py --dry-run   # rl_plan_runs.py's tiny row, one step
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
import weakref
from pathlib import Path

MiB = 2**20


def status(key: str) -> int:
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def main() -> int:
    from effitrain.speedups import allocator

    allocator.preload()  # as the `effitrain` command: re-executed once with tcmalloc preloaded
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.planner.rl_plan_runs import DRY_RUN, ROWS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", nargs="?", help="a row of rl_plan_runs.py")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dry-run", action="store_true", help="rl_plan_runs.py's dry-run row, one step")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--kl-beta", type=float, default=0.0)
    parser.add_argument("--peft", default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.dry_run:
        args.label, args.steps = DRY_RUN[0][0], 1
        print(f"dry run: rl_plan_runs.py's row {args.label}, one step", flush=True)
    if args.label is None:
        parser.error("name a row of rl_plan_runs.py, or pass --dry-run")
    row = next(r for r in ROWS + DRY_RUN if r[0] == args.label)
    label, model, micro, accumulation, generations, new_tokens, precision, flags = row

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    from effitrain import cli
    from effitrain.engine import memory_fit, step
    from effitrain.tasks import sampling
    from effitrain.tasks.objectives import grpo

    class Live(TorchDispatchMode):
        """Live bytes of every storage made under it (in any phase), the peak within the current phase, and
        at that peak the largest live storages by the operator that made them."""

        def __init__(self):
            super().__init__()
            self.records = WeakIdKeyDictionary()
            self.alive: dict[int, tuple] = {}
            self.held = self.peak = self.snapshot_at = 0
            self.snapshot: list = []
            self.next_id = 0

        def phase(self):
            self.peak, self.snapshot_at, self.snapshot = self.held, 0, []

        def adopt(self, tensors) -> int:
            """Storages made before the first phase (the weights, buffers, a reference copy): views of them
            are not new memory; returns their bytes."""
            total = 0
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage not in self.records:
                    self.records[storage] = -1
                    total += storage.nbytes()
            return total

        def _freed(self, key, size):
            self.held -= size
            self.alive.pop(key, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                    continue
                storage = tensor.untyped_storage()
                if storage in self.records:
                    continue
                size = storage.nbytes()
                key = self.next_id
                self.next_id += 1
                self.records[storage] = key
                self.alive[key] = (size, str(func), tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
                weakref.finalize(storage, self._freed, key, size)
                self.held += size
            if self.held > self.peak:
                self.peak = self.held
                if self.peak - self.snapshot_at > MiB:  # what is alive at (near) the peak
                    self.snapshot_at = self.peak
                    self.snapshot = sorted(self.alive.values(), key=lambda r: -r[0])[:40]
            return out

    live = Live()
    phases: list[dict] = []
    state = {"step": 0, "baseline": None}

    @contextlib.contextmanager
    def measured(name):
        if state["baseline"] is None:
            state["baseline"] = memory_fit.recorded_in_use
            model = state["model"]
            state["existing"] = live.adopt([*model.parameters(), *model.buffers(), *state["reference"]])
        rss, file_before = status("VmRSS"), status("RssFile")
        held_before = live.held
        reset_peak()
        live.phase()
        with live:
            yield
        phases.append({"step": state["step"], "phase": name, "rss_before": rss - state["baseline"],
                       "hwm": status("VmHWM") - state["baseline"], "rss_file_growth": status("RssFile") - file_before,
                       "held_before": held_before, "held_peak": live.peak, "held_after": live.held,
                       "top": live.snapshot[:args.top]})

    # The run's in_use_bytes, to measure from where the run's own plan measures.
    plan_run = memory_fit._plan_run

    def plan_and_record(*a, **k):
        out = plan_run(*a, **k)
        memory_fit.recorded_in_use = out[-1]["in_use_bytes"]
        state["planned"] = out[-1]["predicted_peak_bytes"]
        return out

    memory_fit._plan_run = plan_and_record
    sample, rollout = sampling.sample, grpo.Grpo.rollout

    def sample_measured(*a, **k):
        with measured("generation"):
            return sample(*a, **k)

    def rollout_measured(self, model, *a, **k):
        state["step"] += 1
        state["model"] = model
        copy = getattr(self.reference, "model", None)  # --kl-beta without --peft: the frozen copy
        state["reference"] = [*copy.parameters(), *copy.buffers()] if copy is not None else []
        a = (model, *a)
        with measured("rollout"):
            return rollout(self, *a, **k)

    sampling.sample = sample_measured
    grpo.Grpo.rollout = rollout_measured
    forward_backward, clip_and_step = step.StepRunner._forward_backward, step.StepRunner._clip_and_step

    def update(self, *a, **k):
        with measured("update"):
            return forward_backward(self, *a, **k)

    def optimizer_step(self, *a, **k):
        with measured("optimizer"):
            return clip_and_step(self, *a, **k)

    step.StepRunner._forward_backward, step.StepRunner._clip_and_step = update, optimizer_step

    with tempfile.TemporaryDirectory() as out:
        argv = ["train", "--task", "causal-lm", "--data", "addition", "--model", model, "--rl", "grpo",
                "--batch-size", str(micro), "--grad-accum", str(accumulation), "--num-generations", str(generations),
                "--max-new-tokens", str(new_tokens), "--precision", precision, "--max-steps", str(args.steps),
                "--max-eval-samples", "4", "--eval-batch-size", "4", "--memory-budget", "64GiB",
                "--output-dir", out, "--overwrite"]
        argv += list(flags)
        if args.kl_beta:
            argv += ["--kl-beta", str(args.kl_beta)]
        if args.peft:
            argv += ["--peft", args.peft]
        code = cli.main(argv)
        metrics = json.loads((Path(out) / "metrics.json").read_text())
    if code:
        return code
    measured_peak = metrics["peak_memory_bytes"] - metrics["memory_plan"]["in_use_bytes"]
    print(f"{label}: run peak {measured_peak / MiB:.1f} MiB over in_use, planned {state['planned'] / MiB:.1f}; "
          f"tensors before the first step (weights, buffers, reference) {state['existing'] / MiB:.1f} MiB")
    for p in phases:
        print(f"step {p['step']} {p['phase']:10} rss before {p['rss_before'] / MiB:7.1f} hwm {p['hwm'] / MiB:7.1f} "
              f"(file +{p['rss_file_growth'] / MiB:.1f}) | tensors before {p['held_before'] / MiB:7.1f} peak "
              f"{p['held_peak'] / MiB:7.1f} after {p['held_after'] / MiB:7.1f}")
    last = {p["phase"]: p for p in phases if p["step"] == max(q["step"] for q in phases)}
    for name, p in last.items():
        print(f"-- last step's {name}: the largest live tensors at its peak")
        by_op = collections.Counter()
        for size, op, shape, dtype in p["top"]:
            print(f"   {size / MiB:8.2f} MiB {op:40} {shape} {dtype}")
            by_op[op] += size
    if args.json:
        Path(args.json).write_text(json.dumps({"label": label, "measured": measured_peak, "planned": state["planned"],
                                               "phases": phases}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
