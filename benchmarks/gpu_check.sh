#!/usr/bin/env bash
# One prepared check of effitrain on a machine with NVIDIA GPUs (issue 15, item 5), under 8 minutes:
#   1. effitrain env
#   2. the default job (`effitrain train`, its defaults) with --precision auto (bf16 on such GPUs):
#      test accuracy, samples/s, peak memory from the run's metrics.json
#   3. on all N GPUs (skipped when N == 1): 1 process with the whole batch vs N with --strategy ddp vs N with
#      --strategy fsdp on a tiny model, same final weights and loss to 1e-5, fp32 (benchmarks/gpu/gpu_equivalence.py)
#   4. benchmarks/planner/memory_plan.py: the planner's prediction vs torch.cuda.max_memory_allocated
#   5. benchmarks/gpu/mfu.py: MFU of a ~1B Llama-shaped model, bf16 autocast, with and without checkpointing
# and writes the tables, the date, GPU, torch and CUDA versions and the exact commands to
# benchmarks/gpu-results.md. Never run on a GPU yet: no GPU has been lent to this project.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run       # anywhere: print each step's command and validate its
#                                                # arguments (effitrain's own parser and config validation,
#                                                # the scripts' --dry-run); trains nothing, uses no GPU
# Options: --only STEP[,STEP] (among env, train, equivalence, memory_plan, mfu: rerun some steps; the results
# page then holds those only), --work-dir DIR (runs and logs; default runs/gpu-check-<time>, a temporary
# folder for --dry-run), --results FILE (default benchmarks/gpu-results.md; for --dry-run
# WORK_DIR/gpu-results.md, or stdout without --work-dir; `-` is stdout).
# Environment: PYTHON (default .venv/bin/python, else python3); GPU_CHECK_TRAIN_ARGS, extra flags for step 2's
# train; GPU_CHECK_MFU_ARGS, extra flags for mfu.py; PEAK_FLOPS, mfu.py's --peak-flops for a GPU its table
# lacks; GPU_CHECK_SECONDS, the total budget (default 470).
# Each step runs under `timeout` within the total budget; a failed step does not stop the others.
# Exit codes: 0 all steps passed (dry run: all valid), 1 a step failed or timed out, 2 a bad option, no GPU,
# or (dry run) an invalid command.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
HELPER=benchmarks/gpu/_gpu_check.py
TOTAL_SECONDS=${GPU_CHECK_SECONDS:-470}
REPORT_SECONDS=20  # kept for writing the results
DRY_RUN=0 WORK="" RESULTS="" ONLY=""
STEPS=(env train equivalence memory_plan mfu)
read -r -a EXTRA_TRAIN <<< "${GPU_CHECK_TRAIN_ARGS:-}"
read -r -a EXTRA_MFU <<< "${GPU_CHECK_MFU_ARGS:-}"
if [[ -n ${PEAK_FLOPS:-} ]]; then EXTRA_MFU+=(--peak-flops "$PEAK_FLOPS"); fi

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "gpu_check.sh: error: $1" >&2; exit 2; }

