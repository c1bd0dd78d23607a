#!/usr/bin/env bash
# A GPU lease's script, in the guide's order; each part fits one call (under 10 minutes on one H100):
#   part 1 (about 6 minutes): the GPU-defaults issue's measurements: the memory layout's own share (NCHW vs
#          channels-last at the same batch, loader and precision), the defaults as they are
#          (pytorch_auto_mixed_precision.py with no flag, at 256 and at the articles' 32), then the peer trainer
#          beside ours (.gpu/peer.sh: NVIDIA's ResNet50 v1.5 trainer, 3 launches each; bash .gpu/fetch_peer.sh
#          before the lease, and carry ["shared/peer"]);
#   part 2 (about 4 minutes): the what-if issue's check: calibrate on this GPU, the throughput preset's
#          single-GPU rows beside it, `benchmark.py predict` (tests/gpu/test_gpu.py
#          test_throughput_single_rows_predicted_within_10pct: the calibration took 93 s on an H100, a row ~30 s);
#          then the rest of the GPU tier (`pytest -m gpu`) in what is left of BUDGET_S (default 570 s: set it to
#          the call's limit less a margin when the lease has less left).
# Usage, from the repository root: bash .gpu/run.sh 1, then bash .gpu/run.sh 2 (each one call).
# Under $OUT (at most 8 files come back): env.txt, rows.csv, logs.tgz (part 1), peer.tgz, whatif.txt,
# whatif.tgz (calibration.json, summary.csv, logs), gpu_tier.txt.
set -uo pipefail
PART=${1:-}
case "$PART" in 1|2) ;; *) echo "usage: bash .gpu/run.sh 1|2 (one call each)"; exit 2;; esac
BUDGET_S=${BUDGET_S:-570}
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
ROWS=$OUT/rows.csv; LOGS=$OUT/logs
export OUT ROWS
{ nvidia-smi; python -c "import torch, torchvision; print(torch.__version__, torch.version.cuda, torchvision.__version__)"
  pip list 2>/dev/null | grep -iE "^(torch|torchvision|deepspeed|accelerate) "; git rev-parse HEAD
  cat shared/peer/REVISIONS 2>/dev/null; } > "$OUT/env.txt" 2>&1
COMMON="--dataset synthetic --no-pretrained --model resnet50 --image-size 224 --epochs 1 --max-steps 60
        --timing-warmup-steps 20 --train-samples 40000 --test-samples 512 --warmup-steps 0 --log-every 20
        --results $ROWS --save-dir /tmp/ckpt"
run() {  # name, script, flags...
  local name=$1 script=$2; shift 2
  timeout 300 python "$script" $COMMON --run-name "lease/$name" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name exit $?"
}
if [ "$PART" = 1 ]; then
  mkdir -p "$LOGS"
  # the layout at the same batch (256) and loader (gpu): AMP bf16, TF32, fp32
  for layout in no-channels-last channels-last; do
    run "amp_bf16_gpu_${layout}" pytorch_auto_mixed_precision.py --precision bf16 --batch-size 256 --loader gpu --$layout
    run "tf32_gpu_${layout}" pytorch_SingleGPU.py --tf32 --batch-size 256 --loader gpu --$layout
    run "fp32_gpu_${layout}" pytorch_SingleGPU.py --batch-size 256 --loader gpu --$layout
  done
  # the defaults as a user meets them (fp16 + GradScaler, NCHW, 4 CPU workers), at 256 and at the articles' 32
  run amp_defaults_256 pytorch_auto_mixed_precision.py --batch-size 256 --workers 4
  run amp_defaults_32 pytorch_auto_mixed_precision.py --batch-size 32 --workers 4 --max-steps 200
  bash .gpu/peer.sh
  tar czf "$OUT/peer.tgz" -C "$OUT" peer && rm -r "$OUT/peer"
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"
fi
if [ "$PART" = 2 ]; then
  # the what-if check, its calibration and rows kept for the campaign folder
  cap=$(( BUDGET_S - SECONDS < 400 ? BUDGET_S - SECONDS : 400 ))
  GPU_TIER_KEEP="$OUT/whatif" timeout "$cap" python -m pytest -q -m gpu tests/gpu -rA -k throughput_single_rows \
    > "$OUT/whatif.txt" 2>&1; echo "what-if check exit $?"
  # the matrix and calibrate start each run in a session of its own: a timeout above does not reach them, so a
  # run it cut short is ended here, before the tier shares the card with it
  pkill -f -- "benchmark.py (calibrate|run)" 2>/dev/null; pkill -f -- "pytorch_(SingleGPU|auto_mixed_precision)\.py" 2>/dev/null
  tar czf "$OUT/whatif.tgz" -C "$OUT" whatif && rm -r "$OUT/whatif"
  # the rest of the GPU tier, in what is left of the call's 10 minutes (SECONDS: bash's clock since start)
  left=$(( BUDGET_S - SECONDS )); if [ "$left" -gt 30 ]; then
    timeout "$left" python -m pytest -q -m gpu tests -x -k "not throughput_single_rows" > "$OUT/gpu_tier.txt" 2>&1
    echo "gpu tier exit $?"; else echo "gpu tier: no time left ($SECONDS s used)"; fi
fi
