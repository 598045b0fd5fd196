#!/usr/bin/env bash
# call C of 2026-11-28 (x4): LLaMA-7B at 64 x 1024 tokens under 11 GiB on 4 ranks, 1 GPU and 2 ranks, with the plan's
# GPU Adam share and with none (--gpu-adam-share 0); the GPUs' clocks, power and throttle reasons every 250 ms.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/c; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; } > $O/version.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 250 > $O/smi.csv & SMI=$!
TR="python3 -m torch.distributed.run --nproc-per-node"
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --grad-accum 16 --max-gpu-memory 11 --warmup 1 --repeat 1"
r() { name=$1; n=$2; shift 2; date +%T.%N > $O/$name.start; if [ $n = 1 ]; then timeout 200 python3 offload_llama.py $L "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; else timeout 120 $TR $n offload_llama.py $L "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; fi; echo "$name rc $? at $SECONDS s"; }
r g4 4 --steps 5
r g4_share0 4 --steps 5 --gpu-adam-share 0
r g1 1 --steps 4
r g1_share0 1 --steps 4 --gpu-adam-share 0
[ $SECONDS -lt 450 ] && r g2_share0 2 --steps 5 --gpu-adam-share 0
kill $SMI
python3 calls/summary.py $O
cd $OUT && tar czf c.tgz c && rm -rf c
