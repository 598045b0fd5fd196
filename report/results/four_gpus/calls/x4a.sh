#!/usr/bin/env bash
# call A (x4): 7b-8l's 4096-token forward on 1 GPU (resident and offloaded), on 2 and 4 ranks (issue 57 item 2);
# LLaMA-7B at 64 x 1024 tokens under 11 GiB a GPU on 1, 4 and 2 GPUs (item 1); then, time left, 7b-8l's step shapes
# with the resident units' Adam in the bound (issue 56 item 1). Host memory sampled every 5 s throughout.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/a; mkdir -p $O
sha256sum offload_llama.py > $O/version.txt; nvidia-smi topo -m >> $O/version.txt; free -g >> $O/version.txt; nproc >> $O/version.txt
python3 calls/sample_memory.py $O/memory.log & SAMPLER=$!
TR="python3 -m torch.distributed.run --nproc-per-node"
I="--preset 7b-8l --dtype bfloat16 --batch-size 1 --seq-len 4096 --warmup 3 --repeat 20"
timeout 150 python3 offload_llama.py $I --mode gpu,overlapped --json $O/inf_1.json > $O/inf_1.md 2> $O/inf_1.log; echo "inf 1 rc $?"
for n in 2 4; do timeout 150 $TR $n offload_llama.py $I --mode overlapped --json $O/inf_$n.json > $O/inf_$n.md 2> $O/inf_$n.log; echo "inf $n rc $?"; done
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --grad-accum 16 --max-gpu-memory 11 --steps 4 --warmup 1 --repeat 1"
timeout 260 python3 offload_llama.py $L --json $O/l7_1.json > $O/l7_1.md 2> $O/l7_1.log; echo "l7 1 rc $?"
for n in 4 2; do timeout 200 $TR $n offload_llama.py $L --json $O/l7_$n.json > $O/l7_$n.md 2> $O/l7_$n.log; echo "l7 $n rc $?"; done
F7="--preset 7b-8l --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 1 --seq-len 4096 --steps 6 --warmup 2 --repeat 1"
for k in 4 1 16; do
  [ $SECONDS -lt 480 ] || break
  timeout 100 python3 offload_llama.py $F7 --grad-accum $k --json $O/s_$k.json > $O/s_$k.md 2> $O/s_$k.log; echo "shape $k rc $?"
done
kill $SAMPLER
python3 calls/summary.py $O
cd $OUT && tar czf a.tgz a && rm -rf a
