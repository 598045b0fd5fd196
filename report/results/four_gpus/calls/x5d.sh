#!/usr/bin/env bash
# call D of 2026-11-28 (x4): the bound's GPU compute timed at settled clocks (SETTLE_S of load first): LLaMA-7B at
# 64 x 1024 tokens under 11 GiB on 4 ranks (the plan's GPU Adam share, and none), 1 GPU, 2 ranks; clocks every 250 ms;
# then the GPU tests of the bound's rounds.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/d; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; } > $O/version.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 250 > $O/smi.csv & SMI=$!
TR="python3 -m torch.distributed.run --nproc-per-node"
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --grad-accum 16 --max-gpu-memory 11 --warmup 1 --repeat 1"
r() { name=$1; n=$2; shift 2; date +%T.%N > $O/$name.start; if [ $n = 1 ]; then timeout 200 python3 offload_llama.py $L "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; else timeout 130 $TR $n offload_llama.py $L "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.log; fi; echo "$name rc $? at $SECONDS s"; }
r g4 4 --steps 5
r g1 1 --steps 4
r g4_share0 4 --steps 5 --gpu-adam-share 0
r g2 2 --steps 5
kill $SMI
[ $SECONDS -lt 440 ] && CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -x tests/test_train_gpu.py -k "bound" 2>&1 | tail -5 > $O/tests_bound.log; echo "tests rc $?"; cat $O/tests_bound.log
python3 calls/summary.py $O
cd $OUT && tar czf d.tgz d && rm -rf d
