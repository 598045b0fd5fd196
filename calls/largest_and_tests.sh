#!/usr/bin/env bash
# Issue 72, items 4 and 6 on one H200 at the segments' commit: the GPU test files calls/gpt2xl.sh did not run, then
# 88 LLaMA-7B layers (18.0B) at 64 x 1024 tokens under a 130 GiB cap, which the plan now fits with segments of 2
# units (predicted 21.3 s a step, 128.0 GiB of GPU, 118.2 GiB of host). Logs and JSON under $OUT; give it 430 s.
export PYTHONUNBUFFERED=1
bash calls/other_gpu_tests.sh  # about 180 s
timeout $(( 420 - SECONDS )) python3 offload_llama.py --preset llama-7b --layers 88 --mode overlapped --train \
  --no-inference --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --steps 3 --warmup 1 --repeat 1 \
  --json $OUT/layers88.json > $OUT/layers88.log 2>&1
echo "layers 88 rc=$? at $SECONDS s"
grep -E "^\| overlapped |segments|predicted peak|peak resident|bound, each part|Error|error" $OUT/layers88.log \
  | cut -c1-600
