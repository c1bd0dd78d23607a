#!/usr/bin/env bash
# The first GPU lease's script (about 6 minutes on one H100): the GPU-defaults issue's measurements first.
#   1. the memory layout's own share: NCHW vs channels-last at the same batch, loader and precision;
#   2. the defaults as they are: pytorch_auto_mixed_precision.py with no precision or layout flag;
#   3. the GPU tier (`pytest -m gpu`), what time is left.
# Every row, log and the environment go under $OUT (at most 8 files come back): rows.csv, logs.tgz, env.txt,
# gpu_tier.txt. Run from the repository root: bash .gpu/run.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
ROWS=$OUT/rows.csv; LOGS=$OUT/logs; mkdir -p "$LOGS"
{ nvidia-smi; python -c "import torch, torchvision; print(torch.__version__, torch.version.cuda, torchvision.__version__)"
  pip list 2>/dev/null | grep -iE "^(torch|torchvision|deepspeed|accelerate) "; git rev-parse HEAD; } > "$OUT/env.txt" 2>&1
COMMON="--dataset synthetic --no-pretrained --model resnet50 --image-size 224 --epochs 1 --max-steps 80
        --timing-warmup-steps 20 --train-samples 40000 --test-samples 512 --warmup-steps 0 --log-every 20
        --results $ROWS --save-dir /tmp/ckpt"
run() {  # name, script, flags...
  local name=$1 script=$2; shift 2
  timeout 300 python "$script" $COMMON --run-name "lease/$name" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name exit $?"
}
# 1. layout at the same batch (256) and loader (gpu): AMP bf16, TF32, fp32
for layout in no-channels-last channels-last; do
  run "amp_bf16_gpu_${layout}" pytorch_auto_mixed_precision.py --precision bf16 --batch-size 256 --loader gpu --$layout
  run "tf32_gpu_${layout}" pytorch_SingleGPU.py --tf32 --batch-size 256 --loader gpu --$layout
  run "fp32_gpu_${layout}" pytorch_SingleGPU.py --batch-size 256 --loader gpu --$layout
done
# 2. the defaults as a user meets them (fp16 + GradScaler, NCHW, 4 CPU workers), at 256 and at the articles' 32
run amp_defaults_256 pytorch_auto_mixed_precision.py --batch-size 256 --workers 4
run amp_defaults_32 pytorch_auto_mixed_precision.py --batch-size 32 --workers 4 --max-steps 200
# 3. the GPU tier, in what is left of the command's 10 minutes
timeout 200 python -m pytest -q -m gpu tests -x > "$OUT/gpu_tier.txt" 2>&1; echo "gpu tier exit $?"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"
