#!/usr/bin/env bash
# Issue 72's checks left at 3b2cbb4 for one H200, in the order they matter: the GPU test files the segments touch
# (the streamer, the backward in segments, the placements), GPT2-XL's shape at 16 x (4 x 1024) under 11 GiB and
# 16 GiB again (0.52x of plain forward and backward at e203dd5), then 88 LLaMA-7B layers again (298.4 model TFLOPS
# at 9902ed3, one timed step). Logs and JSON under $OUT; give it 600 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
T="-p no:cacheprovider -rfE --tb=short --timeout 250"
timeout 250 python3 -m pytest $T -q -n 2 tests/test_train_gpu.py tests/test_placement_gpu.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
mkdir -p /tmp/nvme
shape=(--hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 --intermediate-size 4267)
timeout 180 python3 offload_llama.py "${shape[@]}" --max-gpu-memory 11 --max-host-memory 16 --nvme /tmp/nvme \
  --seq-len 1024 --batch-size 4 --grad-accum 16 --mode overlapped --train --no-inference --fwd-bwd-reference \
  --steps 6 --warmup 2 --repeat 3 --json $OUT/gpt2xl_b4.json > $OUT/gpt2xl_b4.log 2>&1
echo "gpt2xl_b4 rc=$? at $SECONDS s"
grep -E "^\| overlapped|segments|the reference|peak resident|Error|error" $OUT/gpt2xl_b4.log | cut -c1-400
timeout $(( 590 - SECONDS )) python3 offload_llama.py --preset llama-7b --layers 88 --mode overlapped --train \
  --no-inference --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --steps 3 --warmup 1 --repeat 1 \
  --json $OUT/layers88.json > $OUT/layers88.log 2>&1
echo "layers 88 rc=$? at $SECONDS s"
grep -E "^\| overlapped |segments|peak resident|Error|error" $OUT/layers88.log | cut -c1-400
