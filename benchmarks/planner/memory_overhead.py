"""What glibc keeps resident beyond the live tensors of a CPU training run (xeon2c, 2026-12-05:
results/memory_overhead_xeon2c_2026-12-05.md). Two tools:

`replay-rows`: the planner's simulation (planning/simulate.py, `trace=`) records every storage a micro-step
creates and frees (forward and backward, at full depth); the trace is replayed in a fresh Python process
that imports nothing else: glibc told what `train` tells it (speedups/allocator.py: M_MMAP_MAX 0,
M_TRIM_THRESHOLD 256 MiB); the weights allocated first (one block per parameter); then STEPS steps of the
trace, each block from posix_memalign(64, n) (PyTorch's CPU allocator, c10/core/impl/alloc_cpu.cpp) with
every byte written; after each step's trace the optimizer's states (first step: two fp32 moments per
trainable parameter for AdamW, the momentum for SGD, the planner's bytes in one block otherwise) and the
gradients freed (zero_grad). The replay's overhead: its peak RSS above the RSS before its first block, minus
its peak of live bytes. Set against the measured rows of memory_plan_runs.py (the recorded json) and
preference_accuracy.py --memory (the recorded table).

`real ROW_JSON OUT_DIR`: one real training row (`{"row": [a memory_plan_runs row]}`, or `{"preference":
train settings}`) with marks at the plan and around each step's forward and backward: statm RSS, RssAnon,
RssFile, ru_maxrss and glibc's mallinfo2 (heap size, in use, free, releasable top) in OUT_DIR/marks.json,
malloc_info's XML at the end. Environment: EXP_MALLOPT="-3=1048576,-1=268435456" replaces train's mallopt
calls (keys: glibc's M_ constants), EXP_STEPS the row's steps, EXP_CONFIG (JSON) other train settings.
Each mark is also a malloc of MARK bytes, so that a glibc malloc trace of the run (mtrace) can be cut at
them: run under a Python whose main() calls mtrace() first, with libc_malloc_debug.so.0 preloaded and
MALLOC_TRACE set (a 4-line C launcher: see the results file).

    python benchmarks/planner/memory_overhead.py replay-rows --json out.json   # 20 single-process rows + 4 preference
                                                                               # rows, ~1 min
    python benchmarks/planner/memory_overhead.py real '{"row": [...]}' /tmp/out
    python benchmarks/planner/memory_overhead.py --dry-run                     # one tiny row's trace replayed

`allocators`: rows of `real` in fresh processes under other C allocators preloaded (LD_PRELOAD: jemalloc,
tcmalloc-minimal; Debian's libjemalloc2, libtcmalloc-minimal4), taking turns: each row's overhead above the
planner's tensors and its median step (steps 2 on). Under a preloaded allocator train's mallopt goes to
glibc's unused malloc (jemalloc exports none) or to tcmalloc's no-op; `real`'s mallinfo2 marks then read
glibc's empty heap, the RSS marks stay right.

    taskset -c 1 python benchmarks/planner/memory_overhead.py allocators --rows lm,ckpt --rounds 3 --steps 10
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py and the topic packages
import _common  # noqa: E402

MiB = 2**20
STEPS = 3
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

REPLAY = r'''
import ctypes, json, resource, sys
libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.memset.restype = ctypes.c_void_p
spec = json.load(open(sys.argv[1]))
if spec["keep"]:
    assert libc.mallopt(-4, 0) and libc.mallopt(-1, 256 * 2**20)
PAGE = 4096
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
out = ctypes.c_void_p()
live = 0
peak_live = 0
peak_rss = 0
libc.malloc.restype = ctypes.c_void_p
SMALL = spec.get("small", [])  # C++ objects made with each storage (c10's StorageImpl, TensorImpl...): bytes
def alloc(n):
    global live, peak_live, peak_rss
    n = max(n, 1)
    smalls = [libc.malloc(m) for m in SMALL[:1]]
    if libc.posix_memalign(ctypes.byref(out), 64, n):
        raise MemoryError(n)
    libc.memset(out, 1, n)
    p = out.value
    smalls += [libc.malloc(m) for m in SMALL[1:]]
    for q in smalls:
        libc.memset(q, 1, 8)
    small_of[p] = smalls
    live += n
    if live > peak_live:
        peak_live = live
    r = rss()
    if r > peak_rss:
        peak_rss = r
    return p
small_of = {}
def free(p, n):
    global live
    libc.free(p)
    for q in small_of.pop(p):
        libc.free(q)
    live -= max(n, 1)
base = rss()
weights = [alloc(n) for n in spec["weights"]]
trace = spec["trace"]
states = []
at_step = []
for step in range(spec["steps"]):
    blocks = {}
    for i, n in trace:
        if n:
            blocks[i] = (alloc(n), n)
        else:
            p, m = blocks.pop(i)
            free(p, m)
    if step == 0:
        states = [alloc(n) for n in spec["states"]]
    for n in spec["step_temporaries"]:
        p = alloc(n)
        free(p, n)
    for p, m in list(blocks.values()):  # zero_grad(set_to_none=True): the gradients (and any survivor)
        free(p, m)
    at_step.append([peak_rss - base, peak_live])
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak_rss": peak_rss - base, "peak_live": peak_live, "maxrss": maxrss,
                  "at_step": at_step}))
'''


MARK = 32753
marks = []


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


libc.mallinfo2.restype = MallInfo2


def mark(label):
    b = bytearray(MARK - 1)  # a malloc(MARK) in the trace (ctypes' calls bypass the preloaded tracer)
    del b
    info = libc.mallinfo2()
    rss = int(open("/proc/self/statm").read().split()[1]) * 4096
    marks.append([label, rss, _common.status_bytes("RssAnon"), _common.status_bytes("RssFile"), _common.rss_peak_bytes(),
                  info.arena, info.uordblks, info.fordblks, info.keepcost, info.hblkhd, time.perf_counter()])


def real_run(row, out):
    """A real training row (a memory_plan_runs row as {"row": [...]}, or {"preference": train settings}) with
    marks; see the module's doc."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mark("start")
    import effitrain
    from effitrain.engine import memory_fit, step
    from effitrain.planning import planner as plan

    in_use = memory_fit.in_use_bytes

    def marked_in_use(device):
        mark("plan")
        return in_use(device)

    memory_fit.in_use_bytes = marked_in_use
    run = step.StepRunner.run
    counter = [0]

    def marked_run(self, group, n):
        counter[0] += 1
        mark(f"step{counter[0]}-start")
        backward = self.accelerator.backward

        def marked_backward(loss, **kw):
            mark(f"step{counter[0]}-forward-end")
            result = backward(loss, **kw)
            mark(f"step{counter[0]}-backward-end")
            return result

        self.accelerator.backward = marked_backward
        try:
            result = run(self, group, n)
        finally:
            del self.accelerator.backward
        mark(f"step{counter[0]}-end")
        return result

    step.StepRunner.run = marked_run
    fit = plan.fit
    seen = {}

    def capturing_fit(planner, *args, **kwargs):
        estimate, changes = fit(planner, *args, **kwargs)
        seen.update(tensors=estimate.total - estimate.overhead, overhead=estimate.overhead, total=estimate.total,
                    loss_positions=planner.shapes.loss_positions, rows_per_example=planner.shapes.rows_per_example)
        mark("planned")
        return estimate, changes

    plan.fit = capturing_fit
    settings = os.environ.get("EXP_MALLOPT")  # e.g. "-4=0,-1=268435456,-3=8388608": glibc's mallopt instead of train's
    if settings:
        from effitrain.speedups import allocator

        def keep_freed_memory():
            for item in settings.split(","):
                key, value = item.split("=")
                assert libc.mallopt(int(key), int(value)), item
            return True

        allocator.keep_freed_memory = keep_freed_memory
    if "preference" in row:
        config = row["preference"]
    else:
        from planner import memory_plan_runs as runs
        config = runs.train_config(row["row"], str(out / "run"))
    config["output_dir"] = str(out / "run")
    config.update(json.loads(os.environ.get("EXP_CONFIG", "{}")))
    if os.environ.get("EXP_STEPS"):
        config["max_steps"] = int(os.environ["EXP_STEPS"])
    metrics = effitrain.train(config)
    mark("end")
    libc.fopen.restype = ctypes.c_void_p
    f = libc.fopen(str(out / "malloc_info.xml").encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    memory = metrics["memory_plan"]
    result = {"peak": metrics["peak_memory_bytes"], "in_use": memory["in_use_bytes"],
              "predicted": memory["predicted_peak_bytes"], **seen, "marks": marks}
    (out / "marks.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "marks"}))



JEMALLOC, TCMALLOC = "libjemalloc.so.2", "libtcmalloc_minimal.so.4"  # LD_PRELOAD finds them as ld.so finds libraries
NEVER_PURGE = "background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1"
ALLOCATORS = {  # name -> environment
    "glibc": {},  # train's mallopt: M_MMAP_MAX 0, M_TRIM_THRESHOLD 256 MiB
    "jemalloc": {"LD_PRELOAD": JEMALLOC},  # its defaults: dirty pages purged over 10 s, blocks >= 8 MiB at once
    "jemalloc-keep": {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": NEVER_PURGE},
    "jemalloc-keep-o0": {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": NEVER_PURGE + ",oversize_threshold:0"},
    "jemalloc-o0": {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": "oversize_threshold:0"},
    "jemalloc-pytorch": {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": "oversize_threshold:1,background_thread:true,"
                         "metadata_thp:auto,dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"},  # PyTorch's tuning guide
    "tcmalloc": {"LD_PRELOAD": TCMALLOC},
    "tcmalloc-keep": {"LD_PRELOAD": TCMALLOC, "TCMALLOC_RELEASE_RATE": "0"},
}


def allocator_rows(folder: Path) -> dict:
    """name -> `real`'s row: section 3's three rows, DPO with LoRA, three more memory_plan_runs rows."""
    from planner import memory_plan_runs as runs
    from techniques import preference_accuracy as pref

    sft, pairs = pref.memory_data(folder, pref.MEMORY_LENGTH, 64)
    data = {"sft": sft, "pairs": pairs}
    by_name = {run[0]: run for run in pref.MEMORY_RUNS}
    rows = {"sft": {"preference": pref.memory_settings(by_name["sft-full"], data, "", False)},
            "dpo": {"preference": pref.memory_settings(by_name["dpo-lora"], data, "", False)}}
    for name, row in (("lm", ("fit", runs.LLAMA, runs.LM, 8, 256, "fp32", "adamw", False, "none", "single")),
                      ("ckpt", ("fit", runs.DEFAULT, runs.CLS, 32, 128, "fp32", "adamw", True, "none", "single")),
                      ("d24", ("fit", runs.DEFAULT, runs.CLS, 24, 128, "fp32", "adamw", False, "none", "single")),
                      ("g16", ("fit", runs.GPT2, runs.LM, 16, 256, "fp32", "adamw", False, "none", "single")),
                      ("h16", ("held-out", runs.DEFAULT, runs.CLS, 16, 256, "fp32", "adamw", True, "none", "single"))):
        assert row in runs.ROWS, row
        rows[name] = {"row": list(row)}
    return rows


def allocators(args) -> int:
    import statistics


    names = args.allocators.split(",")
    with tempfile.TemporaryDirectory(prefix="memory_overhead_") as tmp:
        rows = allocator_rows(Path(tmp))
        chosen = args.rows.split(",")
        results: dict = {}
        for _ in range(args.rounds):
            for row in chosen:
                for name in names:  # the allocators take turns on each row
                    out = Path(tmp) / f"{row}-{name}"
                    env = {**os.environ, "HF_HUB_OFFLINE": "1", **ALLOCATORS[name]}
                    if args.steps:
                        env["EXP_STEPS"] = str(args.steps)
                    _common.run_checked([sys.executable, __file__, "real", json.dumps(rows[row]), str(out)], env)
                    d = json.loads((out / "marks.json").read_text())
                    t = {m[0]: m[-1] for m in d["marks"]}
                    steps = [t[f"step{i}-end"] - t[f"step{i}-start"] for i in range(2, 10000) if f"step{i}-end" in t]
                    r = {"row": row, "allocator": name, "tensors": d["tensors"], "measured": d["peak"] - d["in_use"],
                         "overhead": d["peak"] - d["in_use"] - d["tensors"], "step_median": statistics.median(steps),
                         "steps": len(steps) + 1}
                    results.setdefault((row, name), []).append(r)
                    print(f"{row:5} {name:17} tensors {r['tensors'] / MiB:5.0f} overhead {r['overhead'] / MiB:5.0f} MiB "
                          f"step median {r['step_median']:.3f} s", flush=True)
                    shutil.rmtree(out)
    print()
    for row in chosen:
        base = statistics.median(r["step_median"] for r in results[(row, names[0])])
        for name in names:
            rs = results[(row, name)]
            overheads = " ".join(f"{r['overhead'] / MiB:.0f}" for r in rs)
            times = " ".join(f"{r['step_median']:.3f}" for r in rs)
            ratio = statistics.median(r["step_median"] for r in rs) / base
            print(f"{row:5} {name:17} overhead {overheads:16} MiB, step {times} s, x{ratio:.3f} of {names[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps([r for rs in results.values() for r in rs], indent=1))
    return 0


def step_trace(shapes, seq_len: int, precision: str, checkpointing: bool, micro: int) -> list:
    """The ordered (id, bytes) allocations and (id, 0) frees of one micro-step, simulated at full depth."""
    from effitrain.planning import simulate

    trace: list = []
    simulate._simulate(shapes.task, shapes.config, micro * shapes.rows_per_example, seq_len, precision,
                       checkpointing, split=False, peft=shapes.peft, packing=shapes.packing, trace=trace,
                       loss_positions=shapes.loss_positions)
    return trace


def replay_spec(shapes, optimizer: str, trace: list, steps: int = STEPS, keep: bool = True, small=()) -> dict:
    from effitrain.planning import planner as plan

    quantized = {tuple(s) for s in shapes.quantized or []}
    weights = [plan.bnb_4bit_bytes(s) if tuple(s) in quantized else 4 * math.prod(s) for s, _ in shapes.param_shapes]
    trainable = [s for s, t in shapes.param_shapes if t]
    per = {"adamw": 2, "sgd": 1}.get(optimizer)
    states = [4 * math.prod(s) for s in trainable for _ in range(per)] if per is not None else \
        [plan.optimizer_state_bytes(optimizer, trainable)]
    temporaries = [plan.optimizer_step_temporary_bytes(optimizer, trainable)] if optimizer != "adamw" else []
    return {"weights": weights, "trace": trace, "states": states, "step_temporaries": [t for t in temporaries if t],
            "steps": steps, "keep": keep, "small": list(small)}


def pooled(spec: dict, large: int, steps: int = STEPS) -> tuple[int, int]:
    """(peak live bytes, peak of live + cached bytes) of the spec's allocations under a CPU allocator that
    keeps every freed block of `large` bytes or more for a later block of exactly its size (no heap, no
    holes): what such an allocator would hold resident, computed, not run."""
    import collections

    live = cached = peak_live = peak_total = 0
    cache: collections.Counter = collections.Counter()

    def alloc(n):
        nonlocal live, cached, peak_live, peak_total
        if n >= large and cache[n]:
            cache[n] -= 1
            cached -= n
        live += n
        peak_live, peak_total = max(peak_live, live), max(peak_total, live + cached)

    def free(n):
        nonlocal live, cached
        live -= n
        if n >= large:
            cache[n] += 1
            cached += n

    for n in spec["weights"]:
        alloc(n)
    for step in range(steps):
        blocks = {}
        for i, n in spec["trace"]:
            if n:
                blocks[i] = n
                alloc(n)
            else:
                free(blocks.pop(i))
        if step == 0:
            for n in spec["states"]:
                alloc(n)
        for n in spec["step_temporaries"]:
            alloc(n)
            free(n)
        for n in blocks.values():
            free(n)
    return peak_live, peak_total


def replay(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "spec.json"
        path.write_text(json.dumps(spec))
        script = Path(folder) / "replay.py"
        script.write_text(REPLAY)
        out = subprocess.run([sys.executable, "-S", str(script), str(path)], capture_output=True, text=True,
                             env={"PATH": os.environ.get("PATH", ""),  # and a preloaded allocator: replayed through it
                                  **{k: os.environ[k] for k in ("LD_PRELOAD", "MALLOC_CONF") if k in os.environ}})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


def planned_shapes(row):
    """(planner, shapes) as memory_plan_runs.planned builds them."""
    from effitrain.planning import planner as plan
    from planner import memory_plan_runs as runs

    _role, model, task, micro, length, precision, optimizer, ckpt, peft, strategy = row
    vocab = None if model == runs.DEFAULT else 30522
    shapes = plan.model_shapes(task, model, 5, vocab, plan.Peft(peft) if peft != "none" else None)
    return shapes


PREFERENCE = [  # name, measured MiB (preference_accuracy_xeon2c_2026-12-05.md), peft, preference, reference, rows
    ("sft-lora", 360, "lora", None, None),
    ("dpo-lora", 356, "lora", "dpo", "adapters"),
    ("sft-full", 598, "none", None, None),
    ("dpo-precompute", 552, "none", "dpo", "precompute"),
]


def preference_shapes(peft, preference, reference, loss_positions):
    from dataclasses import replace

    from effitrain.planning import planner as plan
    from planner import memory_plan_runs as runs

    shapes = plan.model_shapes("causal-lm", runs.LLAMA, 5, 30522, plan.Peft(peft) if peft != "none" else None)
    shapes = plan.for_preference(shapes, preference, reference)
    return replace(shapes, loss_positions=loss_positions)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="replay-rows", choices=("replay-rows", "real", "allocators"))
    parser.add_argument("args", nargs="*", help="real: ROW_JSON OUT_DIR")
    parser.add_argument("--json", help="replay-rows: also write the rows to this file")
    parser.add_argument("--measured",
                        default=str(_common.BENCHMARKS / "results" / "memory_plan_xeon2c_2026-12-05_0725.json"))
    parser.add_argument("--loss-positions", type=int, default=2, help="the preference rows' longest answer")
    parser.add_argument("--steps", type=int, help=f"replay-rows: steps replayed ({STEPS}); allocators: the rows' steps (theirs)")
    parser.add_argument("--no-keep", action="store_true", help="glibc's defaults (no mallopt)")
    parser.add_argument("--only", help="substring of the row name")
    parser.add_argument("--small", type=int, nargs="*", default=[],
                        help="bytes of small objects malloc'd with each storage (first: before its data)")
    parser.add_argument("--pool", type=float, metavar="MIB",
                        help="also the peak under an exact-size cache of freed blocks of MIB or more (computed)")
    parser.add_argument("--dry-run", action="store_true", help="one tiny row's trace replayed; nothing measured")
    parser.add_argument("--rows", default="sft,lm,ckpt,dpo,d24,g16,h16", help="allocators: which rows")
    parser.add_argument("--allocators", default="glibc,jemalloc,jemalloc-keep,tcmalloc",
                        help=f"allocators: the first is the step times' base; of {', '.join(ALLOCATORS)}")
    parser.add_argument("--rounds", type=int, default=1, help="allocators: turns")
    args = parser.parse_args()
    if args.command == "real":
        real_run(json.loads(args.args[0]), args.args[1])
        return 0
    if args.command == "allocators":
        return allocators(args)
    from effitrain.planning import planner as plan
    from planner import memory_plan_runs as runs

    jobs = []
    if args.dry_run:
        row = runs.DRY_RUN[0]
        jobs.append(("dry run " + runs.name(row), lambda row=row: planned_shapes(row), row[4], row[5], row[6], row[7],
                     row[3], None, None, None))
    else:
        measured = {tuple(r["row"]): r for r in json.load(open(args.measured)) if "failed" not in r}
        for row in runs.ROWS:
            if row[9] != "single" or tuple(row) not in measured:
                continue
            m = measured[tuple(row)]
            jobs.append((f"{row[0]} {runs.name(row)} {row[3]}x{row[4]} {row[5]} {row[6]} ckpt={row[7]} {row[8]}",
                         lambda row=row: planned_shapes(row), row[4], row[5], row[6], row[7], row[3],
                         m["measured"], m["tensors"], m["breakdown"]["overhead"]))
        for name, mib, peft, preference, reference in PREFERENCE:
            jobs.append((f"pref {name}", lambda a=(peft, preference, reference): preference_shapes(*a, args.loss_positions),
                         256, "fp32", "adamw", False, 4 if preference else 8, mib * MiB, None, None))
    results = []
    for name, shapes_of, length, precision, optimizer, ckpt, micro, meas, _, _ in jobs:
        if args.only and args.only not in name:
            continue
        shapes = shapes_of()
        planner = plan.Planner(shapes, length, "cpu")
        estimate = planner.estimate(plan.Setting(precision, optimizer, ckpt, micro, 1))
        tensors = estimate.total - estimate.overhead
        trace = step_trace(shapes, length, precision, ckpt, micro)
        spec = replay_spec(shapes, optimizer, trace, 1 if args.dry_run else args.steps or STEPS, not args.no_keep, args.small)
        out = replay(spec)
        replay_overhead = out["peak_rss"] - out["peak_live"]
        r = {"name": name, "measured": meas, "tensors": tensors, "model_overhead": estimate.overhead,
             "replay_peak_rss": out["peak_rss"], "replay_peak_live": out["peak_live"], "replay_overhead": replay_overhead,
             "allocs": sum(1 for _, n in trace if n), "at_step": out["at_step"]}
        if meas is not None:
            r["measured_overhead"] = meas - tensors
        pool_text = ""
        if args.pool is not None:
            r["pool_peak_live"], r["pool_peak"] = pooled(spec, round(args.pool * MiB), spec["steps"])
            pool_text = f" pool {(r['pool_peak'] - r['pool_peak_live']) / MiB:4.0f}"
        results.append(r)
        measured_text = "" if meas is None else f"measured {meas / MiB:6.0f} ovh: measured {(meas - tensors) / MiB:5.0f} "
        print(f"{name:58} tensors {tensors / MiB:6.0f} {measured_text}model {estimate.overhead / MiB:5.0f} "
              f"replay {replay_overhead / MiB:5.0f}{pool_text} (live {out['peak_live'] / MiB:.0f}, allocs {r['allocs']})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
