#!/usr/bin/env bash
# The peer beside ours on the same card (the GPU-defaults issue, item 5): NVIDIA DeepLearningExamples' PyTorch
# ResNet50 v1.5 trainer, unchanged, in its own benchmark mode (benchmark_training_short: synthetic data, one
# tensor made once on the GPU, 100 iterations; AMP: fp16 with GradScaler from a scale of 128, NHWC, 256 images
# an iteration, label smoothing 0.1 and mixup 0.2, an optimizer step every 8 iterations (optimizer batch 2048,
# configs.yml), a synchronize and loss.item() every iteration), then ours at those settings as far as they go
# (fp16 autocast with GradScaler, channels-last, 256 images a micro-batch, 8 accumulated: --batch-size 2048
# --grad-accum 8; the GPU loader, which makes each batch on the GPU; no mixup, no label smoothing), 3 launches
# each, alternating. .gpu/peer_summary.py sets them side by side from the peer's per-iteration log (print_freq
# 1): its mean iteration over whole accumulation cycles after its warm-up, not its train.total_ips, which
# averages the per-iteration rates of all 100, the first ones included.
# Needs shared/peer (bash .gpu/fetch_peer.sh before the lease; carry ["shared/peer"]). Writes under $PEER_LOGS
# (default $OUT/peer) each launch's log and the peer's dllogger JSON; our rows go to $ROWS beside the others.
# Each launch is skipped once it no longer fits before DEADLINE_AT (epoch seconds; .gpu/run.sh sets it).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; ROWS=${ROWS:-$OUT/rows.csv}; PEER=${PEER:-shared/peer}; LOGS=${PEER_LOGS:-$OUT/peer}
DEADLINE_AT=${DEADLINE_AT:-$(( $(date +%s) + 560 ))}
mkdir -p "$LOGS"
if [ ! -f "$PEER/ConvNets/launch.py" ]; then echo "peer: $PEER missing (bash .gpu/fetch_peer.sh first)"; exit 0; fi
ROOT=$(pwd); LOGS=$(cd "$LOGS" && pwd); PEER=$(cd "$PEER" && pwd)
STUBS="$ROOT/.gpu/peer_stubs:$PEER/dllogger"
# the trainer's dataloaders subclass DALI's Pipeline at import: if the stand-in does not import here, say so once
PYTHONPATH="$STUBS" python -c "import nvidia.dali.pipeline, dllogger" > "$LOGS/stand_in.log" 2>&1 \
  || echo "peer: the DALI stand-in or dllogger does not import (peer/stand_in.log)"
left() { echo $(( DEADLINE_AT - $(date +%s) )); }
fits() { local l; l=$(left); [ "$l" -ge 45 ] || { echo "peer $1 skipped: $l s left"; return 1; }; }
cap() { local l; l=$(( $(left) - 5 )); echo $(( l < 240 ? l : 240 )); }  # a launch ends by the deadline
packed() { type pack > /dev/null 2>&1 && pack; }  # .gpu/run.sh's: what finished is in $OUT at once
for i in 1 2 3; do
  if fits "dle_amp_$i"; then
    ( cd "$PEER/ConvNets" && PYTHONPATH="$STUBS" timeout -k 5 "$(cap)" python launch.py \
        --model resnet50 --precision AMP --mode benchmark_training_short --platform DGXA100 --gpu-affinity none \
        --workers 8 --raport-file "$LOGS/dle_amp_$i.json" /nonexistent ) > "$LOGS/dle_amp_$i.log" 2>&1
    echo "peer dle_amp_$i exit $?"; packed
  fi
  if fits "ours_amp_$i"; then
    timeout -k 5 "$(cap)" python pytorch_auto_mixed_precision.py --dataset synthetic --no-pretrained --model resnet50 \
      --image-size 224 --epochs 1 --batch-size 2048 --grad-accum 8 --precision fp16 --channels-last --loader gpu \
      --max-steps 14 --timing-warmup-steps 3 --train-samples 32768 --test-samples 512 --warmup-steps 0 \
      --log-every 2 --results "$ROWS" --save-dir /tmp/ckpt --run-name "lease/peer_ours_amp_fp16_$i" \
      > "$LOGS/ours_amp_$i.log" 2>&1
    echo "peer ours_amp_$i exit $?"; packed
  fi
done
