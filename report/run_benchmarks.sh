#!/usr/bin/env bash
# Regenerates the measured results on a GPU machine: JSON, logs and a profiler trace under OUTDIR.
#   bash report/run_benchmarks.sh OUTDIR [bf16|prefetch|fp32 ...]   (default: all three)
set -euo pipefail
out=${1:?usage: run_benchmarks.sh OUTDIR [bf16|prefetch|fp32 ...]}; shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
run() { local name=$1; shift; python3 offload_llama.py "$@" --json "$out/$name.json" | tee "$out/$name.md"; }
for part in "${@:-bf16 prefetch fp32}"; do
  for p in $part; do
    case $p in
      bf16) run inference_bf16 --mode all --dtype bfloat16 --profile "$out/trace_overlapped_bf16.json" ;;
      prefetch) for d in 2 3; do run "inference_bf16_prefetch$d" --mode overlapped --dtype bfloat16 --prefetch "$d"; done ;;
      fp32) run inference_fp32 --mode all --dtype float32 ;;
      *) echo "unknown part $p" >&2; exit 2 ;;
    esac
  done
done
