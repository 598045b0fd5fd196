#!/usr/bin/env bash
# Regenerates the measured results on a GPU machine: JSON, logs and profiler traces under OUTDIR.
#   bash report/run_benchmarks.sh OUTDIR [bf16|prefetch|fp32|train|accum|eager ...]   (default: all of them)
set -euo pipefail
out=${1:?usage: run_benchmarks.sh OUTDIR [bf16|prefetch|fp32|train|accum|eager ...]}; shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
run() { local name=$1; shift; python3 offload_llama.py "$@" --json "$out/$name.json" 2> >(tee "$out/$name.log" >&2) \
  | tee "$out/$name.md"; }
for part in "${@:-bf16 prefetch fp32 train accum eager}"; do
  for p in $part; do
    case $p in
      bf16) run inference_bf16 --mode all --dtype bfloat16 --profile "$out/trace_overlapped_bf16.json" ;;
      prefetch) for d in 2 3; do run "inference_bf16_prefetch$d" --mode overlapped --dtype bfloat16 --prefetch "$d"; done ;;
      fp32) run inference_fp32 --mode all --dtype float32 ;;
      # the cpu mode trains at about 20 s a step: 2 steps
      train) run train_bf16 --mode gpu,blocked,overlapped --train --dtype bfloat16 --profile "$out/trace_bf16.json"
             run train_bf16_cpu --mode cpu --train --steps 2 --dtype bfloat16 ;;
      accum) run train_bf16_accum16 --mode gpu,overlapped --train --grad-accum 16 --steps 5 --warmup 1 --dtype bfloat16 ;;
      # bitwise gradients at full size: eager attention, whose backward is deterministic
      eager) run train_bf16_eager --mode gpu,overlapped --train --steps 3 --warmup 1 --attention eager --dtype bfloat16 ;;
      *) echo "unknown part $p" >&2; exit 2 ;;
    esac
  done
done
