#!/usr/bin/env bash
# Issue 72 on one H200 at the segments' commit: GPT2-XL's shape at 64 x 1024 tokens a step under --max-gpu-memory 11
# --max-host-memory 16 --nvme as 16 micro-batches of 4 x 1024 (calls/gpt2xl.sh ran 64 of 1 x 1024, where every
# kernel waits on its launch), against plain forward and backward in the same run; the low-host placement test; then
# 7b-8l's rows (overlapped and gpu mode at --grad-accum 4, blocked and overlapped at 1, overlapped at 16) while time
# is left. Logs and JSON under $OUT; give it 600 s.
source calls/runs.sh
mkdir -p /tmp/nvme
shape=(--hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 --intermediate-size 4267)
caps=(--max-gpu-memory 11 --max-host-memory 16 --nvme /tmp/nvme --seq-len 1024)
timeout 200 python3 offload_llama.py "${shape[@]}" "${caps[@]}" --batch-size 4 --grad-accum 16 --mode overlapped \
  --train --no-inference --fwd-bwd-reference --steps 6 --warmup 2 --repeat 3 --json $OUT/gpt2xl_b4.json \
  > $OUT/gpt2xl_b4.log 2>&1
echo "gpt2xl_b4 rc=$? at $SECONDS s"
grep -E "^\| overlapped|segments|reference|the reference|peak resident|bound, each part|Error|error" $OUT/gpt2xl_b4.log \
  | cut -c1-600
T="-p no:cacheprovider -rfE --tb=short --timeout 200"
timeout 150 python3 -m pytest $T -q tests/test_placement_gpu.py -k low_host > $OUT/low_host.log 2>&1
echo "low_host rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/low_host.log | tail -5
budget() {  # budget NAME LIMIT ARGS...: run() if LIMIT seconds are left before 590
  local name=$1 limit=$2; shift 2
  if (( SECONDS + limit > 590 )); then echo "$name skipped: $SECONDS s spent"; return; fi
  timeout $limit python3 offload_llama.py --train --no-inference --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? at $SECONDS s"
  grep -E "^\| (gpu|w/o|blocked|overlapped) |keeping their graphs|Error|error" $OUT/$name.log | cut -c1-500
}
budget ga16 120 --mode overlapped --grad-accum 16
budget ga4 90 --mode overlapped --grad-accum 4
budget ga4_gpu 60 --mode gpu --grad-accum 4
budget bo1 100 --mode blocked,overlapped
