#!/usr/bin/env bash
# prepared for the next session (x4): LLaMA-7B at 64 x 1024 tokens under 11 GiB on 1 GPU (--grad-accum 16, and 4:
# the per-unit shape of a rank of four), 4 and 2 ranks; then 7b-8l's step shapes 1, 4, 16 on GPU 0; clocks sampled.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/n; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; } > $O/version.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 250 > $O/smi.csv & SMI=$!
TR="python3 -m torch.distributed.run --nproc-per-node"
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --max-gpu-memory 11 --warmup 1 --repeat 1"
r() { name=$1; n=$2; shift 2; if [ $n = 1 ]; then timeout 200 python3 offload_llama.py $L "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; else timeout 130 $TR $n offload_llama.py $L "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; fi; echo "$name rc $? at $SECONDS s"; }
r g1 1 --steps 4 --grad-accum 16
r g1_accum4 1 --steps 6 --grad-accum 4
r g4 4 --steps 5 --grad-accum 16
r g2 2 --steps 5 --grad-accum 16
F7="--preset 7b-8l --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 1 --seq-len 4096 --steps 6 --warmup 2 --repeat 1"
for k in 4 1 16; do
  [ $SECONDS -lt 500 ] || break
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 offload_llama.py $F7 --grad-accum $k --json $O/s_$k.json > $O/s_$k.md 2> $O/s_$k.log; echo "shape $k rc $?"
done
kill $SMI; gzip $O/smi.csv
python3 calls/summary.py $O
cd $OUT && tar czf n.tgz n && rm -rf n
