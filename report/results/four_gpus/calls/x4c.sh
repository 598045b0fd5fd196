#!/usr/bin/env bash
# call C (x4): tests/test_ranks_gpu.py: its two-GPU tests in two halves at once, on GPUs 0-1 and 2-3 (torchrun's
# port apart), then its four-GPU tests; then, time left, the largest model of LLaMA-7B layers that 4 ranks train under
# 11 GiB a GPU (issue 57 item 1). Host memory sampled every 5 s.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/c; mkdir -p $O
sha256sum offload_llama.py > $O/version.txt
python3 calls/sample_memory.py $O/memory.log & SAMPLER=$!
T="timeout 330 python3 -m pytest -q -p no:cacheprovider -rA tests/test_ranks_gpu.py"
FIRST="train_as_one and not bfloat16-4-4 or compose or more_ranks"
CUDA_VISIBLE_DEVICES=0,1 $T -k "$FIRST" > $O/tests_gpus01.log 2>&1 & P1=$!
CUDA_VISIBLE_DEVICES=2,3 PET_MASTER_PORT=29611 $T -k "not ($FIRST)" > $O/tests_gpus23.log 2>&1 & P2=$!
wait $P1 $P2; echo "two-GPU tests done at $SECONDS s"  # the four-GPU cases skip themselves there
$T -k "bfloat16-4-4 or forward_to_one_gpus_logits_bitwise[4]" > $O/tests_4gpus.log 2>&1; echo "four-GPU tests done at $SECONDS s"
tail -n 2 $O/tests_*.log
timeout $((585 - SECONDS)) python3 report/find_largest.py --nproc-per-node 4 --mode overlapped --preset llama-7b --dtype bfloat16 \
  --batch-size 1 --seq-len 4096 --grad-accum 4 --max-gpu-memory 11 --steps 2 --warmup 1 --repeat 1 \
  --json $O/largest_4gpus.json > $O/largest_4gpus.md 2> $O/largest_4gpus.log; echo "largest rc $?"
tail -n 5 $O/largest_4gpus.log; cat $O/largest_4gpus.md
kill $SAMPLER
cd $OUT && tar czf c.tgz c && rm -rf c
