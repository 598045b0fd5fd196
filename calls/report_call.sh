#!/usr/bin/env bash
# One device call of report/run_benchmarks.sh for issue 69: bash calls/report_call.sh PART...; each part's start
# and end (seconds from the call's start) in $OUT/parts.txt, its files and output in $OUT/results.tar.gz (a call
# returns 8 files), the versions of the four files it ran in $OUT/version.txt. Give it 600 s; plan the parts to end
# by 570.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py report/peers.py report/run_benchmarks.sh report/find_largest.py | tee $OUT/version.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $OUT/version.txt
results=/tmp/results; mkdir -p $results
for part in "$@"; do
  start=$SECONDS
  NVME_DIR=/tmp/nvme_$part; mkdir -p $NVME_DIR; export NVME_DIR
  timeout $(( 590 - SECONDS )) bash report/run_benchmarks.sh $results $part > $results/$part.out 2>&1
  echo "$part rc=$? $start-$SECONDS" | tee -a $OUT/parts.txt
done
tar czf $OUT/results.tar.gz -C $results . && ls -la $OUT
