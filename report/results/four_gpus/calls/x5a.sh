#!/usr/bin/env bash
# call A of 2026-11-28 (x4): where a 4-rank LLaMA-7B step loses 15% to its bound. Each rank's last step traced
# (trace_ranks.py), the traces read (trace_nccl.py); the same run with NCCL_MAX_CTAS=2; 7b-8l's forward on 2 and 4
# ranks with each all-gather on its own stream (issue 57 item 2).
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/a; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; nvidia-smi topo -m; free -g; nproc; env | grep -E "NCCL|TORCH_SYMM"; } > $O/version.txt 2>&1
python3 calls/sample_memory.py $O/memory.log & SAMPLER=$!
TR="python3 -m torch.distributed.run --nproc-per-node"
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --grad-accum 16 --max-gpu-memory 11 --warmup 1 --repeat 1"
TRACE_DIR=$O/tr timeout 220 $TR 4 calls/trace_ranks.py $L --steps 5 --json $O/l7_4t.json > $O/l7_4t.md 2> $O/l7_4t.log; echo "traced rc $?"
for r in 0 3; do [ -f $O/tr/rank$r.json ] && timeout 120 python3 calls/trace_nccl.py $O/tr/rank$r.json $O/nccl_$r.json > $O/nccl_$r.txt 2>&1; echo "read $r rc $?"; done
head -c 3000 $O/nccl_0.txt
NCCL_MAX_CTAS=2 timeout 150 $TR 4 offload_llama.py $L --steps 4 --json $O/l7_4c2.json > $O/l7_4c2.md 2> $O/l7_4c2.log; echo "ctas2 rc $?"
I="--preset 7b-8l --dtype bfloat16 --batch-size 1 --seq-len 4096 --warmup 3 --repeat 20"
for n in 2 4; do timeout 120 $TR $n offload_llama.py $I --mode overlapped --json $O/inf_$n.json > $O/inf_$n.md 2> $O/inf_$n.log; echo "inf $n rc $?"; done
kill $SAMPLER
python3 calls/summary.py $O
gzip $O/tr/rank0.json; ls -la $O/tr; [ $(stat -c %s $O/tr/rank0.json.gz) -lt 12000000 ] && mv $O/tr/rank0.json.gz $O/; rm -rf $O/tr
cd $OUT && tar czf a.tgz a && rm -rf a
