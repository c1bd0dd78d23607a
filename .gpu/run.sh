#!/usr/bin/env bash
# A GPU lease's script, in the guide's order, one call a part. A lease is 15 minutes of device time with the
# machine's start (1-2 minutes) in it, and a warm machine goes back after 30 s idle: send part 2 at once.
#   part 1 (7 minutes by default): the GPU-defaults issue's measurements, most wanted first: the memory layout's
#          own share (NCHW vs channels-last at the same batch 256, GPU loader and precision: AMP bf16, TF32), the
#          defaults as a user meets them (pytorch_auto_mixed_precision.py with no precision or layout flag, at 256
#          and at the articles' 32), the peer trainer beside ours (.gpu/peer.sh), then fp32's layout pair;
#   part 2 (about 4.5 minutes, then what is left): the what-if issue's check (tests/gpu/test_gpu.py
#          test_throughput_single_rows_predicted_within_10pct: calibrate on this GPU, 93 s on an H100; the
#          throughput preset's four single-GPU rows, ~33 s each; `benchmark.py predict`), then the GPU tier:
#          first the tests TIER_FIRST names (a -k expression: what changed), then the rest, the untimed tests
#          four at a time, until the deadline.
# Every step is skipped once its usual time no longer fits before DEADLINE_S (seconds from the start; default
# 390 for part 1, which leaves a 15-minute lease with its start about 5 minutes for part 2: give part 2
# DEADLINE_S = the lease's time left less a minute), so the call ends by itself with all it measured packed
# under $OUT, where at most 8 files come back: env.txt, rows.csv, logs.tgz (each run's log, the peer's logs and
# JSON, skipped.txt, steps.txt; part 1), whatif.txt, whatif.tgz (calibration.json, summary.csv, REPORT.md,
# logs), gpu_tier.txt, steps.txt (part 2). Loose files are written under $WORK (/tmp/lease) and packed after each
# step: a call cut short still returns what it finished. The working tree travels without .git: GIT_COMMIT
# (git describe --always --abbrev=7 --dirty=+dirty, here) names the commit in env.txt and in every row
# (common/runner.py).
# Before the lease, here: bash .gpu/fetch_peer.sh (carry "shared/peer") and bash .gpu/fetch_wheels.sh (carry
# ".whl": DeepSpeed for the tier; installed into /tmp/site when present).
# Usage, from the repository root: GIT_COMMIT=<sha> bash .gpu/run.sh 1, then GIT_COMMIT=<sha> DEADLINE_S=<s>
# TIER_FIRST="<-k expression>" bash .gpu/run.sh 2.
set -uo pipefail
PART=${1:-}
case "$PART" in 1|2) ;; *) echo "usage: bash .gpu/run.sh 1|2 (one call each)"; exit 2;; esac
DEADLINE_S=${DEADLINE_S:-$([ "$PART" = 1 ] && echo 390 || echo 560)}
export PYTHONUNBUFFERED=1  # a run its timeout ends keeps the lines it printed
export GIT_COMMIT=${GIT_COMMIT:-$(git describe --always --abbrev=7 --dirty=+dirty 2>/dev/null)}
export DEADLINE_AT=$(( $(date +%s) + DEADLINE_S ))
OUT=${OUT:-/tmp/gpu_out}; WORK=${WORK:-/tmp/lease}
[ "$PART" = 1 ] && rm -rf "$WORK"  # a warm machine's earlier call: its rows and logs are not this one's
mkdir -p "$OUT" "$WORK/logs"
ROWS=$WORK/rows.csv
export OUT WORK ROWS
left() { echo $(( DEADLINE_AT - $(date +%s) )); }
# every process this call starts inherits LEASE_RUN, which the launchers pass on: stop_ours ends those and no
# other (a pattern on command lines would end any matching process on the host: a user's, the test suite's)
export LEASE_RUN="$$.$(date +%s%N)"
ours() {  # builtins only: a process this reads with would carry the mark (this shell's own block predates it)
  local f v vars
  for f in /proc/[0-9]*/environ; do
    mapfile -d '' -t vars 2>/dev/null < "$f" || continue  # 2> first: a gone or foreign process is silent
    for v in "${vars[@]}"; do [ "$v" = "LEASE_RUN=$LEASE_RUN" ] && { f=${f#/proc/}; echo "${f%/environ}"; break; }; done
  done
}
stop_ours() {  # SIGTERM, then SIGKILL to whichever is still there after 5 s
  local pid i
  for pid in $(ours); do kill -TERM "$pid" 2>/dev/null; done
  for i in $(seq 50); do [ -z "$(ours)" ] && return; sleep 0.1; done
  for pid in $(ours); do kill -KILL "$pid" 2>/dev/null; done
}
if [ -d .whl ] && python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
     --target /tmp/site .whl/*.whl > "$WORK/logs/wheels.log" 2>&1; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
{ nvidia-smi; python -c "import torch, torchvision; print(torch.__version__, torch.version.cuda, torchvision.__version__)"
  python -m pip list 2>/dev/null | grep -iE "^(torch|torchvision|deepspeed|accelerate) "; echo "commit ${GIT_COMMIT:-?}"
  cat shared/peer/REVISIONS 2>/dev/null; } > "$OUT/env.txt" 2>&1
pack() {  # what part 1 has so far, into $OUT (a lock file stays in $WORK); .gpu/peer.sh calls it too
  [ -f "$ROWS" ] && cp "$ROWS" "$OUT/rows.csv"
  tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
}
export -f pack
skip() { echo "$1 skipped: $(left) s left, needs ~$2" | tee -a "${3:-$WORK/logs/skipped.txt}"; }
STEPS=$([ "$PART" = 1 ] && echo "$WORK/logs/steps.txt" || echo "$OUT/steps.txt")  # packed / as it is
say() { echo "$*" | tee -a "$STEPS"; }  # each step's exit, in the files that come back
COMMON="--dataset synthetic --no-pretrained --model resnet50 --image-size 224 --epochs 1 --max-steps 60
        --timing-warmup-steps 20 --train-samples 40000 --test-samples 512 --warmup-steps 0 --log-every 20
        --results $ROWS --save-dir /tmp/ckpt"
run() {  # name, seconds it usually takes, script, flags...
  local name=$1 need=$2 script=$3 l; shift 3; l=$(left)
  if [ "$l" -lt "$need" ]; then skip "$name" "$need"; return; fi
  timeout -k 10 $(( l < 300 ? l : 300 )) python "$script" $COMMON --run-name "lease/$name" "$@" \
    > "$WORK/logs/$name.log" 2>&1
  say "$name exit $? at $(( DEADLINE_S - $(left) )) s"; pack
}
if [ "$PART" = 1 ]; then
  layouts() {  # the layout at the same batch (256) and loader (gpu)
    local prec=$1 script flags need
    case $prec in
      amp_bf16) script=pytorch_auto_mixed_precision.py; flags="--precision bf16"; need=40;;
      tf32) script=pytorch_SingleGPU.py; flags="--tf32"; need=45;;
      fp32) script=pytorch_SingleGPU.py; flags=""; need=55;;
    esac
    for layout in no-channels-last channels-last; do
      run "${prec}_gpu_${layout}" $need $script $flags --batch-size 256 --loader gpu --$layout
    done
  }
  layouts amp_bf16
  layouts tf32
  # the defaults as a user meets them (fp16 + GradScaler, NCHW, 4 CPU workers), at 256 and at the articles' 32
  run amp_defaults_256 60 pytorch_auto_mixed_precision.py --batch-size 256 --workers 4
  run amp_defaults_32 45 pytorch_auto_mixed_precision.py --batch-size 32 --workers 4 --max-steps 200
  PEER_LOGS=$WORK/logs/peer bash .gpu/peer.sh >> "$STEPS" 2>&1  # a file, not a pipe a stray child could hold
  layouts fp32  # fp32 on CUDA cores: the layout matters least there
  pack
fi
if [ "$PART" = 2 ]; then
  # the what-if check, its calibration and rows kept for the campaign folder; -s streams the predict table
  # into whatif.txt as it comes, and SIGINT lets pytest print its summary when the deadline cuts it
  l=$(left)
  if [ "$l" -ge 270 ]; then
    GPU_TIER_KEEP="$WORK/whatif" PYTHONUNBUFFERED=1 timeout -s INT -k 20 $(( l - 30 )) python -m pytest -q -s -rfE \
      -p no:cacheprovider -m gpu tests/gpu -k throughput_single_rows > "$OUT/whatif.txt" 2>&1
    say "what-if check exit $? at $(( DEADLINE_S - $(left) )) s"
  else skip "what-if check" 270 "$OUT/whatif.txt"; fi
  # the matrix and calibrate start each run in a session of its own: a timeout above does not reach them, so a
  # run it cut short is ended here, before the tier shares the card with it
  stop_ours
  if [ -d "$WORK/whatif" ]; then tar czf "$OUT/whatif.tgz" -C "$WORK" whatif; fi
  # the rest of the GPU tier: the untimed tests four at a time (the timed ones would share the card), those
  # TIER_FIRST names first; then the two timed ones alone, each part until the deadline. --maxfail: addopts' 10
  # would end the tier at one missing library's failures
  untimed="not throughput_single_rows and not calibrated and not bubble_lane"
  tier() {  # -k expression, seconds to keep for what follows
    local l; l=$(left)
    [ "$l" -ge $(( $2 + 30 )) ] || { skip "gpu tier ($1)" $(( $2 + 30 )) "$OUT/gpu_tier.txt"; return; }
    timeout -s INT -k 15 $(( l - $2 )) python -m pytest -v -rfEs -p no:cacheprovider --maxfail=1000 -m gpu \
      tests/gpu -n 4 -k "$1" >> "$OUT/gpu_tier.txt" 2>&1
    say "gpu tier ($1) exit $? at $(( DEADLINE_S - $(left) )) s"
    stop_ours  # what a test's matrix or doctor left on the card
  }
  : > "$OUT/gpu_tier.txt"
  if [ -n "${TIER_FIRST:-}" ]; then
    tier "($untimed) and ($TIER_FIRST)" 40
    tier "($untimed) and not ($TIER_FIRST)" 40
  else tier "$untimed" 40; fi
  l=$(left)
  if [ "$l" -ge 120 ]; then
    timeout -s INT -k 15 $(( l - 15 )) python -m pytest -v -rfEs -p no:cacheprovider -m gpu tests/gpu \
      -k "calibrated or bubble_lane" >> "$OUT/gpu_tier.txt" 2>&1
    say "gpu tier, timed tests, exit $?"
  fi
  if [ -f "$WORK/logs/wheels.log" ]; then { echo "--- wheels"; cat "$WORK/logs/wheels.log"; } >> "$OUT/gpu_tier.txt"; fi
fi
exit 0  # what ran and what was skipped is in the files; a failed step is in its own log
