#!/usr/bin/env bash
# prepared for the next session (x4, run from the repository root as `bash report/results/four_gpus/calls/next_share.sh`):
# issue 57 item 1 / issue 56 item 1, sizing the GPU's Adam by the CPU Adam's backlog. LLaMA-7B at 64 x 1024 tokens
# under 11 GiB: 4 ranks at --gpu-adam-share 0, 0.05, 0.1, 0.15 (the plan gives 0 where compute bounds the step), then
# one GPU at a rank of four's per-unit shape (--grad-accum 4) at 0, 0.1, 0.15, 0.2; call o found 0.15 4.4% faster there.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/s; mkdir -p $O
C=report/results/four_gpus/calls
{ sha256sum offload_llama.py; nvidia-smi -L; free -g; nproc; } > $O/version.txt 2>&1
TR="python3 -m torch.distributed.run --nproc-per-node"
L="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --max-gpu-memory 11 --warmup 1 --repeat 1"
for share in 0 0.05 0.1 0.15; do
  [ $SECONDS -lt 330 ] || break
  timeout 130 $TR 4 offload_llama.py $L --steps 5 --grad-accum 16 --gpu-adam-share $share --json $O/r4_$share.json > $O/r4_$share.md 2> $O/r4_$share.log
  echo "4 ranks share $share rc $? at $SECONDS s"
done
for share in 0 0.1 0.15 0.2; do
  [ $SECONDS -lt 470 ] || break
  CUDA_VISIBLE_DEVICES=0 timeout 110 python3 offload_llama.py $L --steps 5 --grad-accum 4 --gpu-adam-share $share --json $O/g1_$share.json > $O/g1_$share.md 2> $O/g1_$share.log
  echo "1 GPU accum 4 share $share rc $? at $SECONDS s"
done
python3 $C/summary.py $O
cd $OUT && tar czf s.tgz s && rm -rf s
