#!/usr/bin/env bash
# call B (x4): the 32B shape (Qwen2.5-32B as a LLaMA config) at 64 x 1024 tokens a step under 11 GiB a GPU, on one
# GPU and on four (issue 57 item 1; issue 56 item 3), no host cap: the plan leaves HOST_SLACK of the host. Host memory
# sampled every 5 s.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/b; mkdir -p $O
sha256sum offload_llama.py > $O/version.txt; free -g >> $O/version.txt
python3 calls/sample_memory.py $O/memory.log & SAMPLER=$!
Q="--preset llama-7b --hidden-size 5120 --intermediate-size 27648 --layers 64 --heads 40 --kv-heads 8 --vocab-size 152064"
Q="$Q --train --no-inference --dtype bfloat16 --seq-len 1024 --steps 2 --warmup 0 --repeat 1 --mode blocked --batch-size 1 --grad-accum 64 --max-gpu-memory 11"
timeout 200 python3 -m torch.distributed.run --nproc-per-node 4 offload_llama.py $Q --json $O/q32_4.json > $O/q32_4.md 2> $O/q32_4.log; echo "q32 4 rc $?"
timeout 330 python3 offload_llama.py $Q --json $O/q32_1.json > $O/q32_1.md 2> $O/q32_1.log; echo "q32 1 rc $?"
kill $SAMPLER
python3 calls/summary.py $O
cd $OUT && tar czf b.tgz b && rm -rf b
