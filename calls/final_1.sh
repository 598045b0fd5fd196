#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 1 of 3: 88 LLaMA-7B layers (18.1B) at 64 x 1024 tokens under a 130 GiB cap
# (item 4: 298.4 model TFLOPS at 9902ed3), GPT2-XL's shape at 16 x (4 x 1024) under 11 GiB and 16 GiB (item 1), then
# the GPU test files of the plan and the trainer (item 6) in what is left. Logs and JSON under $OUT; give it 600 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
timeout 200 python3 offload_llama.py --preset llama-7b --layers 88 --mode overlapped --train --no-inference \
  --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --steps 4 --warmup 1 --repeat 1 \
  --json $OUT/layers88.json > $OUT/layers88.log 2>&1
echo "layers 88 rc=$? at $SECONDS s"
grep -E "^\| overlapped |segments|step [0-9]:|peak resident|Error|error" $OUT/layers88.log | cut -c1-300
mkdir -p /tmp/nvme
shape=(--hidden-size 1600 --layers 48 --heads 25 --kv-heads 25 --vocab-size 50257 --intermediate-size 4267)
timeout 170 python3 offload_llama.py "${shape[@]}" --max-gpu-memory 11 --max-host-memory 16 --nvme /tmp/nvme \
  --seq-len 1024 --batch-size 4 --grad-accum 16 --mode overlapped --train --no-inference --fwd-bwd-reference \
  --steps 5 --warmup 1 --repeat 2 --json $OUT/gpt2xl_b4.json > $OUT/gpt2xl_b4.log 2>&1
echo "gpt2xl_b4 rc=$? at $SECONDS s"
grep -E "^\| overlapped|segments|reference|peak resident|Error|error" $OUT/gpt2xl_b4.log | cut -c1-300
T="-p no:cacheprovider -rfE --tb=short --timeout 250"
timeout $(( 590 - SECONDS )) python3 -m pytest $T -q -n 2 tests/test_train_gpu.py tests/test_placement_gpu.py \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
