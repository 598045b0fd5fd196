#!/usr/bin/env bash
# Training's step against its bound on one H200: blocked and overlapped twice (the host's memory is noisy between
# runs), overlapped at --grad-accum 4, then the GPU training tests.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
for r in 1 2; do
  timeout 170 python3 offload_llama.py --mode blocked,overlapped --train --no-inference --json $OUT/bo$r.json > $OUT/bo$r.log 2>&1; echo "bo$r rc=$?"
  grep -E "^\| (blocked|overlapped)|bound, each part|step [0-9]+:" $OUT/bo$r.log | grep -v "^  " | cut -c1-400
done
timeout 170 python3 offload_llama.py --mode overlapped --train --no-inference --grad-accum 4 --json $OUT/ga4.json > $OUT/ga4.log 2>&1; echo "ga4 rc=$?"
grep -E "^\| (blocked|overlapped)|bound, each part" $OUT/ga4.log | cut -c1-400
timeout 250 python3 -m pytest -p no:cacheprovider -rfE --tb=short -q -n 2 tests/test_train_gpu.py > $OUT/train_gpu.log 2>&1; echo "train_gpu rc=$?"; tail -5 $OUT/train_gpu.log
