#!/usr/bin/env bash
# Issue 72, item 1 on one H200: GPT2-XL's own shape as a LLaMA config (48 layers of hidden 1600, 25 heads, vocabulary
# 50257, an MLP of its parameter count: 1.64B untied) at 64 x 1024 tokens a step under --max-gpu-memory 11
# --max-host-memory 16 --nvme, the plan choosing its segments with no other flag, against plain forward and backward
# of the same model resident (--fwd-bwd-reference, same run); then the GPU test files the change touches (the streamer
# and the backward in segments, the placements). Logs and JSON under $OUT; give it 600 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
mkdir -p /tmp/nvme
shape=(--hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 --intermediate-size 4267)
caps=(--grad-accum 64 --batch-size 1 --seq-len 1024 --max-gpu-memory 11 --max-host-memory 16 --nvme /tmp/nvme)
train=(--mode overlapped --train --no-inference)
python3 offload_llama.py "${shape[@]}" "${caps[@]}" "${train[@]}" --plan > $OUT/gpt2xl_plan.log 2>&1
timeout 330 python3 offload_llama.py "${shape[@]}" "${caps[@]}" "${train[@]}" --fwd-bwd-reference \
  --steps 6 --warmup 2 --repeat 3 --json $OUT/gpt2xl.json > $OUT/gpt2xl.log 2>&1
echo "gpt2xl rc=$? at $SECONDS s"
grep -E "^\| (gpu|w/o|blocked|overlapped|fwd|plain)|segments|reference|peak|bound, each part|Error|error" \
  $OUT/gpt2xl.log | cut -c1-700
T="-p no:cacheprovider -rfE --tb=short --timeout 300"
timeout $(( 590 - SECONDS )) python3 -m pytest $T -q -n 2 tests/test_train_gpu.py tests/test_placement_gpu.py \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -20
