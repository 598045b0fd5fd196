#!/usr/bin/env bash
# call B of 2026-11-28 (x4): the 4-rank LLaMA-7B step against variants that change how NCCL's kernels share the SMs
# with the compute: the compute on a high-priority stream, cuBLAS leaving SMs out, NCCL's CTAs and protocol.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/b; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; } > $O/version.txt 2>&1
TR="python3 -m torch.distributed.run --nproc-per-node 4"
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --grad-accum 16 --max-gpu-memory 11 --warmup 1 --repeat 1 --steps 5"
v() { name=$1; shift; env "$@" timeout 110 $TR calls/variant.py $L --json $O/$name.json > $O/$name.md 2> $O/$name.log; echo "$name rc $? at $SECONDS s"; }
v base NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING
v prio PRIO=-5
v carve16 CARVEOUT=16
v prio_carve8 PRIO=-5 CARVEOUT=8
v ctas32 NCCL_MIN_CTAS=32
v simple NCCL_PROTO=Simple
[ $SECONDS -lt 420 ] && v prio_simple PRIO=-5 NCCL_PROTO=Simple
grep -h "nChannels\|Channel 00\|ncclCommInitRank\|Algo\|Proto" $O/base.log | head -40 > $O/nccl_info.txt
grep -v "NCCL INFO" $O/base.log > $O/base.log.short; mv $O/base.log.short $O/base.log
python3 calls/summary.py $O
cd $OUT && tar czf b.tgz b && rm -rf b
