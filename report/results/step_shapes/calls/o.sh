#!/usr/bin/env bash
# call o (x2, GPU 0): where one GPU at LLaMA-7B's 4-micro-batch shape (a rank of four's per-unit shape) loses 11% to
# its bound: two consecutive steps traced (the boundary between them), the compute stream's gaps read; then the same
# shape with the GPU's Adam on 30% of the units (the first units of the forward, whose updates come last).
set -o pipefail
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
O=$OUT/o; mkdir -p $O/tr
{ sha256sum offload_llama.py; nvidia-smi -L; free -g; nproc; } > $O/version.txt 2>&1
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --grad-accum 4 --max-gpu-memory 11 --warmup 1 --repeat 1"
timeout 200 python3 calls/trace_two_steps.py $O/tr $L --steps 4 --json $O/t4.json > $O/t4.md 2> $O/t4.log; echo "traced rc $? at $SECONDS s"
timeout 100 python3 calls/trace_gaps.py $O/tr/trace.train.json.gz $O/gaps.json > $O/gaps.txt 2>&1; echo "gaps rc $?"
head -c 2500 $O/gaps.txt
for share in 0.3 0.15; do
  timeout 110 python3 offload_llama.py $L --steps 5 --gpu-adam-share $share --json $O/share_$share.json > $O/share_$share.md 2> $O/share_$share.log; echo "share $share rc $? at $SECONDS s"
done
python3 calls/summary.py $O
s=$(stat -c %s $O/tr/trace.train.json.gz 2>/dev/null || echo 0); [ $s -gt 0 ] && [ $s -lt 15000000 ] && mv $O/tr/trace.train.json.gz $O/trace.json.gz; rm -rf $O/tr
cd $OUT && tar czf o.tgz o && rm -rf o