while (($#)); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --work-dir) [[ $# -ge 2 ]] || die "--work-dir needs a folder; fix: pass --work-dir DIR"; WORK=$2; shift ;;
        --results) [[ $# -ge 2 ]] || die "--results needs a file; fix: pass --results FILE"; RESULTS=$2; shift ;;
        --only) [[ $# -ge 2 ]] || die "--only needs step names; fix: pass e.g. --only train,mfu"; ONLY=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1; fix: see bash benchmarks/gpu_check.sh --help" ;;
    esac
    shift
done

for name in ${ONLY//,/ }; do
    [[ " ${STEPS[*]} " == *" $name "* ]] || die "--only: unknown step $name; fix: name steps among ${STEPS[*]}"
done
wanted() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }

# GPUs: nvidia-smi's list (none on a machine without the driver).
N=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
if ((DRY_RUN)); then
    if [[ -z $WORK ]]; then  # a temporary folder, removed at the end: the results page goes to stdout
        WORK=$(mktemp -d -t gpu-check-dry.XXXXXX)
        trap 'rm -rf "$WORK"' EXIT
        RESULTS=${RESULTS:--}
    fi
    RESULTS=${RESULTS:-$WORK/gpu-results.md}
else
    ((N > 0)) || die "no NVIDIA GPU here (nvidia-smi lists none); fix: run it on a GPU machine, or pass --dry-run"
    WORK=${WORK:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
    RESULTS=${RESULTS:-benchmarks/gpu-results.md}
fi
mkdir -p "$WORK/steps"
WORK=$(cd "$WORK" && pwd)
git rev-parse --short HEAD > "$WORK/git.txt" 2>/dev/null || echo "?" > "$WORK/git.txt"
if ((N > 0)); then
    timeout 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader \
        > "$WORK/nvidia-smi.csv" 2>/dev/null || true
fi

FAILED=0 INVALID=0 STEP_DIR="" STEP_NUMBER=0

quoted() { local q; printf -v q '%q ' "$@"; echo "${q% }"; }

begin() {  # begin NAME TITLE COMMAND...: a step's folder, its title and command, printed
    STEP_NUMBER=$((STEP_NUMBER + 1))
    STEP_DIR="$WORK/steps/$STEP_NUMBER-$1"
    mkdir -p "$STEP_DIR"
    echo "$2" > "$STEP_DIR/title"
    shift 2
    quoted "$@" > "$STEP_DIR/commands"
    echo
    echo "== $(cat "$STEP_DIR/title")"
    echo "\$ $(cat "$STEP_DIR/commands")"
}

finish() {  # finish STATUS SECONDS
    echo "$1" > "$STEP_DIR/status"
    echo "$2" > "$STEP_DIR/seconds"
    echo "-> $1"
}

execute() {  # execute CAP COMMAND...: run it under timeout, at most CAP seconds and what the budget has left
    local cap=$1 left limit start rc=0
    shift
    left=$((TOTAL_SECONDS - REPORT_SECONDS - SECONDS))
    limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        finish "skipped: the ${TOTAL_SECONDS} s budget is spent" 0
        FAILED=1
        return
    fi
    start=$SECONDS
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$STEP_DIR/log" || rc=$?
    case $rc in
        0) finish ok $((SECONDS - start)) ;;
        124|137) finish "timed out after $limit s" $((SECONDS - start)); FAILED=1 ;;
        *) finish "failed (exit $rc)" $((SECONDS - start)); FAILED=1 ;;
    esac
}

validate() {  # validate COMMAND...: the dry run's check of a step; trains nothing
    local start=$SECONDS rc=0
    echo "(dry run, checked with: $(quoted "$@"))"
    "$@" 2>&1 | tee "$STEP_DIR/log" || rc=$?
    if ((rc == 0)); then
        finish "dry run: arguments valid, not run" $((SECONDS - start))
    else
        finish "dry run: INVALID (exit $rc)" $((SECONDS - start))
        INVALID=1
    fi
}

echo "gpu_check.sh: $( ((DRY_RUN)) && echo "dry run" || echo "run") with $PYTHON, $N GPU(s), work folder $WORK"

# 1. What effitrain sees.
if wanted env; then
    begin env "1. effitrain env" "$PYTHON" -m effitrain env
    if ((DRY_RUN)); then validate "$PYTHON" "$HELPER" validate env; else execute 30 "$PYTHON" -m effitrain env; fi
fi

# 2. The default job, --precision auto.
TRAIN=(train --precision auto --output-dir "$WORK/train-default" ${EXTRA_TRAIN[@]+"${EXTRA_TRAIN[@]}"})
if wanted train; then
    begin train "2. The default job with --precision auto" "$PYTHON" -m effitrain "${TRAIN[@]}"
    if ((DRY_RUN)); then validate "$PYTHON" "$HELPER" validate "${TRAIN[@]}"
    else execute 110 "$PYTHON" -m effitrain "${TRAIN[@]}"; fi
fi

# 3. 1 process vs N with ddp vs N with fsdp (the dry run validates the commands for 2 processes).
NPROC=$N
if ((DRY_RUN && N < 2)); then NPROC=2; fi
EQUIVALENCE=(benchmarks/gpu/gpu_equivalence.py --nproc "$NPROC" --work-dir "$WORK/equivalence"
             --json "$WORK/equivalence.json")
if wanted equivalence; then
    begin equivalence "3. 1 process vs N = $NPROC with --strategy ddp vs N with --strategy fsdp (tiny model, fp32)" \
        "$PYTHON" "${EQUIVALENCE[@]}"
    if ((DRY_RUN)); then
        ((N >= 2)) || echo "(this machine has $N GPU(s): the commands are validated for 2 processes)"
        validate "$PYTHON" "${EQUIVALENCE[@]}" --dry-run
    elif ((N < 2)); then
        finish "skipped: 1 GPU here; the equivalence needs 2 or more" 0
    else
        execute 110 "$PYTHON" "${EQUIVALENCE[@]}"
    fi
fi

# 4. Memory planner vs CUDA (memory_plan.py has no --dry-run: its own parser checks its arguments).
MEMORY=(benchmarks/planner/memory_plan.py --json "$WORK/memory_plan.json")
if wanted memory_plan; then
    begin memory_plan "4. Memory plan: predicted vs measured (torch.cuda.max_memory_allocated)" "$PYTHON" "${MEMORY[@]}"
    if ((DRY_RUN)); then
        validate "$PYTHON" "$HELPER" validate-script "${MEMORY[@]}"
    else  # 100 s kept for step 5 when it follows
        execute $((TOTAL_SECONDS - REPORT_SECONDS - SECONDS - ($(wanted mfu && echo 100 || echo 0)))) \
            "$PYTHON" "${MEMORY[@]}"
    fi
fi

# 5. MFU of a ~1B Llama-shaped model.
MFU=(benchmarks/gpu/mfu.py --json "$WORK/mfu.json" ${EXTRA_MFU[@]+"${EXTRA_MFU[@]}"})
if wanted mfu; then
    begin mfu "5. MFU of a ~1B Llama-shaped model (bf16 autocast, fused AdamW, seq 2048)" "$PYTHON" "${MFU[@]}"
    if ((DRY_RUN)); then validate "$PYTHON" "${MFU[@]}" --dry-run; else execute 100 "$PYTHON" "${MFU[@]}"; fi
fi

# 6. The results page.
echo
REPORT=("$PYTHON" "$HELPER" report "$WORK" --out "$RESULTS")
if ((DRY_RUN)); then REPORT+=(--dry-run); fi
timeout 60 "${REPORT[@]}" || { echo "gpu_check.sh: writing the results failed" >&2; FAILED=1; }
echo "gpu_check.sh: $SECONDS s in all"
if ((DRY_RUN)); then
    if ((INVALID)); then echo "gpu_check.sh: dry run: a command is invalid (see above)" >&2; exit 2; fi
    echo "gpu_check.sh: dry run: every command is valid (nothing was trained; checks that need GPUs were not made)"
    exit 0
fi
exit $((FAILED ? 1 : 0))
