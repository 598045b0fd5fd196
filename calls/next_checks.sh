#!/usr/bin/env bash
# What the last commit of 2026-12-04's third session left unmeasured, for one H200, in one call: the largest
# --nvme run again (104 LLaMA-7B layers: 51.3 s a step against a disk bound of 29.8 s at e5dc161, the disk's layers
# then the last 18; now spread over the streamed layers), then the disk tier's GPU test file. The other GPU test
# files: calls/final_1.sh's last part and calls/final_3.sh. Logs and JSON under $OUT; give it 600 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
mkdir -p /tmp/nvme; df -h /tmp | tail -1
timeout 330 python3 offload_llama.py --preset llama-7b --layers 104 --mode overlapped --train --no-inference \
  --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --nvme /tmp/nvme --steps 3 --warmup 1 \
  --repeat 1 --json $OUT/nvme_104.json > $OUT/nvme_104.log 2>&1
echo "nvme 104 layers rc=$? at $SECONDS s"
grep -E "^\| overlapped |disk tier|step [0-9]:|waited|peak resident|Error|error" $OUT/nvme_104.log | cut -c1-300
T="-p no:cacheprovider -rfE --tb=short --timeout 200"
timeout $(( 590 - SECONDS )) python3 -m pytest $T -v tests/test_disk_gpu.py > $OUT/disk_gpu.log 2>&1
echo "disk GPU tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/disk_gpu.log | tail -8
