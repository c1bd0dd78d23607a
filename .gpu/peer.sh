#!/usr/bin/env bash
# The peer beside ours on the same card (the GPU-defaults issue, item 5): NVIDIA DeepLearningExamples' PyTorch
# ResNet50 v1.5 trainer, unchanged, in its own benchmark mode (benchmark_training_short: synthetic data on the
# GPU, 100 iterations; AMP: fp16 with GradScaler from a scale of 128, NHWC, 256 images a step, label smoothing
# 0.1 and mixup 0.2, and an optimizer batch of 2048 (it accumulates 8 batches a step) from its configs.yml), then
# ours at those settings (fp16 autocast with GradScaler, channels-last, 256, the GPU loader; no mixup, no label
# smoothing, a step every batch), 3 launches each, alternating. Its train.total_ips averages all 100 iterations,
# warm-up included; its log has each iteration's (print_freq 1), to set beside our timed window's. Needs shared/peer (bash
# .gpu/fetch_peer.sh before the lease; carry ["shared/peer"]). Writes under $OUT/peer: each launch's log and
# the peer's dllogger JSON (its summary line's train.total_ips); our rows go to $ROWS beside the others.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; ROWS=${ROWS:-$OUT/rows.csv}; PEER=${PEER:-shared/peer}
mkdir -p "$OUT/peer"
if [ ! -f "$PEER/ConvNets/launch.py" ]; then echo "peer: $PEER missing (bash .gpu/fetch_peer.sh first)"; exit 0; fi
ROOT=$(pwd); PEER_OUT=$(cd "$OUT/peer" && pwd); PEER=$(cd "$PEER" && pwd)
for i in 1 2 3; do
  ( cd "$PEER/ConvNets" && PYTHONPATH="$ROOT/.gpu/peer_stubs:$PEER/dllogger" timeout 240 python launch.py \
      --model resnet50 --precision AMP --mode benchmark_training_short --platform DGXA100 --gpu-affinity none \
      --workers 8 --raport-file "$PEER_OUT/dle_amp_$i.json" /nonexistent ) > "$OUT/peer/dle_amp_$i.log" 2>&1
  echo "peer dle_amp_$i exit $?"
  timeout 240 python pytorch_auto_mixed_precision.py --dataset synthetic --no-pretrained --model resnet50 \
    --image-size 224 --epochs 1 --batch-size 256 --precision fp16 --channels-last --loader gpu --max-steps 100 \
    --timing-warmup-steps 20 --train-samples 51200 --test-samples 512 --warmup-steps 0 --log-every 20 \
    --results "$ROWS" --save-dir /tmp/ckpt --run-name "lease/peer_ours_amp_fp16_$i" > "$OUT/peer/ours_amp_$i.log" 2>&1
  echo "peer ours_amp_$i exit $?"
done
