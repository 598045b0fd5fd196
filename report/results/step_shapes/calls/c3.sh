#!/usr/bin/env bash
# call 3 (x4): the Qwen2.5-32B shape as a LLaMA config on one H100 of the four, 64 x 1024 tokens a step: under an
# 11 GiB cap (blocked: one slot; 1024-token micro-batches, activation offload) and with no cap (overlapped)
set -o pipefail
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
O=$OUT; (while sleep 10; do echo "$(date +%T) $(grep -E "MemAvailable" /proc/meminfo)"; done > $O/mem.log) & sha256sum offload_llama.py > $O/version.txt; free -g >> $O/version.txt; grep MemAvailable /proc/meminfo >> $O/version.txt
Q="--preset llama-7b --hidden-size 5120 --intermediate-size 27648 --layers 64 --heads 40 --kv-heads 8 --vocab-size 152064"
C="--train --no-inference --dtype bfloat16 --seq-len 1024 --steps 2 --warmup 0 --repeat 1"
run() {
  local name=$1 limit=$2; shift 2
  timeout $limit python3 offload_llama.py $Q $C "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; echo "$name rc $?"
  grep -h "state on the host\|weights in the masters\|step [0-9]*:\|set-up\|error\|Error" $O/$name.log $O/$name.md | cut -c1-300
}
run q32_cap11 400 --mode blocked --batch-size 1 --grad-accum 64 --max-gpu-memory 11 --max-host-memory 460
#run q32_nocap 270 --mode overlapped --batch-size 4 --grad-accum 16 --gpu-adam-share 0
cat $O/*.md | grep -A4 "^| mode" | head -40
