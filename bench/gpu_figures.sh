#!/usr/bin/env bash
# Issue 17's GPU figures in one go, on a GPU machine prepared by bench/gpu_setup.sh:
#   bash bench/gpu_figures.sh [--python PY] [--out DIR] [--budget SECONDS] [--only STEP[,STEP...]] [--cpu-check]
# Steps, in this order (each bounded by what is left of the budget, default 540 s; a step that would start with
# under its minimum left is skipped and says so):
#   gemm     python -m bench.gpu_gemm --json   (a block's matmuls against the planner's shape model, ~20 s)
#   mfu124   python -m bench.gpu_mfu --model 124m --steps 60 ... --json  (ours, sync saves, peer, a profiled step)
#   resume   python -m bench.kill_resume 3 --accelerator cuda --ranks 1 --precision bf16   (compile on)
#   mfu350   python -m bench.gpu_mfu --model 350m (the same, saves every 20 of 50 steps)
#   levers   python -m bench.gpu_mfu --model 124m --levers all --json   (the peer with each speed lever off in turn;
#            not in the default --only: a lease of 15 minutes has no room for it after the three above)
#   recovery python -m bench.recovery 1 --model 350m --accelerator cuda --ranks 1 --precision bf16 --spare --json
#            (issue 21: relaunch from memory, from disk, and a hot spare's takeover; not in the default --only)
#   dali     python -m bench.image_loader --device cuda --json  (issue 48: the CLIP loader's stall per step, workers
#            against DALI's nvJPEG; DALI is too big for gpu_wheels.sh, so only where it is installed, else a JSON line
#            saying it is not)
# Exit status 1 when a step failed (a skipped step is not a failure).
# Logs go to DIR (default ./gpu-figures), one per step, and a summary of the JSON lines to DIR/summary.jsonl.
# --cpu-check runs the same steps on this machine's CPU with the tiny shape and one kill (no GPU, no nvidia-smi):
# a check of the script and every path it drives before a lease is spent on it (tests/test_install.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
OUT_DIR=gpu-figures
BUDGET=540
ONLY=gemm,mfu124,resume,mfu350,dali
CPU_CHECK=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY=$2; shift 2 ;;
        --out) OUT_DIR=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --cpu-check) CPU_CHECK=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu_figures.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT_DIR"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
START=$(date +%s)
FAILED=""
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

step() {  # step NAME MIN_SECONDS MAX_SECONDS COMMAND...
    local name=$1 min=$2 max=$3; shift 3
    case ",$ONLY," in *",$name,"*) ;; *) return 0 ;; esac
    local have; have=$(left)
    if [ "$have" -lt "$min" ]; then
        echo "== $name skipped: ${have}s of the budget left, it needs ${min}s" | tee -a "$OUT_DIR/summary.txt"
        return 0
    fi
    local limit=$(( have < max ? have : max ))
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT_DIR/summary.txt"
    local t0; t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] || FAILED="$FAILED $name"
    echo "== $name exit $rc after $(( $(date +%s) - t0 ))s" | tee -a "$OUT_DIR/summary.txt"
    grep -E '^\{' "$OUT_DIR/$name.log" | tail -1 >> "$OUT_DIR/summary.jsonl" || true
    tail -25 "$OUT_DIR/$name.log"
    # a killed run leaves no ranks behind: they die with their supervisor (PR_SET_PDEATHSIG)
}

if [ "$CPU_CHECK" = 1 ]; then
    export DS_ACCELERATOR=cpu
    MFU_ARGS=(--device cpu --steps 12 --every 4 --log-every 2 --sync-steps 4 --sync-every 2 --peer-steps 4 --warmup 1
              --json)
    MODEL_SMALL=tiny MODEL_LARGE=tiny RESUME=(1 --accelerator cpu --ranks 1 --precision fp32)
    RECOVERY=(1 --spare --json)
    LARGE_ARGS=()
    LEVER_ARGS=(--device cpu --peer-steps 4 --warmup 1 --json)
    GEMM_ARGS=(--cpu-check)
    DALI_ARGS=(--device cpu --steps 6 --rounds 1 --json)
    echo "cpu check: tiny shapes on the CPU" | tee "$OUT_DIR/gpu.txt"
else
    # saves every 15 steps at 124M (~2-4 s apart: the persist of ~2 GB fits), every 20 at 350M
    MFU_ARGS=(--steps 60 --every 15 --sync-steps 9 --sync-every 3 --peer-steps 20 --warmup 6 --json)
    MODEL_SMALL=124m MODEL_LARGE=350m RESUME=(3 --accelerator cuda --ranks 1 --precision bf16)
    RECOVERY=(1 --model 350m --accelerator cuda --ranks 1 --precision bf16 --spare --json)
    LARGE_ARGS=(--steps 50 --every 20)
    LEVER_ARGS=(--peer-steps 20 --warmup 6 --json)
    GEMM_ARGS=(--json)
    DALI_ARGS=(--device cuda --steps 60 --rounds 2 --json)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
fi
"$PY" -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__)" \
    | tee -a "$OUT_DIR/gpu.txt"
echo "commit ${LIFECYCLE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT_DIR/gpu.txt"

step gemm 20 60 "$PY" -m bench.gpu_gemm "${GEMM_ARGS[@]}"
step mfu124 150 300 "$PY" -m bench.gpu_mfu --model "$MODEL_SMALL" "${MFU_ARGS[@]}"
step resume 90 200 "$PY" -m bench.kill_resume "${RESUME[@]}"
step mfu350 150 300 "$PY" -m bench.gpu_mfu --model "$MODEL_LARGE" "${MFU_ARGS[@]}" ${LARGE_ARGS[@]+"${LARGE_ARGS[@]}"}
step levers 120 400 "$PY" -m bench.gpu_mfu --model "$MODEL_SMALL" --levers all "${LEVER_ARGS[@]}"
step recovery 120 400 "$PY" -m bench.recovery "${RECOVERY[@]}"
step dali 30 150 "$PY" -m bench.image_loader "${DALI_ARGS[@]}"
echo "== done in $(( $(date +%s) - START ))s${FAILED:+; failed:$FAILED}" | tee -a "$OUT_DIR/summary.txt"
[ -z "$FAILED" ]
