#!/usr/bin/env bash
# Issue 72 after the segments' micro-batch backward, call 3: the other five GPU test files (item 6, about 170 s), then
# the largest LLaMA-7B stack with --nvme (104 layers, the disk tier's layers spread, item 4's "with --nvme").
# Logs and JSON under $OUT; give it 600 s.
bash calls/other_gpu_tests.sh
mkdir -p /tmp/nvme; df -h /tmp | tail -1
timeout $(( 585 - SECONDS )) python3 offload_llama.py --preset llama-7b --layers 104 --mode overlapped --train \
  --no-inference --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --nvme /tmp/nvme --steps 3 \
  --warmup 1 --repeat 1 --json $OUT/nvme_104.json > $OUT/nvme_104.log 2>&1
echo "nvme 104 layers rc=$? at $SECONDS s"
grep -E "^\| overlapped |disk tier|step [0-9]:|waited|peak resident|Error|error" $OUT/nvme_104.log | cut -c1-300
