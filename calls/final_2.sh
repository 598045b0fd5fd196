#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 2 of 3: 7b-8l's rows (items 2 and 3: overlapped and the resident gpu mode at
# --grad-accum 4, overlapped at 1 and 16), then the largest LLaMA-7B stack that trains with --nvme on this machine's
# disk (item 4): the most layers of 104, 100 and 96 the plan does not refuse, 3 steps. Logs and JSON under $OUT;
# give it 600 s.
source calls/runs.sh
run ga4 90 --mode overlapped --grad-accum 4
run ga4_gpu 60 --mode gpu --grad-accum 4
run o1 60 --mode overlapped
run ga16 110 --mode overlapped --grad-accum 16
mkdir -p /tmp/nvme; df -h /tmp | tail -1
for n in 104 100 96; do
  timeout $(( 590 - SECONDS )) python3 offload_llama.py --preset llama-7b --layers $n --mode overlapped --train \
    --no-inference --grad-accum 16 --batch-size 4 --seq-len 1024 --max-gpu-memory 130 --nvme /tmp/nvme --steps 3 \
    --warmup 1 --repeat 1 --json $OUT/nvme_largest.json > $OUT/nvme_largest.log 2>&1
  rc=$?; echo "nvme $n layers rc=$rc at $SECONDS s"
  grep -E "^\| overlapped |segments|Adam moments|step [0-9]:|peak resident|Error|error" $OUT/nvme_largest.log \
    | cut -c1-300
  (( rc == 2 )) || break  # 2: refused before the model is built
done
cd $OUT && tar czf rows.tar.gz ga4.* ga4_gpu.* o1.* ga16.* && rm ga4.* ga4_gpu.* o1.* ga16.*  # 8 files come back
