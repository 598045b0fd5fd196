#!/usr/bin/env bash
# Issue 72, segments run micro-batch by micro-batch (no forward twice), call 1: the GPU tests of segments (gpu mode's
# gradients bit for bit, the slot race), 88 LLaMA-7B layers at 64 x 1024 tokens under a 130 GiB cap (item 4),
# GPT2-XL's shape under 11 GiB and 16 GiB (item 1), 7b-8l at --grad-accum 16 --segment 2 (every unit recomputed).
# Logs and JSON under $OUT; give it 600 s.
source calls/runs.sh
T="-p no:cacheprovider -rfE --tb=short --timeout 200"
timeout 150 python3 -m pytest $T -q tests/test_train_gpu.py -k "segment" > $OUT/seg_tests.log 2>&1
echo "segment tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/seg_tests.log | tail -8
timeout 200 python3 offload_llama.py --preset llama-7b --layers 88 --mode overlapped --train --no-inference \
  --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --steps 4 --warmup 1 --repeat 1 \
  --json $OUT/layers88.json > $OUT/layers88.log 2>&1
echo "layers 88 rc=$? at $SECONDS s"
grep -E "^\| overlapped |segments|step [0-9]:|peak resident|Error|error" $OUT/layers88.log | cut -c1-400
mkdir -p /tmp/nvme
shape=(--hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 --intermediate-size 4267)
if (( SECONDS < 400 )); then
  timeout 170 python3 offload_llama.py "${shape[@]}" --max-gpu-memory 11 --max-host-memory 16 --nvme /tmp/nvme \
    --seq-len 1024 --batch-size 4 --grad-accum 16 --mode overlapped --train --no-inference --fwd-bwd-reference \
    --steps 5 --warmup 1 --repeat 2 --json $OUT/gpt2xl_b4.json > $OUT/gpt2xl_b4.log 2>&1
  echo "gpt2xl_b4 rc=$? at $SECONDS s"
  grep -E "^\| overlapped|segments|reference|peak resident|Error|error" $OUT/gpt2xl_b4.log | cut -c1-400
fi
run seg2 80 --mode overlapped --grad-accum 16 --segment 2
